//! The spoofed SYN rate a node takes while it keeps serving, eBPF mode beside
//! the iptables mode, each on a fresh node: [`crate::flood::syn_flood`]'s run (idle
//! connections opened before, a spoofed SYN flood from the external namespace to an
//! externalTrafficPolicy Cluster NodePort with a legitimate client making new connections
//! beside it, new connections after it, the idle connections speaking again).

use std::time::{Duration, Instant};

use super::IptablesBackend;
use super::agent_runs::ProxyMode;
use crate::Result;
use crate::flood::{SynFloodOutcome, SynFloodPlan, start_syn_flood_agent, syn_flood_scenario};

/// The eBPF mode's conntrack map (`--bpf-map-conntrack`): small, so that the flood overflows
/// the unanswered flows' map (a quarter of it) many times over, as a long flood would a map
/// of any size.
pub const EBPF_CONNTRACK: &str = "4096";

/// The section's result.
#[derive(Debug, Clone)]
pub struct SynFloodResult {
    pub plan: SynFloodPlan,
    pub ebpf: super::Outcome<SynFloodOutcome>,
    pub iptables: super::Outcome<SynFloodOutcome>,
    pub elapsed: Duration,
}

/// One mode on a fresh node.
pub fn run_mode(
    mode: ProxyMode,
    backend: IptablesBackend,
    plan: SynFloodPlan,
) -> Result<SynFloodOutcome> {
    let mut s = syn_flood_scenario()?;
    if let Some((program, args)) = backend.hint_command() {
        s.topo.node().exec(program, args)?;
    }
    let args: &[&str] = match mode {
        ProxyMode::Ebpf => &["--bpf-map-conntrack", EBPF_CONNTRACK],
        ProxyMode::Iptables => &[],
    };
    start_syn_flood_agent(&mut s, mode.as_arg(), args)?;
    let outcome = crate::flood::syn_flood(&mut s, plan, mode == ProxyMode::Ebpf)?;
    println!("    {}: {outcome}", mode.as_arg());
    Ok(outcome)
}

/// Both modes, eBPF first.
pub fn section(
    plan: SynFloodPlan,
    backend: IptablesBackend,
    mut failed: impl FnMut(&str, crate::RigError) -> super::Outcome<SynFloodOutcome>,
) -> SynFloodResult {
    let started = Instant::now();
    let mut outcome = |mode: ProxyMode| match run_mode(mode, backend, plan) {
        Ok(o) => super::Outcome::Done(o),
        Err(e) => failed(&format!("SYN flood, {} mode", mode.as_arg()), e),
    };
    let ebpf = outcome(ProxyMode::Ebpf);
    let iptables = outcome(ProxyMode::Iptables);
    SynFloodResult {
        plan,
        ebpf,
        iptables,
        elapsed: started.elapsed(),
    }
}
