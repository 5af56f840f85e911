//! I/O request blocks (IRBs) and the device chain they travel down.
//!
//! Every operation on a virtual connection is an [`Irb`]: attach, detach, connect,
//! disconnect, connect-request, disconnect-request, send, receive, alert, or a kind this
//! build does not know ([`IrbKind::Other`]). A [`Chain`] hands the IRB to its devices in
//! order. Each device either forwards it ([`Disposition::Forward`], possibly transformed),
//! completes it ([`Irb::complete`], which consumes it: an IRB cannot be completed twice), or
//! pends it ([`Irb::pend`]) and completes it later through the chain
//! ([`Chain::complete_pending`]). A device must forward kinds it does not handle; the
//! default [`Device::dispatch`] does. Once an IRB is complete, the devices it passed run their
//! completion routines ([`Device::on_complete`]) from the bottom up, as NT's I/O manager does;
//! that is where a filter sees how many bytes really moved.
//!
//! A connection has a send chain and a receive chain (each used under its own lock), so a
//! blocked receive never holds up a send.

use std::fmt;

/// What an IRB asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrbKind {
    /// A device was put on the chain.
    Attach,
    /// A device is being taken off the chain.
    Detach,
    /// Open the connection's link.
    Connect,
    /// Close it.
    Disconnect,
    /// The peer asks to connect.
    ConnectRequest,
    /// The peer asks to disconnect.
    DisconnectRequest,
    /// Move application bytes toward the peer.
    Send,
    /// Fill an application buffer with the peer's bytes.
    Receive,
    /// Something happened that devices may want to know (link down, resync).
    Alert,
    /// A kind a newer device defines; devices that do not know it pass it on.
    Other(u16),
}

/// Why an IRB failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrbError {
    /// The operation would block (non-blocking caller).
    WouldBlock,
    /// An OS error from the sink, as errno.
    Os(i32),
    /// The peer broke the protocol; the connection is closed.
    Protocol,
    /// No device on the chain handled this kind.
    Unhandled,
    /// The link under the connection failed: the connection waits for a new one (the
    /// caller retries once it is in place; a program never sees this).
    LinkDown,
}

impl fmt::Display for IrbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IrbError::WouldBlock => write!(f, "would block"),
            IrbError::Os(e) => write!(f, "os error {e}"),
            IrbError::Protocol => write!(f, "protocol error"),
            IrbError::Unhandled => write!(f, "no device handled the request"),
            IrbError::LinkDown => write!(f, "link down"),
        }
    }
}

/// Result of a completed IRB: bytes moved, or why not.
pub type IrbResult = Result<usize, IrbError>;

/// The buffer an IRB carries.
#[derive(Debug)]
pub enum Buf<'a> {
    /// No data.
    None,
    /// Bytes to send.
    Out(&'a [u8]),
    /// Space to receive into.
    In(&'a mut [u8]),
}

/// An I/O request block.
#[derive(Debug)]
#[must_use = "an IRB must be forwarded, completed or pended"]
pub struct Irb<'a> {
    kind: IrbKind,
    /// The buffer.
    pub buf: Buf<'a>,
    /// Operation flags (for send/receive: the caller's `MSG_*` flags).
    pub flags: i32,
    /// Sink-specific handle (for the kernel-TCP sink: the socket descriptor used).
    pub handle: i64,
    /// The caller's context for the sinks (the layer: the link generation the call runs on,
    /// plus one; 0 for none).
    pub ctx: u64,
}

/// A completed IRB. Only [`Irb::complete`] and [`PendedIrb::complete`] make one.
#[derive(Debug)]
#[must_use]
pub struct Completion {
    kind: IrbKind,
    result: IrbResult,
}

impl Completion {
    /// What was asked.
    pub fn kind(&self) -> IrbKind {
        self.kind
    }
    /// What came of it.
    pub fn result(&self) -> IrbResult {
        self.result
    }
}

