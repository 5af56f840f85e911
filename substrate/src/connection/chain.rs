//! Filters on a connection's stream: devices that own and transform the payload of each
//! frame (compression, encryption, a test filter that doubles every byte), attached to or
//! detached from a live connection at a frame boundary both layers agree on.
//!
//! A chain is described by a string of filter names separated by commas (`"double"`,
//! `""` for none). This side offers a new chain for its own stream (`ChainOffer`, numbered
//! 1..=15); the peer builds the inverse from the same description and answers
//! (`ChainAnswer`); once taken, every byte of the stream from the next new frame on goes
//! through it, and each data frame names the chain that transformed it, so frames sent again
//! after a failure (or arriving over another link) are decoded with the chain of their own
//! offsets. A filter works on one frame at a time, given the frame's stream offset, so the
//! same bytes at the same offset always encode the same way.

pub use super::filter::{DecodeError, Filter};

/// The test filter that changes lengths: every byte goes twice.
#[derive(Debug, Default)]
pub struct Doubler;

impl Filter for Doubler {
    fn name(&self) -> &'static str {
        "double"
    }
    fn max_out(&self, n: usize) -> usize {
        2 * n
    }
    fn encode(&mut self, _seq: u64, _raw_len: usize, input: &[u8], out: &mut Vec<u8>) {
        out.reserve(2 * input.len());
        for &b in input {
            out.extend_from_slice(&[b, b]);
        }
    }
    fn decode(&mut self, _seq: u64, input: &[u8], out: &mut Vec<u8>) -> Result<(), DecodeError> {
        if !input.len().is_multiple_of(2) {
            return Err(DecodeError::Malformed);
        }
        for p in input.chunks_exact(2) {
            if p[0] != p[1] {
                return Err(DecodeError::Malformed);
            }
            out.push(p[0]);
        }
        Ok(())
    }
}

/// A block compressor under the tagged frame format the compressing filters share: an
/// encoded frame starts with a tag byte, `0` and the frame's bytes as they were (data that
/// does not compress), or `1`, the original length (4 bytes, little-endian) and one
/// compressed block. Whether a frame is worth compressing is judged from its first
/// [`PROBE`] bytes, so that incompressible data (already compressed, encrypted, random)
/// costs a small fraction of a compression. Both the judgement and the compression depend
/// only on the frame's bytes: the same frame always encodes the same way.
trait Packer {
    /// The filter's name in a chain.
    fn name(&self) -> &'static str;
    /// Compresses `input` into [`packed`](Self::packed); its length, `None` if it cannot.
    fn pack(&mut self, input: &[u8]) -> Option<usize>;
    /// What the last [`pack`](Self::pack) wrote.
    fn packed(&self) -> &[u8];
    /// Decompresses `block` into `out` (exactly its length); the length written.
    fn unpack(&mut self, block: &[u8], out: &mut [u8]) -> Option<usize>;
}

/// Bytes of a frame compressed first to judge whether the whole frame is worth it.
pub const PROBE: usize = 2048;

/// A frame through packer `p` in the tagged format (see [`Packer`]).
fn tagged_encode(p: &mut impl Packer, input: &[u8], out: &mut Vec<u8>) {
    // Tiny frames are not worth it; a probe that saves less than an eighth says the data does
    // not compress.
    let probe = &input[..input.len().min(PROBE)];
    let packed = match (input.len() > 64).then(|| p.pack(probe)).flatten() {
        Some(n) if n < probe.len() - probe.len() / 8 => {
            if probe.len() == input.len() {
                Some(n)
            } else {
                p.pack(input)
            }
        }
        _ => None,
    };
    match packed.filter(|&n| n + 4 < input.len()) {
        Some(n) => {
            out.reserve(5 + n);
            out.push(1);
            out.extend_from_slice(&(input.len() as u32).to_le_bytes());
            out.extend_from_slice(&p.packed()[..n]);
        }
        None => {
            out.reserve(1 + input.len());
            out.push(0);
            out.extend_from_slice(input);
        }
    }
}

