//! Trust between the agents of a cluster: the cluster key, the encrypted channel agents talk
//! over, and sealed heartbeats.
//!
//! Every node of a cluster holds the same 256-bit cluster key (`vmi-agent --init` makes one;
//! it is copied to every node, mode 0600). Two keys are derived from it with HKDF-SHA256:
//!
//! * the pre-shared key of the agents' TCP channel, `Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`
//!   (the `snow` crate): both ends prove they hold the cluster key, every message after the
//!   handshake is encrypted and authenticated, and each channel has its own ephemeral keys,
//!   so a recorded channel cannot be replayed or read later even by someone who learns the
//!   key afterwards. A connection's secret rides only inside this channel.
//! * the key of the heartbeats (UDP): XChaCha20-Poly1305 with a random nonce per datagram.
//!   A heartbeat counts only if it echoes one of the receiver's own recent heartbeat numbers,
//!   so one recorded earlier cannot keep a dead path alive (see [`crate::paths`]).
//!
//! The agent port also takes the layers' own dials when a link is rebuilt (`Resume`, plain:
//! the link carries the program's bytes and is proven by the challenge-response on the
//! connection's secret, [`substrate::auth`]). The two are told apart by their first four
//! bytes: [`MESH_MAGIC`] is no valid length prefix of a plain message.

use crate::journal::Journal;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use sha2::{Digest, Sha256};
use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;
use tracing::warn;

/// Where the cluster key is looked for when neither `--key` nor `VMI_CLUSTER_KEY` says.
pub const DEFAULT_KEY_PATH: &str = "/etc/vmi/cluster.key";

/// First bytes of an agent-to-agent channel ("VMIM"; as a little-endian length, 1.3 GB: no
/// plain message is that long).
pub const MESH_MAGIC: [u8; 4] = *b"VMIM";
/// First bytes of a heartbeat datagram.
pub const PROBE_MAGIC: [u8; 4] = *b"VMIP";

const NOISE: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
const PROLOGUE: &[u8] = b"vmi agent mesh v1";
/// Largest Noise message (the protocol's limit).
const NOISE_MAX: usize = 65535;
/// Poly1305 tag.
const TAG: usize = 16;
/// XChaCha20 nonce.
const XNONCE: usize = 24;
/// Largest heartbeat datagram accepted.
pub const PROBE_MAX: usize = 512;

/// Time allowed for the other end's half of the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// The cluster key and the keys derived from it.
#[derive(Clone)]
pub struct ClusterKey {
    psk: [u8; 32],
    probe: [u8; 32],
    /// A short public name of the key (SHA-256 of a derived value): nodes with the same
    /// fingerprint hold the same key.
    pub fingerprint: String,
    /// The cluster's id, the fingerprint's first 16 bits: the top 16 bits of every GID the
    /// cluster's agents issue (a GID says which cluster issued it).
    pub cluster_id: u16,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterKey({})", self.fingerprint)
    }
}

fn derive(ikm: &[u8; 32], info: &[u8]) -> [u8; 32] {
    let hk = hkdf::Hkdf::<Sha256>::new(Some(b"vmi cluster key"), ikm);
    let mut out = [0u8; 32];
    hk.expand(info, &mut out).expect("32 bytes is a valid HKDF-SHA256 length");
    out
}

impl ClusterKey {
    /// The keys derived from the 32 key bytes.
    pub fn from_bytes(k: &[u8; 32]) -> Self {
        let id = derive(k, b"fingerprint v1");
        let fp = Sha256::digest(id);
        ClusterKey {
            psk: derive(k, b"agent channel psk v1"),
            probe: derive(k, b"heartbeat aead v1"),
            fingerprint: fp[..8].iter().map(|b| format!("{b:02x}")).collect(),
            cluster_id: u16::from_be_bytes([fp[0], fp[1]]),
        }
    }