/// Names a pended IRB inside its chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(u64);

/// An IRB a device keeps to complete later. It owns its data (the caller's buffer is gone by
/// then): bytes to send, or the size of the buffer to fill.
#[derive(Debug)]
#[must_use = "a pended IRB must be completed"]
pub struct PendedIrb {
    kind: IrbKind,
    /// Bytes to send (copied when pended).
    pub data: Vec<u8>,
    /// For a receive: how many bytes the caller wanted.
    pub want: usize,
    /// The IRB's flags.
    pub flags: i32,
    ticket: Ticket,
}

impl PendedIrb {
    /// What is asked.
    pub fn kind(&self) -> IrbKind {
        self.kind
    }
    /// Its ticket.
    pub fn ticket(&self) -> Ticket {
        self.ticket
    }
    /// Completes the pended IRB (consumes it).
    pub fn complete(self, result: IrbResult) -> (Ticket, Completion) {
        (self.ticket, Completion { kind: self.kind, result })
    }
}

impl<'a> Irb<'a> {
    /// A new IRB of `kind` with no buffer.
    pub fn new(kind: IrbKind) -> Self {
        Irb { kind, buf: Buf::None, flags: 0, handle: -1, ctx: 0 }
    }
    /// A send IRB.
    pub fn send(data: &'a [u8], flags: i32) -> Self {
        Irb { kind: IrbKind::Send, buf: Buf::Out(data), flags, handle: -1, ctx: 0 }
    }
    /// A receive IRB.
    pub fn receive(space: &'a mut [u8], flags: i32) -> Self {
        Irb { kind: IrbKind::Receive, buf: Buf::In(space), flags, handle: -1, ctx: 0 }
    }
    /// Sets the sink handle.
    pub fn with_handle(mut self, handle: i64) -> Self {
        self.handle = handle;
        self
    }
    /// Sets the caller's context.
    pub fn with_ctx(mut self, ctx: u64) -> Self {
        self.ctx = ctx;
        self
    }
    /// What is asked.
    pub fn kind(&self) -> IrbKind {
        self.kind
    }
    /// Completes the IRB (consumes it, so it cannot be completed twice).
    pub fn complete(self, result: IrbResult) -> Disposition<'a> {
        Disposition::Done(Completion { kind: self.kind, result })
    }
    /// Keeps the IRB to complete later; `ticket_seed` comes from [`Dispatch::ticket`].
    pub fn pend(self, ticket: Ticket) -> PendedIrb {
        let (data, want) = match self.buf {
            Buf::None => (Vec::new(), 0),
            Buf::Out(b) => (b.to_vec(), b.len()),
            Buf::In(b) => (Vec::new(), b.len()),
        };
        PendedIrb { kind: self.kind, data, want, flags: self.flags, ticket }
    }
}

/// What a device did with an IRB.
#[derive(Debug)]
pub enum Disposition<'a> {
    /// Pass it (maybe changed) to the next device.
    Forward(Irb<'a>),
    /// It is complete.
    Done(Completion),
    /// The device kept it; it completes later under this ticket.
    Pended(Ticket),
}

/// Context given to a device with each IRB.
pub struct Dispatch<'c> {
    next_ticket: &'c mut u64,
}

impl Dispatch<'_> {
    /// A fresh ticket for pending the IRB at hand.
    pub fn ticket(&mut self) -> Ticket {
        *self.next_ticket += 1;
        Ticket(*self.next_ticket)
    }
}

/// A filter or a sink on a chain.
pub trait Device: Send {
    /// Short name, shown by `vmictl`.
    fn name(&self) -> &'static str;
    /// Handles an IRB. The default passes it on, as every device must for kinds it does not
    /// know.
    fn dispatch<'a>(&mut self, irb: Irb<'a>, _cx: &mut Dispatch<'_>) -> Disposition<'a> {
        Disposition::Forward(irb)
    }
    /// Completion routine: runs, bottom up, for each device an IRB passed, once it completed.
    fn on_complete(&mut self, _kind: IrbKind, _result: &IrbResult) {}
}

