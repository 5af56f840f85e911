//! Device plug-ins (`plugins/vmi_device.h`): shared libraries `libvmi_dev_NAME.so` in the
//! plug-in folder (`VMI_PLUGINS`, default `/usr/lib/vmi/plugins`), each exporting
//! `vmi_device_entry`, which returns a table of C functions and its interface version. A
//! plug-in is opened the first time a chain names it, and stays loaded; one that cannot be
//! had (no such file, a missing symbol, another interface version, a failed
//! initialisation) is refused with one log line that says why, and whatever chain asked for
//! it is refused (the connection keeps the chain it had).

use std::collections::HashMap;
use std::ffi::{c_char, c_long, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};
use substrate::connection::chain::{DecodeError, Filter, FilterSource};

/// The interface version this layer speaks.
pub const ABI: u32 = 1;
/// Most bytes a plug-in may decode one frame into (the largest frame).
const DECODE_MAX: usize = substrate::wire::frame::MAX_PAYLOAD as usize;

/// `struct vmi_device` of `vmi_device.h`.
#[repr(C)]
struct Table {
    abi: u32,
    reserved: u32,
    name: *const c_char,
    max_out: Option<unsafe extern "C" fn(usize) -> usize>,
    open: Option<unsafe extern "C" fn() -> *mut c_void>,
    close: Option<unsafe extern "C" fn(*mut c_void)>,
    encode: Option<unsafe extern "C" fn(*mut c_void, u64, *const u8, usize, *mut u8, usize) -> c_long>,
    decode: Option<unsafe extern "C" fn(*mut c_void, u64, *const u8, usize, *mut u8, usize) -> c_long>,
}

/// A plug-in's functions, checked once.
#[derive(Clone, Copy)]
struct Device {
    name: &'static str,
    max_out: unsafe extern "C" fn(usize) -> usize,
    open: unsafe extern "C" fn() -> *mut c_void,
    close: unsafe extern "C" fn(*mut c_void),
    encode: unsafe extern "C" fn(*mut c_void, u64, *const u8, usize, *mut u8, usize) -> c_long,
    decode: unsafe extern "C" fn(*mut c_void, u64, *const u8, usize, *mut u8, usize) -> c_long,
}

/// The plug-in folder's devices: their names (sorted: a device's place is its id in chains'
/// compact form) and, once opened, their tables or why they were refused.
pub struct Plugins {
    dir: String,
    /// Where a loaded or refused plug-in is told (true: a refusal).
    say: fn(bool, std::fmt::Arguments<'_>),
    names: Vec<&'static str>,
    opened: Mutex<HashMap<&'static str, Result<Device, String>>>,
}

impl Plugins {
    /// The devices of folder `dir` (a folder that cannot be read has none).
    pub fn scan(dir: &str, say: fn(bool, std::fmt::Arguments<'_>)) -> Plugins {
        let names = substrate::connection::chain::plugin_names_kept(std::path::Path::new(dir));
        Plugins { dir: dir.to_string(), say, names, opened: Mutex::new(HashMap::new()) }
    }

    /// Opens plug-in `name` (once), checking its table.
    fn device(&self, name: &str) -> Result<Device, String> {
        let Some(&name) = self.names.iter().find(|n| **n == name) else {
            return Err(format!(
                "no device {name} in this build, and no plug-in {}/libvmi_dev_{name}.so",
                self.dir
            ));
        };
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = opened.get(name) {
            return r.clone();
        }
        let r = self.open(name);
        match &r {
            Ok(_) => {
                (self.say)(false, format_args!("device plug-in {}/libvmi_dev_{name}.so loaded", self.dir))
            }
            Err(e) => (self.say)(
                true,
                format_args!("device plug-in {}/libvmi_dev_{name}.so refused: {e}", self.dir),
            ),
        }
        opened.insert(name, r.clone());
        r
    }

    fn open(&self, name: &'static str) -> Result<Device, String> {
        let path = CString::new(format!("{}/libvmi_dev_{name}.so", self.dir))
            .map_err(|_| "a bad path".to_string())?;
        // SAFETY: `path` is NUL-terminated; dlopen runs the library's initialisers, which is
        // what loading a plug-in means. It is never closed (its functions stay in use).
        let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror returns a NUL-terminated message or null.
            let e = unsafe { libc::dlerror() };
            let why = if e.is_null() {
                "it cannot be loaded".to_string()
            } else {
                // SAFETY: as above.
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            return Err(why);
        }
        // SAFETY: a NUL-terminated symbol name on a live handle.
        let sym = unsafe { libc::dlsym(h, c"vmi_device_entry".as_ptr()) };
        if sym.is_null() {
            return Err("it has no symbol vmi_device_entry (the single entry point of vmi_device.h)".into());
        }
        // SAFETY: the plug-in interface says `vmi_device_entry` is
        // `const struct vmi_device *(void)`.
        let entry: unsafe extern "C" fn() -> *const Table = unsafe { std::mem::transmute(sym) };
        // SAFETY: calling the plug-in's entry point as its interface says.
        let t = unsafe { entry() };
        if t.is_null() {
            return Err("its initialisation failed (vmi_device_entry returned NULL)".into());
        }
        // SAFETY: a non-null pointer to the plug-in's table, which lives as long as the
        // library (never closed). Only the version is read before it is known to be ours.
        let abi = unsafe { std::ptr::read_unaligned(t as *const u32) };
        if abi != ABI {
            return Err(format!("it speaks interface version {abi}; this layer speaks {ABI}"));
        }
        // SAFETY: version 1: the table has the layout of `Table`.
        let t = unsafe { &*t };
        let missing = |what: &str| format!("its table has no {what} function");
        let dev = Device {
            name,
            max_out: t.max_out.ok_or_else(|| missing("max_out"))?,
            open: t.open.ok_or_else(|| missing("open"))?,
            close: t.close.ok_or_else(|| missing("close"))?,
            encode: t.encode.ok_or_else(|| missing("encode"))?,
            decode: t.decode.ok_or_else(|| missing("decode"))?,
        };
        if !t.name.is_null() {
            // SAFETY: a NUL-terminated string of the plug-in's, as its interface says.
            let said = unsafe { CStr::from_ptr(t.name) }.to_string_lossy();
            if said != name {
                return Err(format!("its table calls it {said:?}, its file {name:?}"));
            }
        }
        // A state opened and closed: a device that cannot work says so now.
        // SAFETY: the plug-in's own functions, called as its interface says.
        let s = unsafe { (dev.open)() };
        if s.is_null() {
            return Err("its initialisation failed (open returned NULL)".into());
        }
        // SAFETY: as above, on the state open gave.
        unsafe { (dev.close)(s) };
        Ok(dev)
    }
}

impl FilterSource for Plugins {
    fn make(&self, name: &str) -> Result<Box<dyn Filter>, String> {
        let dev = self.device(name)?;
        // SAFETY: the plug-in's own function, as its interface says.
        let state = unsafe { (dev.open)() };
        if state.is_null() {
            return Err(format!("device plug-in {name}: open returned NULL"));
        }
        Ok(Box::new(PluginFilter { dev, state }))
    }
    fn place_of(&self, name: &str) -> Option<u8> {
        self.names.iter().position(|n| *n == name).map(|p| p as u8)
    }
    fn name_at(&self, place: u8) -> Option<&'static str> {
        self.names.get(place as usize).copied()
    }
}

/// A filter whose work a plug-in does.
struct PluginFilter {
    dev: Device,
    state: *mut c_void,
}

// SAFETY: the layer uses a filter from one thread at a time, which the interface allows
// (states may move between threads).
unsafe impl Send for PluginFilter {}

impl std::fmt::Debug for PluginFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PluginFilter({})", self.dev.name)
    }
}