    /// Parses a key file's text: 64 hexadecimal digits, blank space around them allowed.
    pub fn parse(text: &[u8]) -> Result<Self, String> {
        let t = std::str::from_utf8(text).map_err(|_| "the key file is not text".to_string())?.trim();
        if t.len() != 64 || !t.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err("a cluster key is 64 hexadecimal digits (256 bits)".into());
        }
        let mut k = [0u8; 32];
        for (i, b) in k.iter_mut().enumerate() {
            *b = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).expect("checked hex");
        }
        Ok(Self::from_bytes(&k))
    }

    /// Reads the key from `path`, refusing a file others can read or write.
    pub fn load(path: &Path) -> Result<Self, String> {
        let hint = "create one with `vmi-agent --init` on one node and copy it to the others (mode 0600)";
        let text = read_private(path, "cluster key", hint)?;
        Self::parse(&text).map_err(|e| format!("cluster key {}: {e}; {hint}", path.display()))
    }

    /// Makes a new random key at `path` (mode 0600; its folder is made if missing). An
    /// existing file is left alone.
    pub fn create(path: &Path) -> Result<Self, String> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut k = [0u8; 32];
        getrandom::fill(&mut k).map_err(|e| format!("no randomness for a key: {e}"))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let hex: String = k.iter().map(|b| format!("{b:02x}")).collect();
        f.write_all(format!("{hex}\n").as_bytes()).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self::from_bytes(&k))
    }

    /// The key file to use: `--key`, else `VMI_CLUSTER_KEY`, else [`DEFAULT_KEY_PATH`].
    pub fn path(flag: Option<PathBuf>) -> PathBuf {
        flag.or_else(|| std::env::var_os("VMI_CLUSTER_KEY").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_KEY_PATH))
    }

    fn noise(&self) -> snow::Builder<'_> {
        snow::Builder::new(NOISE.parse().expect("a valid Noise pattern"))
            .prologue(PROLOGUE)
            .expect("prologue set once")
            .psk(0, &self.psk)
            .expect("psk set once")
    }

    /// Reads a dialer's first handshake message (from outside: anything may come), as the
    /// side that was dialed; the handshake state to answer with if the dialer holds this key.
    pub fn hello(&self, msg: &[u8]) -> io::Result<snow::HandshakeState> {
        let mut hs = self.noise().build_responder().map_err(refused)?;
        let mut scratch = vec![0u8; NOISE_MAX];
        // The dialer's payload is empty: nothing in the first message is acted on (it could
        // be a recording); the dialer proves itself with its first transport message.
        hs.read_message(msg, &mut scratch).map_err(refused)?;
        Ok(hs)
    }

    /// Seals a heartbeat on the path from `src` to `dst` (both are authenticated with it).
    pub fn seal_probe(&self, m: &Msg, src: IpAddr, dst: IpAddr) -> Vec<u8> {
        let mut nonce = [0u8; XNONCE];
        // Without randomness no heartbeat goes out: the path looks dead, which is safe.
        if getrandom::fill(&mut nonce).is_err() {
            return Vec::new();
        }
        let c = XChaCha20Poly1305::new((&self.probe).into());
        let body = m.encode();
        let ct = c
            .encrypt(XNonce::from_slice(&nonce), Payload { msg: &body, aad: &probe_aad(src, dst) })
            .expect("encryption of a short message cannot fail");
        let mut out = Vec::with_capacity(4 + XNONCE + ct.len());
        out.extend_from_slice(&PROBE_MAGIC);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        out
    }

    /// Opens a heartbeat datagram that came from `src` to `dst`; `None` when it is not one
    /// sealed with this cluster's key for that path.
    pub fn open_probe(&self, d: &[u8], src: IpAddr, dst: IpAddr) -> Option<Msg> {
        if d.len() < 4 + XNONCE + TAG || d.len() > PROBE_MAX || d[..4] != PROBE_MAGIC {
            return None;
        }
        let c = XChaCha20Poly1305::new((&self.probe).into());
        let body = c
            .decrypt(
                XNonce::from_slice(&d[4..4 + XNONCE]),
                Payload { msg: &d[4 + XNONCE..], aad: &probe_aad(src, dst) },
            )
            .ok()?;
        Msg::decode_framed(&body).ok()
    }
}

