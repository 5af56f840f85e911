//! The agent reads statistics tables written by processes it does not trust: parsing any
//! bytes never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::stats::SlotView;

fuzz_target!(|data: &[u8]| {
    let _ = SlotView::parse(data);
    let _ = SlotView::table_slots(data, data.len());
    let _ = SlotView::table_in_use(data, data.len());
});
