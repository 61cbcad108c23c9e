//! Items 1, 2 and 3: new-connection latency/rate and request/response over an established
//! connection, to a ClusterIP from the node (1, 2) and to a NodePort from the external
//! namespace (3), through each path, with the paths of one mode interleaved run by run so that
//! drift on the shared machine hits them alike.

use std::net::SocketAddr;
use std::time::Duration;

use super::agent_runs::{external, in_cgroup, outside, pod1_addr};
use super::client::{Place, Workload as ClientWorkload, run_bench};
use super::stats::Percentiles;
use crate::scenario::{Scenario, cluster_addr};
use crate::{Result, RigError};

/// How a client reaches the echo pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// pod1's IP, from outside the agent's cgroup, no rules: the physical floor.
    Direct,
    /// pod1's IP from inside the cgroup: the connect hook runs and finds no frontend.
    DirectInCgroup,
    /// The ClusterIP from inside the cgroup, translated by the socket hook (eBPF mode).
    Ebpf,
    /// pod1's IP while the iptables mode's rules are in place (nat chains walked, no match).
    DirectUnderIptables,
    /// The ClusterIP, DNATed by kube-proxy's rules (iptables mode).
    Iptables,
    /// Item 3 floor: from the external namespace to pod1's IP, routed by the node, before any
    /// agent ran (no tc program, no rules).
    ExtRouted,
    /// From outside to pod1's IP while the eBPF agent's tc programs are attached (they look
    /// the packet up and pass it on to routing).
    ExtRoutedUnderTc,
    /// From outside to the node's NodePort, translated by the tc programs (eBPF mode) on the
    /// default netfilter path: ingress DNAT, the host's FORWARD/POSTROUTING, egress SNAT.
    NodePortEbpf,
    /// The same with `--tc-fast-path`: both halves at ingress, then `bpf_redirect_neigh` past
    /// the host's netfilter. Same agent run: the pinned node config's `FAST_PATH` flag is
    /// flipped before each run of this path and cleared before the others.
    NodePortEbpfFastPath,
    /// From outside to pod1's IP with the iptables mode's rules loaded.
    ExtRoutedUnderIptables,
    /// From outside to the node's NodePort, DNATed and masqueraded by kube-proxy's rules.
    NodePortIptables,
}

impl Path {
    pub fn label(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::DirectInCgroup => "direct, in cgroup (hook miss)",
            Self::Ebpf => "eBPF socket LB",
            Self::DirectUnderIptables => "direct, iptables rules loaded",
            Self::Iptables => "iptables",
            Self::ExtRouted => "routed to the pod IP (no agent)",
            Self::ExtRoutedUnderTc => "routed to the pod IP, tc programs attached",
            Self::NodePortEbpf => "NodePort, eBPF tc (netfilter path)",
            Self::NodePortEbpfFastPath => "NodePort, eBPF tc --tc-fast-path",
            Self::ExtRoutedUnderIptables => "routed to the pod IP, iptables rules loaded",
            Self::NodePortIptables => "NodePort, iptables",
        }
    }

    /// Item 3's paths: clients in the external namespace.
    pub fn external(self) -> bool {
        matches!(
            self,
            Self::ExtRouted
                | Self::ExtRoutedUnderTc
                | Self::NodePortEbpf
                | Self::NodePortEbpfFastPath
                | Self::ExtRoutedUnderIptables
                | Self::NodePortIptables
        )
    }

    fn place_and_target(self, s: &Scenario) -> (Place, SocketAddr) {
        match self {
            Self::Direct | Self::DirectUnderIptables => (outside(s), pod1_addr()),
            Self::DirectInCgroup => (in_cgroup(s), pod1_addr()),
            Self::Ebpf | Self::Iptables => (in_cgroup(s), cluster_addr()),
            Self::ExtRouted | Self::ExtRoutedUnderTc | Self::ExtRoutedUnderIptables => {
                (external(s), pod1_addr())
            }
            Self::NodePortEbpf | Self::NodePortEbpfFastPath | Self::NodePortIptables => (
                external(s),
                SocketAddr::new(
                    crate::topology::Topology::node_ext_ip().into(),
                    super::workload::LIVE_NODE_PORT,
                ),
            ),
        }
    }
}