impl Drop for PluginFilter {
    fn drop(&mut self) {
        // SAFETY: the state open gave, closed once.
        unsafe { (self.dev.close)(self.state) };
    }
}

impl PluginFilter {
    /// Runs `f` (encode or decode) with `cap` bytes of room after `out`'s end.
    fn run(
        &mut self,
        f: unsafe extern "C" fn(*mut c_void, u64, *const u8, usize, *mut u8, usize) -> c_long,
        seq: u64,
        input: &[u8],
        out: &mut Vec<u8>,
        cap: usize,
    ) -> bool {
        let at = out.len();
        out.reserve(cap);
        // SAFETY: `out` has `cap` bytes of spare room from `at`; the plug-in writes at most
        // `cap` bytes there and says how many, which is checked before they count.
        let r = unsafe { f(self.state, seq, input.as_ptr(), input.len(), out.as_mut_ptr().add(at), cap) };
        if r < 0 || r as usize > cap {
            return false;
        }
        // SAFETY: the plug-in initialised `r` bytes from `at` (checked: at most `cap`).
        unsafe { out.set_len(at + r as usize) };
        true
    }
}

impl Filter for PluginFilter {
    fn name(&self) -> &'static str {
        self.dev.name
    }
    fn max_out(&self, n: usize) -> usize {
        // SAFETY: the plug-in's own function.
        unsafe { (self.dev.max_out)(n) }
    }
    fn encode(&mut self, seq: u64, _raw_len: usize, input: &[u8], out: &mut Vec<u8>) {
        let cap = self.max_out(input.len());
        let at = out.len();
        if !self.run(self.dev.encode, seq, input, out, cap) {
            out.truncate(at);
        }
    }
    fn decode(&mut self, seq: u64, input: &[u8], out: &mut Vec<u8>) -> Result<(), DecodeError> {
        if self.run(self.dev.decode, seq, input, out, DECODE_MAX) {
            Ok(())
        } else {
            Err(DecodeError::Malformed)
        }
    }
}

static INSTALLED: OnceLock<()> = OnceLock::new();

/// Makes the plug-ins of folder `dir` available to chains (once per process); `say` logs
/// each plug-in loaded (false) or refused (true).
pub fn install(dir: &str, say: fn(bool, std::fmt::Arguments<'_>)) {
    INSTALLED.get_or_init(|| substrate::connection::chain::set_plugins(Box::new(Plugins::scan(dir, say))));
}
