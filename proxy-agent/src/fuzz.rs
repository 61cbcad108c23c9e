//! Entry points for fuzzing: each parser that reads untrusted bytes, without its I/O. Used by
//! the bounded mutation test (`proxy-agent/tests/fuzz_smoke.rs`) that `cargo xtask test` runs,
//! and, as this very file, by the cargo-fuzz targets in `tests/fuzz/`, which build without the
//! agent (no network client, no runtime): so it names the parsers' own crates only. A finding
//! is a panic (or a hang); errors are the expected outcome for most inputs.

use std::path::Path;

/// A manifests file (`proxy_decode::manifests` document loading). Any panic is a finding: the
/// loader has no `catch_unwind` around the YAML library.
pub fn manifests(bytes: &[u8]) {
    let _ = proxy_decode::manifests::load_bytes(Path::new("fuzz.yaml"), bytes);
}

/// A KubeProxyConfiguration file (`config::parse`: size/nesting limits, strict decoding).
pub fn config(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let _ = proxy_model::config::parse(text);
}

/// One ctnetlink dump datagram (`proxy_kernel::conntrack::netlink`).
pub fn ctnetlink(bytes: &[u8]) {
    let _ = proxy_kernel::conntrack::netlink::parse_dump_datagram(bytes);
}

/// One SOCK_DIAG dump datagram (`proxy_kernel::bpf::sockdiag`).
pub fn sockdiag(bytes: &[u8]) {
    let _ = proxy_kernel::bpf::sockdiag::parse_dump_datagram(bytes);
}

/// An API server response in protobuf: a LIST body or a watch stream of each kind, an error
/// `Status` (`proxy_decode::protobuf`).
pub fn api_protobuf(bytes: &[u8]) {
    proxy_decode::protobuf::decode_everything(bytes);
}