/// True when [`tagged_encode`] would store `input` as it is, judged as it judges (from the
/// probe alone: a frame whose probe compresses but whose whole does not is not foreseen).
fn tagged_passes(p: &mut impl Packer, input: &[u8]) -> bool {
    let probe = &input[..input.len().min(PROBE)];
    !matches!((input.len() > 64).then(|| p.pack(probe)).flatten(), Some(n) if n < probe.len() - probe.len() / 8)
}

/// The inverse of [`tagged_encode`], for a peer's frame: a bad tag, a claimed length above
/// the largest frame, or a block that does not decode to exactly that length is an error.
fn tagged_decode(p: &mut impl Packer, input: &[u8], out: &mut Vec<u8>) -> Result<(), DecodeError> {
    match input.split_first() {
        Some((0, rest)) => {
            out.extend_from_slice(rest);
            Ok(())
        }
        Some((1, rest)) if rest.len() >= 4 => {
            let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            if len > crate::wire::frame::MAX_PAYLOAD as usize {
                return Err(DecodeError::Malformed);
            }
            let at = out.len();
            out.resize(at + len, 0);
            match p.unpack(&rest[4..], &mut out[at..]) {
                Some(n) if n == len => Ok(()),
                _ => {
                    out.truncate(at);
                    Err(DecodeError::Malformed)
                }
            }
        }
        _ => Err(DecodeError::Malformed),
    }
}

/// Every compressor is a filter through the tagged frame format.
impl<P: Packer + std::fmt::Debug + Send> Filter for P {
    fn name(&self) -> &'static str {
        Packer::name(self)
    }
    fn max_out(&self, n: usize) -> usize {
        // A frame that would not shrink goes stored, behind its tag.
        n + 1
    }
    fn encode(&mut self, _seq: u64, _raw_len: usize, input: &[u8], out: &mut Vec<u8>) {
        tagged_encode(self, input, out)
    }
    fn passes(&mut self, input: &[u8]) -> bool {
        tagged_passes(self, input)
    }
    fn decode(&mut self, _seq: u64, input: &[u8], out: &mut Vec<u8>) -> Result<(), DecodeError> {
        tagged_decode(self, input, out)
    }
}

/// LZ4 compression of each frame (the block format, from the `lz4_flex` crate), in the
/// tagged frame format of [`Packer`].
#[derive(Default)]
pub struct Lz4 {
    table: lz4_flex::block::CompressTable,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Lz4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Lz4")
    }
}

impl Packer for Lz4 {
    fn name(&self) -> &'static str {
        "lz4"
    }
    fn pack(&mut self, input: &[u8]) -> Option<usize> {
        let need = lz4_flex::block::get_maximum_output_size(input.len());
        if self.scratch.len() < need {
            self.scratch.resize(need, 0);
        }
        lz4_flex::block::compress_into_with_table(input, &mut self.scratch, &mut self.table).ok()
    }
    fn packed(&self) -> &[u8] {
        &self.scratch
    }
    fn unpack(&mut self, block: &[u8], out: &mut [u8]) -> Option<usize> {
        lz4_flex::block::decompress_into(block, out).ok()
    }
}

/// Zstandard compression of each frame at a level (1 fastest .. 19 smallest), with the
/// reference C library, in the tagged frame format of [`Packer`].
pub struct Zstd {
    level: i32,
    enc: Option<zstd::bulk::Compressor<'static>>,
    dec: Option<zstd::bulk::Decompressor<'static>>,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Zstd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Zstd({})", self.level)
    }
}

impl Zstd {
    /// A filter at `level` (1..=19).
    pub fn new(level: i32) -> Zstd {
        Zstd { level, enc: None, dec: None, scratch: Vec::new() }
    }
}

impl Packer for Zstd {
    fn name(&self) -> &'static str {
        ZSTD_NAMES[(self.level - 1) as usize]
    }
    fn pack(&mut self, input: &[u8]) -> Option<usize> {
        if self.enc.is_none() {
            self.enc = zstd::bulk::Compressor::new(self.level).ok();
        }
        self.scratch.clear();
        self.scratch.reserve(zstd::zstd_safe::compress_bound(input.len()));
        self.enc.as_mut()?.compress_to_buffer(input, &mut self.scratch).ok()
    }
    fn packed(&self) -> &[u8] {
        &self.scratch
    }
    fn unpack(&mut self, block: &[u8], out: &mut [u8]) -> Option<usize> {
        if self.dec.is_none() {
            self.dec = zstd::bulk::Decompressor::new().ok();
        }
        self.dec.as_mut()?.decompress_to_buffer(block, out).ok()
    }
}

