//! Messages between a layer and its node agent (over the agent's Unix socket) and between
//! agents (over TCP). Each message travels as a little-endian `u32` body length, then the
//! body: a tag byte and the fields in order. Addresses are a family byte (4 or 6), the IP
//! bytes and a `u16` port.
//!
//! The decoder refuses anything malformed with an [`AgentWireError`] and never allocates more
//! than the stated body length, which is itself bounded by [`MAX_BODY`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Largest body accepted (a status reply for tens of thousands of connections fits).
pub const MAX_BODY: usize = 64 << 20;

/// A message on an agent socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Layer → agent: a process under the layer introduces itself (its statistics table
    /// travels beside this message as a file descriptor).
    Hello {
        /// The process id.
        pid: u32,
        /// The program's name.
        name: String,
    },
    /// Layer → agent: a socket under the layer listens at `addr`.
    Listen {
        /// Listening address (the IP may be unspecified).
        addr: SocketAddr,
        /// The listening process's window (its accepted connections use it).
        window: u64,
    },
    /// Layer → agent: the listener at `addr` is closed.
    Unlisten {
        /// Listening address.
        addr: SocketAddr,
    },
    /// Layer → local agent, and agent → the destination's agent: a connection from `src` to
    /// `dst` is about to be made; if `dst` is a listener under the layer, expect it as the
    /// virtual connection `gid`.
    Connect {
        /// Source address (layer → agent: the IP may be unspecified).
        src: SocketAddr,
        /// Destination address.
        dst: SocketAddr,
        /// The new connection's identity.
        gid: u128,
        /// Secret that authenticates the connection's ends later.
        secret: u128,
        /// The connecting side's window.
        window: u64,
    },
    /// Layer → agent: a listener accepted a connection from `peer`; is it virtual?
    Accept {
        /// The accepted socket's local address.
        local: SocketAddr,
        /// The peer's address.
        peer: SocketAddr,
    },
    /// Answer: the connection is virtual.
    Virtual {
        /// Its identity.
        gid: u128,
        /// Its secret.
        secret: u128,
        /// The other side's window.
        window: u64,
    },
    /// Answer: plain TCP.
    Plain,
    /// Answer: done.
    Ok,
    /// Answer: the request failed.
    Error {
        /// Why.
        reason: String,
    },
    /// `vmictl` → agent: report everything.
    Status,
    /// Agent → `vmictl`: the report, as JSON.
    StatusReply {
        /// JSON document.
        json: String,
    },
}

/// Why a message was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentWireError {
    /// The body ended before a field did.
    Truncated,
    /// The stated body length is over [`MAX_BODY`].
    TooLong(usize),
    /// Unknown message tag.
    UnknownTag(u8),
    /// Address family byte other than 4 or 6.
    BadFamily(u8),
    /// A string that is not UTF-8.
    BadString,
    /// Bytes left over after the last field.
    TrailingBytes(usize),
}

impl std::fmt::Display for AgentWireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentWireError::Truncated => write!(f, "message truncated"),
            AgentWireError::TooLong(n) => write!(f, "message of {n} bytes is too long"),
            AgentWireError::UnknownTag(t) => write!(f, "unknown message tag {t}"),
            AgentWireError::BadFamily(x) => write!(f, "bad address family {x}"),
            AgentWireError::BadString => write!(f, "string is not UTF-8"),
            AgentWireError::TrailingBytes(n) => write!(f, "{n} bytes after the message"),
        }
    }
}

impl std::error::Error for AgentWireError {}

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v)
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u128(&mut self, v: u128) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes())
    }
    fn addr(&mut self, a: &SocketAddr) {
        match a.ip() {
            IpAddr::V4(ip) => {
                self.u8(4);
                self.0.extend_from_slice(&ip.octets())
            }
            IpAddr::V6(ip) => {
                self.u8(6);
                self.0.extend_from_slice(&ip.octets())
            }
        }
        self.0.extend_from_slice(&a.port().to_le_bytes())
    }
}

struct R<'a>(&'a [u8]);

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], AgentWireError> {
        if self.0.len() < n {
            return Err(AgentWireError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, AgentWireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, AgentWireError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, AgentWireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, AgentWireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn u128(&mut self) -> Result<u128, AgentWireError> {
        Ok(u128::from_le_bytes(self.take(16)?.try_into().expect("16")))
    }
    fn str(&mut self) -> Result<String, AgentWireError> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| AgentWireError::BadString)
    }
    fn addr(&mut self) -> Result<SocketAddr, AgentWireError> {
        let ip = match self.u8()? {
            4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(self.take(4)?).expect("4"))),
            6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(self.take(16)?).expect("16"))),
            f => return Err(AgentWireError::BadFamily(f)),
        };
        Ok(SocketAddr::new(ip, self.u16()?))
    }
}

