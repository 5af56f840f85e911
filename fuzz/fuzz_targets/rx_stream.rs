//! A hostile peer's byte stream, read in chunks of fuzzer-chosen sizes through the receive
//! half: it never panics, never delivers more payload than arrived, and once it reports an
//! error the connection is over.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::reliability::RxState;

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    // First byte picks read sizes; the rest is the link.
    let seed = data[0] as usize;
    let link = &data[1..];
    let mut rx = RxState::new();
    let mut pos = 0;
    let mut delivered = 0usize;
    let mut i = 0usize;
    while pos < link.len() {
        i += 1;
        let n = 1 + (seed * 31 + i * 17) % 97;
        let mut app = vec![0u8; n];
        let plan = rx.plan_read(n);
        let (got, r) = rx.read_from(plan, &link[pos..], &mut app);
        pos += got;
        match r {
            Ok(r) => {
                assert!(r.payload <= got);
                delivered += r.payload;
            }
            Err(_) => return,
        }
    }
    assert!(delivered <= link.len());
    assert_eq!(rx.delivered as usize, delivered);
});
