#![no_main]
//! libFuzzer entry of `hubsync::fuzz::ledger_fold` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("ledger_fold").expect("a known target");
    (target.run)(data);
});
