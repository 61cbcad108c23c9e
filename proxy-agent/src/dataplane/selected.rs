//! [`Dataplane`]: the dataplane `--proxy-mode` selected (or the iptables fallback), behind one
//! interface for the agent's loop. Each method only forwards to its mode; what a sync did comes
//! back as a [`SyncOutcome`] that the caller logs and records.

use std::{collections::BTreeSet, time::Duration};

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::options::{ebpf_options, iptables_config};
use crate::sync_runner::{RunnerConfig, SyncReason};
use proxy_common::StatIndex;
use proxy_dataplane_ebpf::{
    self as ebpf, ApplyError, ApplySummary, EbpfDataplane, FullPass, GcProgress,
};
use proxy_dataplane_iptables::{self as iptables, IptablesDataplane, IptablesError, SyncReport};
use proxy_kernel::node::NodeSettings;
use proxy_model::{
    config::{Config, ProxyMode},
    desired::{IpFamily, ServicePortName, Snapshot},
};

/// pkg/proxy/util `FullSyncPeriod`: the iptables runner's maximum interval.
const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

#[derive(Debug)]
pub enum Dataplane {
    Ebpf(Box<EbpfDataplane>),
    Iptables(IptablesDataplane),
}

/// What one sync did, per mode.
#[derive(Debug)]
pub enum SyncOutcome {
    Ebpf(EbpfSyncOutcome),
    /// One result per family the dataplane runs.
    Iptables(Vec<(IpFamily, Result<SyncReport, IptablesError>)>),
}

#[derive(Debug)]
pub struct EbpfSyncOutcome {
    pub summary: ApplySummary,
    pub errors: Vec<ApplyError>,
    /// Service ports that do not fit in the maps (not programmed, or with their old backends).
    pub unfit: Vec<String>,
    pub capacity_errors: u64,
    /// (map, entries, capacity) of the maps the map_writer fills.
    pub map_usage: Vec<(&'static str, u64, u64)>,
    pub elapsed: Duration,
}

impl SyncOutcome {
    /// Whether everything was applied. For eBPF a failed map write is a failed sync as upstream
    /// counts one: /healthz turns unhealthy after the health timeout and the runner retries
    /// after the sync period. A service port that does not fit in the maps (or in its Service's
    /// or namespace's share of them), or has more endpoints than it is programmed with, is not:
    /// it is the tenant's, not the node's, and the node keeps serving everything else; it is
    /// reported and retried whenever room is freed.
    pub fn ok(&self) -> bool {
        match self {
            SyncOutcome::Ebpf(outcome) => outcome.errors.iter().all(ApplyError::is_tenant_limit),
            SyncOutcome::Iptables(results) => results.iter().all(|(_, result)| result.is_ok()),
        }
    }
}

impl Dataplane {
    /// Starts the configured mode; an eBPF dataplane that cannot start falls back to the
    /// iptables mode when the mode was not chosen explicitly (rather than no proxy at all).
    /// `fast_path`: the path external traffic starts on (`crate::fast_path::start`).
    pub fn start(config: &Config, fast_path: bool) -> anyhow::Result<Self> {
        let mut options = ebpf_options(config);
        options.tc.fast_path = fast_path;
        match config.mode {
            ProxyMode::Ebpf => match EbpfDataplane::start(&options) {
                Ok(mut ebpf) => {
                    // The loop writes them in the turn after the first sync (`names_pending`).
                    ebpf.write_names_later();
                    Ok(Dataplane::Ebpf(Box::new(ebpf)))
                }
                Err(error) if config.mode_defaulted => {
                    warn!(
                        error = %format!("{:#}", anyhow::Error::from(error)),
                        "the eBPF dataplane cannot be used here; falling back to the iptables mode"
                    );
                    Self::start_iptables(config)
                }
                Err(error) => Err(error).context("cannot start the eBPF dataplane"),
            },
            ProxyMode::Iptables => Self::start_iptables(config),
        }
    }

    fn start_iptables(config: &Config) -> anyhow::Result<Self> {
        Ok(Dataplane::Iptables(
            IptablesDataplane::start(iptables_config(config))
                .context("cannot start the iptables dataplane")?,
        ))
    }

