//! The eBPF dataplane: socket-level load balancing with cgroup sock_addr programs, and external
//! traffic (NodePort, externalIPs, LoadBalancer IPs) with tc programs.

mod bpf_syscall;
mod bpffs;
mod cgroup;
mod ct_maps;
mod ct_worker;
mod dataplane;
mod drift;
mod drift_reader;
mod error;
pub mod features;
pub mod handback;
mod ids;
mod kernel_nat;
pub mod layout;
pub mod legacy_tc;
mod maglev;
mod map_batch;
pub mod map_sizes;
mod map_writer;
mod object;
mod options;
mod orphans;
mod pin_files;
mod pins;
pub mod reserved_ports;
mod service_maps;
pub(crate) mod sockdiag;
mod stats;
mod tc;
mod tc_conntrack;
mod tc_programs;
mod test_run;
mod touched_keys;
pub mod xdp;

pub use ct_maps::ConntrackMaps;
pub use ct_worker::WorkerReports;
pub use dataplane::{EbpfDataplane, GcProgress};
pub use drift::{Drift, DriftCheck, DriftKind, DriftNotChecked, RepairReport};
pub use drift_reader::{DriftFound, DriftJob, DriftReader, DriftReading};
pub use error::EbpfError;
pub use features::{Feature, FeatureState, KernelFeatures};
pub use maglev::{
    DEFAULT_TABLE_SIZE as DEFAULT_MAGLEV_TABLE_SIZE, MAX_TABLE_SIZE as MAX_MAGLEV_TABLE_SIZE,
    is_valid_table_size,
};
pub use map_writer::shares::DEFAULT_PER_SERVICE as DEFAULT_MAX_FRONTENDS_PER_SERVICE;
pub use map_writer::{
    ApplyError, ApplySummary, BackendValue, DEFAULT_MAX_ENDPOINTS_PER_SERVICE, FrontendMapKey,
    GENERATION_GRACE, MapOps, MapWriteError, MapWriter, MapsContent, RecordCopy, RemovedBackend,
    Retirement, ip4_from_map, ip4_to_map, ip6_from_map, ip6_to_map,
};
pub use options::{EbpfOptions, LbOptions};
pub use pins::{PIN_DIR_MODE, PIN_DIR_NAME, cleanup};
pub use tc::TcOptions;
pub use tc_conntrack::{CtWalk, monotonic_ns};
pub use test_run::{TcTestInput, TcTestRun, XdpTestRun};
pub use xdp::XdpSetting;

/// The conntrack map's static size (`--bpf-map-dynamic-size-ratio 0`), for test rigs that want
/// a fixed one.
pub const DEFAULT_CONNTRACK_CAPACITY: u32 = proxy_common::default_sizes::CT;