/// The names of the zstd filters, by level.
const ZSTD_NAMES: [&str; 19] = [
    "zstd:1", "zstd:2", "zstd:3", "zstd:4", "zstd:5", "zstd:6", "zstd:7", "zstd:8", "zstd:9", "zstd:10",
    "zstd:11", "zstd:12", "zstd:13", "zstd:14", "zstd:15", "zstd:16", "zstd:17", "zstd:18", "zstd:19",
];

/// The filters this build knows, by name; a filter's id in a chain's compact form (see
/// [`Chain::ids`]) is its place here plus one. (`zstd` alone names `zstd:3`.)
pub const FILTERS: &[&str] = &[
    "double",
    "lz4",
    "zstd:1",
    "zstd:2",
    "zstd:3",
    "zstd:4",
    "zstd:5",
    "zstd:6",
    "zstd:7",
    "zstd:8",
    "zstd:9",
    "zstd:10",
    "zstd:11",
    "zstd:12",
    "zstd:13",
    "zstd:14",
    "zstd:15",
    "zstd:16",
    "zstd:17",
    "zstd:18",
    "zstd:19",
    "aead:aes-256-gcm",
    "aead:chacha20-poly1305",
];

/// The devices as an operator names them (each zstd level is one name here).
pub const DEVICE_NAMES: &[&str] = &[
    "double",
    "lz4",
    "zstd",
    "zstd:LEVEL (1-19)",
    "aead",
    "aead:aes-256-gcm",
    "aead:chacha20-poly1305",
    "profile",
];

/// The devices that only watch one end's traffic (taps, not filters: nothing is agreed
/// with the peer's layer).
pub const TAPS: &[&str] = &["profile"];

/// Filters from outside this build: the layer's plug-in folder. A plug-in's id in a chain's
/// compact form is [`PLUGIN_IDS`] plus its place in the source's list (which must not change
/// while the process lives, nor across its `exec`: the sorted names in the folder).
pub trait FilterSource: Send + Sync {
    /// A new filter of plug-in `name`; why not, when it cannot be had (no such plug-in, a
    /// wrong interface version, a missing symbol, a failed initialisation).
    fn make(&self, name: &str) -> Result<Box<dyn Filter>, String>;
    /// The place of plug-in `name` in the list (0-based), if there is one by that name.
    fn place_of(&self, name: &str) -> Option<u8>;
    /// The name of the plug-in at `place`.
    fn name_at(&self, place: u8) -> Option<&'static str>;
}

/// The first compact-form id of plug-ins (up to 127 of them).
pub const PLUGIN_IDS: u8 = 0x80;

static PLUGINS: std::sync::OnceLock<Box<dyn FilterSource>> = std::sync::OnceLock::new();

/// Installs the source of plug-in filters (once per process; later calls do nothing).
pub fn set_plugins(src: Box<dyn FilterSource>) {
    let _ = PLUGINS.set(src);
}

/// True for a name a plug-in device may have: a lowercase letter, then up to 31 lowercase
/// letters, digits, `_` or `-` (it names a file: `libvmi_dev_NAME.so`).
pub fn plugin_name_ok(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 32
        && b[0].is_ascii_lowercase()
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-')
}

/// The plug-in devices of folder `dir`: the NAMEs of its `libvmi_dev_NAME.so` files, sorted
/// (a plug-in's place in this list is its id in compact forms; a folder that cannot be read
/// has none).
pub fn plugin_names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| {
                let f = e.ok()?.file_name().into_string().ok()?;
                let n = f.strip_prefix("libvmi_dev_")?.strip_suffix(".so")?;
                (plugin_name_ok(n) && FILTERS.iter().all(|b| *b != n)).then(|| n.to_string())
            })
            .collect()
        })
        .unwrap_or_default();
    names.sort_unstable();
    names.truncate(0x7f);
    names
}

