#![no_main]
//! libFuzzer entry of `hubsync::fuzz::auth_exchange` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("auth_exchange").expect("a known target");
    (target.run)(data);
});
