//! The conformance tests every sink passes: the connection core (`substrate::connection`)
//! driven over one sink's links between two processes, as the layer drives it.
//!
//! * **stream**: both sides send `bytes` of a pattern of their own and check every byte they
//!   read against the peer's pattern, then end their streams; the connection must close
//!   cleanly (both ends read, everything acknowledged).
//! * **pingpong**: the client sends messages of each size, the server sends each back; the
//!   client checks every byte and times the round trips.
//! * **cuts**: during either test, the client closes its link `cuts` times and makes a new
//!   one through the same sink; the resume handshake (what each side delivered) makes the
//!   core send only what the peer lacks, so the streams stay exact.
//!
//! The driver is single-threaded: it moves frames between the core and the link and sleeps in
//! `poll` on the link's descriptor ([`crate::Link::arm`]) when nothing moves.

use crate::{Link, Listener, Sink};
use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};
use substrate::connection::{Config, Connection, Event, LinkId, Recv, State};

/// Waits until one of `fds` is readable or `wait` passed.
pub fn wait_readable(fds: &[RawFd], wait: Duration) {
    let mut p: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    let ms = wait.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `p` is a valid array of `p.len()` pollfd structures.
    unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
}

/// Byte `i` of the pattern with seed `seed`.
pub fn pattern(seed: u64, i: u64) -> u8 {
    let mut z = seed ^ (i >> 3).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> ((i & 7) * 8)) as u8
}

fn fill(seed: u64, from: u64, buf: &mut [u8]) {
    for (k, b) in buf.iter_mut().enumerate() {
        *b = pattern(seed, from + k as u64);
    }
}

/// How the link of one side comes and goes.
pub enum Ends {
    /// The client: makes links to `addr`.
    Dial { addr: Vec<u8> },
    /// The server: takes them from its passive endpoint.
    Take(Box<dyn Listener>),
}

struct Current {
    id: LinkId,
    link: Box<dyn Link>,
    /// Our side of the resume handshake, not all written yet.
    hello: Vec<u8>,
    /// The peer's, not all read yet.
    peer_hello: Vec<u8>,
    up: bool,
    /// A frame the link has not taken all of yet.
    out: Vec<u8>,
    out_at: usize,
}

/// One side: the core, the sink, the link of the moment.
pub struct Side<'a> {
    sink: &'a dyn Sink,
    ends: Ends,
    conn: Connection,
    cur: Option<Current>,
    next_id: u32,
    t0: Instant,
    /// Links made or taken so far.
    pub links: u32,
    /// Link failures seen (cuts included).
    pub failures: u32,
    last_accept: Instant,
    scratch: Vec<u8>,
}

const WAIT: Duration = Duration::from_secs(10);

