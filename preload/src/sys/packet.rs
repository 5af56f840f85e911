//! Raw Ethernet frames through the kernel's packet rings: an `AF_PACKET` socket bound to one
//! interface and one EtherType, with a receive ring and a transmit ring shared with the
//! kernel (`PACKET_RX_RING` / `PACKET_TX_RING`, `TPACKET_V2`), so that many frames cost one
//! system call or none:
//!
//! * **Receiving** reads frames straight out of the ring the kernel fills; a frame slot is
//!   handed back by one store. No system call at all while frames keep coming; `wait`
//!   sleeps in `poll` only when the ring is empty.
//! * **Sending** writes frames into free slots of the transmit ring and hands them to the
//!   kernel, all of them with one `send` (`flush`).
//!
//! `TPACKET_V2` rather than `V3`: a V3 receive block reaches the reader only when it is full
//! or its retire timer (at least a millisecond) fires, which a request/response exchange
//! pays as latency; V2 hands each frame over as soon as it lands.
//!
//! The calls go to the kernel directly (`syscall`), not through libc's symbols, so that the
//! module serves the layer (whose own hooks must not see them) and stand-alone programs alike.
//! It needs `CAP_NET_RAW`.

use libc::{c_int, c_long, c_void};
use std::sync::atomic::{fence, AtomicU32, Ordering};

// The kernel's ABI (linux/if_packet.h), written out so as not to depend on which of them a
// libc release exports.
const SOL_PACKET: c_int = 263;
const PACKET_RX_RING: c_int = 5;
const PACKET_VERSION: c_int = 10;
const PACKET_TX_RING: c_int = 13;
const PACKET_LOSS: c_int = 14;
const PACKET_STATISTICS: c_int = 6;
const TPACKET_V2: c_int = 1;
const TP_STATUS_KERNEL: u32 = 0;
const TP_STATUS_USER: u32 = 1;
const TP_STATUS_AVAILABLE: u32 = 0;
const TP_STATUS_SEND_REQUEST: u32 = 1;
const TP_STATUS_SENDING: u32 = 2;
const TP_STATUS_WRONG_FORMAT: u32 = 4;
/// `TPACKET_ALIGN(sizeof(struct tpacket2_hdr))`: where a transmit slot's frame starts.
const TX_DATA_OFF: usize = 32;
/// Room a receive slot keeps in front of the frame (header, alignment of the network header).
const RX_SLACK: usize = 96;

/// `struct tpacket_req`.
#[repr(C)]
#[derive(Clone, Copy)]
struct TpacketReq {
    block_size: u32,
    block_nr: u32,
    frame_size: u32,
    frame_nr: u32,
}

/// The head of every slot (`struct tpacket2_hdr`, 32 bytes).
#[repr(C)]
struct Tpacket2Hdr {
    status: AtomicU32,
    len: u32,
    snaplen: u32,
    mac: u16,
    net: u16,
    sec: u32,
    nsec: u32,
    vlan_tci: u16,
    vlan_tpid: u16,
    padding: [u8; 4],
}

/// Why a ring could not be set up, with the errno of the call that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingError {
    /// The step that failed.
    pub what: &'static str,
    /// Its errno.
    pub errno: c_int,
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.what, std::io::Error::from_raw_os_error(self.errno))
    }
}

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

fn check(what: &'static str, r: c_long) -> Result<c_long, RingError> {
    if r < 0 {
        Err(RingError { what, errno: errno() })
    } else {
        Ok(r)
    }
}

/// One ring's geometry inside the shared mapping.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    /// Offset of the ring in the mapping.
    base: usize,
    frame_size: usize,
    frames: usize,
    block_size: usize,
    per_block: usize,
}

impl Geometry {
    /// Slots of `frame_size` bytes; blocks of whole pages, each holding whole slots.
    fn request(frame_size: usize, frames: usize) -> (TpacketReq, Geometry) {
        let page = 4096;
        let block = frame_size.div_ceil(page) * page;
        let per_block = block / frame_size;
        let blocks = frames.div_ceil(per_block).max(1);
        let req = TpacketReq {
            block_size: block as u32,
            block_nr: blocks as u32,
            frame_size: frame_size as u32,
            frame_nr: (blocks * per_block) as u32,
        };
        (req, Geometry { base: 0, frame_size, frames: blocks * per_block, block_size: block, per_block })
    }

