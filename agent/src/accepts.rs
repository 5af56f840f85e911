//! The tables of announced connections the processes under the layer share with the agent
//! (layout and rules in `substrate::accepts`): a process hands its table over with its first
//! listener, the agent writes there each connection announced to a listener of that process,
//! and the process's accept takes the entry instead of asking.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use substrate::accepts::{self, Entry, TABLE_BYTES};

/// Most tables mapped at once (one per process with listeners, forked children sharing
/// their parent's).
pub const MAX_TABLES: usize = 4096;

/// A process's table, mapped read-write.
pub struct AcceptMap {
    base: *mut AtomicU64,
    /// Inode of its memfd (a forked child hands over its parent's).
    inode: u64,
}

// SAFETY: the mapping is only ever reached through atomics.
unsafe impl Send for AcceptMap {}
// SAFETY: as above.
unsafe impl Sync for AcceptMap {}

impl AcceptMap {
    /// Maps the table handed over as `fd`: a memfd of the table's size whose size its
    /// process can no longer change (sealed against shrinking: a process that shrank the
    /// memory under the agent's mapping would make the agent's next write fault). `None`,
    /// with the reason, otherwise.
    pub fn map(fd: &OwnedFd) -> Result<AcceptMap, &'static str> {
        let raw = fd.as_raw_fd();
        // SAFETY: F_GET_SEALS takes no argument; fails on anything but a memfd.
        let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err("not a memfd sealed against shrinking");
        }
        let Some(st) = fstat(fd).filter(|st| st.st_size as usize >= TABLE_BYTES) else {
            return Err("smaller than a table");
        };
        let Some(p) = map_rw(fd) else { return Err("cannot be mapped") };
        let m = AcceptMap { base: p, inode: st.st_ino };
        if !accepts::valid(m.words()) {
            return Err("not a table of this build's layout");
        }
        // Nothing an earlier agent wrote counts for this one.
        accepts::init(m.words());
        Ok(m)
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: TABLE_BYTES mapped at `base` (page-aligned) for the life of `self`,
        // reached only atomically.
        unsafe { std::slice::from_raw_parts(self.base, TABLE_BYTES / 8) }
    }
}

impl Drop for AcceptMap {
    fn drop(&mut self) {
        // SAFETY: unmaps what `map` mapped.
        unsafe { libc::munmap(self.base as *mut _, TABLE_BYTES) };
    }
}

/// The tables, by the local client (request socket) that handed each over.
#[derive(Default)]
pub struct Tables {
    by_client: Mutex<HashMap<u64, Arc<AcceptMap>>>,
    /// Virtual connections accepted since the agent started: taken from a table, asked.
    pub taken: AtomicU64,
    /// (See `taken`.)
    pub asked: AtomicU64,
}

impl Tables {
    /// Client `client` handed over `fd` with a listener.
    pub fn attach(&self, client: u64, pid: Option<u32>, fd: &OwnedFd) {
        // Handed over again with each listener: mapped (and cleared) only the first time;
        // a forked child's table is its parent's mapping.
        if let Some(ino) = inode(fd) {
            let mut t = self.by_client.lock().unwrap_or_else(|e| e.into_inner());
            if t.get(&client).is_some_and(|k| k.inode == ino) {
                return;
            }
            if let Some(k) = t.values().find(|k| k.inode == ino).cloned() {
                t.insert(client, k);
                return;
            }
        }
        let m = match AcceptMap::map(fd) {
            Ok(m) => m,
            Err(why) => {
                tracing::warn!(
                    "process {}: its table of announced connections is refused ({why}); its accepts ask instead",
                    pid.map_or_else(|| "?".into(), |p| p.to_string())
                );
                return;
            }
        };
        let mut t = self.by_client.lock().unwrap_or_else(|e| e.into_inner());
        if t.len() >= MAX_TABLES && !t.contains_key(&client) {
            tracing::debug!(
                "{MAX_TABLES} tables of announced connections mapped: client {client}'s accepts ask"
            );
            return;
        }
        let known = t.values().find(|k| k.inode == m.inode).cloned();
        t.insert(client, known.unwrap_or_else(|| Arc::new(m)));
    }

    /// Client `client` is gone.
    pub fn detach(&self, client: u64) {
        self.by_client.lock().unwrap_or_else(|e| e.into_inner()).remove(&client);
    }

    /// Writes `e` into the table of client `owner` (the listener's), if it handed one over.
    pub fn put(&self, owner: u64, e: &Entry, now_ns: u64) -> bool {
        let m = self.by_client.lock().unwrap_or_else(|e| e.into_inner()).get(&owner).cloned();
        m.is_some_and(|m| accepts::put(m.words(), e, now_ns))
    }

    /// Clears the entry `src → dst` (GID `gid`) from the table of client `owner`.
    pub fn clear(&self, owner: u64, src: SocketAddr, dst: SocketAddr, gid: u128) {
        let m = self.by_client.lock().unwrap_or_else(|e| e.into_inner()).get(&owner).cloned();
        if let Some(m) = m {
            accepts::clear(m.words(), src, dst, gid);
        }
    }
}

fn inode(fd: &OwnedFd) -> Option<u64> {
    fstat(fd).map(|st| st.st_ino)
}

