//! A new image reads its virtual connections from the `VMI_INHERIT` variable of its
//! environment (anything may set it): parsing any text never panics, and a record that
//! parses encodes to a record that parses to the same.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::handover::ExecRecord;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    for r in text.split(';') {
        let _ = ExecRecord::names(r);
        if let Some(rec) = ExecRecord::parse(r) {
            let again = rec.encode().expect("a parsed record encodes");
            let back = ExecRecord::parse(&again).expect("an encoded record parses");
            assert_eq!(back.encode(), Some(again));
        }
    }
});