/// [`plugin_names`] kept for the life of the process (a source's filters name themselves
/// with `&'static str`; a source is made once per process).
pub fn plugin_names_kept(dir: &std::path::Path) -> Vec<&'static str> {
    plugin_names(dir).into_iter().map(|n| &*Box::leak(n.into_boxed_str())).collect()
}

/// The plug-ins of a folder by name only, for those who show chains but never run them
/// (the agent): every filter made from it is refused.
pub struct PluginNames(pub Vec<&'static str>);

impl FilterSource for PluginNames {
    fn make(&self, name: &str) -> Result<Box<dyn Filter>, String> {
        Err(format!("device {name}: plug-ins are not run here"))
    }
    fn place_of(&self, name: &str) -> Option<u8> {
        self.0.iter().position(|n| *n == name).map(|p| p as u8)
    }
    fn name_at(&self, place: u8) -> Option<&'static str> {
        self.0.get(place as usize).copied()
    }
}

/// A filter by name from the plug-ins; why not.
pub fn plugin_filter(name: &str) -> Result<Box<dyn Filter>, String> {
    match PLUGINS.get() {
        Some(p) => p.make(name),
        None => Err(format!("no device {name} in this build, and no plug-ins here")),
    }
}

/// The filter a name asks for (`zstd` is `zstd:3`; a name this build does not know comes
/// from the plug-ins, if any).
fn filter_named(name: &str) -> Option<Box<dyn Filter>> {
    if let Some(f) = builtin_named(name) {
        return Some(f);
    }
    if plugin_name_ok(name) && FILTERS.iter().all(|n| *n != name) {
        return plugin_filter(name).ok();
    }
    None
}

fn builtin_named(name: &str) -> Option<Box<dyn Filter>> {
    match name {
        "double" => Some(Box::new(Doubler)),
        "lz4" => Some(Box::new(Lz4::default())),
        "zstd" => Some(Box::new(Zstd::new(3))),
        "aead" | "aead:aes-256-gcm" => Some(Box::new(super::aead::Aead::new(super::aead::Suite::Aes256Gcm))),
        "aead:chacha20-poly1305" => {
            Some(Box::new(super::aead::Aead::new(super::aead::Suite::ChaCha20Poly1305)))
        }
        _ => {
            let level: i32 = name.strip_prefix("zstd:")?.parse().ok()?;
            (1..=19).contains(&level).then(|| Box::new(Zstd::new(level)) as Box<dyn Filter>)
        }
    }
}

/// Most filters in one chain's compact form.
pub const MAX_FILTERS: usize = 4;

/// Most encoded payload bytes of one frame on a kernel-TCP link: the receiving layer looks
/// at a whole encoded frame in its socket before it decodes it, so a frame must fit the
/// socket's receive buffer with room to spare.
pub const CODED_MAX: usize = 128 * 1024;

/// The description a compact form names (`""` for none), or `None` for an id this build
/// does not know.
pub fn spec_of_ids(ids: u32) -> Option<String> {
    let mut names = Vec::new();
    for k in 0..MAX_FILTERS {
        let id = (ids >> (8 * k)) as u8;
        if id == 0 {
            if ids >> (8 * k) != 0 {
                return None;
            }
            break;
        }
        if id >= PLUGIN_IDS {
            names.push(PLUGINS.get()?.name_at(id - PLUGIN_IDS)?);
        } else {
            names.push(*FILTERS.get(id as usize - 1)?);
        }
    }
    Some(names.join(","))
}