/// What submitting an IRB gave.
#[derive(Debug)]
pub enum Outcome {
    /// Completed now.
    Complete(Completion),
    /// Pended by a device; [`Chain::complete_pending`] finishes it.
    Pending(Ticket),
}

/// An ordered list of devices, top (nearest the application) first.
#[derive(Default)]
pub struct Chain {
    devices: Vec<Box<dyn Device>>,
    pending: Vec<(Ticket, usize)>,
    next_ticket: u64,
}

impl fmt::Debug for Chain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.devices.iter().map(|d| d.name())).finish()
    }
}

impl Chain {
    /// An empty chain.
    pub fn new() -> Self {
        Chain::default()
    }

    /// Device names, top first.
    pub fn names(&self) -> Vec<&'static str> {
        self.devices.iter().map(|d| d.name()).collect()
    }

    /// How many devices are attached.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// No device is attached.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Puts `dev` at position `at` (0 = top) and sends it an attach IRB.
    pub fn attach(&mut self, at: usize, mut dev: Box<dyn Device>) -> IrbResult {
        let at = at.min(self.devices.len());
        let mut cx = Dispatch { next_ticket: &mut self.next_ticket };
        let r = match dev.dispatch(Irb::new(IrbKind::Attach), &mut cx) {
            Disposition::Done(c) => c.result,
            _ => Ok(0),
        };
        if r.is_ok() {
            for p in &mut self.pending {
                if p.1 >= at {
                    p.1 += 1;
                }
            }
            self.devices.insert(at, dev);
        }
        r
    }

    /// Takes the device named `name` off the chain (after a detach IRB), if no IRB is pended
    /// in it.
    pub fn detach(&mut self, name: &str) -> Option<Box<dyn Device>> {
        let i = self.devices.iter().position(|d| d.name() == name)?;
        if self.pending.iter().any(|p| p.1 == i) {
            return None;
        }
        let mut dev = self.devices.remove(i);
        for p in &mut self.pending {
            if p.1 > i {
                p.1 -= 1;
            }
        }
        let mut cx = Dispatch { next_ticket: &mut self.next_ticket };
        if let Disposition::Pended(_) = dev.dispatch(Irb::new(IrbKind::Detach), &mut cx) {
            // A device may not keep its own detach request; treat it as done.
        }
        Some(dev)
    }

    /// Sends an IRB down the chain.
    pub fn submit(&mut self, irb: Irb<'_>) -> Outcome {
        let mut irb = irb;
        let n = self.devices.len();
        for i in 0..n {
            let mut cx = Dispatch { next_ticket: &mut self.next_ticket };
            match self.devices[i].dispatch(irb, &mut cx) {
                Disposition::Forward(next) => irb = next,
                Disposition::Done(c) => {
                    self.unwind(i, &c);
                    return Outcome::Complete(c);
                }
                Disposition::Pended(t) => {
                    self.pending.push((t, i));
                    return Outcome::Pending(t);
                }
            }
        }
        // Fell off the end: no device handled it.
        let c = Completion { kind: irb.kind, result: Err(IrbError::Unhandled) };
        self.unwind(n, &c);
        Outcome::Complete(c)
    }

    /// Finishes an IRB a device pended; runs the completion routines above that device.
    pub fn complete_pending(&mut self, ticket: Ticket, c: Completion) -> Option<Completion> {
        let pos = self.pending.iter().position(|p| p.0 == ticket)?;
        let (_, dev) = self.pending.swap_remove(pos);
        self.unwind(dev, &c);
        Some(c)
    }

    /// Number of IRBs pended somewhere on the chain.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    fn unwind(&mut self, below: usize, c: &Completion) {
        for d in self.devices[..below].iter_mut().rev() {
            d.on_complete(c.kind, &c.result);
        }
    }
}
