#![no_main]
//! libFuzzer entry of `hubsync::fuzz::ledger_entry` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("ledger_entry").expect("a known target");
    (target.run)(data);
});
