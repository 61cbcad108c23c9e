//! What the eBPF dataplane is started with.

use std::{collections::BTreeSet, path::PathBuf};

use crate::{attach::tc::TcOptions, maps::maglev};
use proxy_kernel::bpf::features::Feature;

#[derive(Debug, Clone)]
pub struct EbpfOptions {
    /// cgroup2 directory to attach to; `None` means the cgroup2 mount point.
    pub cgroup_path: Option<PathBuf>,
    pub bpf_root: PathBuf,
    pub frontends_capacity: u32,
    /// Most frontend entries one Service may take.
    pub max_frontends_per_service: u32,
    /// Most backends one frontend is programmed with (the first by address and port).
    pub max_endpoints_per_service: u32,
    pub backends_capacity: u32,
    /// `--bpf-map-conntrack`: entries of the tc conntrack map; `None`: from `lru_budget`, and a
    /// pinned map keeps its size.
    pub conntrack_capacity: Option<u32>,
    /// What the preallocated LRU maps are sized from (`map_sizes`): kube-proxy's conntrack
    /// table size, or `--bpf-map-dynamic-size-ratio` of the node's memory.
    pub lru_budget: crate::maps::map_sizes::LruBudget,
    /// `--lb-algorithm` and the Maglev table for external traffic.
    pub lb: LbOptions,
    /// Interfaces and node facts for the tc programs (`tc.tcx` is set from the probe).
    pub tc: TcOptions,
    /// `--bpf-disable-feature`: kernel features not to use even when the probe finds them.
    pub disabled_features: BTreeSet<Feature>,
    /// Minimum interval between ICMP port unreachables to one client (both families); `None`:
    /// the node's `net.ipv4.icmp_ratelimit` / `net.ipv6.icmp.ratelimit`, as the kernel's own.
    pub icmp_ratelimit: Option<std::time::Duration>,
    /// `--bpf-snat-port-range`: the source ports of SNATed external flows, reserved from the
    /// node's ephemeral ports at start (`reserved_ports`).
    pub snat_ports: std::ops::RangeInclusive<u16>,
}

/// `--lb-algorithm`, `--bpf-maglev-table-size`, `--bpf-map-maglev`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LbOptions {
    /// Maglev for new external (tc) flows; random otherwise (socket-level LB always is).
    pub maglev: bool,
    /// Slots of each external frontend's Maglev table: a prime (see `maglev`).
    pub maglev_table_size: u32,
    /// Capacity of `KPR_MAGLEV` in blocks of `MAGLEV_BLOCK_SLOTS` slots.
    pub maglev_capacity: u32,
}

impl Default for LbOptions {
    fn default() -> Self {
        LbOptions {
            maglev: false,
            maglev_table_size: maglev::DEFAULT_TABLE_SIZE,
            maglev_capacity: proxy_common::default_sizes::MAGLEV,
        }
    }
}