    /// Before the first sync's writes: the eBPF mode adopts the flows the other mode's rules
    /// started while it loaded (see `EbpfDataplane::adopt_kernel_nat_flows_before_frontends`).
    pub fn before_first_sync(&mut self) {
        if let Dataplane::Ebpf(dataplane) = self {
            dataplane.adopt_kernel_nat_flows_before_frontends();
        }
    }

    /// After the first successful sync the new mode carries the traffic: remove what the other
    /// mode left behind (a mode switch), so nothing of it keeps intercepting traffic. The
    /// iptables rules go at once (established connections need only the kernel's conntrack
    /// entries, and the eBPF mode leaves segments of flows it does not know to the stack); the
    /// eBPF mode's programs drain their own flows first (`ebpf::attach::handback`).
    ///
    /// eBPF mode: returns the read of the kernel's NATed flows, started on a blocking thread,
    /// which [`Dataplane::adopt_kernel_nat_flows`] takes when it is back.
    pub fn remove_other_mode(
        &mut self,
        config: &Config,
    ) -> Option<JoinHandle<ebpf::KernelNatFlows>> {
        match self {
            Dataplane::Ebpf(_) => {
                // Again now that the first sync has given the tc programs their frontends: the
                // flows the rules set up since the start's adoption keep their NAT (and SNAT
                // ports) too. Read off the loop: a dump of the kernel's conntrack is
                // milliseconds that a change which came meanwhile would wait for.
                let kernel_flows = tokio::task::spawn_blocking(ebpf::read_kernel_nat_flows);
                // On a blocking thread: listing and restoring the tables is processes (a quarter
                // of a second at 50k Services' first sync), and the loop, which writes only BPF
                // maps in this mode, has the changes that came during the first sync to take.
                let drain = config.ebpf.mode_switch_drain_period;
                tokio::task::spawn_blocking(move || {
                    // Before the rules go: the kernel keeps NATing their connections meanwhile.
                    proxy_kernel::iptables::nat_hold::hold_while_draining(drain);
                    let problems = iptables::cleanup();
                    if problems.is_empty() {
                        debug!("no iptables-mode leftovers");
                    }
                    for problem in problems {
                        warn!(%problem, "removing iptables-mode leftovers");
                    }
                });
                Some(kernel_flows)
            }
            Dataplane::Iptables(_) => {
                let bpf_root = &config.ebpf.bpf_root;
                let period = config.ebpf.mode_switch_drain_period;
                if !period.is_zero() {
                    match ebpf::attach::handback::start_drain(bpf_root) {
                        Ok(true) => {
                            info!(
                                ?period,
                                "the eBPF mode's programs carry their established flows until they end \
                                 (--mode-switch-drain-period); new connections get the iptables rules"
                            );
                            // The SNAT ports stay reserved while the eBPF mode still uses them.
                            let ports = config.ebpf.snat_ports.clone();
                            ebpf::attach::handback::finish_in_background(
                                bpf_root,
                                period,
                                move || {
                                    ebpf::conntrack::reserved_ports::release(&ports);
                                },
                            );
                            return None;
                        }
                        Ok(false) => {}
                        Err(error) => warn!(%error, "cannot drain the eBPF mode's flows"),
                    }
                }
                match ebpf::cleanup(bpf_root) {
                    Ok(0) => debug!("no eBPF-mode leftovers"),
                    Ok(removed) => info!(removed, "removed the eBPF mode's pins and links"),
                    Err(error) => warn!(%error, "removing eBPF-mode leftovers"),
                }
                ebpf::conntrack::reserved_ports::release(&config.ebpf.snat_ports);
                None
            }
        }
    }

    /// The kernel's NATed flows the read [`Dataplane::remove_other_mode`] started found, into
    /// the tc conntrack (eBPF mode).
    pub fn adopt_kernel_nat_flows(&mut self, flows: &ebpf::KernelNatFlows) {
        if let Dataplane::Ebpf(dataplane) = self {
            dataplane.adopt_kernel_nat_flows(flows);
        }
    }

    pub fn mode(&self) -> ProxyMode {
        match self {
            Dataplane::Ebpf(_) => ProxyMode::Ebpf,
            Dataplane::Iptables(_) => ProxyMode::Iptables,
        }
    }

