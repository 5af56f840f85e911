//! Event channels: each process under the layer keeps one Unix connection open to its agent
//! (besides its request socket) on which it says which virtual connections it holds, and the
//! agent tells it when a network path dies or comes back, and hands it the sockets of links
//! other nodes rebuilt for its connections.

use crate::wire::read_msg;
use std::collections::{HashMap, HashSet};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;
use substrate::wire::agent::Msg;
use tracing::{debug, info, warn};

struct Chan {
    pid: u32,
    out: UnixStream,
    holds: HashSet<u128>,
}

/// The node's event channels.
#[derive(Default)]
pub struct Events {
    chans: Mutex<HashMap<u64, Chan>>,
}

fn send_with_fd(s: &UnixStream, body: &[u8], fd: Option<RawFd>) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: body.as_ptr() as *mut _, iov_len: body.len() };
    // SAFETY: zeroed msghdr is valid; pointers set to live locals below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let mut cbuf = [0u64; 4];
    if let Some(pfd) = fd {
        msg.msg_control = cbuf.as_mut_ptr() as *mut _;
        // SAFETY: CMSG_SPACE is a pure computation.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as _;
        // SAFETY: the control buffer holds one int.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut i32, pfd);
        }
    }
    // SAFETY: msg is fully initialised.
    let r = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // The rest (rare: a full socket buffer) without the descriptor.
    let mut w = s;
    w.write_all(&body[r as usize..])
}

impl Events {
    /// Serves the event channel `id` of process `pid` until it closes.
    pub fn serve(&self, id: u64, pid: u32, s: UnixStream) {
        let out = match s.try_clone() {
            Ok(o) => o,
            Err(e) => {
                warn!("event channel of process {pid}: {e}");
                return;
            }
        };
        // A process that stops reading must not stall the agent.
        let _ = out.set_write_timeout(Some(Duration::from_millis(200)));
        self.lock().insert(id, Chan { pid, out, holds: HashSet::new() });
        debug!("event channel {id} of process {pid}");
        let mut r = &s;
        loop {
            match read_msg(&mut r) {
                Ok(Msg::Hold { gid }) => {
                    if let Some(c) = self.lock().get_mut(&id) {
                        c.holds.insert(gid);
                    }
                }
                Ok(Msg::Release { gid }) => {
                    if let Some(c) = self.lock().get_mut(&id) {
                        c.holds.remove(&gid);
                    }
                }
                Ok(other) => {
                    warn!("process {pid} sent {other:?} on its event channel; closing it");
                    break;
                }
                Err(e) => {
                    if e.kind() != io::ErrorKind::UnexpectedEof {
                        info!("event channel of process {pid}: {e}");
                    }
                    break;
                }
            }
        }
        self.lock().remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Chan>> {
        self.chans.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tells every process (each keeps only what concerns its connections).
    pub fn broadcast(&self, m: &Msg) {
        let body = m.encode();
        let mut chans = self.lock();
        let mut dead = Vec::new();
        for (id, c) in chans.iter() {
            if let Err(e) = send_with_fd(&c.out, &body, None) {
                info!("process {} does not take events ({e}); dropping its channel", c.pid);
                dead.push(*id);
            }
        }
        for id in dead {
            if let Some(c) = chans.remove(&id) {
                let _ = c.out.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// Hands the new link `fd` of connection `gid` to a process holding it. False if no
    /// process here holds it.
    pub fn handover(&self, gid: u128, nonce: u128, fd: RawFd) -> bool {
        let body = Msg::Handover { gid, nonce }.encode();
        let chans = self.lock();
        for c in chans.values().filter(|c| c.holds.contains(&gid)) {
            match send_with_fd(&c.out, &body, Some(fd)) {
                Ok(()) => {
                    debug!("link for {gid:032x} handed to process {}", c.pid);
                    return true;
                }
                Err(e) => info!("handing a link to process {}: {e}", c.pid),
            }
        }
        false
    }

    /// Number of GIDs held by processes of this node (for reports).
    pub fn held(&self) -> usize {
        self.lock().values().map(|c| c.holds.len()).sum()
    }
}
