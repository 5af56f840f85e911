//! A sink that keeps sent bytes in memory and hands them back on receive: a chain can be
//! tested with no network at all.

use crate::irb::{Buf, Device, Dispatch, Disposition, Irb, IrbError, IrbKind};
use std::collections::VecDeque;

/// Loops sends back to receives, up to `capacity` buffered bytes.
#[derive(Debug)]
pub struct LoopbackSink {
    queue: VecDeque<u8>,
    capacity: usize,
}

impl LoopbackSink {
    /// A loopback holding at most `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        LoopbackSink { queue: VecDeque::new(), capacity }
    }
    /// Bytes waiting.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }
}

impl Device for LoopbackSink {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn dispatch<'a>(&mut self, irb: Irb<'a>, _cx: &mut Dispatch<'_>) -> Disposition<'a> {
        match (irb.kind(), &irb.buf) {
            (IrbKind::Send, Buf::Out(data)) => {
                let n = data.len().min(self.capacity - self.queue.len());
                if n == 0 && !data.is_empty() {
                    return irb.complete(Err(IrbError::WouldBlock));
                }
                self.queue.extend(&data[..n]);
                irb.complete(Ok(n))
            }
            (IrbKind::Receive, Buf::In(_)) => {
                let mut irb = irb;
                let Buf::In(space) = &mut irb.buf else { unreachable!() };
                let n = space.len().min(self.queue.len());
                if n == 0 && !space.is_empty() {
                    return irb.complete(Err(IrbError::WouldBlock));
                }
                for (d, s) in space.iter_mut().zip(self.queue.drain(..n)) {
                    *d = s;
                }
                irb.complete(Ok(n))
            }
            (IrbKind::Connect | IrbKind::Disconnect | IrbKind::Attach | IrbKind::Detach, _) => {
                irb.complete(Ok(0))
            }
            _ => Disposition::Forward(irb),
        }
    }
}