fn v6(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

fn probe_aad(src: IpAddr, dst: IpAddr) -> [u8; 36] {
    let mut a = [0u8; 36];
    a[..4].copy_from_slice(&PROBE_MAGIC);
    a[4..20].copy_from_slice(&v6(src));
    a[20..].copy_from_slice(&v6(dst));
    a
}

/// An established channel between two agents: implements `Read` and `Write` over the plain
/// message stream, each write sent as encrypted Noise messages (a `u16` big-endian length,
/// then the message).
pub struct Channel {
    s: TcpStream,
    noise: snow::TransportState,
    /// Decrypted bytes of the last message; `plain[at..len]` not read yet.
    plain: Box<[u8; NOISE_MAX]>,
    at: usize,
    len: usize,
    /// A message as it comes off the wire, or goes on it (with its length first).
    wire: Box<[u8; NOISE_MAX + 2]>,
}

fn write_frame(s: &mut TcpStream, m: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(2 + m.len());
    buf.extend_from_slice(&(m.len() as u16).to_be_bytes());
    buf.extend_from_slice(m);
    s.write_all(&buf)
}

fn read_frame(s: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len)?;
    let n = u16::from_be_bytes(len) as usize;
    s.read_exact(&mut buf[..n])?;
    Ok(n)
}

fn refused(e: snow::Error) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, format!("handshake failed ({e})"))
}

impl Channel {
    /// Opens a channel on a connected stream, as the side that dialed.
    pub fn dial(mut s: TcpStream, key: &ClusterKey) -> io::Result<Channel> {
        let mut hs = key.noise().build_initiator().map_err(refused)?;
        let mut buf = Box::new([0u8; NOISE_MAX]);
        let n = hs.write_message(&[], &mut buf[..]).map_err(refused)?;
        let mut first = Vec::with_capacity(4 + 2 + n);
        first.extend_from_slice(&MESH_MAGIC);
        first.extend_from_slice(&(n as u16).to_be_bytes());
        first.extend_from_slice(&buf[..n]);
        s.write_all(&first)?;
        let n = read_frame(&mut s, &mut buf[..]).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => io::Error::new(
                io::ErrorKind::PermissionDenied,
                "it closed the channel in the handshake (another cluster key, or not an agent)",
            ),
            _ => e,
        })?;
        let mut scratch = Box::new([0u8; NOISE_MAX]);
        hs.read_message(&buf[..n], &mut scratch[..]).map_err(refused)?;
        let noise = hs.into_transport_mode().map_err(refused)?;
        Ok(Channel::new(s, noise))
    }

    fn new(s: TcpStream, noise: snow::TransportState) -> Channel {
        Channel {
            s,
            noise,
            plain: Box::new([0; NOISE_MAX]),
            at: 0,
            len: 0,
            wire: Box::new([0; NOISE_MAX + 2]),
        }
    }

    /// Completes a channel whose [`MESH_MAGIC`] was read already, as the side that was
    /// dialed. Fails (and nothing else happens) unless the dialer holds the cluster key.
    pub fn answer(mut s: TcpStream, key: &ClusterKey) -> io::Result<Channel> {
        let mut buf = Box::new([0u8; NOISE_MAX]);
        let n = read_frame(&mut s, &mut buf[..])?;
        let mut hs = key.hello(&buf[..n])?;
        let n = hs.write_message(&[], &mut buf[..]).map_err(refused)?;
        write_frame(&mut s, &buf[..n])?;
        let noise = hs.into_transport_mode().map_err(refused)?;
        Ok(Channel::new(s, noise))
    }

    /// The TCP stream under the channel.
    pub fn stream(&self) -> &TcpStream {
        &self.s
    }
}