impl<'a> Side<'a> {
    /// A side with its first link (the client dials, the server waits for it).
    pub fn new(sink: &'a dyn Sink, ends: Ends) -> io::Result<Side<'a>> {
        let cfg = Config { grace_ms: 20_000, ..Config::default() };
        let mut s = Side {
            sink,
            ends,
            conn: Connection::new(cfg, 0),
            cur: None,
            next_id: 1,
            t0: Instant::now(),
            links: 0,
            failures: 0,
            last_accept: Instant::now(),
            scratch: vec![0; 256 << 10],
        };
        s.new_link(WAIT)?;
        Ok(s)
    }

    fn now(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    fn adopt(&mut self, link: Box<dyn Link>) {
        let id = LinkId(self.next_id);
        self.next_id += 1;
        self.links += 1;
        self.cur = Some(Current {
            id,
            link,
            hello: self.conn.resume_ack().to_le_bytes().to_vec(),
            peer_hello: Vec::new(),
            up: false,
            out: Vec::new(),
            out_at: 0,
        });
    }

    fn new_link(&mut self, wait: Duration) -> io::Result<()> {
        let link = match &mut self.ends {
            Ends::Dial { addr } => self.sink.connect(addr, wait)?,
            Ends::Take(l) => l.accept(wait)?,
        };
        self.drop_link();
        self.adopt(link);
        Ok(())
    }

    /// The link failed or was cut: the core learns it, the link goes.
    fn drop_link(&mut self) {
        if let Some(c) = self.cur.take() {
            if c.up {
                let now = self.now();
                self.conn.handle_link_down(now, c.id);
            }
            self.failures += 1;
        }
    }

    /// The client cuts its link and makes a new one.
    pub fn cut(&mut self) -> io::Result<()> {
        self.drop_link();
        self.new_link(WAIT)
    }

    /// The core, for the program's side.
    pub fn conn(&mut self) -> &mut Connection {
        &mut self.conn
    }

    /// Moves what can move between the core and the link; true if anything did.
    pub fn step(&mut self) -> io::Result<bool> {
        let now = self.now();
        let mut moved = false;
        if self.cur.is_none() {
            // (The server waits for the client's next link; the client makes one.)
            match self.new_link(Duration::from_millis(50)) {
                Ok(()) => moved = true,
                Err(e) if matches!(self.ends, Ends::Take(_)) && e.kind() != io::ErrorKind::InvalidInput => {
                    self.conn.handle_timeout(now);
                    return Ok(false);
                }
                Err(e) => return Err(e),
            }
        } else if matches!(self.ends, Ends::Take(_)) && self.last_accept.elapsed() > Duration::from_millis(20)
        {
            // A new link from the client means it gave the old one up.
            self.last_accept = Instant::now();
            if let Ends::Take(l) = &mut self.ends {
                if let Ok(link) = l.accept(Duration::ZERO) {
                    self.drop_link();
                    self.adopt(link);
                    moved = true;
                }
            }
        }
        match self.move_bytes(now) {
            Ok(m) => moved |= m,
            Err(_) => {
                self.drop_link();
                moved = true;
            }
        }
        self.conn.handle_timeout(now);
        Ok(moved)
    }

    fn move_bytes(&mut self, now: u64) -> io::Result<bool> {
        let Some(c) = self.cur.as_mut() else { return Ok(false) };
        let mut moved = false;
        // The resume handshake: 8 bytes each way, what each side delivered.
        while !c.hello.is_empty() {
            let n = c.link.send(&c.hello)?;
            if n == 0 {
                break;
            }
            c.hello.drain(..n);
            moved = true;
        }
        if !c.up {
            let mut b = [0u8; 8];
            let want = 8 - c.peer_hello.len();
            let n = c.link.recv(&mut b[..want])?;
            c.peer_hello.extend_from_slice(&b[..n]);
            moved |= n > 0;
            if c.peer_hello.len() == 8 && c.hello.is_empty() {
                let ack = u64::from_le_bytes(c.peer_hello[..8].try_into().expect("8 bytes"));
                self.conn
                    .handle_link_up(now, c.id, Some(ack))
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("resume: {e:?}")))?;
                c.up = true;
            } else {
                return Ok(moved);
            }
        }
        // Frames out.
        loop {
            if c.out_at == c.out.len() {
                match self.conn.poll_transmit(now, c.id, 256 << 10) {
                    Some(f) => {
                        c.out = f;
                        c.out_at = 0;
                    }
                    None => break,
                }
            }
            let n = c.link.send(&c.out[c.out_at..])?;
            if n == 0 {
                break;
            }
            c.out_at += n;
            moved = true;
        }
        // Bytes in.
        loop {
            let n = c.link.recv(&mut self.scratch)?;
            if n == 0 {
                break;
            }
            moved = true;
            self.conn
                .handle_link_bytes(now, c.id, &self.scratch[..n])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("frames: {e:?}")))?;
        }
        Ok(moved)
    }

    /// After the connection closed: keeps moving what the link has until the peer closes it
    /// or `max` passes (the peer may still wait for this side's last acknowledgement, as
    /// TCP's TIME_WAIT allows for); no new link is made.
    pub fn linger(&mut self, max: Duration) {
        let end = Instant::now() + max;
        while Instant::now() < end && self.cur.is_some() {
            let now = self.now();
            match self.move_bytes(now) {
                Ok(true) => {}
                Ok(false) => self.wait(Duration::from_millis(10)),
                Err(_) => break,
            }
        }
    }

    /// Sleeps until the link may move something (at most `max`).
    pub fn wait(&mut self, max: Duration) {
        let fd = match self.cur.as_mut() {
            Some(c) => match c.link.arm() {
                Some(fd) => fd,
                None => return,
            },
            None => return,
        };
        let mut wait = max;
        if let Some(t) = self.conn.poll_timeout() {
            wait = wait.min(Duration::from_millis(t.saturating_sub(self.now()).max(1)));
        }
        wait_readable(&[fd], wait);
    }

    /// Events of the core, for the report.
    pub fn drain_events(&mut self) -> Vec<Event> {
        std::iter::from_fn(|| self.conn.poll_event()).collect()
    }
}

