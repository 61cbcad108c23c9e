//! What an apply, a retirement or a refused frontend reports to the caller.

use super::*;

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("frontend {frontend} ({service}): {reason}; it keeps its previous backends")]
    Frontend {
        frontend: FrontendKey,
        service: String,
        reason: MapWriteError,
    },
    #[error("frontend {frontend}: removing it failed: {reason}")]
    Remove {
        frontend: FrontendKey,
        reason: MapWriteError,
    },
    /// The service port has more endpoints than `--bpf-max-endpoints-per-service`: it is
    /// programmed with the first `programmed` of them.
    #[error(
        "{service}: {endpoints} endpoints, programmed with the first {programmed} by address \
         and port (--bpf-max-endpoints-per-service)"
    )]
    Truncated {
        service: String,
        endpoints: usize,
        programmed: usize,
    },
    /// The node's first IPv6 Service needed the IPv6 tc programs and the kernel did not load
    /// them: its frontends are written (the socket hooks translate its ClusterIPs), but
    /// traffic through tc (NodePorts, external and LoadBalancer IPs, replies) is not.
    #[error(
        "the IPv6 tc programs could not be loaded: {reason}; IPv6 Services are not translated \
         on the tc path (NodePorts, external and LoadBalancer IPs) until they are"
    )]
    Ipv6Programs { reason: String },
}

impl ApplyError {
    /// The frontend did not fit in the maps, or in its Service's or namespace's share of them
    /// (as opposed to a kernel error).
    pub fn is_capacity(&self) -> bool {
        matches!(
            self,
            ApplyError::Frontend {
                reason: MapWriteError::Full(_) | MapWriteError::Share(_),
                ..
            }
        )
    }

    /// The error is a limit on what the tenant's Service gets (it did not fit, or was
    /// truncated), not a fault of the node: the node stays healthy.
    pub fn is_tenant_limit(&self) -> bool {
        self.is_capacity() || matches!(self, ApplyError::Truncated { .. })
    }
}

/// A backend that a frontend stopped using: sockets translated through `frontend` to `backend`
/// must not keep using it (see `sockdiag`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RemovedBackend {
    pub frontend: FrontendKey,
    pub backend: SocketAddr,
}

/// What one apply did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplySummary {
    pub frontends_written: usize,
    pub frontends_removed: usize,
    pub frontends_unchanged: usize,
    /// Frontends this dataplane cannot serve (none at the moment; kept for the log line).
    pub frontends_unsupported: usize,
    /// (frontend, backend) pairs that were live before and are not any more.
    pub removed_backends: Vec<RemovedBackend>,
    /// Connected UDP sockets destroyed because their backend was removed (set by `EbpfDataplane::apply`).
    pub udp_sockets_destroyed: usize,
    /// tc conntrack entries of removed backends deleted by this apply (set by
    /// `EbpfDataplane::apply`; 0 when the conntrack worker purges them off the sync loop, see
    /// `conntrack_purge_queued`).
    pub conntrack_purged: usize,
    /// A purge of removed backends' tc conntrack entries was handed to the conntrack worker.
    pub conntrack_purge_queued: bool,
    /// Changed frontends not switched yet: their previous generation is still in its grace
    /// ([`GENERATION_GRACE`]); they keep their current set and are written by the first apply
    /// after it ([`MapWriter::retire_expired`] says when one is due).
    pub frontends_deferred: usize,
}

impl ApplySummary {
    /// Adds a second pass over some of the same service ports: what it wrote, removed and
    /// deferred (its unchanged ones were counted, or failed, in the first pass).
    pub(super) fn add_retry(&mut self, again: ApplySummary) {
        self.frontends_written += again.frontends_written;
        self.frontends_removed += again.frontends_removed;
        self.frontends_deferred += again.frontends_deferred;
        self.removed_backends.extend(again.removed_backends);
    }

    /// Adds what another apply did (one step of a full pass in steps to the pass's total).
    pub fn add(&mut self, other: ApplySummary) {
        self.frontends_written += other.frontends_written;
        self.frontends_removed += other.frontends_removed;
        self.frontends_unchanged += other.frontends_unchanged;
        self.frontends_unsupported += other.frontends_unsupported;
        self.removed_backends.extend(other.removed_backends);
        self.udp_sockets_destroyed += other.udp_sockets_destroyed;
        self.conntrack_purged += other.conntrack_purged;
        self.conntrack_purge_queued |= other.conntrack_purge_queued;
        self.frontends_deferred += other.frontends_deferred;
    }

    /// Whether a frontend was written or removed: what changes service ids, their names and
    /// the map writer's trees (an apply over unchanged service ports, such as an idle
    /// periodic resync, changes none of them).
    pub fn changed_frontends(&self) -> bool {
        self.frontends_written > 0 || self.frontends_removed > 0
    }
}

/// What [`MapWriter::retire_expired`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Retirement {
    /// Retired generations deleted.
    pub deleted: usize,
    /// An apply now has something to do: a deferred frontend can be switched, or frontends that
    /// did not fit may fit in the room the deletions freed.
    pub sync_needed: bool,
}
