//! Per-CPU datapath counters (`KPR_STATS`), indexed by [`StatIndex`].

/// Why the datapath did what it did; each variant is one slot of the per-CPU counter array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatIndex {
    /// A socket connect to a frontend was translated to a backend.
    Translated = 0,
    /// A connect to a frontend without backends was refused (kube-proxy's REJECT).
    RejectedNoBackends = 1,
    /// The chosen slot or backend was missing (should not happen with the update protocol).
    BackendMissing = 2,
    /// `getpeername()` was rewritten back to the service address.
    PeerNameRewritten = 3,
}

impl StatIndex {
    pub const COUNT: u32 = 4;
    pub const ALL: [StatIndex; Self::COUNT as usize] = [
        StatIndex::Translated,
        StatIndex::RejectedNoBackends,
        StatIndex::BackendMissing,
        StatIndex::PeerNameRewritten,
    ];

    /// Label used in logs and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            StatIndex::Translated => "translated",
            StatIndex::RejectedNoBackends => "rejected_no_backends",
            StatIndex::BackendMissing => "backend_missing",
            StatIndex::PeerNameRewritten => "peername_rewritten",
        }
    }
}
