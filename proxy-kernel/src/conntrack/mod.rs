//! Netfilter conntrack: stale-entry cleanup after endpoint changes (kube-proxy's
//! pkg/proxy/conntrack) and the conntrack sysctls from `KubeProxyConntrackConfiguration`.
//!
//! - `netlink.rs`: a small ctnetlink client (dump and delete) over a NETLINK_NETFILTER socket.
//! - `cleanup.rs`: which entries are stale for a snapshot (a pure function) and the reconcile.
//! - `sysctls.rs`: nf_conntrack_max and timeouts.

mod cleanup;
pub mod netlink;
mod sysctls;

pub use cleanup::{
    CleanupReport, GoneFrontends, ServedStreams, StaleFilter, reconcile, stale_filters,
};
pub use netlink::{ConntrackEntry, ConntrackError, Ctnetlink, Tuple};
pub use sysctls::{
    ConntrackSettings, SysctlError, apply_sysctls, machine_cpus, planned_writes, table_size,
};

/// Connections in the kernel's conntrack (both families) whose reply comes from another
/// address or port than the original destination: DNATed ones.
pub fn dnat_connections() -> Result<usize, ConntrackError> {
    let mut ctnetlink = Ctnetlink::open()?;
    let mut count = 0;
    for family in [
        proxy_model::ip_family::IpFamily::V4,
        proxy_model::ip_family::IpFamily::V6,
    ] {
        count += ctnetlink
            .dump(family)?
            .iter()
            .filter(|entry| entry.dnat())
            .count();
    }
    Ok(count)
}
