//! Dataplanes make the kernel match a [`crate::desired::Snapshot`]; they never decide policy.

pub mod ebpf;
pub mod iptables;
mod options;
mod selected;

pub use selected::{Dataplane, EbpfSyncOutcome, SyncOutcome};
