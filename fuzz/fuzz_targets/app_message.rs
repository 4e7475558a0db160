#![no_main]
//! libFuzzer entry of `hubsync::fuzz::app_message` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("app_message").expect("a known target");
    (target.run)(data);
});