    pub fn mode_name(&self) -> &'static str {
        match self {
            Dataplane::Ebpf(_) => "ebpf",
            Dataplane::Iptables(_) => "iptables",
        }
    }

    /// eBPF: a sync costs O(changed Services), so there is no minimum interval beyond coalescing
    /// what is queued (`--iptables-min-sync-period` is, as its name says, for the iptables
    /// mode), and every sync period reconciles every map entry. iptables: kube-proxy's runner
    /// (proxier.go: min minSyncPeriod, retry syncPeriod, max `proxyutil.FullSyncPeriod`, an
    /// hour); the canary timer covers the sync period.
    pub fn runner_config(&self, config: &Config) -> RunnerConfig {
        match self {
            Dataplane::Ebpf(_) => RunnerConfig {
                min_interval: Duration::ZERO,
                max_interval: config.sync_period,
                retry_interval: config.sync_period,
            },
            Dataplane::Iptables(_) => RunnerConfig {
                min_interval: config.min_sync_period,
                // validation keeps minSyncPeriod <= syncPeriod, but not <= an hour's runner max.
                max_interval: FULL_SYNC_PERIOD.max(config.min_sync_period),
                retry_interval: config.sync_period,
            },
        }
    }

    /// New node settings. Returns whether the dataplane needs a sync for them (eBPF: always,
    /// the node maps and tc links are written by the apply and cost little; iptables: when a
    /// family's rules change).
    pub fn set_node(&mut self, settings: &NodeSettings) -> bool {
        match self {
            Dataplane::Ebpf(ebpf) => {
                ebpf.set_node(settings);
                true
            }
            Dataplane::Iptables(iptables) => iptables.set_node(settings),
        }
    }

    /// Switches external traffic between the fast path and the netfilter path now (eBPF;
    /// nothing in iptables mode). Returns the path taken, `None` in iptables mode.
    pub fn set_fast_path(&mut self, on: bool) -> Option<bool> {
        match self {
            Dataplane::Ebpf(ebpf) => {
                ebpf.set_fast_path(on);
                Some(ebpf.fast_path())
            }
            Dataplane::Iptables(_) => None,
        }
    }

    /// Whether this dataplane has canary chains to watch (iptables).
    pub fn has_canary(&self) -> bool {
        matches!(self, Dataplane::Iptables(_))
    }

    /// What the canary check reads, for a thread of its own (iptables; `None` in eBPF mode).
    pub fn canary_reader(&self) -> Option<iptables::CanaryReader> {
        match self {
            Dataplane::Iptables(iptables) => Some(iptables.canary_reader()),
            Dataplane::Ebpf(_) => None,
        }
    }

    /// The canary check's reading: someone flushed our tables → a full resync now (`true`).
    pub fn settle_canaries(&mut self, reading: &iptables::CanaryReading) -> bool {
        match self {
            Dataplane::Iptables(iptables) => iptables.settle_canaries(reading),
            Dataplane::Ebpf(_) => false,
        }
    }

    /// Whether this dataplane has a conntrack of its own to garbage-collect (the tc programs'
    /// `KPR_CT`; the kernel's conntrack collects itself).
    pub fn has_conntrack(&self) -> bool {
        matches!(self, Dataplane::Ebpf(_))
    }

    /// Garbage collection of the eBPF dataplane's conntrack: what it finished since the last
    /// call (`None` without a conntrack of our own, or when it failed, which is logged).
    pub fn conntrack_gc(&mut self) -> Option<GcProgress> {
        let Dataplane::Ebpf(ebpf) = self else {
            return None;
        };
        ebpf.request_conntrack_gc()
            .inspect_err(|error| warn!(%error, "tc conntrack garbage collection failed"))
            .ok()
    }

    /// When the eBPF map writer's oldest retired generation may be deleted (none in iptables
    /// mode).
    pub fn next_retirement(&self) -> Option<std::time::Instant> {
        match self {
            Dataplane::Ebpf(ebpf) => ebpf.next_retirement(),
            Dataplane::Iptables(_) => None,
        }
    }

