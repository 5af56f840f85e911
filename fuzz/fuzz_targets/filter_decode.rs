//! A hostile peer's coded payload: the first byte picks a chain of filters (a compact form
//! of up to two filters this build knows), the rest is a frame's payload as the peer sent it.
//! Decoding never panics and never yields more than the largest frame; whatever a chain
//! encodes, it decodes back to the same bytes (a sealing filter under a fixed key).
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::connection::chain::{Chain, FILTERS};
use substrate::wire::frame::MAX_PAYLOAD;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let n = FILTERS.len() as u32 + 1;
    let (a, b) = (pick as u32 % n, (pick as u32 / n) % n);
    let ids = if a == 0 { 0 } else { a | if b == 0 { 0 } else { b << 8 } };
    let Some(mut chain) = Chain::from_ids(ids) else { return };
    // (A sealing filter under a fixed key: the peer's records are forgeries unless they
    // carry its tag.)
    chain.set_key(&[0x42; 32]);
    if let Ok(out) = chain.decode(7, rest.to_vec()) {
        assert!(out.len() <= MAX_PAYLOAD as usize);
    }
    let coded = chain.encode(7, rest);
    assert!(coded.len() <= chain.max_out(rest.len()));
    assert_eq!(chain.decode(7, coded).expect("its own encoding"), rest);
});
