//! Tickets: identities for this process's next connections to a listener, which the node
//! agent agreed ahead with the listener's agent (its `tickets` module), or expects itself
//! when the listener is on this node. A `connect` that holds one binds the socket to the
//! ticket's source port and is virtual from then on without asking the agent: the
//! connection's set-up waits for no one but the kernel, as a native one does. The agent
//! hears of the connection later (`Msg::Used` on the event channel, within 50 ms, with
//! others: one wake-up of the agent for many).
//!
//! Books are kept per listener that answered a `connect` as virtual on another node, and
//! filled (a request to the agent) when they run low, at most once per [`ASK_EVERY_NS`] when
//! the agent had none to give. Tickets are used only within the time the agent said, and
//! ones that cannot be used (their port taken, too old) go back with the next request.

use crate::sys;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Mutex, MutexGuard};
use substrate::wire::agent::Msg;

/// Tickets asked for at once.
const BATCH: u16 = 32;

/// A book with this many tickets or fewer is filled at the next `connect` there.
const LOW: usize = 8;

/// How long a listener for which the agent had no tickets is not asked again.
const ASK_EVERY_NS: u64 = 1_000_000_000;

/// Most listeners with a book (the oldest-asked go first beyond it).
const MAX_BOOKS: usize = 64;

/// One ticket: source port, GID, secret, and until when it may be used (`sys::now_ns`).
#[derive(Clone, Copy)]
struct Entry {
    port: u16,
    gid: u128,
    secret: u128,
    until_ns: u64,
}

#[derive(Default)]
struct Book {
    /// The agent session the tickets were given in (`agent::session`).
    session: u64,
    /// The listener's window and its node's agents, and the source address the tickets
    /// were announced with, from the last answer.
    window: u64,
    src: Option<std::net::IpAddr>,
    addrs: Vec<SocketAddr>,
    tickets: VecDeque<Entry>,
    /// Not asked before this time.
    next_ask_ns: u64,
}

#[derive(Default)]
struct Books {
    by_dst: BTreeMap<SocketAddr, Book>,
    /// Tickets that will not be used, or whose connection closed, told with the next
    /// request (their ports are free for new tickets then).
    returned: Vec<u128>,
    /// Tickets whose port a socket holds in TIME_WAIT (a bind failed there, or this side
    /// closed the connection first), told with the next request.
    busy: Vec<u128>,
    /// Tickets whose connection is open.
    open: std::collections::HashSet<u128>,
}

static BOOKS: Mutex<Option<Books>> = Mutex::new(None);

/// Until when (`sys::now_ns`) no tickets are asked for: the agent did not know the request
/// (a version before tickets, which closes the socket after its error answer).
static NOT_ASKED_UNTIL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How long an agent that does not know tickets is not asked again.
const UNKNOWN_FOR_NS: u64 = 60_000_000_000;

fn lock() -> MutexGuard<'static, Option<Books>> {
    BOOKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A ticket taken for a connection.
pub struct Ticket {
    /// The source address to bind: the one the tickets were announced with.
    pub src: SocketAddr,
    /// The connection's GID.
    pub gid: u128,
    /// Its secret.
    pub secret: u128,
    /// The listener's window.
    pub window: u64,
    /// The listener's node's agents.
    pub addrs: Vec<SocketAddr>,
}

/// A `connect` to `dst` was answered virtual by the agent (the listener on another node or
/// on this one): its connections get a book (filled at the next `connect` there).
pub fn note_virtual(dst: SocketAddr) {
    let mut g = lock();
    let b = g.get_or_insert_with(Books::default);
    if b.by_dst.contains_key(&dst) {
        return;
    }
    if b.by_dst.len() >= MAX_BOOKS {
        // (The one asked longest ago goes; its tickets come back.)
        if let Some(old) = b.by_dst.iter().min_by_key(|(_, k)| k.next_ask_ns).map(|(d, _)| *d) {
            if let Some(k) = b.by_dst.remove(&old) {
                b.returned.extend(k.tickets.iter().map(|t| t.gid));
            }
        }
    }
    b.by_dst.insert(dst, Book::default());
}

/// Takes a ticket for a connection to `dst`, filling the book first when it runs low; `None`
/// when there is no book for `dst` or no ticket to be had.
pub fn take(dst: SocketAddr) -> Option<Ticket> {
    let now = sys::now_ns();
    if now < NOT_ASKED_UNTIL.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    let ask = {
        let mut g = lock();
        let b = g.as_mut()?;
        let book = b.by_dst.get_mut(&dst)?;
        if book.session != crate::agent::session() {
            // Given by an agent that is gone (or before this process was restored from a
            // checkpoint): the agent now does not know them, and may give their ports again.
            book.tickets.clear();
            book.session = crate::agent::session();
        }
        // Too old to be used safely: back to the agent.
        while book.tickets.front().is_some_and(|t| t.until_ns <= now) {
            if let Some(t) = book.tickets.pop_front() {
                b.returned.push(t.gid);
            }
        }
        (book.tickets.len() <= LOW && now >= book.next_ask_ns).then(|| {
            book.next_ask_ns = now + ASK_EVERY_NS;
            (std::mem::take(&mut b.returned), std::mem::take(&mut b.busy))
        })
    };
    if let Some((returned, busy)) = ask {
        fill(dst, returned, busy, now);
    }
    let mut g = lock();
    let book = g.as_mut()?.by_dst.get_mut(&dst)?;
    let src = book.src?;
    let t = book.tickets.pop_front()?;
    Some(Ticket {
        src: SocketAddr::new(src, t.port),
        gid: t.gid,
        secret: t.secret,
        window: book.window,
        addrs: book.addrs.clone(),
    })
}

