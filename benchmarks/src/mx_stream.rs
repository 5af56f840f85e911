//! `mx-stream`: the Myrinet-style protocol (`substrate::mx`) over raw Ethernet between two
//! hosts' interfaces, to check and measure the protocol and its packet driver on a real
//! network before they become a sink of the layer.
//!
//! ```text
//! mx-stream recv|send --iface IF --peer MAC --session N --bytes B [--msg S] [--io ring|call]
//! mx-stream pong|ping --iface IF --peer MAC --session N --iters K [--msg S] [--io ring|call]
//!                     [--spin-us U]
//! ```
//!
//! * `send`/`recv`: `B` bytes of a pseudo-random stream in messages of `S` bytes (default
//!   64 KiB, a connection frame's size); the receiver checks every byte.
//! * `ping`/`pong`: `K` round trips of one `S`-byte message (default 64 B) each way; the
//!   pinger reports the median, 99th percentile and mean of half the round trip, in µs.
//!
//! `--io ring` (the default) moves frames through the kernel's packet rings
//! (`vmi_preload::sys::packet`: no system call per received frame, one per batch of sent
//! ones); `--io call` makes one `sendto`/`recv` per frame, for comparison. A waiting side
//! spins on the receive ring for `--spin-us` (default 50) before it sleeps in `poll`. The MTU
//! is the interface's. Every role prints one JSON line.

#[allow(dead_code, unsafe_code)]
#[path = "../../preload/src/sys/packet.rs"]
mod packet;

use packet::PacketRing;
use std::time::{Duration, Instant};
use substrate::mx::{MxConfig, MxLink, ETHERTYPE, ETH_HEADER};

/// Bytes of each packet ring (a receive ring must hold a window's worth of announcements
/// and a pull window's worth of chunks while the reader is busy).
const RING_BYTES: usize = 8 << 20;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Send,
    Recv,
    Ping,
    Pong,
}

struct Args {
    role: Role,
    iface: String,
    peer: [u8; 6],
    session: u32,
    bytes: u64,
    iters: u64,
    msg: usize,
    ring: bool,
    spin_us: u64,
}

fn usage() -> ! {
    eprintln!(
        "usage: mx-stream send|recv|ping|pong --iface IF --peer MAC --session N \
         (--bytes B | --iters K) [--msg S] [--io ring|call] [--spin-us U]"
    );
    std::process::exit(2)
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let v: Vec<u8> = s.split(':').map(|p| u8::from_str_radix(p, 16)).collect::<Result<_, _>>().ok()?;
    v.try_into().ok()
}

fn args() -> Args {
    let a: Vec<String> = std::env::args().collect();
    let role = match a.get(1).map(String::as_str) {
        Some("send") => Role::Send,
        Some("recv") => Role::Recv,
        Some("ping") => Role::Ping,
        Some("pong") => Role::Pong,
        _ => usage(),
    };
    let small = matches!(role, Role::Ping | Role::Pong);
    let mut r = Args {
        role,
        iface: String::new(),
        peer: [0; 6],
        session: 0,
        bytes: 0,
        iters: 0,
        msg: if small { 64 } else { 64 << 10 },
        ring: true,
        spin_us: 50,
    };
    let mut i = 2;
    while i + 1 < a.len() {
        let v = &a[i + 1];
        match a[i].as_str() {
            "--iface" => r.iface = v.clone(),
            "--peer" => r.peer = parse_mac(v).unwrap_or_else(|| usage()),
            "--session" => r.session = v.parse().unwrap_or_else(|_| usage()),
            "--bytes" => r.bytes = v.parse().unwrap_or_else(|_| usage()),
            "--iters" => r.iters = v.parse().unwrap_or_else(|_| usage()),
            "--msg" => r.msg = v.parse().unwrap_or_else(|_| usage()),
            "--io" => {
                r.ring = match v.as_str() {
                    "ring" => true,
                    "call" => false,
                    _ => usage(),
                }
            }
            "--spin-us" => r.spin_us = v.parse().unwrap_or_else(|_| usage()),
            // (Accepted for older scripts: the MTU is the interface's.)
            "--mtu" => {}
            _ => usage(),
        }
        i += 2;
    }
    if r.iface.is_empty() || r.msg == 0 || (if small { r.iters == 0 } else { r.bytes == 0 }) {
        usage();
    }
    r
}

