//! Sink plug-ins (`plugins/vmi_sink.h`): shared libraries `libvmi_sink_NAME.so` in the
//! plug-in folder, each exporting `vmi_sink_entry`, which returns a table of C functions and
//! its interface version. A plug-in that cannot be had (no such file, a missing symbol,
//! another interface version, a missing function, a failed initialisation) is refused with a
//! message that says why. The library is opened with `dlopen` when a sink is asked for, so
//! whatever it links (libibverbs, libfabric) never becomes a dependency of the layer.

use crate::{Link, Listener, Sink};
use std::ffi::{c_char, c_int, c_long, c_void, CStr, CString};
use std::io;
use std::os::fd::RawFd;
use std::path::Path;
use std::time::Duration;

/// The interface version this layer speaks.
pub const ABI: u32 = 1;
/// Largest endpoint address (`VMI_SINK_ADDR_MAX`).
pub const ADDR_MAX: usize = 256;
const WHY: usize = 512;

type ProbeFn = unsafe extern "C" fn(*mut c_char, usize) -> c_int;
type ListenFn = unsafe extern "C" fn(*const c_char, *mut u8, *mut usize, *mut c_char, usize) -> *mut c_void;
type AcceptFn = unsafe extern "C" fn(*mut c_void, c_int, *mut c_char, usize) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void);
type ConnectFn = unsafe extern "C" fn(*const u8, usize, c_int, *mut c_char, usize) -> *mut c_void;
type SendFn = unsafe extern "C" fn(*mut c_void, *const u8, usize) -> c_long;
type RecvFn = unsafe extern "C" fn(*mut c_void, *mut u8, usize) -> c_long;
type ArmFn = unsafe extern "C" fn(*mut c_void) -> c_int;

/// `struct vmi_sink` of `vmi_sink.h`.
#[repr(C)]
struct Table {
    abi: u32,
    reserved: u32,
    name: *const c_char,
    probe: Option<ProbeFn>,
    listen: Option<ListenFn>,
    accept: Option<AcceptFn>,
    close_listener: Option<FreeFn>,
    connect: Option<ConnectFn>,
    send: Option<SendFn>,
    recv: Option<RecvFn>,
    arm: Option<ArmFn>,
    close: Option<FreeFn>,
}

/// A sink plug-in's functions, checked once.
#[derive(Clone, Copy)]
struct Fns {
    probe: ProbeFn,
    listen: ListenFn,
    accept: AcceptFn,
    close_listener: FreeFn,
    connect: ConnectFn,
    send: SendFn,
    recv: RecvFn,
    arm: ArmFn,
    close: FreeFn,
}

/// A loaded sink plug-in. (The library stays loaded for the life of the process: links
/// may outlive any one user of the table.)
pub struct SinkPlugin {
    name: String,
    f: Fns,
}

/// What a plug-in says about this node's devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Devices {
    /// Devices that work, and what the plug-in says of them.
    Some(u32, String),
    /// None: why.
    None(String),
    /// The sink cannot work here: why.
    Broken(String),
}

fn why_text(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

impl SinkPlugin {
    /// Opens `libvmi_sink_NAME.so` of folder `dir` and checks its table.
    pub fn open(dir: &Path, name: &str) -> Result<SinkPlugin, String> {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            return Err(format!("sink plug-in {name:?}: not a plug-in name"));
        }
        let path = dir.join(format!("libvmi_sink_{name}.so"));
        Self::open_file(&path, name)
    }

    /// Opens the sink plug-in at `path` (its name: `name`).
    pub fn open_file(path: &Path, name: &str) -> Result<SinkPlugin, String> {
        let shown = path.display();
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("sink plug-in {name}: {shown}: not a file name"))?;
        // SAFETY: `cpath` is NUL-terminated; dlopen runs the library's initialisers, which is
        // what loading a plug-in means.
        let h = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror returns a NUL-terminated message or null.
            let e = unsafe { libc::dlerror() };
            let e = if e.is_null() {
                "unknown error".into()
            } else {
                // SAFETY: not null, NUL-terminated (above).
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            return Err(format!("sink plug-in {name}: cannot load {shown}: {e}"));
        }
        // SAFETY: `h` is a live handle; the name is NUL-terminated.
        let sym = unsafe { libc::dlsym(h, c"vmi_sink_entry".as_ptr()) };
        if sym.is_null() {
            return Err(format!("sink plug-in {name}: {shown} has no symbol vmi_sink_entry"));
        }
        // SAFETY: the interface declares vmi_sink_entry as `const struct vmi_sink *(void)`.
        let entry: unsafe extern "C" fn() -> *const Table = unsafe { std::mem::transmute(sym) };
        // SAFETY: calling the plug-in's entry point as declared.
        let t = unsafe { entry() };
        if t.is_null() {
            return Err(format!(
                "sink plug-in {name}: its initialisation failed (vmi_sink_entry gave no table)"
            ));
        }
        // SAFETY: a non-null table of the declared layout, which the plug-in keeps alive
        // (the library is never closed).
        let t = unsafe { &*t };
        if t.abi != ABI {
            return Err(format!("sink plug-in {name}: interface version {}, this layer speaks {ABI}", t.abi));
        }
        let missing = |what: &str| format!("sink plug-in {name}: its table has no {what} function");
        let f = Fns {
            probe: t.probe.ok_or_else(|| missing("probe"))?,
            listen: t.listen.ok_or_else(|| missing("listen"))?,
            accept: t.accept.ok_or_else(|| missing("accept"))?,
            close_listener: t.close_listener.ok_or_else(|| missing("close_listener"))?,
            connect: t.connect.ok_or_else(|| missing("connect"))?,
            send: t.send.ok_or_else(|| missing("send"))?,
            recv: t.recv.ok_or_else(|| missing("recv"))?,
            arm: t.arm.ok_or_else(|| missing("arm"))?,
            close: t.close.ok_or_else(|| missing("close"))?,
        };
        Ok(SinkPlugin { name: name.to_string(), f })
    }

    /// The node's devices for this sink.
    pub fn probe(&self) -> Devices {
        let mut why = [0u8; WHY];
        // SAFETY: `why` has WHY bytes, as told.
        let n = unsafe { (self.f.probe)(why.as_mut_ptr().cast(), WHY) };
        let why = why_text(&why);
        match n {
            n if n > 0 => Devices::Some(n as u32, why),
            0 => Devices::None(why),
            _ => Devices::Broken(why),
        }
    }
}

