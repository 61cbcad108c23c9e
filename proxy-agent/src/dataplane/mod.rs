//! Dataplanes make the kernel match a [`crate::desired::Snapshot`]; they never decide policy.

pub mod ebpf;
pub mod iptables;
