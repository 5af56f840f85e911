//! `mx-stream`: one stream of messages over raw Ethernet with the Myrinet-style protocol
//! (`substrate::mx`), between two hosts' interfaces, to check and measure the protocol on a
//! real network before it becomes a sink of the layer.
//!
//! ```text
//! mx-stream recv --iface eth1 --peer MAC --session N --bytes B [--mtu M] [--msg S]
//! mx-stream send --iface eth1 --peer MAC --session N --bytes B [--mtu M] [--msg S]
//! ```
//!
//! The sender sends `B` bytes of a pseudo-random stream in messages of `S` bytes (default
//! 64 KiB, a connection frame's size); the receiver checks every byte and both print one JSON
//! line: bytes, seconds, Gbit/s, packets, resends, chunks pulled again, packets refused. One
//! system call per packet (`sendto`/`recv` on an AF_PACKET socket bound to the interface and
//! EtherType 0x86DF).

use std::time::Instant;
use substrate::mx::{MxConfig, MxLink, ETHERTYPE, ETH_HEADER};

struct Args {
    send: bool,
    iface: String,
    peer: [u8; 6],
    session: u32,
    bytes: u64,
    mtu: usize,
    msg: usize,
}

fn usage() -> ! {
    eprintln!("usage: mx-stream send|recv --iface IF --peer MAC --session N --bytes B [--mtu M] [--msg S]");
    std::process::exit(2)
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let v: Vec<u8> = s.split(':').map(|p| u8::from_str_radix(p, 16)).collect::<Result<_, _>>().ok()?;
    v.try_into().ok()
}

fn args() -> Args {
    let a: Vec<String> = std::env::args().collect();
    let mut r = Args {
        send: false,
        iface: String::new(),
        peer: [0; 6],
        session: 0,
        bytes: 0,
        mtu: 1500,
        msg: 64 << 10,
    };
    match a.get(1).map(String::as_str) {
        Some("send") => r.send = true,
        Some("recv") => {}
        _ => usage(),
    }
    let mut i = 2;
    while i + 1 < a.len() {
        let v = &a[i + 1];
        match a[i].as_str() {
            "--iface" => r.iface = v.clone(),
            "--peer" => r.peer = parse_mac(v).unwrap_or_else(|| usage()),
            "--session" => r.session = v.parse().unwrap_or_else(|_| usage()),
            "--bytes" => r.bytes = v.parse().unwrap_or_else(|_| usage()),
            "--mtu" => r.mtu = v.parse().unwrap_or_else(|_| usage()),
            "--msg" => r.msg = v.parse().unwrap_or_else(|_| usage()),
            _ => usage(),
        }
        i += 2;
    }
    if r.iface.is_empty() || r.bytes == 0 {
        usage();
    }
    r
}

fn byte(i: u64) -> u8 {
    (i.wrapping_mul(2654435761) >> 9) as u8
}

fn die(what: &str) -> ! {
    eprintln!("mx-stream: {what}: {}", std::io::Error::last_os_error());
    std::process::exit(1)
}

/// A packet socket on `iface` for our EtherType; its interface index and MAC address.
fn open(iface: &str) -> (i32, i32, [u8; 6]) {
    let proto = (ETHERTYPE).to_be() as i32;
    // SAFETY: plain socket creation.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto) };
    if fd < 0 {
        die("socket(AF_PACKET)");
    }
    let name = std::ffi::CString::new(iface).unwrap_or_else(|_| usage());
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
    if index == 0 {
        die("if_nametoindex");
    }
    // SAFETY: zeroed sockaddr_ll is valid; fields set below.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = ETHERTYPE.to_be();
    sll.sll_ifindex = index;
    // SAFETY: a valid sockaddr_ll of its size.
    if unsafe {
        libc::bind(fd, &sll as *const _ as *const libc::sockaddr, std::mem::size_of_val(&sll) as u32)
    } != 0
    {
        die("bind");
    }
    // SAFETY: zeroed ifreq, name copied in (shorter than IFNAMSIZ).
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(iface.bytes().take(libc::IFNAMSIZ - 1)) {
        *d = s as libc::c_char;
    }
    // SAFETY: SIOCGIFHWADDR fills the ifreq.
    if unsafe { libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut ifr) } != 0 {
        die("SIOCGIFHWADDR");
    }
    // SAFETY: the hardware address union member was just filled.
    let hw = unsafe { ifr.ifr_ifru.ifru_hwaddr.sa_data };
    let mac = [hw[0] as u8, hw[1] as u8, hw[2] as u8, hw[3] as u8, hw[4] as u8, hw[5] as u8];
    let big: libc::c_int = 8 << 20;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_SNDBUFFORCE] {
        // SAFETY: an int option.
        unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, opt, &big as *const _ as *const _, 4) };
    }
    (fd, index, mac)
}

