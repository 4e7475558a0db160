#![no_main]
//! libFuzzer entry of `hubsync::fuzz::commit_frame` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("commit_frame").expect("a known target");
    (target.run)(data);
});