impl Read for Channel {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.at == self.len {
            let n = read_frame(&mut self.s, &mut self.wire[..NOISE_MAX])?;
            let m = self.noise.read_message(&self.wire[..n], &mut self.plain[..]).map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidData, format!("a message failed authentication ({e})"))
            })?;
            self.len = m;
            self.at = 0;
        }
        let n = out.len().min(self.len - self.at);
        out[..n].copy_from_slice(&self.plain[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

impl Write for Channel {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        for chunk in data.chunks(NOISE_MAX - TAG) {
            let n = self
                .noise
                .write_message(chunk, &mut self.wire[2..])
                .map_err(|e| io::Error::other(format!("encrypting for another agent: {e}")))?;
            self.wire[..2].copy_from_slice(&(n as u16).to_be_bytes());
            self.s.write_all(&self.wire[..2 + n])?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.s.flush()
    }
}

/// What was refused, counted for `vmictl status` and logged at most once a second per kind
/// (a flood must not flood the log).
#[derive(Default)]
pub struct Refusals {
    /// Agent channels whose handshake failed (no or another cluster key).
    pub channel: AtomicU64,
    /// Agent messages that came in clear (only a link's own `Resume` may).
    pub clear: AtomicU64,
    /// Heartbeats that were not sealed with the cluster key.
    pub forged: AtomicU64,
    /// Heartbeats sealed with the key but old (recorded and sent again).
    pub replayed: AtomicU64,
    /// Local commands refused for want of rights.
    pub local: AtomicU64,
    /// Requests to the web view without its token (or from a name it does not answer to).
    pub web: AtomicU64,
    last: Mutex<[Option<Instant>; 6]>,
    journal: Arc<Journal>,
}

/// A kind of refusal.
#[derive(Clone, Copy, Debug)]
pub enum Refused {
    /// See [`Refusals::channel`].
    Channel,
    /// See [`Refusals::clear`].
    Clear,
    /// See [`Refusals::forged`].
    Forged,
    /// See [`Refusals::replayed`].
    Replayed,
    /// See [`Refusals::local`].
    Local,
    /// See [`Refusals::web`].
    Web,
}

impl Refusals {
    /// Refusals recorded in `journal` too (at the rate they are logged).
    pub fn new(journal: Arc<Journal>) -> Self {
        Refusals { journal, ..Default::default() }
    }

    /// Counts one refusal and logs `what` unless one of its kind was logged in the last second.
    pub fn note(&self, kind: Refused, what: impl FnOnce() -> String) {
        let (c, i) = match kind {
            Refused::Channel => (&self.channel, 0),
            Refused::Clear => (&self.clear, 1),
            Refused::Forged => (&self.forged, 2),
            Refused::Replayed => (&self.replayed, 3),
            Refused::Local => (&self.local, 4),
            Refused::Web => (&self.web, 5),
        };
        let n = c.fetch_add(1, Relaxed) + 1;
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if last[i].is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1)) {
            last[i] = Some(now);
            let what = what();
            let hint = [
                "if that node belongs to this cluster, give it this node's key file; `vmictl status` shows the key's fingerprint on each node",
                "only agents of the cluster, through its channel, and the layer's own link rebuilds may talk to this port; firewall it from anything else",
                "compare the cluster key's fingerprint in `vmictl status` on both nodes, and see who else sends to this UDP port",
                "someone may be replaying captured traffic: see who sends to this UDP port",
                "run the command as root, as the agent's user, or as the owner of the processes",
                "the web view answers requests with the token of its web-token file (header `Authorization: Bearer TOKEN`, or ?token= once in a browser) and, without a token, only those naming it by address or as localhost; firewall its port from anyone else",
            ][i];
            warn!("refused: {what} ({n} of this kind so far; {hint})");
            drop(last);
            let kind = ["channel", "clear", "forged_heartbeat", "replayed_heartbeat", "local", "web"][i];
            self.journal.record(
                "refused",
                None,
                serde_json::json!({ "what": kind, "detail": what, "count": n }),
            );
        }
    }

    /// The counts, for reports.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "channel": self.channel.load(Relaxed),
            "clear": self.clear.load(Relaxed),
            "forged_heartbeats": self.forged.load(Relaxed),
            "replayed_heartbeats": self.replayed.load(Relaxed),
            "local": self.local.load(Relaxed),
            "web": self.web.load(Relaxed),
        })
    }
}

