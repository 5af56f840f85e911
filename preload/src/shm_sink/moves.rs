//! A live connection leaving shared memory for TCP, and bytes owed to the ring after it
//! came back.

use super::*;

impl ShmLink {
    /// Moves the connection off this memory: the stream positions the rings reached become
    /// the TCP halves' (what the peer's program has not read of ours joins the replay ring,
    /// what ours read of the peer's is delivered), the peer is told (`moving`), and the
    /// memory and descriptors are let go. The caller holds both halves' locks.
    pub fn demote(&self, mem: crate::shm::ConnMem) -> Result<(), String> {
        if matches!(self.mode(), Mode::Tcp | Mode::Moved) {
            return Ok(());
        }
        let c = mem.conn();
        self.head().moving.store(1, Release);
        let (tx_base, rx_base) = self.bases;
        // (The caller holds both locks.)
        let r = mem.with_tx_ring_held(|tx, ring| {
            c.with_rx_held(|rx| {
                // What our program read of the peer's stream.
                rx.delivered = rx.delivered.max(rx_base + self.rx.consumed());
                // Ours: written to the ring, and how much of it the peer's program took.
                let (p, got) = (self.tx.produced(), self.tx.consumed());
                if got > p || p - got > self.tx.capacity() as u64 {
                    return Err("the ring's positions are impossible".to_string());
                }
                let (sent, peer_has) = (tx_base + p, tx_base + got);
                if tx.next_seq < sent {
                    // (Below `next_seq`, the TCP ring still holds a replay not finished here.)
                    if tx.next_seq < peer_has {
                        tx.next_seq = peer_has;
                        tx.acked = peer_has;
                    }
                    let from = tx.next_seq;
                    let mut bytes = vec![0u8; (sent - from) as usize];
                    self.tx.copy_written(from - tx_base, &mut bytes).map_err(|e| e.to_string())?;
                    substrate::reliability::ring_write(ring, tx.ring_pos(from), &bytes);
                    tx.next_seq = sent;
                }
                tx.acked = tx.acked.max(peer_has).min(tx.next_seq);
                tx.wire_seq = tx.next_seq;
                if tx.unacked() > tx.window {
                    return Err(format!("{} unacknowledged bytes do not fit the replay ring", tx.unacked()));
                }
                rx.peer_ack = rx.peer_ack.max(tx.acked);
                c.delivered.store(rx.delivered, Release);
                c.peer_ack.fetch_max(tx.acked, AcqRel);
                c.wire_hi.fetch_max(tx.next_seq, AcqRel);
                c.unacked.store(tx.unacked(), Relaxed);
                Ok(())
            })
        });
        self.mode.store(3, Release);
        // A peer waiting for room wakes and finds `moving`.
        sys::futex_wake(self.rx.space_word(), i32::MAX);
        sys::futex_wake(self.tx.space_word(), i32::MAX);
        self.let_go_fds();
        if let Some(p) = &self.path {
            // An offer nobody took (already gone when it was taken).
            sys::fd::unlink(p);
        }
        // The memory goes (a checkpoint must not find it): zero pages take its place, so a
        // racing reader of the positions sees an empty ring.
        self.map.forget_contents();
        r
    }

    /// A link moved onto shared memory replays what the peer did not deliver (from the TCP
    /// replay ring) into the ring first, then the end of stream if the program shut its
    /// side down. True when nothing is left to push. The caller holds the tx lock.
    pub fn push_replay(&self, mem: crate::shm::ConnMem, fd: i32) -> Result<bool, IrbError> {
        let c = mem.conn();
        mem.with_tx_ring_held(|tx, ring| {
            let mut wrote = false;
            while tx.replaying() {
                let room = self.tx.writable().map_err(|_| corrupt())? as u64;
                let n = (tx.next_seq - tx.wire_seq).min(room) as usize;
                if n == 0 {
                    break;
                }
                let (a, b) = substrate::reliability::ring_slices(ring, tx.ring_pos(tx.wire_seq), n);
                for part in [a, b] {
                    let w = self.tx.write(part).map_err(|_| corrupt())?;
                    tx.wire_seq += w as u64;
                    if w < part.len() {
                        break;
                    }
                }
                wrote = true;
            }
            let done = !tx.replaying();
            if done && c.fin_owed.load(Acquire) != 0 {
                self.tx.close();
                c.fin_owed.store(0, Release);
                wrote = true;
            }
            if wrote && self.tx.after_write() == Bell::Ring {
                self.ring(fd);
            }
            Ok(done)
        })
    }

    /// True once the peer's program closed the connection (its layer can no longer take a
    /// rebuilt link: moving now would lose what it wrote and we did not read yet).
    pub fn peer_closed(&self) -> bool {
        matches!(self.mode(), Mode::Shm | Mode::Pending) && self.tx.reader_gone()
    }

    /// Sets the stream offsets of the rings' first bytes (a rebuilt link's dialer learns
    /// the peer's only after its offer was made).
    pub fn set_bases(&mut self, b: (u64, u64)) {
        self.bases = b;
    }

    /// Tells the peer (and this process's other threads) that the connection is leaving
    /// this memory; wakes whoever waits for room, and with a bell each way (through our
    /// socket `fd` and the peer's), whoever sleeps waiting for bytes.
    pub fn set_moving(&self, fd: i32) {
        if matches!(self.mode(), Mode::Tcp | Mode::Moved) {
            return;
        }
        self.head().moving.store(1, Release);
        sys::futex_wake(self.rx.space_word(), i32::MAX);
        sys::futex_wake(self.tx.space_word(), i32::MAX);
        bell(fd);
        // (The accepting side may not have taken the peer's socket yet: taken now, so that a
        // thread of ours asleep on our socket in a receive wakes too.)
        let p = self.peer_socket(fd);
        if p >= 0 {
            bell(p);
        }
    }
}
