//! Entry points for fuzzing: each parser that reads untrusted bytes, without its I/O. Used by
//! the cargo-fuzz targets in `tests/fuzz/` and by the bounded mutation test
//! (`proxy-agent/tests/fuzz_smoke.rs`) that `cargo xtask test` runs. A finding is a panic (or
//! a hang); errors are the expected outcome for most inputs.

use std::path::Path;

use crate::source::manifests::{self, ManifestError};

/// A manifests file (`source::manifests` document loading). The loader turns a panic inside
/// the YAML library into an error for the agent's sake; for fuzzing that is still a finding.
pub fn manifests(bytes: &[u8]) {
    let loaded = manifests::load_bytes(Path::new("fuzz.yaml"), bytes);
    for error in &loaded.errors {
        if let ManifestError::Panic { message, .. } = error {
            panic!("the manifests loader panicked: {message}");
        }
    }
}

/// A KubeProxyConfiguration file (`config::parse`: size/nesting limits, strict decoding).
pub fn config(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let _ = crate::config::parse(text);
}

/// One ctnetlink dump datagram (`conntrack::netlink`).
pub fn ctnetlink(bytes: &[u8]) {
    let _ = crate::conntrack::netlink::parse_dump_datagram(bytes);
}

/// One SOCK_DIAG dump datagram (`dataplane::ebpf::sockdiag`).
pub fn sockdiag(bytes: &[u8]) {
    let _ = crate::dataplane::ebpf::sockdiag::parse_dump_datagram(bytes);
}
