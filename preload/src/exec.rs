//! Handing virtual connections over across `exec`.
//!
//! A socket without close-on-exec survives `exec`, but the layer's state (stream offsets, a
//! frame in progress, the GID) lives in memory that `exec` discards. Before the real `exec`
//! the layer writes that state into the new image's environment (`VMI_INHERIT`), and makes
//! sure the new image loads the layer (`LD_PRELOAD`), since a virtual connection read
//! without it would show the program raw frames. The new image's layer rebuilds each
//! connection at start and removes the variable. The bytes the peer's layer has not
//! acknowledged yet (the replay ring's contents, including a replay still owed to a rebuilt
//! link) cross in a memory file left open across the exec, named in the record, so a link
//! that fails after the exec is still rebuilt without loss. What cannot cross: sharing with
//! a process that keeps using the same socket in the old image (each side then has its own
//! stream offsets).

use crate::error::Real;
use crate::fdtable::{self, Entry};
use crate::vc::{Setup, Vc};
use crate::{config, log};
use std::ffi::CString;
use std::sync::Arc;
use substrate::handover::ExecRecord;
use substrate::reliability::{ring_slices, RxState, TxState};

const VAR: &str = "VMI_INHERIT";

/// Writes the unacknowledged bytes of a connection (`tx.acked..tx.next_seq` of its replay
/// ring) into a memory file that stays open across the exec; its descriptor, or -1 when
/// there is nothing to carry or no memory file could be made. The caller holds the tx lock.
fn save_unacked(ring: &[u8], tx: &TxState) -> i32 {
    use std::io::Write as _;
    use std::os::fd::IntoRawFd;
    let n = (tx.next_seq - tx.acked) as usize;
    if n == 0 {
        return -1;
    }
    let (a, b) = ring_slices(ring, tx.ring_pos(tx.acked), n);
    // A fresh memory file, without close-on-exec.
    let fd = crate::sys::fd::memfd_create(c"vmi-unacked", 0);
    if fd < 0 {
        log::warn(format_args!(
            "cannot make a memory file for the bytes in flight across exec (errno {}); they are \
             not replayable in the new image",
            crate::sys::errno()
        ));
        return -1;
    }
    // Out of the way of the descriptor numbers the new program may expect to be free.
    let mut f = crate::sys::fd::into_file(crate::ownfd::move_high_inherited(fd));
    match f.write_all(a).and_then(|_| f.write_all(b)) {
        Ok(()) => f.into_raw_fd(),
        Err(_) => -1,
    }
}

/// The memory file name [`save_unacked`] gives (as `/proc/self/fd` shows it).
const MEMFD_LINK: &str = "/memfd:vmi-unacked";

/// Whether `fd` is a memory file [`save_unacked`] made (a record names a descriptor number;
/// anything else under that number is left alone).
fn our_memfd(fd: i32) -> bool {
    fd >= 0
        && std::fs::read_link(format!("/proc/self/fd/{fd}"))
            .is_ok_and(|l| l.to_string_lossy().starts_with(MEMFD_LINK))
}

/// Closes the memory file a record that cannot be used names, if it is one of ours.
fn drop_unacked(r: &str) {
    if let (_, _, Some(fd)) = ExecRecord::names(r) {
        if our_memfd(fd) {
            crate::sys::fd::close(fd);
        }
    }
}

/// Reads the `n` bytes a previous image saved in memory file `fd`, and closes it.
fn load_unacked(fd: i32, n: u64) -> Option<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    if !our_memfd(fd) {
        return None;
    }
    // The memory file the previous image left us; closed when `f` goes.
    let f = crate::sys::fd::into_file(fd);
    let mut buf = vec![0u8; n as usize];
    f.read_exact_at(&mut buf, 0).ok().map(|_| buf)
}

/// The `VMI_INHERIT` value for the virtual connections that survive exec, those
/// connections, and the memory files carrying their unacknowledged bytes.
fn inherit_value() -> Option<(String, Vec<Arc<Vc>>, Vec<i32>)> {
    let mut recs = Vec::new();
    let mut done: Vec<Arc<Vc>> = Vec::new();
    let mut files = Vec::new();
    for (fd, e) in fdtable::snapshot() {
        let Entry::Vc(v) = e else { continue };
        let fl = crate::sys::fd::fcntl(fd, libc::F_GETFD, 0);
        if fl < 0 || fl & libc::FD_CLOEXEC != 0 {
            continue;
        }
        let c = v.mem().conn();
        let mut tg = c.tx_lock.lock();
        let _rg = c.rx_lock.lock();
        let rx = c.with_rx_held(|rx| *rx);
        // One connection on several descriptors (sshd's re-exec passes it as 0 and 1): the
        // first record carries its state; the others only name the descriptor (the new
        // image gives them the same connection).
        let first = !done.iter().any(|d| Arc::ptr_eq(d, &v));
        if first {
            done.push(v.clone());
        }
        let shm =
            if first { v.shm_now().and_then(|l| l.handover(fd)).unwrap_or_default() } else { String::new() };
        let (tx, unacked) =
            v.mem().with_tx_ring(&mut tg, |tx, ring| (*tx, if first { save_unacked(ring, tx) } else { -1 }));
        if unacked >= 0 {
            files.push(unacked);
        }
        let rec = ExecRecord {
            fd,
            gid: c.gid,
            secret: c.secret,
            peer_window: c.peer_window,
            window: tx.soft_window,
            local: v.local,
            peer: v.peer,
            active: v.active,
            tx,
            rx,
            peer_agents: c.peer_agents(),
            shm,
            unacked,
        };
        match rec.encode() {
            Some(r) => recs.push(r),
            None => log::warn(format_args!("fd {fd}: shared-memory hand-over not encodable; not carried")),
        }
    }
    (!recs.is_empty()).then(|| (recs.join(";"), done, files))
}

