//! The eBPF dataplane: socket-level load balancing with cgroup sock_addr programs, and external
//! traffic (NodePort, externalIPs, LoadBalancer IPs) with tc programs.

pub mod attach;
pub mod conntrack;
mod dataplane;
mod drift;
mod error;
pub mod maps;
mod options;
mod route_generation;
mod self_test;
mod stats;
mod test_run;
pub mod traffic;

pub use attach::pins::{PIN_DIR_MODE, PIN_DIR_NAME, cleanup};
pub use attach::tc::{Attachment, TcOptions};
pub use attach::xdp::XdpSetting;
pub use conntrack::ct_maps::ConntrackMaps;
pub use conntrack::ct_worker::WorkerReports;
pub use conntrack::tc_conntrack::{CtWalk, monotonic_ns};
pub use dataplane::{
    DRIFT_COPY_STEP, EbpfDataplane, FULL_PASS_STEP, FullPass, GcProgress, KernelNatFlows,
    read_kernel_nat_flows,
};
pub use drift::reader::{DriftFound, DriftJob, DriftReader, DriftReading, DriftStart, DriftStep};
pub use drift::{Drift, DriftCheck, DriftKind, DriftNotChecked, RepairReport};
pub use error::EbpfError;
pub use maps::maglev::{
    DEFAULT_TABLE_SIZE as DEFAULT_MAGLEV_TABLE_SIZE, MAX_TABLE_SIZE as MAX_MAGLEV_TABLE_SIZE,
    is_valid_table_size,
};
pub use maps::map_writer::{
    ApplyError, ApplySummary, BackendValue, DEFAULT_MAX_ENDPOINTS_PER_SERVICE, FrontendMapKey,
    GENERATION_GRACE, MapOps, MapWriteError, MapWriter, MapsContent, ProbeTarget, RecordCopy,
    RemovedBackend, Retirement, ip4_from_map, ip4_to_map, ip6_from_map, ip6_to_map,
};
pub use options::{EbpfOptions, LbOptions};
pub use proxy_kernel::bpf::features::{Feature, FeatureState, KernelFeatures};
pub use proxy_model::config::ebpf_settings::DEFAULT_MAX_FRONTENDS_PER_SERVICE;
pub use self_test::{
    MAX_PROBED_INTERFACES, PROBE_CLIENT4, PROBE_CLIENT6, PROBE_PORT, ProbeOutcome, ProgramProbe,
    SelfTest,
};
pub use test_run::{TcTestInput, TcTestRun, XdpTestRun};

/// The conntrack map's static size (`--bpf-map-dynamic-size-ratio 0`), for test rigs that want
/// a fixed one.
pub const DEFAULT_CONNTRACK_CAPACITY: u32 = proxy_common::default_sizes::CT;