/// A rule's network in the one form every spelling of it has: host bits cleared, any `/0`
/// the node-wide rule, and an IPv4-mapped IPv6 network the IPv4 network it names (a peer's
/// mapped address is looked up as IPv4). `10.1.2.3/8`, `10.0.0.0/8` and `::ffff:10.0.0.0/104`
/// are one network, so a second rule for it is refused and the rules' text reads back as
/// the same rules.
fn canonical(a: std::net::IpAddr, len: u8) -> (std::net::IpAddr, u8) {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let (a, len) = match a {
        IpAddr::V6(v6) if len >= 96 && v6.to_ipv4_mapped().is_some() => {
            (IpAddr::V4(v6.to_ipv4_mapped().unwrap_or(Ipv4Addr::UNSPECIFIED)), len - 96)
        }
        a => (a, len),
    };
    if len == 0 {
        return (IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
    }
    match a {
        IpAddr::V4(v4) => {
            let m = u32::MAX.checked_shl(32 - len as u32).unwrap_or(0);
            (IpAddr::V4(Ipv4Addr::from(u32::from(v4) & m)), len)
        }
        IpAddr::V6(v6) => {
            let m = u128::MAX.checked_shl(128 - len as u32).unwrap_or(0);
            (IpAddr::V6(Ipv6Addr::from(u128::from(v6) & m)), len)
        }
    }
}

/// A node's default chains (the agent's `chain` setting), as rules: `CHAIN` for every
/// connection, or `NET/LEN=CHAIN` for connections whose peer address is in that network.
/// The most specific rule that matches wins; `none` names the empty chain (a network whose
/// connections keep no filter under a node-wide default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// (network, prefix length, chain description), most specific first; the node-wide rule
    /// is the one of length 0 on the unspecified address.
    rules: Vec<(std::net::IpAddr, u8, String)>,
}

impl Policy {
    /// Parses rules separated by `;` (as the agent passes them to the layers) or given one
    /// by one. A rule whose network, prefix or chain is not valid is an error naming it.
    pub fn parse<'a>(rules: impl IntoIterator<Item = &'a str>) -> Result<Policy, String> {
        let mut p = Policy::default();
        for rule in rules.into_iter().flat_map(|r| r.split(';')).map(str::trim).filter(|r| !r.is_empty()) {
            let (net, chain) = match rule.split_once('=') {
                Some((n, c)) => (Some(n.trim()), c.trim()),
                None => (None, rule),
            };
            let spec = if chain == "none" {
                String::new()
            } else {
                let c = Chain::build(chain).filter(|c| c.ids().is_some()).ok_or_else(|| {
                    format!(
                        "chain rule {rule:?}: no such chain {chain:?} (the devices: {})",
                        DEVICE_NAMES.join(", ")
                    )
                })?;
                c.spec
            };
            let (addr, len) = match net {
                None => (std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0),
                Some(n) => {
                    let (a, l) =
                        n.split_once('/').ok_or_else(|| format!("chain rule {rule:?}: NET/LEN=CHAIN"))?;
                    let a: std::net::IpAddr =
                        a.parse().map_err(|_| format!("chain rule {rule:?}: {a:?} is not an address"))?;
                    let max = if a.is_ipv4() { 32 } else { 128 };
                    let l: u8 = l.parse().ok().filter(|&l| l <= max).ok_or_else(|| {
                        format!("chain rule {rule:?}: {l:?} is not a prefix length (0-{max})")
                    })?;
                    canonical(a, l)
                }
            };
            if p.rules.iter().any(|(a, l, _)| (*a, *l) == (addr, len)) {
                return Err(format!("chain rule {rule:?}: a second rule for the same network"));
            }
            p.rules.push((addr, len, spec));
        }
        p.rules.sort_by_key(|r| std::cmp::Reverse(r.1));
        Ok(p)
    }

    /// The rules in the form [`parse`](Self::parse) reads, separated by `;`.
    pub fn to_text(&self) -> String {
        let one = |(a, l, c): &(std::net::IpAddr, u8, String)| {
            let c = if c.is_empty() { "none" } else { c.as_str() };
            if *l == 0 && a.is_unspecified() {
                c.to_string()
            } else {
                format!("{a}/{l}={c}")
            }
        };
        self.rules.iter().map(one).collect::<Vec<_>>().join(";")
    }

    /// The chain for a connection to (or from) `peer`: the most specific rule that matches;
    /// `None` when no rule does.
    pub fn chain_for(&self, peer: std::net::IpAddr) -> Option<&str> {
        let v4 = |a: std::net::IpAddr| match a {
            std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map(std::net::IpAddr::V4).unwrap_or(a),
            a => a,
        };
        let peer = v4(peer);
        self.rules
            .iter()
            .find(|(net, len, _)| {
                if *len == 0 {
                    return true;
                }
                match (net, peer) {
                    (std::net::IpAddr::V4(n), std::net::IpAddr::V4(p)) => {
                        let m = u32::MAX.checked_shl(32 - *len as u32).unwrap_or(0);
                        u32::from(*n) & m == u32::from(p) & m
                    }
                    (std::net::IpAddr::V6(n), std::net::IpAddr::V6(p)) => {
                        let m = u128::MAX.checked_shl(128 - *len as u32).unwrap_or(0);
                        u128::from(*n) & m == u128::from(p) & m
                    }
                    _ => false,
                }
            })
            .map(|(_, _, c)| c.as_str())
    }

    /// True when there is no rule.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }
}