    /// Offset of slot `i` in the mapping (slots never straddle blocks).
    fn at(&self, i: usize) -> usize {
        self.base + (i / self.per_block) * self.block_size + (i % self.per_block) * self.frame_size
    }

    fn bytes(&self, req: &TpacketReq) -> usize {
        req.block_size as usize * req.block_nr as usize
    }
}

/// Counters of a ring.
#[derive(Clone, Copy, Debug, Default)]
pub struct RingStats {
    /// Frames read out of the receive ring.
    pub frames_in: u64,
    /// Frames put into the transmit ring.
    pub frames_out: u64,
    /// `send` calls that handed transmit slots to the kernel.
    pub flushes: u64,
    /// `poll` calls made while the receive ring was empty.
    pub sleeps: u64,
    /// Times the transmit ring was full.
    pub tx_full: u64,
    /// Frames the kernel refused (`TP_STATUS_WRONG_FORMAT`).
    pub tx_refused: u64,
}

/// A packet socket with its two rings.
pub struct PacketRing {
    fd: c_int,
    ifindex: i32,
    mac: [u8; 6],
    mtu: usize,
    map: *mut u8,
    map_len: usize,
    rx: Geometry,
    tx: Geometry,
    rx_next: usize,
    tx_next: usize,
    /// Slots filled since the last flush.
    tx_unflushed: usize,
    stats: RingStats,
}

// SAFETY: the mapping belongs to this value alone; the kernel is the only other party, and
// every slot access goes through the slot's status word with acquire/release ordering.
unsafe impl Send for PacketRing {}