/// One run of one path: its percentiles and rate.
#[derive(Debug, Clone)]
pub struct Run {
    pub latency: Percentiles,
    /// Sequential samples per second (1 / mean latency).
    pub rate: f64,
    /// Attempts that failed or reached something else than a pod (not in the samples).
    pub errors: u64,
    pub first_error: String,
}

/// Every run of every path, for one workload kind.
#[derive(Debug, Clone, Default)]
pub struct PathRuns {
    pub runs: Vec<(Path, Run)>,
}

impl PathRuns {
    pub fn of(&self, path: Path) -> Vec<Run> {
        self.runs
            .iter()
            .filter(|(p, _)| *p == path)
            .map(|(_, r)| r.clone())
            .collect()
    }
}

/// Sizes of the loops.
#[derive(Debug, Clone, Copy)]
pub struct Loops {
    pub repeats: usize,
    pub connections: u32,
    /// New connections per run for item 3's paths (from the external namespace). Fewer: a
    /// closed flow keeps its SNAT port for the tc conntrack's 10 s close timeout, and source
    /// NAT has a bounded range per backend (`--bpf-snat-port-range`, 16384 ports by default),
    /// so thousands of new flows within seconds would run the probe for a free port into
    /// collisions.
    pub external_connections: u32,
    pub round_trips: u32,
    /// Time bound of one run.
    pub max: Duration,
}

/// Sets or clears `FAST_PATH` in the running eBPF agent's pinned node config (the agent is
/// paused while it is measured, so it does not write it back); nothing without an eBPF agent.
fn set_fast_path(s: &Scenario, on: bool) -> Result<()> {
    use aya::maps::{Array, Map, MapData};
    use proxy_common::{NodeConfig, map_names, node_flags};
    let Some(agent) = s.agent_ref() else {
        return Ok(());
    };
    let pin = agent
        .bpf_root()
        .join("kubeproxy-rs")
        .join(map_names::NODE_CONFIG);
    if !pin.exists() {
        return Ok(());
    }
    let other = |e: &dyn std::fmt::Display| RigError::Other(format!("{}: {e}", pin.display()));
    let data = MapData::from_pin(&pin).map_err(|e| other(&e))?;
    let mut map = Map::from_map_data(data).map_err(|e| other(&e))?;
    let mut config: Array<&mut MapData, NodeConfig> =
        Array::try_from(&mut map).map_err(|e| other(&e))?;
    let mut value = config.get(&0, 0).map_err(|e| other(&e))?;
    let flags = if on {
        value.flags | node_flags::FAST_PATH
    } else {
        value.flags & !node_flags::FAST_PATH
    };
    if flags != value.flags {
        value.flags = flags;
        config.set(0, value, 0).map_err(|e| other(&e))?;
    }
    Ok(())
}

/// Runs `paths` interleaved, `loops.repeats` times, for both workloads. Fails on errors
/// (an untranslated or refused connection would make the numbers meaningless).
pub fn measure(
    s: &Scenario,
    paths: &[Path],
    loops: Loops,
    connect: &mut PathRuns,
    rr: &mut PathRuns,
) -> Result<()> {
    for _ in 0..loops.repeats {
        for &path in paths {
            set_fast_path(s, path == Path::NodePortEbpfFastPath)?;
            let (place, target) = path.place_and_target(s);
            let connections = if path.external() {
                loops.external_connections
            } else {
                loops.connections
            };
            for (workload, count, into) in [
                (ClientWorkload::Connect, connections, &mut *connect),
                (ClientWorkload::Rr, loops.round_trips, &mut *rr),
            ] {
                let samples = run_bench(&place, target, workload, count, loops.max)?;
                // A rare stray (e.g. a connection that reuses a conntrack entry created before
                // the rules existed) is reported, not fatal; more than 0.1 % means the path is
                // broken and its numbers would be meaningless.
                if samples.errors * 1000 > u64::from(count) || samples.ns.is_empty() {
                    return Err(RigError::Other(format!(
                        "{} {workload:?} to {target}: {} errors (first: {}), {} samples",
                        path.label(),
                        samples.errors,
                        samples.first_error,
                        samples.ns.len()
                    )));
                }
                into.runs.push((
                    path,
                    Run {
                        latency: Percentiles::of(&samples.ns),
                        rate: samples.rate,
                        errors: samples.errors,
                        first_error: samples.first_error,
                    },
                ));
            }
        }
    }
    // The agent's own choice (the netfilter path) again.
    set_fast_path(s, false)
}
