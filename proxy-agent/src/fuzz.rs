//! Entry points for fuzzing: each parser that reads untrusted bytes, without its I/O. Used by
//! the cargo-fuzz targets in `tests/fuzz/` and by the bounded mutation test
//! (`proxy-agent/tests/fuzz_smoke.rs`) that `cargo xtask test` runs. A finding is a panic (or
//! a hang); errors are the expected outcome for most inputs.

use std::path::Path;

use crate::source::manifests::{self, ManifestError};

/// Set by `cargo xtask test`'s fuzz replay: a panic inside the YAML library that the loader
/// contained (the file reported as unreadable, the agent unharmed) is not a finding there.
/// serde_yaml 0.9 is final and has more such panics than the text checks in `yaml.rs` catch;
/// any code change shifts what a fixed-seed run explores, so CI would turn red on whichever
/// one it met first. By hand (`cargo xtask fuzz`) they are findings.
pub const CONTAINED_PANICS_OK: &str = "KPR_FUZZ_CONTAINED_PANICS_OK";

/// A manifests file (`source::manifests` document loading). The loader turns a panic inside
/// the YAML library into an error for the agent's sake; for fuzzing that is still a finding,
/// unless [`CONTAINED_PANICS_OK`] is set.
pub fn manifests(bytes: &[u8]) {
    let contained_ok = std::env::var_os(CONTAINED_PANICS_OK).is_some();
    if contained_ok {
        // libFuzzer's panic hook aborts at the panic itself, before the loader's catch_unwind
        // can contain it: put the default hook back. A panic that escapes still aborts (the
        // fuzz harness aborts on any unwind out of the target).
        static DEFAULT_HOOK: std::sync::Once = std::sync::Once::new();
        DEFAULT_HOOK.call_once(|| drop(std::panic::take_hook()));
    }
    let loaded = manifests::load_bytes(Path::new("fuzz.yaml"), bytes);
    if contained_ok {
        return;
    }
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

/// One ctnetlink dump datagram (`kernel_conntrack::netlink`).
pub fn ctnetlink(bytes: &[u8]) {
    let _ = crate::kernel_conntrack::netlink::parse_dump_datagram(bytes);
}

/// One SOCK_DIAG dump datagram (`dataplane::ebpf::sockdiag`).
pub fn sockdiag(bytes: &[u8]) {
    let _ = crate::dataplane::ebpf::sockdiag::parse_dump_datagram(bytes);
}