fn byte(i: u64) -> u8 {
    (i.wrapping_mul(2654435761) >> 9) as u8
}

/// The stream's bytes repeat with this period (a prime, so messages do not line up with it):
/// made once, then sent and checked by slices, so that making and checking the bytes costs
/// far less than moving them.
const PERIOD: usize = (1 << 20) + 7;

struct Pattern(Vec<u8>);

impl Pattern {
    fn new() -> Pattern {
        Pattern((0..PERIOD as u64).map(byte).collect())
    }

    /// Bytes `[at, at + n)` of the stream, appended to `out`.
    fn extend(&self, out: &mut Vec<u8>, mut at: u64, mut n: usize) {
        while n > 0 {
            let i = (at % PERIOD as u64) as usize;
            let k = n.min(PERIOD - i);
            out.extend_from_slice(&self.0[i..i + k]);
            at += k as u64;
            n -= k;
        }
    }

    /// True when `m` is the stream's bytes from `at` on.
    fn matches(&self, mut at: u64, mut m: &[u8]) -> bool {
        while !m.is_empty() {
            let i = (at % PERIOD as u64) as usize;
            let k = m.len().min(PERIOD - i);
            if m[..k] != self.0[i..i + k] {
                return false;
            }
            at += k as u64;
            m = &m[k..];
        }
        true
    }
}

fn die(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("mx-stream: {what}: {e}");
    std::process::exit(1)
}

/// Frames in and out: through the packet rings, or one system call per frame on the same
/// socket (its rings then unused).
struct Wire {
    /// The rings (`None`: `--io call`, one system call per frame on `fd`).
    ring: Option<PacketRing>,
    /// The socket (a ring's socket takes no `recv`: `--io call` has one without rings).
    fd: i32,
    mtu: usize,
    header: [u8; ETH_HEADER],
    to: libc::sockaddr_ll,
    buf: Vec<u8>,
    peer: [u8; 6],
    syscalls: u64,
}

impl Wire {
    fn open(a: &Args) -> Wire {
        let ring =
            PacketRing::open(&a.iface, ETHERTYPE, RING_BYTES).unwrap_or_else(|e| die("packet ring", e));
        let mut header = [0u8; ETH_HEADER];
        header[..6].copy_from_slice(&a.peer);
        header[6..12].copy_from_slice(&ring.mac());
        header[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
        let name = std::ffi::CString::new(a.iface.clone()).unwrap_or_else(|_| usage());
        // SAFETY: a NUL-terminated name.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
        // SAFETY: all-zero is a valid sockaddr_ll; fields set below.
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_protocol = ETHERTYPE.to_be();
        to.sll_ifindex = index;
        to.sll_halen = 6;
        to.sll_addr[..6].copy_from_slice(&a.peer);
        let mtu = ring.mtu();
        let (ring, fd) = if a.ring {
            {
                let fd = ring.fd();
                (Some(ring), fd)
            }
        } else {
            // One system call per frame: a plain packet socket, as before the rings.
            drop(ring);
            (None, plain_socket(index))
        };
        Wire { ring, fd, mtu, header, to, buf: vec![0; 65536], peer: a.peer, syscalls: 0 }
    }

    fn mtu(&self) -> usize {
        self.mtu
    }

    fn io(&self) -> &'static str {
        if self.ring.is_some() {
            "ring"
        } else {
            "call"
        }
    }

    /// Sleeps in `poll` so far (rings only).
    fn sleeps(&self) -> u64 {
        self.ring.as_ref().map_or(0, |r| r.stats().sleeps)
    }