fn parse_rec(r: &str) -> Option<(i32, Setup, TxState, RxState, i32)> {
    let rec = ExecRecord::parse(r)?;
    let s = Setup {
        gid: rec.gid,
        secret: rec.secret,
        peer_window: rec.peer_window,
        window: rec.window,
        local: rec.local,
        peer: rec.peer,
        active: rec.active,
        peer_agents: rec.peer_agents,
        renamed: true,
        shm: if rec.shm.is_empty() { None } else { Some(crate::shm_sink::ShmLink::adopt(&rec.shm)?) },
    };
    Some((rec.fd, s, rec.tx, rec.rx, rec.unacked))
}

/// At start: rebuild the connections the previous image handed over.
pub fn adopt() {
    let Ok(v) = std::env::var(VAR) else { return };
    // (In the library constructor, before the program's threads.)
    crate::sys::process::env_remove(VAR);
    let mut adopted = false;
    let mut by_gid: Vec<(u128, Arc<Vc>)> = Vec::new();
    for r in v.split(';') {
        // Another descriptor of a connection already rebuilt: the same connection.
        let (fd, gid, _) = ExecRecord::names(r);
        if let (Some(fd), Some(gid)) = (fd, gid) {
            if let Some((_, vc)) = by_gid.iter().find(|(g, _)| *g == gid) {
                if crate::sys::tcp_family(fd).is_some() {
                    drop_unacked(r);
                    log::info(format_args!("virtual connection {gid:032x} on fd {fd} carried across exec"));
                    fdtable::insert(fd, Entry::Vc(vc.clone()));
                    continue;
                }
            }
        }
        match parse_rec(r) {
            Some((fd, s, tx, rx, unacked)) if crate::sys::tcp_family(fd).is_some() => {
                let saved = load_unacked(unacked, tx.next_seq - tx.acked);
                match (s.gid, Vc::restore(s, tx, rx, saved)) {
                    (gid, Some(vc)) => {
                        log::info(format_args!(
                            "virtual connection {gid:032x} on fd {fd} carried across exec"
                        ));
                        if vc.mem().conn().broken.load(std::sync::atomic::Ordering::Acquire) != 0 {
                            // Reset (see `Vc::restore`): the peer sees the end too.
                            crate::sys::fd::shutdown(fd, libc::SHUT_RDWR);
                        }
                        let vc = Arc::new(vc);
                        by_gid.push((gid, vc.clone()));
                        fdtable::insert(fd, Entry::Vc(vc));
                        adopted = true;
                    }
                    (gid, None) => {
                        log::error(format_args!("cannot rebuild virtual connection {gid:032x} after exec"))
                    }
                }
            }
            _ => {
                drop_unacked(r);
                log::error(format_args!("unusable {VAR} record; that descriptor stays as it is"))
            }
        }
    }
    if adopted && !config::disabled() {
        crate::agent::hello();
    }
}

fn own_path() -> Option<String> {
    crate::sys::process::library_path()
}

/// What an exec hands over: the new image's environment, and the connections it carries.
pub struct Handover {
    /// `envp` plus the hand-over (and the layer in `LD_PRELOAD`).
    pub env: Vec<CString>,
    /// The connections handed over.
    pub vcs: Vec<Arc<Vc>>,
    /// The memory files with their unacknowledged bytes (closed here if the exec fails).
    files: Vec<i32>,
}

impl Handover {
    /// Runs the real exec with the new environment. The new image counts as one more holder
    /// of each connection from now on (so that a parent closing its copy after a `vfork` +
    /// exec, which the fork hook never saw, is not taken for the last close); if the exec
    /// fails, that is undone.
    ///
    /// In a vfork child the connections are not held through `Arc`s of our own across the
    /// exec (see `sys::process::ExecHeld`).
    pub fn exec(self, with_env: impl FnOnce(&[CString]) -> Real) -> Real {
        let own = !crate::vforked();
        let vcs = crate::sys::process::ExecHeld::new(self.vcs);
        vcs.each(|v| v.exec_hold(own, false));
        let r = with_env(&self.env);
        vcs.each(|v| {
            v.exec_hold(own, true);
            if let Some(l) = v.shm() {
                l.handover_undone();
            }
        });
        for &fd in &self.files {
            crate::sys::fd::close(fd);
        }
        r
    }
}

/// The hand-over for an exec with the environment `envp` gives (called only when there is
/// something to hand over); `None` when nothing is handed over.
pub fn env_for_exec(envp: impl FnOnce() -> Vec<CString>) -> Option<Handover> {
    if config::disabled() || !fdtable::any() {
        return None;
    }
    let (value, vcs, files) = inherit_value()?;
    let mut out: Vec<CString> = Vec::new();
    let mut preload_seen = false;
    let me = own_path().unwrap_or_default();
    for e in envp() {
        let b = e.as_bytes();
        if b.starts_with(b"VMI_INHERIT=") {
            // replaced below
        } else if b.starts_with(b"LD_PRELOAD=") {
            preload_seen = true;
            let v = String::from_utf8_lossy(&b[11..]).into_owned();
            if !me.is_empty() && !v.contains(&me) {
                out.push(CString::new(format!("LD_PRELOAD={me} {v}")).ok()?);
            } else {
                out.push(e);
            }
        } else {
            out.push(e);
        }
    }
    if !preload_seen && !me.is_empty() {
        out.push(CString::new(format!("LD_PRELOAD={me}")).ok()?);
    }
    out.push(CString::new(format!("{VAR}={value}")).ok()?);
    Some(Handover { env: out, vcs, files })
}
