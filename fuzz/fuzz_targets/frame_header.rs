//! Any 24 bytes: decoding never panics, and what decodes encodes back to the same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::wire::frame::{FrameHeader, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_LEN {
        return;
    }
    let b: [u8; HEADER_LEN] = data[..HEADER_LEN].try_into().unwrap();
    if let Ok(h) = FrameHeader::decode(&b) {
        assert_eq!(h.encode(), b);
    }
});
