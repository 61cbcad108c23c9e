//! `proxy_fuzz::fuzz::api_protobuf` under libFuzzer: a panic or a hang is a finding.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| proxy_fuzz::fuzz::api_protobuf(data));
