//! Any bytes as an agent message: decoding never panics, and what decodes re-encodes to the
//! same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::wire::agent::Msg;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Msg::decode_framed(data) {
        assert_eq!(m.encode(), data);
        assert_eq!(Msg::decode_framed(&m.encode()), Ok(m));
    }
    let _ = Msg::decode(data);
});
