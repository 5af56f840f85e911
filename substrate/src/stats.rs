//! The statistics table a process under the layer shares with its node agent: a file (a
//! memfd handed to the agent) holding a header and one fixed-size slot per virtual
//! connection. The layer writes slots with atomics; the agent maps the file read-only and
//! reads them with [`SlotView::parse`], which needs no `unsafe` and trusts nothing.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Magic number at the start of a table.
pub const TABLE_MAGIC: u64 = 0x766d_6973_7461_7432; // "vmistat2"
/// Bytes before the first slot.
pub const TABLE_HEADER: usize = 64;
/// Bytes per slot.
pub const SLOT_SIZE: usize = 256;
/// Slots per table.
pub const TABLE_SLOTS: usize = 65536;
/// Header offset of a u32: every slot in use lies below this index (the layer takes the
/// lowest free slot, so readers need not touch the rest of the table).
pub const HIGH: usize = 16;
/// Total table size in bytes.
pub const TABLE_BYTES: usize = TABLE_HEADER + SLOT_SIZE * TABLE_SLOTS;

/// Byte offsets of a slot's fields (all little endian, naturally aligned).
pub mod off {
    /// u32: 0 free, 1 in use.
    pub const USED: usize = 0;
    /// u32: process id of the process that made the connection.
    pub const PID: usize = 4;
    /// u32: the chain of filters on what this side sends, compact form (0: none).
    pub const SEND_CHAIN: usize = 8;
    /// u32: the chain of filters on what this side receives, compact form (0: none).
    pub const RECV_CHAIN: usize = 12;
    /// u128: the GID.
    pub const GID: usize = 16;
    /// 20 bytes: local address (u16 family 4/6, u16 port, 16 bytes IP).
    pub const LOCAL: usize = 32;
    /// 20 bytes: peer address.
    pub const PEER: usize = 52;
    /// u32: substrate code (1 = tcp, 2 = shm).
    pub const SUBSTRATE: usize = 72;
    /// u32: 1 = this side connected, 0 = accepted.
    pub const ACTIVE: usize = 76;
    /// u64: window (soft) in bytes.
    pub const WINDOW: usize = 80;
    /// u64 ×4: bytes sent, bytes received, messages sent, messages received.
    pub const COUNTERS: usize = 88;
    /// u64: unacknowledged bytes in the replay buffer.
    pub const UNACKED: usize = 120;
    /// u64: creation time, ms since the Unix epoch.
    pub const CREATED_MS: usize = 128;
    /// u32: errno the connection failed with (0 = healthy).
    pub const ERROR: usize = 136;
    /// 20 bytes: local address of the physical link now (changes on failover).
    pub const LINK_LOCAL: usize = 140;
    /// 20 bytes: peer address of the physical link now.
    pub const LINK_PEER: usize = 160;
    /// u32: how many times the link was rebuilt.
    pub const FAILOVERS: usize = 180;
    /// u32: 0 = link up, 1 = rebuilding the link.
    pub const LINK_STATE: usize = 184;
    /// u32: when the chain of what this side sends last changed, in ms after
    /// [`CREATED_MS`] (0: never).
    pub const SEND_CHAIN_AT: usize = 188;
    /// u32: this side's chain offer for what it sends, waiting for the peer's answer (or,
    /// on shared memory, for the next TCP link): [`OFFERED`] | its compact form; 0 none.
    pub const SEND_OFFER: usize = 192;
}

/// `off::SEND_OFFER`: an offer waits (the compact form 0 is the empty chain, an offer too).
pub const OFFERED: u32 = 1 << 31;

/// Encodes an address into the 20-byte slot form.
pub fn encode_addr(a: &SocketAddr) -> [u8; 20] {
    let mut b = [0u8; 20];
    match a.ip() {
        IpAddr::V4(ip) => {
            b[0] = 4;
            b[4..8].copy_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            b[0] = 6;
            b[4..20].copy_from_slice(&ip.octets());
        }
    }
    b[2..4].copy_from_slice(&a.port().to_le_bytes());
    b
}

/// Decodes the 20-byte slot form of an address.
pub fn decode_addr(b: &[u8]) -> Option<SocketAddr> {
    let port = u16::from_le_bytes([b[2], b[3]]);
    let ip = match b[0] {
        4 => IpAddr::V4(Ipv4Addr::new(b[4], b[5], b[6], b[7])),
        6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[4..20]).ok()?)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// One slot as the agent reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotView {
    /// Process that made the connection.
    pub pid: u32,
    /// GID.
    pub gid: u128,
    /// Local address.
    pub local: SocketAddr,
    /// Peer address.
    pub peer: SocketAddr,
    /// Substrate name.
    pub substrate: &'static str,
    /// The chain of filters on what this side sends (`""`: none; `"?"`: unknown here).
    pub send_chain: String,
    /// The chain of filters on what this side receives.
    pub recv_chain: String,
    /// True when this side connected.
    pub active: bool,
    /// Soft window.
    pub window: u64,
    /// Bytes sent.
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
    /// Messages sent.
    pub msgs_sent: u64,
    /// Messages received.
    pub msgs_received: u64,
    /// Bytes in the replay buffer.
    pub unacked: u64,
    /// Creation time (ms since the epoch).
    pub created_ms: u64,
    /// errno the connection failed with, 0 when healthy.
    pub error: u32,
    /// The physical link's local address now (the program's view is `local`).
    pub link_local: Option<SocketAddr>,
    /// The physical link's peer address now.
    pub link_peer: Option<SocketAddr>,
    /// Times the link was rebuilt.
    pub failovers: u32,
    /// True while the link is being rebuilt.
    pub relinking: bool,
    /// When the chain of what this side sends last changed (ms since the epoch; 0: never).
    pub send_chain_ms: u64,
    /// The chain this side offered for what it sends and the peer has not answered yet
    /// (on shared memory: offered once the connection is on TCP again); `None`: no offer.
    pub send_offer: Option<String>,
}

