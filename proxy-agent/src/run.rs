//! The agent's main loop: source → store → desired state → dataplane, until a signal stops it.

use std::{collections::BTreeSet, path::PathBuf, time::Duration};

use anyhow::{Context as _, bail};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
    time::Instant,
};
use tracing::{debug, error, info, warn};

use crate::{
    config::{Config, DetectLocal, NodePortAddresses, ProxyMode},
    dataplane::{
        ebpf::{self, ApplyError, EbpfDataplane, EbpfOptions},
        iptables::{self, DetectLocalMode, IptablesConfig, IptablesDataplane},
    },
    desired::{NodeContext, ServicePortName, Snapshot},
    objects::{Kind, Objects, Store},
    source::{self, kubernetes::ClientOptions},
    sync_runner::{RunnerConfig, SyncReason, SyncRunner},
};

/// `--cleanup`: removes everything either mode installed (pinned maps and links, which detaches
/// the programs; our iptables chains and jump rules), then returns.
pub fn cleanup(config: &Config) -> anyhow::Result<()> {
    let removed = ebpf::cleanup(&config.ebpf.bpf_root).context("--cleanup failed")?;
    info!(removed, "eBPF cleanup done");
    let problems = iptables::cleanup();
    for problem in &problems {
        warn!(%problem, "iptables cleanup");
    }
    info!(problems = problems.len(), "iptables cleanup done");
    Ok(())
}

/// Where the objects come from.
enum Source {
    Manifests(PathBuf),
    Kubernetes(kube::Client),
}

impl Source {
    fn name(&self) -> &'static str {
        match self {
            Self::Manifests(_) => "manifests",
            Self::Kubernetes(_) => "kubernetes",
        }
    }
}

pub async fn run(config: Config) -> anyhow::Result<()> {
    let node = NodeContext::new(&node_name(config.hostname_override.as_deref())?, None);
    // Resolve the source before touching the kernel, so a bad flag fails fast.
    let source = match config.ebpf.manifests.clone() {
        Some(manifests) => {
            if !manifests.is_dir() {
                bail!("--manifests {}: not a directory", manifests.display());
            }
            Source::Manifests(manifests)
        }
        None => Source::Kubernetes(
            source::kubernetes::client(&ClientOptions {
                kubeconfig: config.client_connection.kubeconfig.clone(),
                master: config.master.clone(),
            })
            .await?,
        ),
    };
    info!(node = %node.name, mode = ?config.mode, source = source.name(), "starting proxy-agent");

    let mut dataplane = Dataplane::start(&config)?;
    let (tx, mut rx) = mpsc::channel(64);
    let mut store = Store::default();
    let source_task = match source {
        Source::Manifests(dir) => {
            // A manifests folder may hold no Node: that counts as listed.
            store.mark_synced(Kind::Node);
            tokio::spawn(source::manifests::run(dir, node.name.clone(), tx))
        }
        // The Node is watched like the other kinds: the first sync waits for its list.
        Source::Kubernetes(client) => {
            let name = node.name.clone();
            tokio::spawn(async move {
                source::kubernetes::run(client, name, tx).await;
                Ok(())
            })
        }
    };
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut snapshot = Snapshot::default();
    let mut synced_once = false;
    let mut other_mode_removed = false;
    let runner_config = dataplane.runner_config(&config);
    let mut runner = SyncRunner::new(runner_config, Instant::now());

    let outcome = loop {
        // Nothing is programmed until every kind was listed once (kube-proxy's rule), so a
        // restart never programs a half-empty view.
        let wake = if store.is_synced() {
            runner.next_wakeup(Instant::now())
        } else {
            Instant::now() + runner_config.max_interval
        };
        tokio::select! {
            update = rx.recv() => {
                let Some(update) = update else {
                    break Err(anyhow::anyhow!("the {} source stopped", dataplane.name()));
                };
                let mut changed = store.apply(update);
                // Drain what is already queued so a burst becomes one sync.
                while let Ok(update) = rx.try_recv() {
                    changed |= store.apply(update);
                }
                if changed || (store.is_synced() && !synced_once) {
                    runner.request();
                }
            }
            () = tokio::time::sleep_until(wake) => {
                if !store.is_synced() {
                    continue;
                }
                let Some(reason) = runner.due(Instant::now()) else {
                    continue;
                };
                if reason == SyncReason::Periodic {
                    dataplane.periodic_check();
                }
                let changes = store.take_changes();
                // The first sync and a node change recompute every Service.
                let all_services = !synced_once || changes.node;
                synced_once = true;
                let scope = (!all_services).then_some(&changes.services);
                let update_started = Instant::now();
                let update = snapshot.update(store.objects(), &node.name, scope);
                for error in &update.new_errors {
                    warn!("{error}");
                }
                let changed = (!all_services).then_some(&update.changed);
                let ok = dataplane.apply(&snapshot, changed, reason);
                if ok && !other_mode_removed {
                    dataplane.remove_other_mode(&config);
                    other_mode_removed = true;
                }
                debug!(elapsed_us = update_started.elapsed().as_micros() as u64, "sync done");
                if !ok {
                    // kube-proxy retries a failed sync after one sync period.
                    runner.retry_after(config.sync_period, Instant::now());
                }
                log_snapshot_size(store.objects(), &snapshot);
            }
            _ = sigint.recv() => break Ok("SIGINT"),
            _ = sigterm.recv() => break Ok("SIGTERM"),
        }
    };
    source_task.abort();
    match &outcome {
        Ok(signal) => info!(signal, "shutting down"),
        Err(error) => error!(%error, "shutting down"),
    }
    dataplane.shutdown();
    outcome.map(|_| ())
}

