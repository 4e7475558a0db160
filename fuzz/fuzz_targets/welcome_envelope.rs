#![no_main]
//! libFuzzer entry of `hubsync::fuzz::welcome_envelope` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("welcome_envelope").expect("a known target");
    (target.run)(data);
});
