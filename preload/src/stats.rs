//! This process's statistics table: a memfd holding one slot per virtual connection
//! (layout in `substrate::stats`), handed to the node agent so `vmictl` can read it without
//! asking the program anything. Survives `fork` (shared mapping); slots are claimed with
//! compare-and-swap, so parent and child allocate safely.

use crate::sys;
use crate::sys::shared::SharedMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering::*};
use std::sync::OnceLock;
use substrate::devices::Counters;
use substrate::stats::{
    encode_addr, off, HIGH, SLOT_SIZE, TABLE_BYTES, TABLE_HEADER, TABLE_MAGIC, TABLE_SLOTS,
};

/// The mapped table (its memfd stays open, close-on-exec, as the layer's own descriptor
/// `OWN_STATS`, protected from the program's closes).
pub struct Table {
    map: SharedMap,
    hint: AtomicU32,
}

static TABLE: OnceLock<Option<Table>> = OnceLock::new();

fn create() -> Option<Table> {
    let (map, fd) = SharedMap::memfd(c"vmi-stats", TABLE_BYTES, libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)?;
    // The agent maps it and must never find it shorter than it was (its reads would fault).
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    if sys::fd::fcntl(fd, libc::F_ADD_SEALS, seals as libc::c_ulong) != 0 {
        sys::fd::close(fd);
        return None;
    }
    let fd = crate::ownfd::move_high(fd);
    map.u64(0).store(TABLE_MAGIC, Relaxed);
    map.u32(8).store(TABLE_SLOTS as u32, Relaxed);
    map.u32(12).store(crate::pid() as u32, Relaxed);
    crate::ownfd::protect(crate::ownfd::OWN_STATS, fd);
    Some(Table { map, hint: AtomicU32::new(0) })
}

/// The table, created on first use.
pub fn table() -> Option<&'static Table> {
    TABLE.get_or_init(create).as_ref()
}

/// A connection's slot in the table.
#[derive(Clone, Copy)]
pub struct Slot {
    map: &'static SharedMap,
    /// Offset of the slot in the table.
    at: usize,
}

/// What a slot describes.
pub struct SlotInfo {
    /// GID.
    pub gid: u128,
    /// Local address.
    pub local: SocketAddr,
    /// Peer address.
    pub peer: SocketAddr,
    /// True when this side connected.
    pub active: bool,
    /// Soft window.
    pub window: u64,
}

impl Table {
    /// Claims a free slot and fills it.
    pub fn alloc(&'static self, info: &SlotInfo) -> Option<Slot> {
        let m = &self.map;
        let start = self.hint.load(Relaxed) as usize;
        for k in 0..TABLE_SLOTS {
            let i = (start + k) % TABLE_SLOTS;
            let at = TABLE_HEADER + i * SLOT_SIZE;
            let used = m.u32(at + off::USED);
            if used.load(Relaxed) != 0 || used.compare_exchange(0, 2, Acquire, Relaxed).is_err() {
                continue;
            }
            // Lowest free slots first: the table's pages are touched only as far as the most
            // connections open at once, and the agent reads only that far (`HIGH`).
            self.hint.store(((i + 1) % TABLE_SLOTS) as u32, Relaxed);
            m.u32(HIGH).fetch_max(i as u32 + 1, Relaxed);
            // We own the slot (state 2 = being filled); readers look after the release below.
            for w in (4..SLOT_SIZE).step_by(4) {
                m.u32(at + w).store(0, Relaxed);
            }
            m.u32(at + off::PID).store(crate::pid() as u32, Relaxed);
            m.store_bytes(at + off::GID, &info.gid.to_le_bytes());
            m.store_bytes(at + off::LOCAL, &encode_addr(&info.local));
            m.store_bytes(at + off::PEER, &encode_addr(&info.peer));
            m.u32(at + off::SUBSTRATE).store(1, Relaxed);
            m.u32(at + off::ACTIVE).store(info.active as u32, Relaxed);
            m.u64(at + off::WINDOW).store(info.window, Relaxed);
            m.u64(at + off::CREATED_MS).store(sys::unix_ms(), Relaxed);
            used.store(1, Release);
            return Some(Slot { map: m, at });
        }
        None
    }
}