fn log_snapshot_size(objects: &Objects, snapshot: &Snapshot) {
    debug!(
        services = objects.services.len(),
        endpoint_slices = objects.endpoint_slices().len(),
        service_ports_v4 = snapshot.v4.service_ports.len(),
        service_ports_v6 = snapshot.v6.service_ports.len(),
        "snapshot"
    );
}

/// The dataplane `--proxy-mode` selected.
#[derive(Debug)]
enum Dataplane {
    Ebpf(Box<EbpfDataplane>),
    Iptables(IptablesDataplane),
}

impl Dataplane {
    fn start(config: &Config) -> anyhow::Result<Self> {
        match config.mode {
            ProxyMode::Ebpf => match EbpfDataplane::start(&EbpfOptions {
                cgroup_path: config.ebpf.cgroup_path.clone(),
                bpf_root: config.ebpf.bpf_root.clone(),
                frontends_capacity: config.ebpf.map_frontends,
                backends_capacity: config.ebpf.map_backends,
            }) {
                Ok(ebpf) => Ok(Dataplane::Ebpf(Box::new(ebpf))),
                // The mode was not chosen explicitly: run kube-proxy's iptables mode instead of
                // leaving the node without a proxy.
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

    /// After the first successful sync the new mode carries the traffic: remove what the other
    /// mode left behind (a mode switch), so nothing of it keeps intercepting traffic.
    fn remove_other_mode(&self, config: &Config) {
        match self {
            Dataplane::Ebpf(_) => {
                let problems = iptables::cleanup();
                if problems.is_empty() {
                    debug!("no iptables-mode leftovers");
                }
                for problem in problems {
                    warn!(%problem, "removing iptables-mode leftovers");
                }
            }
            Dataplane::Iptables(_) => match ebpf::cleanup(&config.ebpf.bpf_root) {
                Ok(0) => debug!("no eBPF-mode leftovers"),
                Ok(removed) => info!(removed, "removed the eBPF mode's pins and links"),
                Err(error) => warn!(%error, "removing eBPF-mode leftovers"),
            },
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Dataplane::Ebpf(_) => "ebpf",
            Dataplane::Iptables(_) => "iptables",
        }
    }

    /// eBPF: a sync costs O(changed Services), so there is no minimum interval beyond coalescing
    /// what is queued (`--iptables-min-sync-period` is, as its name says, for the iptables
    /// mode). iptables: kube-proxy's min/max periods with a burst of 2.
    fn runner_config(&self, config: &Config) -> RunnerConfig {
        RunnerConfig {
            min_interval: match self {
                Dataplane::Ebpf(_) => Duration::ZERO,
                Dataplane::Iptables(_) => config.min_sync_period,
            },
            max_interval: config.sync_period,
            burst: 2,
        }
    }

    /// Once per sync period: the canary check (someone flushed our tables → full resync).
    fn periodic_check(&mut self) {
        if let Dataplane::Iptables(iptables) = self {
            iptables.check_canaries();
        }
    }

    /// Applies the snapshot; `changed`: the service ports that changed (`None`: all may have).
    /// Returns whether everything was applied.
    fn apply(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
        reason: SyncReason,
    ) -> bool {
        let changed_count = changed.map_or(0, BTreeSet::len);
        match self {
            Dataplane::Ebpf(ebpf) => {
                let started = Instant::now();
                // The periodic sync reconciles every service port.
                let scope = if reason == SyncReason::Periodic {
                    None
                } else {
                    changed
                };
                let (summary, errors) = ebpf.apply(snapshot, scope);
                for error in &errors {
                    warn!("{error}");
                }
                if errors.iter().any(ApplyError::is_capacity) {
                    let unfit = ebpf.unfit_service_ports();
                    let names: Vec<String> = unfit.iter().map(ToString::to_string).collect();
                    warn!(
                        count = names.len(),
                        capacity_errors = ebpf.capacity_errors(),
                        service_ports = %names.join(", "),
                        "service ports that do not fit in the eBPF maps are not programmed (or \
                         keep their previous backends); raise --bpf-map-frontends / \
                         --bpf-map-backends"
                    );
                }
                if summary.frontends_unsupported > 0 {
                    warn!(
                        count = summary.frontends_unsupported,
                        "frontends the eBPF dataplane cannot program (mixed-family backends)"
                    );
                }
                info!(
                    ?reason,
                    changed = changed_count,
                    written = summary.frontends_written,
                    removed = summary.frontends_removed,
                    unchanged = summary.frontends_unchanged,
                    removed_backends = summary.removed_backends.len(),
                    udp_sockets_destroyed = summary.udp_sockets_destroyed,
                    elapsed_us = started.elapsed().as_micros() as u64,
                    "sync applied"
                );
                for (counter, value) in ebpf.stats() {
                    debug!(counter = counter.name(), value, "datapath counter");
                }
                // Map writes that failed keep their previous state; the periodic full
                // reconcile retries them, no faster retry is needed.
                true
            }
            Dataplane::Iptables(iptables) => {
                // The dataplane itself turns a partial sync into a full one when one is due
                // (hourly, after a failure or a canary flush).
                let mut ok = true;
                for result in iptables.apply(snapshot, changed) {
                    match result {
                        Ok(report) => info!(
                            family = report.family.as_k8s(),
                            full = report.full,
                            changed = changed_count,
                            filter_rules = report.filter_rules,
                            nat_rules = report.nat_rules,
                            deleted_chains = report.deleted_chains,
                            elapsed_us = report.elapsed.as_micros() as u64,
                            "sync applied"
                        ),
                        Err(error) => {
                            ok = false;
                            error!(%error, "iptables sync failed; the next sync is a full one");
                        }
                    }
                }
                ok
            }
        }
    }

    fn shutdown(self) {
        match self {
            // Both leave the datapath in place, so a restarted agent takes over without a gap.
            Dataplane::Ebpf(ebpf) => (*ebpf).shutdown(),
            Dataplane::Iptables(_) => info!("iptables rules stay in place"),
        }
    }
}

/// The iptables dataplane's settings from the configuration.
fn iptables_config(config: &Config) -> IptablesConfig {
    let defaults = IptablesConfig::default();
    IptablesConfig {
        masquerade_bit: config.iptables.masquerade_bit,
        masquerade_all: config.masquerade_all,
        detect_local: match &config.detect_local {
            DetectLocal::ClusterCidr => DetectLocalMode::ClusterCidr(config.cluster_cidrs.clone()),
            // The node's podCIDRs come with the Node object; until it is read, nothing is local.
            DetectLocal::NodeCidr => DetectLocalMode::NodeCidr(Vec::new()),
            DetectLocal::BridgeInterface(name) => DetectLocalMode::BridgeInterface(name.clone()),
            DetectLocal::InterfaceNamePrefix(prefix) => {
                DetectLocalMode::InterfaceNamePrefix(prefix.clone())
            }
        },
        node_port_addresses: match &config.node_port_addresses {
            NodePortAddresses::Cidrs(cidrs) => cidrs.clone(),
            // `primary` is resolved from the Node object, which the iptables mode does not read
            // yet: serve every local address like the default.
            NodePortAddresses::All | NodePortAddresses::Primary => Vec::new(),
        },
        localhost_node_ports: config.iptables.localhost_node_ports,
        sync_period: config.sync_period,
        min_sync_period: config.min_sync_period,
        ..defaults
    }
}

fn node_name(hostname_override: Option<&str>) -> anyhow::Result<String> {
    let name = match hostname_override {
        Some(name) => name.trim().to_owned(),
        None => nix::unistd::gethostname()
            .context("cannot read the host name; pass --hostname-override")?
            .to_string_lossy()
            .into_owned(),
    };
    if name.is_empty() {
        bail!("--hostname-override: the node name must not be empty");
    }
    // kube-proxy lower-cases the node name (nodeutil.GetHostname).
    Ok(name.to_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_trimmed_and_lower_cased() {
        assert_eq!(node_name(Some(" Node-A ")).expect("name"), "node-a");
        assert!(node_name(Some("  ")).is_err());
    }
}
