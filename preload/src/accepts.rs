//! This process's table of connections announced to its listeners (layout and rules in
//! `substrate::accepts`): a sealed memfd, made with the first listener and handed to the
//! node agent (`Msg::Table`) before that listener's registration, and again after every new
//! hello (a restarted agent, a forked child); the agent writes each connection announced
//! to one of them, and `setup::after_accept` takes it from here instead of asking the agent
//! and waiting (then tells the agent, one way, `Msg::Accepted`). Shared with forked children
//! (a shared mapping), gone at `exec` (close-on-exec; the new image asks until it has one).

use crate::ownfd::{self, OWN_ACCEPTS};
use crate::sys;
use crate::sys::shared::SharedMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::OnceLock;
use substrate::accepts::{self, Entry, Words, TABLE_BYTES};

static TABLE: OnceLock<Option<SharedMap>> = OnceLock::new();

struct View<'a>(&'a SharedMap);

impl Words for View<'_> {
    fn word(&self, i: usize) -> &AtomicU64 {
        self.0.u64(i * 8)
    }
    fn len(&self) -> usize {
        self.0.len() / 8
    }
}

fn create() -> Option<SharedMap> {
    let (map, fd) =
        SharedMap::memfd(c"vmi-accepts", TABLE_BYTES, libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)?;
    // The agent maps it too, and must never find it shorter than it was.
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    if sys::fd::fcntl(fd, libc::F_ADD_SEALS, seals as libc::c_ulong) != 0 {
        sys::fd::close(fd);
        return None;
    }
    let fd = ownfd::move_high(fd);
    accepts::init(&View(&map));
    ownfd::protect(OWN_ACCEPTS, fd);
    Some(map)
}

/// The table's descriptor, to hand to the agent with a listener (made on first use); `None`
/// when no memfd could be made.
pub fn fd() -> Option<i32> {
    TABLE.get_or_init(create);
    existing_fd()
}

/// The table's descriptor if the table was made already (never makes it).
pub fn existing_fd() -> Option<i32> {
    TABLE.get()?.as_ref()?;
    let fd = ownfd::own_fd(OWN_ACCEPTS);
    (fd >= 0).then_some(fd)
}

/// Takes the connection from `peer` accepted at `local`, if the agent put it in the table.
pub fn take(local: SocketAddr, peer: SocketAddr) -> Option<Entry> {
    let map = TABLE.get()?.as_ref()?;
    accepts::claim(&View(map), peer, local, sys::now_ns())
}