    /// Puts one packet (after its Ethernet header) on the wire, or in the ring.
    fn send(&mut self, p: &[u8]) {
        let len = ETH_HEADER + p.len();
        if let Some(ring) = &mut self.ring {
            let h = self.header;
            loop {
                if ring.push(len, |f| {
                    f[..ETH_HEADER].copy_from_slice(&h);
                    f[ETH_HEADER..].copy_from_slice(p);
                }) {
                    return;
                }
                // Full: hand the kernel what is there and wait for slots to free.
                self.syscalls += 1;
                let _ = ring.flush();
                std::thread::yield_now();
            }
        }
        self.buf[..ETH_HEADER].copy_from_slice(&self.header);
        self.buf[ETH_HEADER..len].copy_from_slice(p);
        loop {
            self.syscalls += 1;
            // SAFETY: a valid frame and address.
            let r = unsafe {
                libc::sendto(
                    self.fd,
                    self.buf.as_ptr() as *const _,
                    len,
                    0,
                    &self.to as *const _ as *const libc::sockaddr,
                    std::mem::size_of_val(&self.to) as u32,
                )
            };
            if r >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOBUFS) {
                return;
            }
            std::thread::yield_now();
        }
    }

    fn flush(&mut self) {
        let Some(ring) = &mut self.ring else { return };
        if ring.unflushed() > 0 {
            self.syscalls += 1;
            if let Err(e) = ring.flush() {
                if e != libc::ENOBUFS {
                    die("flush", std::io::Error::from_raw_os_error(e));
                }
            }
        }
    }

    /// Hands every packet from the peer waiting now to `f` (Ethernet header removed).
    fn recv(&mut self, mut f: impl FnMut(&[u8])) -> usize {
        let peer = self.peer;
        let mine =
            |fr: &[u8]| fr.len() >= ETH_HEADER && fr[6..12] == peer && fr[12..14] == ETHERTYPE.to_be_bytes();
        if let Some(ring) = &mut self.ring {
            return ring.recv_each(usize::MAX, |fr| {
                if mine(fr) {
                    f(&fr[ETH_HEADER..]);
                }
            });
        }
        let mut n = 0;
        loop {
            self.syscalls += 1;
            // SAFETY: reads into our buffer.
            let r = unsafe {
                libc::recv(self.fd, self.buf.as_mut_ptr() as *mut _, self.buf.len(), libc::MSG_DONTWAIT)
            };
            if r <= 0 {
                return n;
            }
            n += 1;
            let fr = &self.buf[..r as usize];
            if mine(fr) {
                f(&fr[ETH_HEADER..]);
            }
        }
    }

    /// Waits for packets: spins for `spin` first, then sleeps at most `ms`.
    fn wait(&mut self, spin: Duration, ms: i32) {
        if let Some(ring) = &mut self.ring {
            let t = Instant::now();
            while t.elapsed() < spin {
                if ring.rx_ready() {
                    return;
                }
                std::hint::spin_loop();
            }
            self.syscalls += 1;
            ring.wait(ms);
            return;
        }
        let mut pfd = libc::pollfd { fd: self.fd, events: libc::POLLIN, revents: 0 };
        let t = Instant::now();
        loop {
            self.syscalls += 1;
            let left = if t.elapsed() < spin { 0 } else { ms };
            // SAFETY: one pollfd.
            if unsafe { libc::poll(&mut pfd, 1, left) } != 0 || left != 0 {
                return;
            }
        }
    }
}

/// An AF_PACKET socket for our EtherType bound to interface `index`, without rings.
fn plain_socket(index: i32) -> i32 {
    let proto = ETHERTYPE.to_be() as i32;
    // SAFETY: plain socket creation.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto) };
    if fd < 0 {
        die("socket(AF_PACKET)", std::io::Error::last_os_error());
    }
    // SAFETY: all-zero is a valid sockaddr_ll; fields set below.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = ETHERTYPE.to_be();
    sll.sll_ifindex = index;
    // SAFETY: a valid sockaddr_ll of its size.
    if unsafe {
        libc::bind(fd, &sll as *const _ as *const libc::sockaddr, std::mem::size_of_val(&sll) as u32)
    } != 0
    {
        die("bind", std::io::Error::last_os_error());
    }
    let big: libc::c_int = 8 << 20;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_SNDBUFFORCE] {
        // SAFETY: an int option.
        unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, opt, &big as *const _ as *const _, 4) };
    }
    fd
}