/// What one side saw.
#[derive(Debug, Default)]
pub struct Report {
    /// Bytes this side's program sent.
    pub sent: u64,
    /// Bytes it read.
    pub received: u64,
    /// The first byte read that was not the peer's, if any.
    pub mismatch: Option<u64>,
    /// The end of the peer's stream was read.
    pub end: bool,
    /// The connection closed cleanly (both ends, everything acknowledged).
    pub done: bool,
    /// Links made and link failures.
    pub links: u32,
    /// See `links`.
    pub failures: u32,
    /// Seconds the test took.
    pub seconds: f64,
    /// Round trips of the ping-pong: message size and median microseconds.
    pub rtt_us: Vec<(usize, f64)>,
}

impl Report {
    /// One JSON line.
    pub fn json(&self, sink: &str, role: &str, mode: &str) -> String {
        let rtt: Vec<String> = self.rtt_us.iter().map(|(s, us)| format!("\"{s}\": {us:.2}")).collect();
        format!(
            "{{\"sink\": \"{sink}\", \"role\": \"{role}\", \"mode\": \"{mode}\", \"sent\": {}, \"received\": {}, \"mismatch\": {}, \"end\": {}, \"done\": {}, \"links\": {}, \"failures\": {}, \"seconds\": {:.3}, \"rtt_us\": {{{}}}}}",
            self.sent,
            self.received,
            self.mismatch.map_or("null".into(), |m| m.to_string()),
            self.end,
            self.done,
            self.links,
            self.failures,
            self.seconds,
            rtt.join(", ")
        )
    }
}

/// What the program on one side does.
pub enum Program {
    /// Sends `bytes` of pattern `seed`, reads the peer's pattern `peer_seed` to its end.
    Stream { bytes: u64, seed: u64, peer_seed: u64 },
    /// Sends back whatever it reads, until the peer's end.
    Echo,
    /// Sends `reps` messages of each size (pattern `seed`) and reads each back.
    PingPong { sizes: Vec<usize>, reps: usize, seed: u64 },
}