impl Msg {
    /// Encodes the message with its length prefix.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(vec![0; 4]);
        match self {
            Msg::Hello { pid, name } => {
                w.u8(1);
                w.u32(*pid);
                w.str(name);
            }
            Msg::Listen { addr, window } => {
                w.u8(2);
                w.addr(addr);
                w.u64(*window);
            }
            Msg::Unlisten { addr } => {
                w.u8(3);
                w.addr(addr);
            }
            Msg::Connect { src, dst, gid, secret, window } => {
                w.u8(4);
                w.addr(src);
                w.addr(dst);
                w.u128(*gid);
                w.u128(*secret);
                w.u64(*window);
            }
            Msg::Accept { local, peer } => {
                w.u8(5);
                w.addr(local);
                w.addr(peer);
            }
            Msg::Virtual { gid, secret, window } => {
                w.u8(6);
                w.u128(*gid);
                w.u128(*secret);
                w.u64(*window);
            }
            Msg::Plain => w.u8(7),
            Msg::Ok => w.u8(8),
            Msg::Error { reason } => {
                w.u8(9);
                w.str(reason);
            }
            Msg::Status => w.u8(10),
            Msg::StatusReply { json } => {
                w.u8(11);
                w.str(json);
            }
        }
        let body = (w.0.len() - 4) as u32;
        w.0[..4].copy_from_slice(&body.to_le_bytes());
        w.0
    }

    /// Reads the body length from a 4-byte prefix, refusing lengths over [`MAX_BODY`].
    pub fn body_len(prefix: [u8; 4]) -> Result<usize, AgentWireError> {
        let n = u32::from_le_bytes(prefix) as usize;
        if n > MAX_BODY {
            return Err(AgentWireError::TooLong(n));
        }
        Ok(n)
    }

    /// Decodes one message body (without its length prefix).
    pub fn decode(body: &[u8]) -> Result<Msg, AgentWireError> {
        let mut r = R(body);
        let m = match r.u8()? {
            1 => Msg::Hello { pid: r.u32()?, name: r.str()? },
            2 => Msg::Listen { addr: r.addr()?, window: r.u64()? },
            3 => Msg::Unlisten { addr: r.addr()? },
            4 => Msg::Connect {
                src: r.addr()?,
                dst: r.addr()?,
                gid: r.u128()?,
                secret: r.u128()?,
                window: r.u64()?,
            },
            5 => Msg::Accept { local: r.addr()?, peer: r.addr()? },
            6 => Msg::Virtual { gid: r.u128()?, secret: r.u128()?, window: r.u64()? },
            7 => Msg::Plain,
            8 => Msg::Ok,
            9 => Msg::Error { reason: r.str()? },
            10 => Msg::Status,
            11 => Msg::StatusReply { json: r.str()? },
            t => return Err(AgentWireError::UnknownTag(t)),
        };
        if !r.0.is_empty() {
            return Err(AgentWireError::TrailingBytes(r.0.len()));
        }
        Ok(m)
    }

    /// Decodes a whole buffer holding one length-prefixed message.
    pub fn decode_framed(buf: &[u8]) -> Result<Msg, AgentWireError> {
        if buf.len() < 4 {
            return Err(AgentWireError::Truncated);
        }
        let n = Self::body_len(buf[..4].try_into().expect("4"))?;
        let body = buf.get(4..4 + n).ok_or(AgentWireError::Truncated)?;
        if buf.len() > 4 + n {
            return Err(AgentWireError::TrailingBytes(buf.len() - 4 - n));
        }
        Self::decode(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_message() {
        let a: SocketAddr = "10.77.0.1:5201".parse().unwrap();
        let b: SocketAddr = "[fe80::1]:80".parse().unwrap();
        for m in [
            Msg::Hello { pid: 42, name: "iperf3".into() },
            Msg::Listen { addr: a, window: 9 },
            Msg::Unlisten { addr: b },
            Msg::Connect { src: a, dst: b, gid: u128::MAX, secret: 7, window: 1 << 22 },
            Msg::Accept { local: b, peer: a },
            Msg::Virtual { gid: 1, secret: 2, window: 3 },
            Msg::Plain,
            Msg::Ok,
            Msg::Error { reason: "no".into() },
            Msg::Status,
            Msg::StatusReply { json: "{}".into() },
        ] {
            assert_eq!(Msg::decode_framed(&m.encode()), Ok(m));
        }
    }

    #[test]
    fn refuses_malformed() {
        assert_eq!(Msg::decode(&[]), Err(AgentWireError::Truncated));
        assert_eq!(Msg::decode(&[99]), Err(AgentWireError::UnknownTag(99)));
        assert_eq!(Msg::decode(&[2, 5, 0]), Err(AgentWireError::BadFamily(5)));
        assert_eq!(Msg::decode(&[3, 4, 1, 2, 3, 4, 0]), Err(AgentWireError::Truncated));
        assert_eq!(Msg::decode(&[8, 0]), Err(AgentWireError::TrailingBytes(1)));
        assert_eq!(Msg::decode(&[9, 255, 255, 255, 255]), Err(AgentWireError::Truncated));
        assert!(Msg::body_len([255, 255, 255, 255]).is_err());
    }
}
