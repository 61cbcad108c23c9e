//! The kernel interfaces the dataplane stands on: the bpf(2) calls aya does not make
//! (`bpf_syscall.rs`, `map_batch.rs`), the bpffs mount, SOCK_DIAG's socket destruction, and the
//! probes of what the kernel has (`features.rs`).

pub(super) mod bpf_syscall;
pub(super) mod bpffs;
pub(super) mod cgroup;
pub mod features;
pub(super) mod map_batch;
pub(crate) mod sockdiag;