fn main() {
    let a = args();
    let (fd, index, mac) = open(&a.iface);
    let cfg = MxConfig::new(a.mtu, a.session);
    let mut link = MxLink::new(cfg);
    let start = Instant::now();
    let now = || start.elapsed().as_millis() as u64;
    // SAFETY: zeroed sockaddr_ll is valid; the peer's address set below.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = libc::AF_PACKET as u16;
    to.sll_protocol = ETHERTYPE.to_be();
    to.sll_ifindex = index;
    to.sll_halen = 6;
    to.sll_addr[..6].copy_from_slice(&a.peer);
    let mut frame = vec![0u8; a.mtu + ETH_HEADER];
    frame[..6].copy_from_slice(&a.peer);
    frame[6..12].copy_from_slice(&mac);
    frame[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
    let mut buf = vec![0u8; 65536];
    let (mut sent, mut got, mut ok, mut done_at) = (0u64, 0u64, true, None);
    let mut first_data = None;
    loop {
        let t = now();
        // Sender: new messages while the window allows.
        while a.send && sent < a.bytes && link.can_send() {
            let n = (a.bytes - sent).min(a.msg as u64);
            let m: Vec<u8> = (sent..sent + n).map(byte).collect();
            if link.send(t, m).is_err() {
                break;
            }
            sent += n;
        }
        while let Some(p) = link.poll_packet(t) {
            frame.truncate(ETH_HEADER);
            frame.extend_from_slice(&p);
            loop {
                // SAFETY: a valid frame and address.
                let r = unsafe {
                    libc::sendto(
                        fd,
                        frame.as_ptr() as *const _,
                        frame.len(),
                        0,
                        &to as *const _ as *const libc::sockaddr,
                        std::mem::size_of_val(&to) as u32,
                    )
                };
                if r >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOBUFS) {
                    break;
                }
                std::thread::yield_now();
            }
        }
        // Packets in.
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let wait = link.poll_timeout().map_or(5, |d| d.saturating_sub(t).min(5)) as i32;
        // SAFETY: one pollfd.
        unsafe { libc::poll(&mut pfd, 1, wait) };
        loop {
            // SAFETY: reads into our buffer.
            let r = unsafe { libc::recv(fd, buf.as_mut_ptr() as *mut _, buf.len(), libc::MSG_DONTWAIT) };
            if r <= 0 {
                break;
            }
            let r = r as usize;
            if r < ETH_HEADER || buf[6..12] != a.peer || buf[12..14] != ETHERTYPE.to_be_bytes() {
                continue;
            }
            let _ = link.handle_packet(now(), &buf[ETH_HEADER..r]);
        }
        link.handle_timeout(now());
        while let Some(m) = link.poll_message() {
            first_data.get_or_insert_with(Instant::now);
            for (k, b) in m.iter().enumerate() {
                if *b != byte(got + k as u64) {
                    ok = false;
                }
            }
            got += m.len() as u64;
        }
        let finished = if a.send { sent == a.bytes && link.in_flight() == 0 } else { got >= a.bytes };
        if finished && done_at.is_none() {
            done_at = Some(start.elapsed());
        }
        // The receiver stays a little for the sender's last acknowledgements to go out.
        let linger = std::time::Duration::from_millis(if a.send { 0 } else { 300 });
        if done_at.is_some_and(|d| start.elapsed() >= d + linger) {
            break;
        }
        if start.elapsed().as_secs() > 120 {
            eprintln!("mx-stream: gave up after 120 s");
            std::process::exit(1);
        }
    }
    let secs = match (first_data, done_at) {
        (Some(f), Some(d)) if !a.send => (d.as_secs_f64() - f.duration_since(start).as_secs_f64()).max(1e-9),
        (_, Some(d)) => d.as_secs_f64(),
        _ => 0.0,
    };
    let bytes = if a.send { sent } else { got };
    let s = link.stats();
    println!(
        "{{\"role\": \"{}\", \"bytes\": {bytes}, \"ok\": {ok}, \"seconds\": {secs:.4}, \"gbit_s\": {:.3}, \"packets_out\": {}, \"packets_in\": {}, \"resent\": {}, \"pulled_again\": {}, \"refused\": {}}}",
        if a.send { "send" } else { "recv" },
        bytes as f64 * 8.0 / secs.max(1e-9) / 1e9,
        s.packets_out,
        s.packets_in,
        s.resent,
        s.pulled_again,
        s.refused
    );
    std::process::exit(if ok { 0 } else { 1 });
}
