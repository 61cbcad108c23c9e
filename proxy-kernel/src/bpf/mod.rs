//! The kernel interfaces the eBPF dataplane stands on: the bpf(2) calls aya does not make
//! (`bpf_syscall.rs`, `map_batch.rs`, `mapped_array.rs`), the bpffs mount, SOCK_DIAG's socket destruction, and the
//! probes of what the kernel has (`features.rs`).

pub mod bpf_syscall;
pub mod bpffs;
pub mod cgroup;
pub mod features;
pub mod map_batch;
pub mod mapped_array;
pub mod sockdiag;