/// Puts every packet the link has on the wire.
fn drain(link: &mut MxLink, wire: &mut Wire, t: u64) {
    while let Some(p) = link.poll_packet(t) {
        wire.send(&p);
    }
    wire.flush();
}

/// One turn of a side's loop at time `t`: what the link has goes out, packets come in (after
/// a wait of at most the link's next time-out), and the time-outs due are handled.
fn turn(a: &Args, wire: &mut Wire, link: &mut MxLink, start: Instant, t: u64) {
    let now = || start.elapsed().as_millis() as u64;
    drain(link, wire, t);
    let wait = link.poll_timeout().map_or(5, |d| d.saturating_sub(t).min(5)) as i32;
    wire.wait(Duration::from_micros(a.spin_us), wait);
    wire.recv(|p| {
        let _ = link.handle_packet(now(), p);
    });
    link.handle_timeout(now());
}

fn stream(a: &Args, wire: &mut Wire, link: &mut MxLink, start: Instant) {
    let now = || start.elapsed().as_millis() as u64;
    let sending = a.role == Role::Send;
    let pattern = Pattern::new();
    let (mut sent, mut got, mut ok, mut done_at) = (0u64, 0u64, true, None);
    let mut first_data = None;
    loop {
        let t = now();
        while sending && sent < a.bytes && link.can_send() {
            let n = (a.bytes - sent).min(a.msg as u64);
            let mut m = Vec::with_capacity(n as usize);
            pattern.extend(&mut m, sent, n as usize);
            if link.send(t, m).is_err() {
                break;
            }
            sent += n;
        }
        turn(a, wire, link, start, t);
        while let Some(m) = link.poll_message() {
            first_data.get_or_insert_with(Instant::now);
            ok &= pattern.matches(got, &m);
            got += m.len() as u64;
        }
        let finished = if sending { sent == a.bytes && link.in_flight() == 0 } else { got >= a.bytes };
        if finished && done_at.is_none() {
            done_at = Some(start.elapsed());
        }
        // The receiver stays a little for the sender's last acknowledgements to go out.
        let linger = Duration::from_millis(if sending { 0 } else { 300 });
        if done_at.is_some_and(|d| start.elapsed() >= d + linger) {
            drain(link, wire, now());
            break;
        }
        if start.elapsed().as_secs() > 120 {
            die("gave up after 120 s", "no progress");
        }
    }
    let secs = match (first_data, done_at) {
        (Some(f), Some(d)) if !sending => (d.as_secs_f64() - f.duration_since(start).as_secs_f64()).max(1e-9),
        (_, Some(d)) => d.as_secs_f64(),
        _ => 0.0,
    };
    let bytes = if sending { sent } else { got };
    let s = link.stats();
    let sleeps = wire.sleeps();
    println!(
        "{{\"role\": \"{}\", \"io\": \"{}\", \"mtu\": {}, \"bytes\": {bytes}, \"ok\": {ok}, \"seconds\": {secs:.4}, \
         \"gbit_s\": {:.3}, \"packets_out\": {}, \"packets_in\": {}, \"resent\": {}, \"pulled_again\": {}, \
         \"refused\": {}, \"syscalls\": {}, \"sleeps\": {}, \"kernel_drops\": {}}}",
        if sending { "send" } else { "recv" },
        wire.io(),
        wire.mtu(),
        bytes as f64 * 8.0 / secs.max(1e-9) / 1e9,
        s.packets_out,
        s.packets_in,
        s.resent,
        s.pulled_again,
        s.refused,
        wire.syscalls,
        sleeps,
        wire.ring.as_ref().map_or(0, |r| r.kernel_drops())
    );
    std::process::exit(if ok { 0 } else { 1 });
}

