//! Dataplanes make the kernel match a [`crate::desired::Snapshot`]; they never decide policy.

pub mod ebpf;
pub mod iptables;
pub mod nat_hold;
mod options;
mod selected;

pub use selected::{Dataplane, EbpfSyncOutcome, SyncOutcome};
