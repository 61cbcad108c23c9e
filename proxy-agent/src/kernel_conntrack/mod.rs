//! Netfilter conntrack: stale-entry cleanup after endpoint changes (kube-proxy's
//! pkg/proxy/conntrack) and the conntrack sysctls from `KubeProxyConntrackConfiguration`.
//!
//! - `netlink.rs`: a small ctnetlink client (dump and delete) over a NETLINK_NETFILTER socket.
//! - `cleanup.rs`: which entries are stale for a snapshot (a pure function) and the reconcile.
//! - `sysctls.rs`: nf_conntrack_max and timeouts.

mod cleanup;
pub(crate) mod netlink;
mod sysctls;

pub use cleanup::{CleanupReport, StaleFilter, reconcile, stale_filters};
pub use netlink::{ConntrackEntry, ConntrackError, Ctnetlink, Tuple};
pub use sysctls::{ConntrackSettings, SysctlError, apply_sysctls, planned_writes};