/// Waits for the next whole message; `None` after `limit` of nothing.
fn next_message(
    a: &Args,
    wire: &mut Wire,
    link: &mut MxLink,
    start: Instant,
    limit: Duration,
) -> Option<Vec<u8>> {
    let now = || start.elapsed().as_millis() as u64;
    let deadline = Instant::now() + limit;
    loop {
        if let Some(m) = link.poll_message() {
            return Some(m);
        }
        let t = now();
        turn(a, wire, link, start, t);
        if Instant::now() > deadline {
            return None;
        }
    }
}

fn pingpong(a: &Args, wire: &mut Wire, link: &mut MxLink, start: Instant) {
    let now = || start.elapsed().as_millis() as u64;
    let msg: Vec<u8> = (0..a.msg as u64).map(byte).collect();
    let mut rtts = Vec::with_capacity(a.iters as usize);
    let mut ok = true;
    let warmup = (a.iters / 10).min(1000);
    for i in 0..a.iters + warmup {
        let t0 = Instant::now();
        if a.role == Role::Ping {
            if link.send(now(), msg.clone()).is_err() {
                die("send", "window full");
            }
            drain(link, wire, now());
        }
        // (The ponger may start well before the pinger.)
        let limit = Duration::from_secs(if i == 0 { 30 } else { 5 });
        let Some(m) = next_message(a, wire, link, start, limit) else {
            if a.role == Role::Pong && i > 0 {
                // The pinger is done.
                break;
            }
            die("no answer within 5 s", format!("round trip {i}"));
        };
        ok &= m == msg;
        if a.role == Role::Pong {
            if link.send(now(), m).is_err() {
                die("send", "window full");
            }
            drain(link, wire, now());
        } else if i >= warmup {
            rtts.push(t0.elapsed().as_nanos() as f64 / 2e3);
        }
    }
    // The last acknowledgements.
    let end = Instant::now() + Duration::from_millis(50);
    while Instant::now() < end {
        link.handle_timeout(now());
        drain(link, wire, now());
        wire.wait(Duration::ZERO, 5);
        wire.recv(|p| {
            let _ = link.handle_packet(now(), p);
        });
    }
    let s = link.stats();
    if a.role == Role::Pong {
        println!(
            "{{\"role\": \"pong\", \"ok\": {ok}, \"resent\": {}, \"refused\": {}}}",
            s.resent, s.refused
        );
        std::process::exit(if ok { 0 } else { 1 });
    }
    rtts.sort_by(f64::total_cmp);
    let pick = |q: f64| rtts[((rtts.len() - 1) as f64 * q) as usize];
    let mean = rtts.iter().sum::<f64>() / rtts.len() as f64;
    println!(
        "{{\"role\": \"ping\", \"io\": \"{}\", \"msg\": {}, \"iters\": {}, \"ok\": {ok}, \"p50_us\": {:.2}, \
         \"p99_us\": {:.2}, \"mean_us\": {mean:.2}, \"resent\": {}, \"syscalls_per_trip\": {:.2}, \"sleeps\": {}}}",
        wire.io(),
        a.msg,
        rtts.len(),
        pick(0.5),
        pick(0.99),
        s.resent,
        wire.syscalls as f64 / (a.iters + warmup) as f64,
        wire.sleeps()
    );
    std::process::exit(if ok { 0 } else { 1 });
}

fn main() {
    let a = args();
    let mut wire = Wire::open(&a);
    let mut link = MxLink::new(MxConfig::new(wire.mtu(), a.session));
    let start = Instant::now();
    match a.role {
        Role::Send | Role::Recv => stream(&a, &mut wire, &mut link, start),
        Role::Ping | Role::Pong => pingpong(&a, &mut wire, &mut link, start),
    }
}
