#![no_main]
//! libFuzzer entry of `hubsync::fuzz::wire_client_frame` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("wire_client_frame").expect("a known target");
    (target.run)(data);
});
