#![no_main]
//! libFuzzer entry of `hubsync::fuzz::rendezvous` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("rendezvous").expect("a known target");
    (target.run)(data);
});