impl PacketRing {
    /// A socket on interface `iface` for frames of EtherType `ethertype`, with two rings of
    /// about `ring_bytes` each (at least 64 slots), their slots sized for the interface's
    /// MTU. A receive ring must hold what arrives while its reader is busy: frames that find
    /// it full are dropped by the kernel (see [`kernel_drops`](Self::kernel_drops)).
    pub fn open(iface: &str, ethertype: u16, ring_bytes: usize) -> Result<PacketRing, RingError> {
        let proto = ethertype.to_be() as c_long;
        // SAFETY: socket(2) with plain integers.
        let fd = check("socket(AF_PACKET)", unsafe {
            libc::syscall(libc::SYS_socket, libc::AF_PACKET as c_long, libc::SOCK_RAW as c_long, proto)
        })? as c_int;
        let mut ring = PacketRing {
            fd,
            ifindex: 0,
            mac: [0; 6],
            mtu: 0,
            map: std::ptr::null_mut(),
            map_len: 0,
            rx: Geometry { base: 0, frame_size: 0, frames: 0, block_size: 0, per_block: 1 },
            tx: Geometry { base: 0, frame_size: 0, frames: 0, block_size: 0, per_block: 1 },
            rx_next: 0,
            tx_next: 0,
            tx_unflushed: 0,
            stats: RingStats::default(),
        };
        // (On error, `ring`'s drop closes the socket.)
        let (index, mac, mtu) = interface(fd, iface)?;
        ring.ifindex = index;
        ring.mac = mac;
        ring.mtu = mtu;
        ring.set_int(PACKET_VERSION, TPACKET_V2, "PACKET_VERSION")?;
        // Frames the transmit ring cannot send (a malformed one) are skipped, not retried.
        ring.set_int(PACKET_LOSS, 1, "PACKET_LOSS")?;
        let frame = (RX_SLACK + libc::ETH_HLEN as usize + 4 + mtu).next_multiple_of(16);
        let frames = (ring_bytes / frame).max(64);
        let (rx_req, mut rx) = Geometry::request(frame, frames);
        let (tx_req, mut tx) = Geometry::request(frame, frames);
        ring.set_req(PACKET_RX_RING, &rx_req, "PACKET_RX_RING")?;
        ring.set_req(PACKET_TX_RING, &tx_req, "PACKET_TX_RING")?;
        rx.base = 0;
        tx.base = rx.bytes(&rx_req);
        let len = tx.base + tx.bytes(&tx_req);
        // SAFETY: a shared mapping of the socket's rings, of the size the kernel set up.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(RingError { what: "mmap of the packet rings", errno: errno() });
        }
        ring.map = p as *mut u8;
        ring.map_len = len;
        ring.rx = rx;
        ring.tx = tx;
        let mut sll = sockaddr_ll(index);
        sll.sll_protocol = ethertype.to_be();
        // SAFETY: a valid sockaddr_ll of its size.
        check("bind", unsafe {
            libc::syscall(
                libc::SYS_bind,
                fd as c_long,
                &sll as *const libc::sockaddr_ll as c_long,
                std::mem::size_of::<libc::sockaddr_ll>() as c_long,
            )
        })?;
        Ok(ring)
    }

    fn set_int(&self, opt: c_int, v: c_int, what: &'static str) -> Result<(), RingError> {
        self.set_opt(opt, &v, what)
    }

    fn set_req(&self, opt: c_int, req: &TpacketReq, what: &'static str) -> Result<(), RingError> {
        self.set_opt(opt, req, what)
    }

    /// `setsockopt(SOL_PACKET, opt)` with a plain value (an int, a `tpacket_req`).
    fn set_opt<T: Copy>(&self, opt: c_int, v: &T, what: &'static str) -> Result<(), RingError> {
        // SAFETY: `v` is valid for its size, which is what the option is given.
        check(what, unsafe {
            libc::syscall(
                libc::SYS_setsockopt,
                self.fd as c_long,
                SOL_PACKET as c_long,
                opt as c_long,
                v as *const T as c_long,
                std::mem::size_of::<T>() as c_long,
            )
        })
        .map(drop)
    }

    /// The interface's MAC address.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// The interface's MTU (bytes after the Ethernet header).
    pub fn mtu(&self) -> usize {
        self.mtu
    }

    /// The socket (for a caller's own `poll` on several).
    pub fn fd(&self) -> c_int {
        self.fd
    }

    /// Counters so far.
    pub fn stats(&self) -> RingStats {
        self.stats
    }

    /// The head of slot `i` of ring `g`.
    fn slot(&self, g: Geometry, i: usize) -> &Tpacket2Hdr {
        debug_assert!(i < g.frames);
        // SAFETY: slot `i` lies inside the mapping (`i < frames`, whole slots in whole
        // blocks from `base`), starts 16-byte aligned, and begins with a tpacket2_hdr; its
        // status word is only ever accessed atomically.
        unsafe { &*(self.map.add(g.at(i)) as *const Tpacket2Hdr) }
    }

    /// True when a received frame waits in the ring.
    pub fn rx_ready(&self) -> bool {
        self.slot(self.rx, self.rx_next).status.load(Ordering::Acquire) & TP_STATUS_USER != 0
    }

    /// Hands every frame waiting in the receive ring (at most `max`) to `f`, as whole
    /// Ethernet frames, and gives their slots back. Returns how many.
    pub fn recv_each(&mut self, max: usize, mut f: impl FnMut(&[u8])) -> usize {
        let mut n = 0;
        while n < max {
            let g = self.rx;
            let i = self.rx_next;
            let h = self.slot(g, i);
            if h.status.load(Ordering::Acquire) & TP_STATUS_USER == 0 {
                break;
            }
            let (mac, snap) = (h.mac as usize, h.snaplen as usize);
            if mac + snap <= g.frame_size {
                // SAFETY: the kernel wrote `snap` bytes at `mac` inside this slot (checked to
                // fit) and leaves the slot alone until its status goes back to the kernel.
                let frame = unsafe { std::slice::from_raw_parts(self.map.add(g.at(i) + mac), snap) };
                f(frame);
            }
            h.status.store(TP_STATUS_KERNEL, Ordering::Release);
            self.rx_next = (i + 1) % g.frames;
            self.stats.frames_in += 1;
            n += 1;
        }
        n
    }

    /// Sleeps until a frame arrives or `ms` pass (`-1`: no limit). Returns at once when one
    /// is already there.
    pub fn wait(&mut self, ms: c_int) {
        if self.rx_ready() {
            return;
        }
        self.stats.sleeps += 1;
        let mut p = libc::pollfd { fd: self.fd, events: libc::POLLIN, revents: 0 };
        let ts;
        let tsp = if ms < 0 {
            std::ptr::null()
        } else {
            ts = libc::timespec { tv_sec: (ms / 1000) as _, tv_nsec: ((ms % 1000) as i64 * 1_000_000) as _ };
            &ts as *const libc::timespec
        };
        // SAFETY: one pollfd, a timespec or null, no signal mask.
        unsafe {
            libc::syscall(
                libc::SYS_ppoll,
                &mut p as *mut libc::pollfd as c_long,
                1 as c_long,
                tsp as c_long,
                0 as c_long,
                0 as c_long,
            )
        };
    }

    /// Frames the kernel dropped because the receive ring was full, since the last call
    /// (`PACKET_STATISTICS`, which resets on reading).
    pub fn kernel_drops(&self) -> u64 {
        let mut st = [0u32; 2];
        let mut len: libc::socklen_t = 8;
        // SAFETY: struct tpacket_stats is two u32s; `len` says how much room there is.
        let r = unsafe {
            libc::syscall(
                libc::SYS_getsockopt,
                self.fd as c_long,
                SOL_PACKET as c_long,
                PACKET_STATISTICS as c_long,
                st.as_mut_ptr() as c_long,
                &mut len as *mut libc::socklen_t as c_long,
            )
        };
        if r < 0 {
            0
        } else {
            u64::from(st[1])
        }
    }

    /// Largest frame (Ethernet header included) a transmit slot takes.
    pub fn max_frame(&self) -> usize {
        self.tx.frame_size - TX_DATA_OFF
    }

    /// Writes one frame of `len` bytes into the next free transmit slot with `fill`, to go
    /// at the next [`flush`](Self::flush). False when the ring is full (flush, and try again
    /// once the kernel has sent some) or the frame is too long.
    pub fn push(&mut self, len: usize, fill: impl FnOnce(&mut [u8])) -> bool {
        if len > self.max_frame() || len < libc::ETH_HLEN as usize {
            return false;
        }
        let g = self.tx;
        let i = self.tx_next;
        let st = self.slot(g, i).status.load(Ordering::Acquire);
        if st & TP_STATUS_WRONG_FORMAT != 0 {
            self.stats.tx_refused += 1;
        } else if st & (TP_STATUS_SEND_REQUEST | TP_STATUS_SENDING) != 0 {
            self.stats.tx_full += 1;
            return false;
        }
        debug_assert!(st == TP_STATUS_AVAILABLE || st & TP_STATUS_WRONG_FORMAT != 0);
        // SAFETY: the slot is ours (available: the kernel is done with it) and `len` fits
        // after its header (checked against max_frame).
        let data = unsafe { std::slice::from_raw_parts_mut(self.map.add(g.at(i) + TX_DATA_OFF), len) };
        fill(data);
        // SAFETY: as in `slot`; the length word is the slot's second field, written before
        // the status that hands the slot over.
        unsafe {
            let h = self.map.add(g.at(i)) as *mut Tpacket2Hdr;
            std::ptr::addr_of_mut!((*h).len).write_volatile(len as u32);
        }
        fence(Ordering::Release);
        self.slot(g, i).status.store(TP_STATUS_SEND_REQUEST, Ordering::Release);
        self.tx_next = (i + 1) % g.frames;
        self.tx_unflushed += 1;
        self.stats.frames_out += 1;
        true
    }

    /// Frames pushed and not flushed yet.
    pub fn unflushed(&self) -> usize {
        self.tx_unflushed
    }

    /// Hands every pushed frame to the kernel with one system call (not waiting for them to
    /// leave). `Err(errno)` when the kernel refused (`ENOBUFS`: try again shortly).
    pub fn flush(&mut self) -> Result<(), c_int> {
        if self.tx_unflushed == 0 {
            return Ok(());
        }
        self.stats.flushes += 1;
        // SAFETY: send(2) with no buffer: the kernel takes the ring's requested slots.
        let r = unsafe {
            libc::syscall(
                libc::SYS_sendto,
                self.fd as c_long,
                0 as c_long,
                0 as c_long,
                libc::MSG_DONTWAIT as c_long,
                0 as c_long,
                0 as c_long,
            )
        };
        if r < 0 {
            let e = errno();
            if e != libc::EAGAIN {
                return Err(e);
            }
        }
        self.tx_unflushed = 0;
        Ok(())
    }
}

