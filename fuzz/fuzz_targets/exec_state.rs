//! The send and receive halves of a connection cross `exec` as bytes, field by field
//! (`TxState::to_bytes`, `RxState::to_bytes`, hex in the `VMI_INHERIT` record, which anything
//! may set): reading any bytes never panics, and a state that reads writes bytes that read
//! back to the same. The input is cut or padded with zeros to each state's length, so every
//! run reaches the checks of the fields rather than the length test.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::reliability::{RxState, TxState};

fn exact(data: &[u8], len: usize) -> Vec<u8> {
    let mut b = data.to_vec();
    b.resize(len, 0);
    b
}

fuzz_target!(|data: &[u8]| {
    assert!(TxState::from_bytes(data).is_none() || data.len() == TxState::BYTES);
    if let Some(tx) = TxState::from_bytes(&exact(data, TxState::BYTES)) {
        let b = tx.to_bytes();
        let back = TxState::from_bytes(&b).expect("a state it wrote");
        assert_eq!(back.to_bytes(), b);
    }
    if let Some(rx) = RxState::from_bytes(&exact(data, RxState::BYTES)) {
        let b = rx.to_bytes();
        let back = RxState::from_bytes(&b).expect("a state it wrote");
        assert_eq!(back.to_bytes(), b);
    }
});
