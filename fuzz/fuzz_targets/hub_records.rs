#![no_main]
//! libFuzzer entry of `hubsync::fuzz::hub_records` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("hub_records").expect("a known target");
    (target.run)(data);
});