/// Runs `prog` on side `s` until the connection closes; the client (`cuts` > 0) cuts its
/// link `cuts` times along the way, evenly over what it reads.
pub fn run(s: &mut Side<'_>, prog: Program, cuts: u32, expect_total: u64) -> io::Result<Report> {
    let t0 = Instant::now();
    let mut r = Report::default();
    let mut buf = vec![0u8; 256 << 10];
    let mut out = vec![0u8; 256 << 10];
    let cut_step = if cuts > 0 { (expect_total / (u64::from(cuts) + 1)).max(1) } else { u64::MAX };
    let mut next_cut = cut_step;
    let mut cuts_left = cuts;
    // Echo: bytes read and not sent back yet.
    let mut echo: std::collections::VecDeque<u8> = Default::default();
    // Ping-pong: the message being timed.
    let (mut pp_size, mut pp_rep, mut pp_read, mut pp_sent) = (0usize, 0usize, 0usize, 0usize);
    let mut pp_start = Instant::now();
    let mut pp_times: Vec<f64> = Vec::new();
    let mut finished = false;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if Instant::now() > deadline {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("not done in 300 s: {r:?}")));
        }
        let mut moved = s.step()?;
        // The program's side.
        match &prog {
            Program::Stream { bytes, seed, .. } => {
                while r.sent < *bytes {
                    let k = ((*bytes - r.sent) as usize).min(out.len());
                    fill(*seed, r.sent, &mut out[..k]);
                    match s.conn().send(&out[..k]) {
                        Ok(n) if n > 0 => {
                            r.sent += n as u64;
                            moved = true;
                        }
                        _ => break,
                    }
                }
                if r.sent == *bytes && !finished {
                    s.conn().shutdown();
                    finished = true;
                }
            }
            Program::Echo => {
                while !echo.is_empty() {
                    let (a, _) = echo.as_slices();
                    match s.conn().send(a) {
                        Ok(n) if n > 0 => {
                            echo.drain(..n);
                            r.sent += n as u64;
                            moved = true;
                        }
                        _ => break,
                    }
                }
                if r.end && echo.is_empty() && !finished {
                    s.conn().shutdown();
                    finished = true;
                }
            }
            Program::PingPong { sizes, seed, .. } => {
                if pp_size < sizes.len() && pp_sent < sizes[pp_size] {
                    if pp_sent == 0 {
                        pp_start = Instant::now();
                    }
                    let size = sizes[pp_size];
                    let k = (size - pp_sent).min(out.len());
                    fill(*seed, r.sent, &mut out[..k]);
                    if let Ok(n) = s.conn().send(&out[..k]) {
                        pp_sent += n;
                        r.sent += n as u64;
                        moved |= n > 0;
                    }
                }
                if pp_size == sizes.len() && !finished {
                    s.conn().shutdown();
                    finished = true;
                }
            }
        }
        loop {
            match s.conn().recv(&mut buf) {
                Recv::Data(n) => {
                    moved = true;
                    let expect_seed = match &prog {
                        Program::Stream { peer_seed, .. } => Some(*peer_seed),
                        Program::PingPong { seed, .. } => Some(*seed),
                        Program::Echo => None,
                    };
                    if let Some(seed) = expect_seed {
                        if r.mismatch.is_none() {
                            if let Some(k) = (0..n).find(|&k| buf[k] != pattern(seed, r.received + k as u64))
                            {
                                r.mismatch = Some(r.received + k as u64);
                            }
                        }
                    } else {
                        echo.extend(&buf[..n]);
                    }
                    r.received += n as u64;
                    if let Program::PingPong { sizes, reps, .. } = &prog {
                        pp_read += n;
                        if pp_size < sizes.len() && pp_read >= sizes[pp_size] && pp_sent == sizes[pp_size] {
                            pp_times.push(pp_start.elapsed().as_secs_f64() * 1e6);
                            pp_read -= sizes[pp_size];
                            pp_sent = 0;
                            pp_rep += 1;
                            if pp_rep == *reps {
                                pp_times.sort_by(|a, b| a.total_cmp(b));
                                r.rtt_us.push((sizes[pp_size], pp_times[pp_times.len() / 2]));
                                pp_times.clear();
                                pp_rep = 0;
                                pp_size += 1;
                            }
                        }
                    }
                    if cuts_left > 0 && r.received >= next_cut {
                        cuts_left -= 1;
                        next_cut += cut_step;
                        s.cut()?;
                    }
                }
                Recv::End => {
                    r.end = true;
                    break;
                }
                Recv::Blocked => break,
                Recv::Closed(_) => break,
            }
        }
        for e in s.drain_events() {
            if let Event::Closed(reason) = e {
                r.done = matches!(s.conn().state(), State::Closed(substrate::connection::CloseReason::Done));
                r.seconds = t0.elapsed().as_secs_f64();
                r.links = s.links;
                r.failures = s.failures;
                let _ = reason;
                s.linger(Duration::from_millis(500));
                return Ok(r);
            }
        }
        if !moved {
            s.wait(Duration::from_millis(10));
        }
    }
}
