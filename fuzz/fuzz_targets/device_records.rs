#![no_main]
//! libFuzzer entry of `hubsync::fuzz::device_records` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("device_records").expect("a known target");
    (target.run)(data);
});