fn fstat(fd: &OwnedFd) -> Option<libc::stat> {
    // SAFETY: zeroed stat is valid; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and pointer.
    (unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0).then_some(st)
}

/// TABLE_BYTES of `fd` mapped shared, read-write (the caller checked its size).
fn map_rw(fd: &OwnedFd) -> Option<*mut AtomicU64> {
    // SAFETY: maps TABLE_BYTES of the memfd, shared, read-write; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            TABLE_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as *mut AtomicU64)
}

/// The local and peer addresses (the peer's `None` when not connected) of a TCP socket a
/// process handed over, as proof that it holds that socket; `None` for anything that is not
/// a TCP socket (a UDP socket may be bound to the same port number, and even connected to
/// the same peer).
pub fn tcp_names(fd: OwnedFd) -> Option<(SocketAddr, Option<SocketAddr>)> {
    let int_opt = |opt: i32| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: valid descriptor, pointer and length.
        let r =
            unsafe { libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, opt, (&raw mut v).cast(), &mut len) };
        (r == 0).then_some(v)
    };
    if int_opt(libc::SO_TYPE)? != libc::SOCK_STREAM || int_opt(libc::SO_PROTOCOL)? != libc::IPPROTO_TCP {
        return None;
    }
    let s = std::net::TcpStream::from(fd);
    let local = s.local_addr().ok()?;
    Some((local, s.peer_addr().ok()))
}

/// CLOCK_MONOTONIC in nanoseconds (the clock the tables' expiry times are on).
pub fn now_ns() -> u64 {
    // SAFETY: zeroed timespec filled by the kernel.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Tables {
    /// Counts one virtual connection accepted, taken from a table or asked about.
    pub fn count(&self, from_table: bool) {
        if from_table { &self.taken } else { &self.asked }.fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn memfd(len: usize, seals: i32) -> OwnedFd {
        // SAFETY: a NUL-terminated name; the descriptor is owned below.
        let fd = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: fd is ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain calls on our descriptor.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
            if seals != 0 {
                assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
            }
        }
        fd
    }

    fn layer_table(fd: &OwnedFd) -> AcceptMap {
        // The layer's side: it writes the header before it hands the table over.
        let m = AcceptMap::map(fd);
        assert!(m.is_err(), "a table without its header was taken");
        let m = AcceptMap { base: map_rw(fd).expect("mapped"), inode: 0 };
        assert!(accepts::init(m.words()));
        m
    }

    fn entry(port: u16) -> Entry {
        Entry {
            src: SocketAddr::from(([10, 0, 0, 2], port)),
            dst: "10.0.0.1:80".parse().unwrap(),
            gid: u128::from(port),
            secret: 9,
            window: 1,
            alias: None,
            agents: vec![],
            expires_ns: u64::MAX,
        }
    }

    #[test]
    fn only_a_tcp_socket_proves_an_address() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let c = std::net::TcpStream::connect(a).unwrap();
        let (s, _) = l.accept().unwrap();
        assert_eq!(tcp_names(OwnedFd::from(l.try_clone().unwrap())), Some((a, None)));
        assert_eq!(tcp_names(OwnedFd::from(s)), Some((a, Some(c.local_addr().unwrap()))));
        // A UDP socket on the same port number, even connected to the same peer, is not it.
        let u = std::net::UdpSocket::bind(a).unwrap();
        u.connect(c.local_addr().unwrap()).unwrap();
        assert_eq!(tcp_names(OwnedFd::from(u)), None);
    }

    #[test]
    fn only_a_sealed_table_of_the_right_size_is_mapped() {
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        assert_eq!(
            AcceptMap::map(&memfd(TABLE_BYTES, 0)).err(),
            Some("not a memfd sealed against shrinking")
        );
        assert_eq!(AcceptMap::map(&memfd(4096, seals)).err(), Some("smaller than a table"));
        let fd = memfd(TABLE_BYTES, 0);
        let _layer = layer_table(&fd);
        // SAFETY: plain call on our descriptor.
        assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) }, 0);
        assert!(AcceptMap::map(&fd).is_ok());
    }

    #[test]
    fn a_table_handed_over_again_keeps_its_entries_and_a_child_shares_it() {
        let fd = memfd(TABLE_BYTES, 0);
        let layer = layer_table(&fd);
        // SAFETY: plain call on our descriptor.
        assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
        let t = Tables::default();
        t.attach(1, None, &fd);
        assert!(t.put(1, &entry(1000), 0));
        // The same table again (a second listener), and from a forked child's socket.
        t.attach(1, None, &fd);
        t.attach(2, None, &fd);
        assert!(t.put(2, &entry(1001), 0));
        for p in [1000, 1001] {
            let e = entry(p);
            assert_eq!(accepts::claim(layer.words(), e.src, e.dst, 0).map(|e| e.gid), Some(u128::from(p)));
        }
        t.clear(1, entry(1000).src, entry(1000).dst, 1000);
        t.detach(1);
        assert!(t.put(2, &entry(1002), 0), "the child's mapping went with the parent's socket");
        assert!(!t.put(1, &entry(1003), 0));
    }
}
