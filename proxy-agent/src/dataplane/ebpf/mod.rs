//! The eBPF dataplane: socket-level load balancing with cgroup sock_addr programs, and external
//! traffic (NodePort, externalIPs, LoadBalancer IPs) with tc programs.

mod bpffs;
mod cgroup;
mod ct;
mod drift;
mod ids;
mod loader;
mod maglev;
mod object;
mod orphans;
mod program;
pub(crate) mod sockdiag;
mod stats;
mod tc;

pub use ct::monotonic_ns;
pub use drift::{Drift, DriftCheck, DriftKind, RepairReport};
pub use loader::{
    EbpfDataplane, EbpfOptions, LbOptions, LoadError, PIN_DIR_MODE, PIN_DIR_NAME, TcTestRun,
    cleanup,
};
pub use maglev::{
    DEFAULT_TABLE_SIZE as DEFAULT_MAGLEV_TABLE_SIZE, MAX_TABLE_SIZE as MAX_MAGLEV_TABLE_SIZE,
    is_valid_table_size,
};
pub use program::{
    ApplyError, ApplySummary, BackendValue, FrontendMapKey, MapOps, MapWriteError, MapsContent,
    Programmer, RemovedBackend, ip4_from_map, ip4_to_map, ip6_from_map, ip6_to_map,
};
pub use tc::TcOptions;
