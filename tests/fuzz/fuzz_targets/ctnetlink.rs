//! `proxy_fuzz::fuzz::ctnetlink` under libFuzzer: a panic or a hang is a finding.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| proxy_fuzz::fuzz::ctnetlink(data));