/// Asks the agent for tickets to `dst` (outside the lock: a request waits for the agent).
fn fill(dst: SocketAddr, returned: Vec<u128>, busy: Vec<u128>, now: u64) {
    let m = Msg::Tickets { dst, want: BATCH, window: crate::config::window(), returned, busy };
    let answer = crate::agent::request(&m);
    if let Some(Msg::Error { reason }) = &answer {
        crate::log::info(format_args!(
            "the node agent does not give tickets ({reason}: an older version?); connections ask it one by one"
        ));
        NOT_ASKED_UNTIL.store(now + UNKNOWN_FOR_NS, std::sync::atomic::Ordering::Relaxed);
        crate::agent::drop_socket();
        return;
    }
    let mut g = lock();
    let Some(b) = g.as_mut() else { return };
    let Some(book) = b.by_dst.get_mut(&dst) else {
        // (Dropped meanwhile: what came goes back.)
        if let Some(Msg::TicketBook { tickets, .. }) = answer {
            b.returned.extend(tickets.iter().map(|t| t.1));
        }
        return;
    };
    match answer {
        Some(Msg::TicketBook { dst: d, src, window, addrs, use_ms, tickets })
            if d == dst && src.is_ipv4() =>
        {
            let until_ns = now + u64::from(use_ms) * 1_000_000;
            if book.session != crate::agent::session() {
                book.tickets.clear();
                book.session = crate::agent::session();
            }
            if book.src.is_some_and(|s| s != src.ip()) {
                // (Announced from another address now: the older ones are no good.)
                b.returned.extend(book.tickets.drain(..).map(|t| t.gid));
            }
            book.src = Some(src.ip());
            book.window = window;
            book.addrs = addrs;
            book.tickets.extend(tickets.into_iter().map(|(port, gid, secret)| Entry {
                port,
                gid,
                secret,
                until_ns,
            }));
            // More may be asked as soon as these run low.
            book.next_ask_ns = now;
        }
        Some(Msg::TicketBook { tickets, .. }) => {
            // (An answer about another listener: never used.)
            b.returned.extend(tickets.iter().map(|t| t.1));
        }
        _ => {}
    }
}

/// The listener at `dst` is gone or moved (its node's agent said so): its tickets go back,
/// and its next connections ask the agent.
pub fn drop_book(dst: SocketAddr) {
    if let Some(b) = lock().as_mut() {
        if let Some(k) = b.by_dst.remove(&dst) {
            b.returned.extend(k.tickets.iter().map(|t| t.gid));
            crate::log::debug(format_args!("listener {dst} is gone or moved: its tickets are dropped"));
        }
    }
}

/// Every ticket is dropped (the process is about to be checkpointed: it may be restored on
/// another node, whose agent gave none of them).
pub fn forget() {
    if let Some(b) = lock().as_mut() {
        for k in b.by_dst.values_mut() {
            k.tickets.clear();
        }
        b.open.clear();
    }
}

/// A ticket taken by [`take`] that was not used: it goes back to the agent with the next
/// request, `busy` when its port is held by another socket (the agent then does not give it
/// again for a minute).
pub fn give_back(gid: u128, busy: bool) {
    if let Some(b) = lock().as_mut() {
        if busy {
            b.busy.push(gid);
        } else {
            b.returned.push(gid);
        }
    }
}

/// The connection of a ticket was made (the agent hears of it from the caller, `Msg::Used`).
pub fn opened(gid: u128) {
    if let Some(b) = lock().as_mut() {
        if b.open.len() < 1 << 16 {
            b.open.insert(gid);
        }
    }
}

/// The program closed connection `gid` for good: if a ticket made it, the agent hears with
/// the next request for tickets that its port is free, or, when this side closed first
/// (`time_wait`: its socket stays in TIME_WAIT a minute), that it is not. (The release itself
/// reaches the agent later, in a batch.)
pub fn closed(gid: u128, time_wait: bool) {
    if let Some(b) = lock().as_mut() {
        if b.open.remove(&gid) {
            if time_wait {
                b.busy.push(gid);
            } else {
                b.returned.push(gid);
            }
        }
    }
}

thread_local! {
    static FORK_GUARD: std::cell::RefCell<Option<MutexGuard<'static, Option<Books>>>> =
        const { std::cell::RefCell::new(None) };
}

/// fork, prepare: the books are held, so that no other thread is inside them.
pub fn before_fork() {
    let g = lock();
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// fork, parent side.
pub fn after_fork_parent() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
}

/// fork, child side: the tickets are the parent's (the agent gave them to it, and each is
/// used once): the child starts with none.
pub fn after_fork_child() {
    FORK_GUARD.with(|f| {
        if let Some(mut g) = f.borrow_mut().take() {
            *g = None;
        }
    });
}