fn failed(why: &[u8]) -> io::Error {
    io::Error::other(why_text(why))
}

fn millis(d: Duration) -> c_int {
    d.as_millis().min(c_int::MAX as u128) as c_int
}

struct PluginPassive {
    ep: *mut c_void,
    f: Fns,
}

struct PluginLink {
    link: *mut c_void,
    f: Fns,
}

impl Sink for SinkPlugin {
    fn name(&self) -> &str {
        &self.name
    }

    fn listen(&self, ip: &str) -> io::Result<(Box<dyn Listener>, Vec<u8>)> {
        let cip =
            CString::new(ip).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "not an address"))?;
        let mut addr = [0u8; ADDR_MAX];
        let mut len = 0usize;
        let mut why = [0u8; WHY];
        // SAFETY: every pointer points at a buffer of the size the interface says.
        let ep = unsafe {
            (self.f.listen)(cip.as_ptr(), addr.as_mut_ptr(), &mut len, why.as_mut_ptr().cast(), WHY)
        };
        if ep.is_null() {
            return Err(failed(&why));
        }
        let l = PluginPassive { ep, f: self.f };
        if len == 0 || len > ADDR_MAX {
            return Err(io::Error::other(format!("the plug-in gave an endpoint address of {len} bytes")));
        }
        Ok((Box::new(l), addr[..len].to_vec()))
    }

    fn connect(&self, addr: &[u8], wait: Duration) -> io::Result<Box<dyn Link>> {
        let mut why = [0u8; WHY];
        // SAFETY: `addr` and `why` are valid for the lengths given.
        let link = unsafe {
            (self.f.connect)(addr.as_ptr(), addr.len(), millis(wait), why.as_mut_ptr().cast(), WHY)
        };
        if link.is_null() {
            return Err(failed(&why));
        }
        Ok(Box::new(PluginLink { link, f: self.f }))
    }
}

impl Listener for PluginPassive {
    fn accept(&mut self, wait: Duration) -> io::Result<Box<dyn Link>> {
        let mut why = [0u8; WHY];
        // SAFETY: `self.ep` is the plug-in's live endpoint; `why` has WHY bytes.
        let link = unsafe { (self.f.accept)(self.ep, millis(wait), why.as_mut_ptr().cast(), WHY) };
        if link.is_null() {
            return Err(failed(&why));
        }
        Ok(Box::new(PluginLink { link, f: self.f }))
    }
}

impl Drop for PluginPassive {
    fn drop(&mut self) {
        // SAFETY: the plug-in's endpoint, freed once.
        unsafe { (self.f.close_listener)(self.ep) }
    }
}

impl Link for PluginLink {
    fn send(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: the plug-in's live link; `buf` is valid for its length.
        let n = unsafe { (self.f.send)(self.link, buf.as_ptr(), buf.len()) };
        if n < 0 || n as usize > buf.len() {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "the link failed"));
        }
        Ok(n as usize)
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: the plug-in's live link; `buf` is valid for its length.
        let n = unsafe { (self.f.recv)(self.link, buf.as_mut_ptr(), buf.len()) };
        if n < 0 || n as usize > buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the link failed or the peer closed it",
            ));
        }
        Ok(n as usize)
    }

    fn arm(&mut self) -> Option<RawFd> {
        // SAFETY: the plug-in's live link.
        let fd = unsafe { (self.f.arm)(self.link) };
        (fd >= 0).then_some(fd)
    }
}

impl Drop for PluginLink {
    fn drop(&mut self) {
        // SAFETY: the plug-in's link, closed once.
        unsafe { (self.f.close)(self.link) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_misnamed_plugin_is_refused_with_a_reason() {
        let e = SinkPlugin::open(Path::new("/nonexistent"), "verbs").err().expect("refused");
        assert!(e.contains("cannot load") && e.contains("libvmi_sink_verbs.so"), "{e}");
        let e = SinkPlugin::open(Path::new("/tmp"), "../x").err().expect("refused");
        assert!(e.contains("not a plug-in name"), "{e}");
    }
}