impl Drop for PacketRing {
    fn drop(&mut self) {
        if !self.map.is_null() {
            // SAFETY: our own mapping, of its length; nothing refers to it past this point.
            unsafe { libc::munmap(self.map as *mut c_void, self.map_len) };
        }
        // SAFETY: our own descriptor.
        unsafe { libc::syscall(libc::SYS_close, self.fd as c_long) };
    }
}

fn sockaddr_ll(index: i32) -> libc::sockaddr_ll {
    // SAFETY: all-zero is a valid sockaddr_ll.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_ifindex = index;
    sll
}

/// Index, MAC address and MTU of interface `iface`, asked through socket `fd`.
fn interface(fd: c_int, iface: &str) -> Result<(i32, [u8; 6], usize), RingError> {
    if iface.is_empty() || iface.len() >= libc::IFNAMSIZ || iface.contains('\0') {
        return Err(RingError { what: "interface name", errno: libc::EINVAL });
    }
    // SAFETY: all-zero is a valid ifreq.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(iface.bytes()) {
        *d = s as libc::c_char;
    }
    let ioctl = |req: libc::c_ulong, ifr: &mut libc::ifreq, what: &'static str| {
        // SAFETY: the request fills the ifreq it is given.
        check(what, unsafe {
            libc::syscall(libc::SYS_ioctl, fd as c_long, req as c_long, ifr as *mut libc::ifreq as c_long)
        })
    };
    ioctl(libc::SIOCGIFINDEX, &mut ifr, "SIOCGIFINDEX")?;
    // SAFETY: SIOCGIFINDEX filled the index member.
    let index = unsafe { ifr.ifr_ifru.ifru_ifindex };
    ioctl(libc::SIOCGIFHWADDR, &mut ifr, "SIOCGIFHWADDR")?;
    // SAFETY: SIOCGIFHWADDR filled the hardware address member.
    let hw = unsafe { ifr.ifr_ifru.ifru_hwaddr.sa_data };
    let mac = [hw[0] as u8, hw[1] as u8, hw[2] as u8, hw[3] as u8, hw[4] as u8, hw[5] as u8];
    ioctl(libc::SIOCGIFMTU, &mut ifr, "SIOCGIFMTU")?;
    // SAFETY: SIOCGIFMTU filled the MTU member.
    let mtu = unsafe { ifr.ifr_ifru.ifru_mtu }.max(68) as usize;
    Ok((index, mac, mtu))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_keeps_whole_slots_in_whole_pages() {
        for (frame, n) in [(1600, 256), (9104, 64), (4096, 3), (100, 1)] {
            let (req, g) = Geometry::request(frame, n);
            assert_eq!(req.block_size % 4096, 0);
            assert!(req.block_size as usize >= frame);
            assert_eq!(req.frame_nr as usize, (req.block_size as usize / frame) * req.block_nr as usize);
            assert!(g.frames >= n, "{frame} {n}: {} slots", g.frames);
            // Every slot inside the ring, none straddling a block, none overlapping.
            let end = req.block_size as usize * req.block_nr as usize;
            for i in 0..g.frames {
                let at = g.at(i);
                assert!(at + frame <= end);
                assert_eq!(at / req.block_size as usize, (at + frame - 1) / req.block_size as usize);
                if i > 0 {
                    assert!(at >= g.at(i - 1) + frame);
                }
            }
        }
    }

    #[test]
    fn a_bad_interface_name_is_refused() {
        // (No CAP_NET_RAW needed to see the name refused, but the socket comes first.)
        match PacketRing::open("no\0such", 0x86DF, 1 << 20) {
            Err(e) => assert!(e.what == "interface name" || e.what == "socket(AF_PACKET)", "{e}"),
            Ok(_) => panic!("opened"),
        }
    }
}
