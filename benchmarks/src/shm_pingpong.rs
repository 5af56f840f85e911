//! `shm-pingpong`: the shared-memory ring (`substrate::shmring`) between two processes,
//! side by side with kernel TCP over loopback, in one run: ping-pong round trips for message
//! sizes 64 B to 64 KiB, and one-way streaming throughput.
//!
//! Both paths use the same pair of processes (fork) and real loopback TCP connections. On
//! the shared-memory path a second connection carries only the doorbell protocol's bells: a
//! receiver spins for `--spin-us` (default 50) and then sleeps in `poll` on its socket, and
//! the sender writes a bell byte only when the receiver said it may sleep, as the layer's
//! shared-memory sink does. The table says how many bells were rung.
//!
//! ```text
//! shm-pingpong [--iters N] [--spin-us US] [--stream-mb MB]
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};
use substrate::shmring::{Bell, Ring, Sleep};

const CAP: usize = 1 << 20;
const SIZES: [usize; 6] = [64, 256, 1024, 4096, 16384, 65536];

struct Side {
    tx: Ring,
    rx: Ring,
    sock: TcpStream,
    spin: Duration,
    bells: u64,
}

impl Side {
    fn bell(&mut self) {
        self.bells += 1;
        let _ = self.sock.write_all(b"b");
    }

    fn take_bells(&mut self) {
        let mut b = [0u8; 64];
        // Bells are single bytes; only ours travel on this socket.
        if let Ok(n) = self.sock.read(&mut b) {
            if n > 0 {
                self.rx.bell_taken();
                self.tx.space_bell_taken();
            }
        }
    }

    fn wait_socket(&mut self) {
        let mut p = libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 1000) };
        self.sock.set_nonblocking(true).unwrap();
        self.take_bells();
        self.sock.set_nonblocking(false).unwrap();
    }

    fn send(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let n = self.tx.write(data).expect("ring");
            data = &data[n..];
            if self.tx.after_write() == Bell::Ring {
                self.bell();
            }
            if n == 0 {
                let t = Instant::now();
                while self.tx.writable().expect("ring") == 0 && t.elapsed() < self.spin {
                    std::hint::spin_loop();
                }
                if self.tx.writable().expect("ring") == 0
                    && self.tx.before_wait_room().expect("ring") == Sleep::Ok
                {
                    self.wait_socket();
                }
                self.tx.room_wait_over();
            }
        }
    }

    fn recv_exact(&mut self, buf: &mut [u8]) {
        let mut got = 0;
        self.rx.awake();
        let mut t = Instant::now();
        while got < buf.len() {
            let n = self.rx.read(&mut buf[got..], false).expect("ring");
            if n > 0 {
                got += n;
                if self.rx.after_read() == Bell::Ring {
                    self.bell();
                }
                t = Instant::now();
                continue;
            }
            if t.elapsed() < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if self.rx.before_sleep().expect("ring") == Sleep::Ok {
                self.wait_socket();
            }
            self.rx.awake();
            t = Instant::now();
        }
    }
}

fn shared(len: usize) -> *mut u8 {
    // SAFETY: a fresh shared anonymous mapping (inherited by the forked child).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap");
    p as *mut u8
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn arg(name: &str, default: u64) -> u64 {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let iters = arg("--iters", 20000) as usize;
    let spin = Duration::from_micros(arg("--spin-us", 50));
    let stream_mb = arg("--stream-mb", 2000) as usize;
    let a = shared(Ring::size(CAP));
    let b = shared(Ring::size(CAP));
    // SAFETY: fresh page-aligned mappings of the right size, kept for the process's life.
    let (ab, ba) =
        unsafe { (Ring::init(a, Ring::size(CAP)).unwrap(), Ring::init(b, Ring::size(CAP)).unwrap()) };
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    // SAFETY: fork in a single-threaded process.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        drop(l);
        let data = TcpStream::connect(addr).unwrap();
        let sock = TcpStream::connect(addr).unwrap();
        data.set_nodelay(true).unwrap();
        sock.set_nodelay(true).unwrap();
        let mut me = Side { tx: ba, rx: ab, sock, spin, bells: 0 };
        echo(&mut me, data, iters, stream_mb);
        // SAFETY: leave without running the parent's destructors twice.
        unsafe { libc::_exit(0) };
    }
    let (mut data, _) = l.accept().unwrap();
    let (sock, _) = l.accept().unwrap();
    data.set_nodelay(true).unwrap();
    sock.set_nodelay(true).unwrap();
    let mut me = Side { tx: ab, rx: ba, sock, spin, bells: 0 };
    println!(
        "shm-pingpong: {iters} round trips per size, receiver spins {} us before sleeping",
        spin.as_micros()
    );
    println!(
        "{:>8} | {:>16} | {:>16} | {:>8} | {:>6}",
        "size", "TCP loopback RTT", "shm ring RTT", "speed-up", "bells"
    );
    println!("{:-<8}-+-{:-<16}-+-{:-<16}-+-{:-<8}-+-{:-<6}", "", "", "", "", "");
    for &size in &SIZES {
        let mut msg = vec![7u8; size];
        // TCP: the same bytes on the kernel path.
        let mut tcp = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            data.write_all(&msg).unwrap();
            data.read_exact(&mut msg).unwrap();
            tcp.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let bells0 = me.bells;
        let mut shm = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            me.send(&msg);
            me.recv_exact(&mut msg);
            shm.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let (t, s) = (median(&mut tcp), median(&mut shm));
        println!(
            "{:>7}B | {:>13.2} us | {:>13.2} us | {:>7.1}x | {:>6}",
            size,
            t,
            s,
            t / s,
            me.bells - bells0
        );
    }
    // Streaming, one way: the child reads, the parent writes 64 KiB at a time.
    let chunk = vec![1u8; 65536];
    let total = stream_mb << 20;
    let t = Instant::now();
    for _ in 0..total / chunk.len() {
        data.write_all(&chunk).unwrap();
    }
    let mut ack = [0u8; 1];
    data.read_exact(&mut ack).unwrap();
    let tcp_gbps = total as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9;
    let t = Instant::now();
    for _ in 0..total / chunk.len() {
        me.send(&chunk);
    }
    me.recv_exact(&mut ack);
    let shm_gbps = total as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9;
    println!();
    println!("stream {stream_mb} MB one way, 64 KiB writes:");
    println!(
        "  TCP loopback {tcp_gbps:>7.1} Gbit/s   shm ring {shm_gbps:>7.1} Gbit/s   ({:.1}x)",
        shm_gbps / tcp_gbps
    );
    let mut st = 0;
    // SAFETY: waits for our child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
}

fn echo(me: &mut Side, mut data: TcpStream, iters: usize, stream_mb: usize) {
    for &size in &SIZES {
        let mut msg = vec![0u8; size];
        for _ in 0..iters {
            data.read_exact(&mut msg).unwrap();
            data.write_all(&msg).unwrap();
        }
        for _ in 0..iters {
            me.recv_exact(&mut msg);
            me.send(&msg);
        }
    }
    let mut chunk = vec![0u8; 65536];
    let total = stream_mb << 20;
    for _ in 0..total / chunk.len() {
        data.read_exact(&mut chunk).unwrap();
    }
    data.write_all(b"k").unwrap();
    for _ in 0..total / chunk.len() {
        me.recv_exact(&mut chunk);
    }
    me.send(b"k");
}
