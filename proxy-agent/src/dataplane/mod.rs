//! The running dataplane: one of the two modes (`proxy_dataplane_ebpf`,
//! `proxy_dataplane_iptables`), chosen and started from the configuration. Dataplanes make the
//! kernel match a [`proxy_model::desired::Snapshot`]; they never decide policy.

mod options;
mod selected;

pub use selected::{Dataplane, EbpfSyncOutcome, SyncOutcome};