    /// Deletes the retired generations whose grace has passed; `true` when a sync should follow.
    pub fn retire_generations(&mut self) -> bool {
        match self {
            Dataplane::Ebpf(ebpf) => ebpf.retire_generations(),
            Dataplane::Iptables(_) => false,
        }
    }

    /// The eBPF datapath's counters (none in iptables mode).
    pub fn datapath_counters(&self) -> Vec<(StatIndex, u64)> {
        match self {
            Dataplane::Ebpf(ebpf) => ebpf.stats(),
            Dataplane::Iptables(_) => Vec::new(),
        }
    }

    /// Applies the snapshot; `changed`: the service ports that changed (`None`: all may have).
    pub fn sync(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
        reason: SyncReason,
    ) -> SyncOutcome {
        match self {
            Dataplane::Ebpf(ebpf) => SyncOutcome::Ebpf(sync_ebpf(ebpf, snapshot, changed, reason)),
            Dataplane::Iptables(iptables) => {
                // The dataplane itself turns a partial sync into a full one when one is due
                // (hourly, after a failure or a canary flush).
                let families: Vec<IpFamily> = iptables.families().collect();
                SyncOutcome::Iptables(
                    families
                        .into_iter()
                        .zip(iptables.apply(snapshot, changed))
                        .collect(),
                )
            }
        }
    }

    /// Whether the periodic sync runs as a full pass in steps between the loop's other work
    /// ([`Dataplane::full_pass_step`]; eBPF). iptables' full sync is one `iptables-restore`,
    /// and it comes hourly.
    /// Whether the eBPF mode's first full sync left the service names for a turn of their own.
    pub fn names_pending(&self) -> bool {
        matches!(self, Dataplane::Ebpf(dataplane) if dataplane.names_pending())
    }

    /// Writes the names the first full sync left (eBPF mode; `inspect`'s and the traffic
    /// metrics', not the datapath's).
    pub fn write_pending_names(&mut self, snapshot: &Snapshot) {
        if let Dataplane::Ebpf(dataplane) = self {
            dataplane.write_pending_names(snapshot);
        }
    }

    pub fn steps_full_pass(&self) -> bool {
        matches!(self, Dataplane::Ebpf(_))
    }

    /// One step of a periodic full pass; at its end, the outcome of the whole pass (as a
    /// periodic sync's, its time the steps' own).
    pub fn full_pass_step(
        &mut self,
        snapshot: &Snapshot,
        pass: &mut FullPass,
    ) -> Option<SyncOutcome> {
        let Dataplane::Ebpf(ebpf) = self else {
            return None;
        };
        let (summary, errors) = ebpf.full_pass_step(snapshot, pass)?;
        Some(SyncOutcome::Ebpf(ebpf_outcome(
            ebpf, summary, errors, pass.work,
        )))
    }

    pub fn shutdown(self) {
        match self {
            // Both leave the datapath in place, so a restarted agent takes over without a gap.
            Dataplane::Ebpf(ebpf) => (*ebpf).shutdown(),
            Dataplane::Iptables(_) => info!("iptables rules stay in place"),
        }
    }
}

fn sync_ebpf(
    ebpf: &mut EbpfDataplane,
    snapshot: &Snapshot,
    changed: Option<&BTreeSet<ServicePortName>>,
    reason: SyncReason,
) -> EbpfSyncOutcome {
    let started = std::time::Instant::now();
    // The periodic sync reconciles every service port.
    let scope = if reason == SyncReason::Periodic {
        None
    } else {
        changed
    };
    let (summary, errors) = ebpf.apply(snapshot, scope);
    ebpf_outcome(ebpf, summary, errors, started.elapsed())
}

/// What an eBPF apply did, with what the metrics read after it.
fn ebpf_outcome(
    ebpf: &EbpfDataplane,
    summary: ApplySummary,
    errors: Vec<ApplyError>,
    elapsed: Duration,
) -> EbpfSyncOutcome {
    EbpfSyncOutcome {
        summary,
        errors,
        unfit: ebpf
            .unfit_service_ports()
            .iter()
            .map(ToString::to_string)
            .collect(),
        capacity_errors: ebpf.capacity_errors(),
        map_usage: ebpf.map_usage(),
        elapsed,
    }
}