impl Slot {
    /// The slot's counters (shared with the agent).
    pub fn counters(&self) -> &'static Counters {
        self.map.atomics(self.at + off::COUNTERS)
    }

    /// Records the replay-buffer fill.
    pub fn set_unacked(&self, n: u64) {
        self.map.u64(self.at + off::UNACKED).store(n, Relaxed);
    }

    /// Records the process using the connection (one relaxed load when unchanged).
    #[inline]
    pub fn set_pid(&self, pid: i32) {
        let a = self.map.u32(self.at + off::PID);
        if a.load(Relaxed) != pid as u32 {
            a.store(pid as u32, Relaxed);
        }
    }

    /// Records the errno the connection failed with.
    pub fn set_error(&self, e: i32) {
        self.map.u32(self.at + off::ERROR).store(e as u32, Relaxed);
    }

    /// Records the physical link's addresses (at set-up and after each failover).
    pub fn set_link(&self, local: &SocketAddr, peer: &SocketAddr) {
        for (o, a) in [(off::LINK_LOCAL, local), (off::LINK_PEER, peer)] {
            let b = encode_addr(a);
            for (i, w) in b.chunks_exact(4).enumerate() {
                self.map
                    .u32(self.at + o + 4 * i)
                    .store(u32::from_ne_bytes(w.try_into().expect("4")), Relaxed);
            }
        }
    }

    /// Records the link state: rebuilding (`true`) or up; counts a rebuild when it ends.
    pub fn set_relinking(&self, on: bool, rebuilt: bool) {
        self.map.u32(self.at + off::LINK_STATE).store(on as u32, Relaxed);
        if rebuilt {
            self.map.u32(self.at + off::FAILOVERS).fetch_add(1, Relaxed);
        }
    }

    /// Records the chain of filters on what this side sends (`send`) or receives, in its
    /// compact form.
    pub fn set_chain(&self, ids: u32, send: bool) {
        let o = if send { off::SEND_CHAIN } else { off::RECV_CHAIN };
        let before = self.map.u32(self.at + o).swap(ids, Relaxed);
        if send && before != ids {
            // When it changed (for `vmictl status` and the time a device load takes).
            let born = self.map.u64(self.at + off::CREATED_MS).load(Relaxed);
            let d = sys::unix_ms().saturating_sub(born).clamp(1, u32::MAX as u64) as u32;
            self.map.u32(self.at + off::SEND_CHAIN_AT).store(d, Relaxed);
        }
    }

    /// Records our chain offer waiting for its answer (its compact form), or none.
    pub fn set_offer(&self, ids: Option<u32>) {
        let v = ids.map_or(0, |i| substrate::stats::OFFERED | i);
        self.map.u32(self.at + off::SEND_OFFER).store(v, Relaxed);
    }

    /// Records the substrate carrying the bytes (1 tcp, 2 shm).
    pub fn set_substrate(&self, code: u32) {
        self.map.u32(self.at + off::SUBSTRATE).store(code, Relaxed);
    }

    /// Takes back a slot this connection freed (an exec that failed): false if another
    /// connection claimed it meanwhile.
    pub fn reclaim(&self) -> bool {
        self.map.u32(self.at + off::USED).compare_exchange(0, 1, AcqRel, Relaxed).is_ok()
    }

    /// Frees the slot.
    pub fn free(&self) {
        self.map.u32(self.at + off::USED).store(0, Release);
        if let Some(t) = TABLE.get().and_then(|t| t.as_ref()) {
            t.hint.fetch_min(((self.at - TABLE_HEADER) / SLOT_SIZE) as u32, Relaxed);
        }
    }
}