/// The filters of a chain, in order (the first encodes first and decodes last).
#[derive(Debug, Default)]
pub struct Chain {
    /// Its description.
    pub spec: String,
    filters: Vec<Box<dyn Filter>>,
}

impl Chain {
    /// Builds the chain a description names; `None` if a filter is unknown here, or for
    /// more than one keyed filter (they would share one key and one nonce per frame).
    pub fn build(spec: &str) -> Option<Chain> {
        let mut filters: Vec<Box<dyn Filter>> = Vec::new();
        for name in spec.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            filters.push(filter_named(name)?);
        }
        if filters.iter().filter(|f| f.keyed()).count() > 1 {
            return None;
        }
        let spec = filters.iter().map(|f| f.name()).collect::<Vec<_>>().join(",");
        Some(Chain { spec, filters })
    }

    /// The compact form: one byte per filter (its id in [`FILTERS`]), first filter in the
    /// low byte; `None` for a chain of more than [`MAX_FILTERS`] filters.
    pub fn ids(&self) -> Option<u32> {
        if self.filters.len() > MAX_FILTERS {
            return None;
        }
        let mut ids = 0u32;
        for (k, f) in self.filters.iter().enumerate() {
            let id = match FILTERS.iter().position(|n| *n == f.name()) {
                Some(at) => at as u32 + 1,
                None => {
                    let place = PLUGINS.get()?.place_of(f.name())?;
                    u32::from(PLUGIN_IDS.checked_add(place).filter(|&id| id < 0xff)?)
                }
            };
            ids |= id << (8 * k);
        }
        Some(ids)
    }

    /// The chain a compact form names.
    pub fn from_ids(ids: u32) -> Option<Chain> {
        Chain::build(&spec_of_ids(ids)?)
    }

    /// True for the chain with no filter.
    pub fn is_empty(&self) -> bool {
        self.filters.is_empty()
    }

    /// True when a filter of the chain needs a key (its offer and answer carry key shares).
    pub fn keyed(&self) -> bool {
        self.filters.iter().any(|f| f.keyed())
    }

    /// True when the chain of compact form `ids` needs a key.
    pub fn ids_keyed(ids: u32) -> bool {
        (0..MAX_FILTERS).any(|k| {
            let id = (ids >> (8 * k)) as u8 as usize;
            id > 0 && FILTERS.get(id - 1).is_some_and(|n| n.starts_with("aead:"))
        })
    }

    /// Gives the chain's keyed filter its key.
    pub fn set_key(&mut self, key: &[u8; 32]) {
        for f in self.filters.iter_mut().filter(|f| f.keyed()) {
            f.set_key(key);
        }
    }

    /// Most bytes `n` payload bytes encode to.
    pub fn max_out(&self, n: usize) -> usize {
        self.filters.iter().fold(n, |n, f| f.max_out(n))
    }

    /// The most payload bytes whose encoding fits `room`.
    pub fn fit(&self, room: usize) -> usize {
        let mut n = room;
        while n > 0 && self.max_out(n) > room {
            n = (n * room / self.max_out(n)).min(n - 1);
        }
        n
    }

    /// Encodes a frame's payload.
    pub fn encode(&mut self, seq: u64, input: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(seq, input, &mut out);
        out
    }

    /// True when every filter of a chain that has some would leave `input` as it is (see
    /// [`Filter::passes`]): the frame may then go plain. Never for a chain with a keyed
    /// filter.
    pub fn passes(&mut self, input: &[u8]) -> bool {
        !self.filters.is_empty() && self.filters.iter_mut().all(|f| f.passes(input))
    }

    /// Encodes a frame's payload into `out` (emptied first; a buffer used again saves the
    /// allocation of one per frame).
    pub fn encode_into(&mut self, seq: u64, input: &[u8], out: &mut Vec<u8>) {
        out.clear();
        let n = self.filters.len();
        if n == 0 {
            out.extend_from_slice(input);
            return;
        }
        let mut cur: Option<Vec<u8>> = None;
        for (k, f) in self.filters.iter_mut().enumerate() {
            let src = cur.as_deref().unwrap_or(input);
            if k + 1 == n {
                f.encode(seq, input.len(), src, out);
            } else {
                let mut o = Vec::new();
                f.encode(seq, input.len(), src, &mut o);
                cur = Some(o);
            }
        }
    }

    /// True for a chain of one filter whose frames start with a tag byte that is `0` when
    /// the frame's bytes follow as they were (the compressors): such a frame can be read
    /// straight into the program's buffer once its tag is taken.
    pub fn ids_store_plain(ids: u32) -> bool {
        let id = ids as usize;
        ids > 0 && ids <= 0xff && FILTERS.get(id - 1).is_some_and(|n| *n == "lz4" || n.starts_with("zstd:"))
    }

    /// Decodes a frame's payload.
    pub fn decode(&mut self, seq: u64, input: Vec<u8>) -> Result<Vec<u8>, DecodeError> {
        let mut cur = input;
        for f in self.filters.iter_mut().rev() {
            match f.decode_in_place(seq, &mut cur) {
                Some(r) => r?,
                None => {
                    let mut out = Vec::new();
                    f.decode(seq, &cur, &mut out)?;
                    cur = out;
                }
            }
        }
        Ok(cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubling_round_trips_and_refuses_garbage() {
        let mut c = Chain::build(" double , double").unwrap();
        assert_eq!(c.spec, "double,double");
        let e = c.encode(0, b"ab");
        assert_eq!(e, b"aaaabbbb");
        assert_eq!(c.decode(0, e).unwrap(), b"ab");
        assert!(c.decode(0, b"aab".to_vec()).is_err());
        assert!(c.decode(0, b"abab".to_vec()).is_err());
        assert_eq!(c.fit(100), 25);
        assert!(Chain::build("brotli").is_none());
        assert!(Chain::build("zstd:20").is_none() && Chain::build("zstd:0").is_none());
        assert_eq!(Chain::build("zstd").unwrap().spec, "zstd:3");
        assert!(Chain::build("").unwrap().is_empty());
    }

    #[test]
    fn lz4_packs_what_compresses_and_stores_what_does_not() {
        let mut c = Chain::build("lz4").unwrap();
        let text: Vec<u8> =
            b"the quick brown fox jumps over the lazy dog. ".iter().copied().cycle().take(16384).collect();
        let e = c.encode(7, &text);
        assert_eq!(e[0], 1, "text compresses");
        assert!(e.len() < text.len() / 4, "{}", e.len());
        assert_eq!(c.decode(7, e.clone()).unwrap(), text);
        assert_eq!(c.encode(7, &text), e, "the same frame encodes the same way");
        // Noise (a xorshift stream) does not: stored behind its tag.
        let mut x = 0x9e3779b97f4a7c15u64;
        let noise: Vec<u8> = (0..16384)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let e = c.encode(0, &noise);
        assert_eq!((e[0], e.len()), (0, noise.len() + 1));
        assert_eq!(c.decode(0, e).unwrap(), noise);
        assert_eq!(c.encode(0, b"short")[0], 0);
        assert_eq!(c.max_out(100), 101);
        assert_eq!(c.fit(CODED_MAX), CODED_MAX - 1);
        // A hostile peer: bad tags, lengths that lie, truncated blocks, a huge claim.
        let good = c.encode(0, &text);
        for bad in [
            vec![],
            vec![2, 0],
            vec![1, 0, 0],
            {
                let mut b = good.clone();
                b[1] ^= 1;
                b
            },
            good[..good.len() - 3].to_vec(),
            vec![1, 0xff, 0xff, 0xff, 0xff, 0x10],
        ] {
            assert!(c.decode(0, bad.clone()).is_err(), "{bad:?}");
        }
        // lz4 after double: the doubled frame compresses to less than the original.
        let mut c = Chain::build("double,lz4").unwrap();
        let e = c.encode(0, &text);
        assert!(e.len() < text.len() / 4);
        assert_eq!(c.decode(0, e).unwrap(), text);
    }

    #[test]
    fn zstd_packs_text_at_every_level_and_refuses_garbage() {
        let text: Vec<u8> =
            b"the quick brown fox jumps over the lazy dog. ".iter().copied().cycle().take(16384).collect();
        for level in [1, 3, 19] {
            let mut c = Chain::build(&format!("zstd:{level}")).unwrap();
            let e = c.encode(0, &text);
            assert_eq!(e[0], 1);
            assert!(e.len() < text.len() / 8, "level {level}: {}", e.len());
            assert_eq!(c.encode(0, &text), e, "the same frame encodes the same way");
            assert_eq!(c.decode(0, e.clone()).unwrap(), text);
            let mut bad = e.clone();
            bad[1] ^= 1;
            assert!(c.decode(0, bad).is_err(), "a length that lies");
            assert!(c.decode(0, e[..e.len() - 2].to_vec()).is_err(), "a truncated frame");
            assert!(c.decode(0, vec![1, 0, 0, 0x20, 0, 0x28, 0xb5]).is_err(), "a huge claim");
        }
        let c = Chain::build("zstd:9").unwrap();
        assert_eq!(Chain::from_ids(c.ids().unwrap()).unwrap().spec, "zstd:9");
    }

    #[test]
    fn policies_pick_the_most_specific_network() {
        let p = Policy::parse(["lz4", "10.78.1.0/24=zstd", "10.78.1.7/32=none", "fd00::/8=double"]).unwrap();
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert_eq!(p.chain_for(ip("10.78.0.2")), Some("lz4"));
        assert_eq!(p.chain_for(ip("10.78.1.2")), Some("zstd:3"));
        assert_eq!(p.chain_for(ip("10.78.1.7")), Some(""));
        assert_eq!(p.chain_for(ip("::ffff:10.78.1.9")), Some("zstd:3"));
        assert_eq!(p.chain_for(ip("fd12::1")), Some("double"));
        assert_eq!(Policy::parse([p.to_text().as_str()]).unwrap(), p);
        let q = Policy::parse(["10.0.0.0/8=lz4"]).unwrap();
        assert_eq!(q.chain_for(ip("192.168.0.1")), None);
        assert!(Policy::parse([""]).unwrap().is_empty());
        let r = Policy::parse(["::ffff:10.78.1.0/120=lz4", "10.78.1.9/24=zstd"]);
        assert!(r.unwrap_err().contains("second rule"), "one network, spelled twice");
        for text in ["::/0=", "::/0=lz4", "10.1.2.3/0=lz4", "10.1.2.3/8=lz4", "::ffff:10.9.9.9/104=lz4"] {
            let p = Policy::parse([text]).unwrap();
            assert_eq!(Policy::parse([p.to_text().as_str()]).unwrap(), p, "{text} -> {}", p.to_text());
        }
        assert_eq!(Policy::parse(["10.1.2.3/8=lz4"]).unwrap().to_text(), "10.0.0.0/8=lz4");
        let m = Policy::parse(["::ffff:10.78.1.0/120=lz4"]).unwrap();
        assert_eq!(m.chain_for(ip("10.78.1.4")), Some("lz4"));
        for bad in [
            "brotli",
            "10.0.0.0=lz4",
            "10.0.0.0/33=lz4",
            "ten/8=lz4",
            "lz4;zstd",
            "fd00::/129=lz4",
            "lz4;::/0=zstd",
        ] {
            assert!(Policy::parse([bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn compact_forms_round_trip() {
        let c = Chain::build("double,double").unwrap();
        assert_eq!(c.ids(), Some(0x0101));
        assert_eq!(spec_of_ids(0x0101).as_deref(), Some("double,double"));
        assert_eq!(Chain::from_ids(0).unwrap().spec, "");
        assert_eq!(spec_of_ids(0x0100), None, "a gap in the list");
        assert_eq!(spec_of_ids(0xf0), None, "an unknown id");
        assert!(Chain::build("double,double,double,double,double").unwrap().ids().is_none());
    }
}
