#![no_main]
//! libFuzzer entry of `hubsync::fuzz::tunnel_handshake` (see that function).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let target = hubsync::fuzz::target("tunnel_handshake").expect("a known target");
    (target.run)(data);
});