/// Reads a secret's file (`what`: how messages name it), refusing one that other users can
/// read or write; `hint` ends the message when the file cannot be read.
pub fn read_private(path: &Path, what: &str, hint: &str) -> Result<Vec<u8>, String> {
    use std::os::unix::fs::MetadataExt;
    let sep = if hint.is_empty() { "" } else { "; " };
    let md = std::fs::metadata(path).map_err(|e| format!("{what} {}: {e}{sep}{hint}", path.display()))?;
    if md.mode() & 0o077 != 0 {
        return Err(format!(
            "{what} {} is open to other users (mode {:o}); `chmod 600 {}`",
            path.display(),
            md.mode() & 0o777,
            path.display()
        ));
    }
    std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn key(b: u8) -> ClusterKey {
        ClusterKey::from_bytes(&[b; 32])
    }

    fn pair(a: ClusterKey, b: ClusterKey) -> (io::Result<Channel>, io::Result<Channel>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut magic = [0u8; 4];
            s.read_exact(&mut magic).unwrap();
            assert_eq!(magic, MESH_MAGIC);
            Channel::answer(s, &b)
        });
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let d = Channel::dial(s, &a);
        (d, t.join().unwrap())
    }

    #[test]
    fn members_talk_and_messages_round_trip_whatever_their_size() {
        let (d, a) = pair(key(1), key(1));
        let (mut d, mut a) = (d.unwrap(), a.unwrap());
        let big = Msg::StatusReply { json: "x".repeat(200_000) };
        crate::wire::write_msg(&mut d, &Msg::Status).unwrap();
        crate::wire::write_msg(&mut d, &big).unwrap();
        assert_eq!(crate::wire::read_msg(&mut a).unwrap(), Msg::Status);
        assert_eq!(crate::wire::read_msg(&mut a).unwrap(), big);
        crate::wire::write_msg(&mut a, &Msg::Ok).unwrap();
        assert_eq!(crate::wire::read_msg(&mut d).unwrap(), Msg::Ok);
    }

    #[test]
    fn a_stranger_is_refused_in_the_handshake() {
        let (d, a) = pair(key(1), key(2));
        // The dialed side cannot tell before the dialer's first message fails (psk0 mixes the
        // key into the first message): the dialer's side fails or its first message does.
        match (d, a) {
            (Ok(mut d), Ok(mut a)) => {
                let _ = crate::wire::write_msg(&mut d, &Msg::Status);
                assert!(crate::wire::read_msg(&mut a).is_err());
            }
            (d, a) => assert!(d.is_err() || a.is_err()),
        }
    }

    #[test]
    fn heartbeats_open_only_with_the_same_key_and_unaltered() {
        let m = Msg::Probe { node: "n1".into(), seq: 5, boot: 9, echo_boot: 3, echo_seq: 4, every_ms: 10 };
        let (a, b, c): (IpAddr, IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap(), "10.0.1.2".parse().unwrap());
        let d = key(1).seal_probe(&m, a, b);
        assert_eq!(key(1).open_probe(&d, a, b), Some(m.clone()));
        assert_eq!(key(2).open_probe(&d, a, b), None);
        assert_eq!(key(1).open_probe(&d, c, b), None, "sent again from another address");
        assert_eq!(key(1).open_probe(&d, b, a), None, "reflected back");
        for i in 0..d.len() {
            let mut x = d.clone();
            x[i] ^= 1;
            assert_eq!(key(1).open_probe(&x, a, b), None, "byte {i} flipped");
        }
        assert_eq!(key(1).open_probe(&m.encode(), a, b), None, "a heartbeat in clear");
        assert_ne!(key(1).seal_probe(&m, a, b), d, "each datagram has its own nonce");
    }

    #[test]
    fn key_files_parse_strictly() {
        let hex = "ab".repeat(32);
        assert!(ClusterKey::parse(format!("{hex}\n").as_bytes()).is_ok());
        assert!(ClusterKey::parse(&hex.as_bytes()[..62]).is_err());
        assert!(ClusterKey::parse(format!("{}zz", &hex[..62]).as_bytes()).is_err());
        assert!(ClusterKey::parse(&[0xff; 64]).is_err());
        assert_eq!(ClusterKey::parse(hex.as_bytes()).unwrap().fingerprint, key(0xab).fingerprint);
        assert_ne!(key(1).fingerprint, key(2).fingerprint);
    }

    #[test]
    fn a_created_key_is_private_and_loads_back() {
        let dir = std::env::temp_dir().join(format!("vmi-key-test-{}", std::process::id()));
        let p = dir.join("sub/cluster.key");
        let k = ClusterKey::create(&p).unwrap();
        assert!(ClusterKey::create(&p).is_err(), "an existing key is never overwritten");
        assert_eq!(ClusterKey::load(&p).unwrap().fingerprint, k.fingerprint);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(ClusterKey::load(&p).unwrap_err().contains("open to other users"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
