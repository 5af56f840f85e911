//! The record that carries a virtual connection across `exec` (the `VMI_INHERIT`
//! variable of the new image's environment): one record per descriptor, `;` between
//! records, 13 fields separated by `,`:
//!
//! ```text
//! fd,gid,secret,peer_window,window,local,peer,active,tx,rx,peer_agents,shm,unacked
//! ```
//!
//! `gid` and `secret` are 32 hexadecimal digits, `tx` and `rx` the send and receive halves
//! in hexadecimal ([`TxState::to_bytes`], [`RxState::to_bytes`]), `peer_agents` socket
//! addresses separated by spaces, `shm` the shared-memory link's own hand-over (empty when
//! none; it never holds `,` or `;`), `unacked` the descriptor of the memory file holding the
//! unacknowledged bytes (-1: none). The environment is outside input (anything may set the
//! variable), so parsing refuses every record that does not hold together.

use crate::reliability::{RxState, TxState};
use std::fmt::Write as _;
use std::net::SocketAddr;

/// One connection's record.
#[derive(Clone, Debug)]
pub struct ExecRecord {
    /// The descriptor that carries it in the new image.
    pub fd: i32,
    /// GID.
    pub gid: u128,
    /// The connection's secret.
    pub secret: u128,
    /// The peer's window.
    pub peer_window: u64,
    /// This side's soft window.
    pub window: u64,
    /// The program's local address.
    pub local: SocketAddr,
    /// The program's peer address.
    pub peer: SocketAddr,
    /// True when this side connected.
    pub active: bool,
    /// The send half.
    pub tx: TxState,
    /// The receive half.
    pub rx: RxState,
    /// Where the peer node's agent can be reached.
    pub peer_agents: Vec<SocketAddr>,
    /// The shared-memory link's hand-over, or empty.
    pub shm: String,
    /// The memory file with the unacknowledged bytes, or -1.
    pub unacked: i32,
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

fn u128_hex(s: &str) -> Option<u128> {
    (s.len() == 32).then(|| u128::from_str_radix(s, 16).ok()).flatten()
}

impl ExecRecord {
    /// The record's text; `None` if `shm` holds a separator.
    pub fn encode(&self) -> Option<String> {
        if self.shm.contains([',', ';']) {
            return None;
        }
        Some(format!(
            "{},{:032x},{:032x},{},{},{},{},{},{},{},{},{},{}",
            self.fd,
            self.gid,
            self.secret,
            self.peer_window,
            self.window,
            self.local,
            self.peer,
            u8::from(self.active),
            hex(&self.tx.to_bytes()),
            hex(&self.rx.to_bytes()),
            self.peer_agents.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(" "),
            self.shm,
            self.unacked,
        ))
    }

    /// Parses one record; `None` unless every field does.
    pub fn parse(r: &str) -> Option<ExecRecord> {
        let f: Vec<&str> = r.split(',').collect();
        if f.len() != 13 {
            return None;
        }
        let agents: Option<Vec<SocketAddr>> =
            f[10].split(' ').filter(|a| !a.is_empty()).map(|a| a.parse().ok()).collect();
        let rec = ExecRecord {
            fd: f[0].parse().ok().filter(|&fd: &i32| fd >= 0)?,
            gid: u128_hex(f[1])?,
            secret: u128_hex(f[2])?,
            peer_window: f[3].parse().ok()?,
            window: f[4].parse().ok()?,
            local: f[5].parse().ok()?,
            peer: f[6].parse().ok()?,
            active: match f[7] {
                "1" => true,
                "0" => false,
                _ => return None,
            },
            tx: TxState::from_bytes(&unhex(f[8])?)?,
            rx: RxState::from_bytes(&unhex(f[9])?)?,
            peer_agents: agents?,
            shm: f[11].to_string(),
            unacked: f[12].parse().ok().filter(|&u: &i32| u >= -1)?,
        };
        Some(rec)
    }

    /// The descriptor and GID a record names, read even where the rest does not parse (the
    /// second descriptor of a connection already rebuilt, a record to clean up after).
    pub fn names(r: &str) -> (Option<i32>, Option<u128>, Option<i32>) {
        let mut f = r.split(',');
        let fd = f.next().and_then(|x| x.parse::<i32>().ok());
        let gid = f.next().and_then(u128_hex);
        let unacked = r.rsplit(',').next().and_then(|x| x.parse::<i32>().ok());
        (fd, gid, unacked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ExecRecord {
        let mut tx = TxState::with_soft_window(8 << 20, 2 << 20);
        tx.next_seq = 5000;
        tx.acked = 1000;
        tx.wire_seq = 4000;
        let mut rx = RxState::new();
        rx.delivered = 777;
        rx.fin = 1;
        ExecRecord {
            fd: 5,
            gid: 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef,
            secret: 42,
            peer_window: 2 << 20,
            window: 2 << 20,
            local: "10.0.0.1:40000".parse().unwrap(),
            peer: "[fd00::2]:5201".parse().unwrap(),
            active: true,
            tx,
            rx,
            peer_agents: vec!["10.0.0.2:7787".parse().unwrap(), "10.1.0.2:7787".parse().unwrap()],
            shm: "3 9 vmi-x 1 2".into(),
            unacked: 7,
        }
    }

    #[test]
    fn round_trip() {
        let r = sample();
        let text = r.encode().unwrap();
        let back = ExecRecord::parse(&text).unwrap();
        assert_eq!(back.encode().unwrap(), text);
        assert_eq!(back.tx.to_bytes(), r.tx.to_bytes());
        assert_eq!(back.rx.to_bytes(), r.rx.to_bytes());
        assert_eq!((back.fd, back.gid, back.peer_agents.clone()), (r.fd, r.gid, r.peer_agents.clone()));
        assert_eq!(ExecRecord::names(&text), (Some(5), Some(r.gid), Some(7)));
    }

    #[test]
    fn refuses_what_does_not_hold_together() {
        let text = sample().encode().unwrap();
        let f: Vec<&str> = text.split(',').collect();
        let with = |i: usize, v: &str| {
            let mut g = f.clone();
            g[i] = v;
            g.join(",")
        };
        assert!(ExecRecord::parse(&with(0, "-3")).is_none());
        assert!(ExecRecord::parse(&with(1, "12")).is_none());
        assert!(ExecRecord::parse(&with(7, "2")).is_none());
        assert!(ExecRecord::parse(&with(8, "00")).is_none());
        assert!(ExecRecord::parse(&with(8, &f[8][1..])).is_none());
        assert!(ExecRecord::parse(&with(10, "nowhere")).is_none());
        assert!(ExecRecord::parse(&with(12, "-2")).is_none());
        assert!(ExecRecord::parse(&f[..12].join(",")).is_none());
        assert!(ExecRecord::parse(&format!("{text},1")).is_none());
        // Acknowledged past what was sent.
        let mut bad = sample();
        bad.tx.acked = bad.tx.next_seq + 1;
        assert!(ExecRecord::parse(&bad.encode().unwrap()).is_none());
        let mut shm = sample();
        shm.shm = "a,b".into();
        assert!(shm.encode().is_none());
    }
}
