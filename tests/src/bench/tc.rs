//! PLACEHOLDERS for items 3 and 4 of the benchmark issue, owned by the tc dataplane work:
//!
//! 3. NodePort forwarding through the tc programs (external client → node → remote pod) against
//!    iptables mode and plain routing.
//! 4. Per-packet cost of the tc program (e.g. `bpf_prog_test_run` or the run-time stats of
//!    `kernel.bpf_stats_enabled`) against an empty tc program.
//!
//! Nothing here is measured yet and nothing calls these functions: the report prints a
//! "not measured yet" section for both items. Wire them into `bench::run` once the tc programs
//! exist.

use crate::Result;

/// Item 3 (not implemented): NodePort forwarding latency/rate per path.
#[derive(Debug, Clone, Default)]
pub struct NodePortResult {}

/// Item 4 (not implemented): per-packet program cost.
#[derive(Debug, Clone, Default)]
pub struct PacketCostResult {}

/// Not implemented: returns an error saying so. Not wired into the benchmark.
pub fn nodeport_forwarding() -> Result<NodePortResult> {
    Err(crate::RigError::Other(
        "NodePort forwarding benchmark (item 3) is not implemented yet".into(),
    ))
}

/// Not implemented: returns an error saying so. Not wired into the benchmark.
pub fn per_packet_cost() -> Result<PacketCostResult> {
    Err(crate::RigError::Other(
        "per-packet tc program cost benchmark (item 4) is not implemented yet".into(),
    ))
}