/// Substrate name for a code.
pub fn substrate_name(code: u32) -> &'static str {
    match code {
        1 => "tcp",
        2 => "shm",
        _ => "unknown",
    }
}

/// The description of a chain's compact form, `"?"` for one this build does not know.
pub fn chain_name(ids: u32) -> String {
    crate::connection::chain::spec_of_ids(ids).unwrap_or_else(|| "?".into())
}

impl SlotView {
    /// Reads a slot; `None` if it is free or does not make sense.
    pub fn parse(s: &[u8]) -> Option<SlotView> {
        if s.len() < SLOT_SIZE {
            return None;
        }
        let u32at = |o: usize| u32::from_le_bytes(s[o..o + 4].try_into().expect("4"));
        let u64at = |o: usize| u64::from_le_bytes(s[o..o + 8].try_into().expect("8"));
        if u32at(off::USED) != 1 {
            return None;
        }
        Some(SlotView {
            pid: u32at(off::PID),
            gid: u128::from_le_bytes(s[off::GID..off::GID + 16].try_into().expect("16")),
            local: decode_addr(&s[off::LOCAL..off::LOCAL + 20])?,
            peer: decode_addr(&s[off::PEER..off::PEER + 20])?,
            substrate: substrate_name(u32at(off::SUBSTRATE)),
            send_chain: chain_name(u32at(off::SEND_CHAIN)),
            recv_chain: chain_name(u32at(off::RECV_CHAIN)),
            active: u32at(off::ACTIVE) == 1,
            window: u64at(off::WINDOW),
            bytes_sent: u64at(off::COUNTERS),
            bytes_received: u64at(off::COUNTERS + 8),
            msgs_sent: u64at(off::COUNTERS + 16),
            msgs_received: u64at(off::COUNTERS + 24),
            unacked: u64at(off::UNACKED),
            created_ms: u64at(off::CREATED_MS),
            error: u32at(off::ERROR),
            link_local: decode_addr(&s[off::LINK_LOCAL..off::LINK_LOCAL + 20]),
            link_peer: decode_addr(&s[off::LINK_PEER..off::LINK_PEER + 20]),
            failovers: u32at(off::FAILOVERS),
            relinking: u32at(off::LINK_STATE) == 1,
            send_chain_ms: match u32at(off::SEND_CHAIN_AT) {
                0 => 0,
                d => u64at(off::CREATED_MS).saturating_add(d as u64),
            },
            send_offer: match u32at(off::SEND_OFFER) {
                v if v & OFFERED != 0 => Some(chain_name(v & !OFFERED)),
                _ => None,
            },
        })
    }

    /// Checks a table's header (its first [`TABLE_HEADER`] bytes) against the table's total
    /// size; returns the slot count.
    pub fn table_slots(header: &[u8], total_len: usize) -> Option<usize> {
        if header.len() < TABLE_HEADER || u64::from_le_bytes(header[..8].try_into().ok()?) != TABLE_MAGIC {
            return None;
        }
        let n = u32::from_le_bytes(header[8..12].try_into().ok()?) as usize;
        (TABLE_HEADER + n.checked_mul(SLOT_SIZE)? <= total_len).then_some(n)
    }

    /// The slots a reader must look at: those below the header's high mark, at most
    /// [`SlotView::table_slots`].
    pub fn table_in_use(header: &[u8], total_len: usize) -> Option<usize> {
        let n = Self::table_slots(header, total_len)?;
        let high = u32::from_le_bytes(header.get(HIGH..HIGH + 4)?.try_into().ok()?) as usize;
        Some(high.min(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(slots: u32, high: u32) -> Vec<u8> {
        let mut h = vec![0u8; TABLE_HEADER];
        h[..8].copy_from_slice(&TABLE_MAGIC.to_le_bytes());
        h[8..12].copy_from_slice(&slots.to_le_bytes());
        h[HIGH..HIGH + 4].copy_from_slice(&high.to_le_bytes());
        h
    }

    #[test]
    fn readers_stop_at_the_high_mark() {
        assert_eq!(SlotView::table_in_use(&header(65536, 12), TABLE_BYTES), Some(12));
        assert_eq!(SlotView::table_in_use(&header(65536, 0), TABLE_BYTES), Some(0));
        // A mark past the table (a confused or hostile writer) is bounded by it.
        assert_eq!(SlotView::table_in_use(&header(4, u32::MAX), TABLE_HEADER + 4 * SLOT_SIZE), Some(4));
        // A table bigger than its file is refused.
        assert_eq!(SlotView::table_in_use(&header(5, 1), TABLE_HEADER + 4 * SLOT_SIZE), None);
        let mut bad = header(4, 1);
        bad[0] ^= 1;
        assert_eq!(SlotView::table_in_use(&bad, TABLE_BYTES), None);
    }
}
