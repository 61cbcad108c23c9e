//! Per-CPU datapath counters (`KPR_STATS`), indexed by [`StatIndex`].

/// Why the datapath did what it did; each variant is one slot of the per-CPU counter array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatIndex {
    /// A `connect()` to a frontend was translated to a backend.
    Translated = 0,
    /// A `connect()` to a frontend without backends was refused (kube-proxy's REJECT).
    RejectedNoBackends = 1,
    /// The chosen slot or backend was missing (should not happen with the update protocol).
    BackendMissing = 2,
    /// `getpeername()` was rewritten back to the service address.
    PeerNameRewritten = 3,
    /// An unconnected UDP `sendmsg()` to a frontend was translated to a backend.
    SendmsgTranslated = 4,
    /// An unconnected UDP `sendmsg()` to a frontend without backends was refused.
    SendmsgRejectedNoBackends = 5,
    /// A UDP reply's source was rewritten to the service address in `recvmsg()`.
    RecvmsgRewritten = 6,
    /// A live session-affinity entry chose the backend.
    AffinityHit = 7,
    /// An affinity entry was found but had expired or its backend left the service.
    AffinityStale = 8,
    /// The reverse-NAT map refused an entry (full and not evictable): getpeername/recvmsg of
    /// that socket will show the backend address.
    RevNatUpdateFailed = 9,
}

impl StatIndex {
    pub const COUNT: u32 = 10;
    pub const ALL: [StatIndex; Self::COUNT as usize] = [
        StatIndex::Translated,
        StatIndex::RejectedNoBackends,
        StatIndex::BackendMissing,
        StatIndex::PeerNameRewritten,
        StatIndex::SendmsgTranslated,
        StatIndex::SendmsgRejectedNoBackends,
        StatIndex::RecvmsgRewritten,
        StatIndex::AffinityHit,
        StatIndex::AffinityStale,
        StatIndex::RevNatUpdateFailed,
    ];

    /// Label used in logs and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            StatIndex::Translated => "translated",
            StatIndex::RejectedNoBackends => "rejected_no_backends",
            StatIndex::BackendMissing => "backend_missing",
            StatIndex::PeerNameRewritten => "peername_rewritten",
            StatIndex::SendmsgTranslated => "sendmsg_translated",
            StatIndex::SendmsgRejectedNoBackends => "sendmsg_rejected_no_backends",
            StatIndex::RecvmsgRewritten => "recvmsg_rewritten",
            StatIndex::AffinityHit => "affinity_hit",
            StatIndex::AffinityStale => "affinity_stale",
            StatIndex::RevNatUpdateFailed => "revnat_update_failed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_every_index_in_order_and_fits_the_map() {
        for (i, index) in StatIndex::ALL.iter().enumerate() {
            assert_eq!(*index as usize, i, "{}", index.name());
        }
        const { assert!(StatIndex::COUNT <= crate::default_sizes::STATS) };
    }
}
