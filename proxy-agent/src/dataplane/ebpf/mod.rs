//! The eBPF dataplane: socket-level load balancing with cgroup sock_addr programs, and external
//! traffic (NodePort, externalIPs, LoadBalancer IPs) with tc programs.

mod bpffs;
mod cgroup;
mod ct;
mod ids;
mod loader;
#[cfg_attr(
    not(test),
    expect(
        dead_code,
        reason = "step 1 of --lb-algorithm maglev: the table builder, not wired into the maps yet"
    )
)]
mod maglev;
mod object;
mod program;
pub(crate) mod sockdiag;
mod stats;
mod tc;

pub use loader::{
    EbpfDataplane, EbpfOptions, LoadError, PIN_DIR_MODE, PIN_DIR_NAME, TcTestRun, cleanup,
};
pub use program::{
    ApplyError, ApplySummary, BackendValue, FrontendMapKey, MapOps, MapWriteError, MapsContent,
    Programmer, RemovedBackend, ip4_from_map, ip6_from_map,
};
pub use tc::TcOptions;
