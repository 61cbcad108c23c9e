//! The eBPF object built by `cargo xtask build-ebpf`, embedded in the agent binary.

/// The ELF object, 8-byte aligned as the ELF parser expects.
#[cfg(not(ebpf_placeholder))]
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("PROXY_EBPF_OBJECT"));

/// Built with `PROXY_EBPF_PLACEHOLDER=1` for `cargo check`/`clippy` only: there is no object,
/// and `EbpfDataplane::start` refuses to run.
#[cfg(ebpf_placeholder)]
pub static OBJECT: &[u8] = &[];

pub const IS_PLACEHOLDER: bool = cfg!(ebpf_placeholder);
