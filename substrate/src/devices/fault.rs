//! A filter that fails or shortens IRBs on purpose, from a seeded generator, so tests can
//! reach error paths deterministically.

use crate::irb::{Buf, Device, Dispatch, Disposition, Irb, IrbError, IrbKind};

/// Injects faults into sends and receives.
#[derive(Debug)]
pub struct FaultInjector {
    state: u64,
    /// Chance, in 1/1000, that a send or receive fails with `WouldBlock`.
    pub fail_per_mille: u32,
    /// Chance, in 1/1000, that a send or receive is cut to a random shorter length.
    pub short_per_mille: u32,
    /// IRBs failed so far.
    pub failed: u64,
}

impl FaultInjector {
    /// A fault injector with a seed.
    pub fn new(seed: u64, fail_per_mille: u32, short_per_mille: u32) -> Self {
        FaultInjector { state: seed | 1, fail_per_mille, short_per_mille, failed: 0 }
    }

    fn next(&mut self) -> u64 {
        // xorshift64*
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

impl Device for FaultInjector {
    fn name(&self) -> &'static str {
        "fault"
    }

    fn dispatch<'a>(&mut self, mut irb: Irb<'a>, _cx: &mut Dispatch<'_>) -> Disposition<'a> {
        if !matches!(irb.kind(), IrbKind::Send | IrbKind::Receive) {
            return Disposition::Forward(irb);
        }
        if (self.next() % 1000) < self.fail_per_mille as u64 {
            self.failed += 1;
            return irb.complete(Err(IrbError::WouldBlock));
        }
        if (self.next() % 1000) < self.short_per_mille as u64 {
            let r = self.next() as usize;
            irb.buf = match std::mem::replace(&mut irb.buf, Buf::None) {
                Buf::Out(b) if b.len() > 1 => Buf::Out(&b[..1 + r % (b.len() - 1)]),
                Buf::In(b) if b.len() > 1 => {
                    let n = 1 + r % (b.len() - 1);
                    Buf::In(&mut b[..n])
                }
                other => other,
            };
        }
        Disposition::Forward(irb)
    }
}
