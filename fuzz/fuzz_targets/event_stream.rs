//! Any bytes on a layer's event channel, read by the agent's buffered reader in reads of
//! any size: it never panics, and yields the messages a one-at-a-time decoding of the same
//! bytes yields, in order, up to the first malformed or unfinished one.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use substrate::wire::agent::Msg;

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else { return };
    // The reference: one message after the other.
    let mut want = Vec::new();
    let mut at = 0;
    while data.len() >= at + 4 {
        let Ok(n) = Msg::body_len([data[at], data[at + 1], data[at + 2], data[at + 3]]) else { break };
        if data.len() < at + 4 + n {
            break;
        }
        match Msg::decode(&data[at + 4..at + 4 + n]) {
            Ok(m) => want.push(m),
            Err(_) => break,
        }
        at += 4 + n;
    }
    // The same bytes in writes of `split + 1` bytes or more (the reader's reads follow them or take
    // several at once).
    let Ok((a, b)) = UnixStream::pair() else { return };
    // (At most 64 writes: each small write costs the socket's buffer far more than its
    // bytes, and the reader reads only after the last one.)
    let step = (usize::from(split) + 1).max(data.len().div_ceil(64));
    for c in data.chunks(step) {
        if (&a).write_all(c).is_err() {
            return;
        }
    }
    drop(a);
    let mut r = agent::wire::MsgReader::default();
    let mut got = Vec::new();
    while let Ok((m, fd)) = r.next(b.as_raw_fd()) {
        assert!(fd.is_none());
        got.push(m);
    }
    assert_eq!(got, want);
});
