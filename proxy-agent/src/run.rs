//! The agent's main loop: source → store → desired state → dataplane, until a signal stops it.

use std::{
    collections::BTreeSet,
    path::PathBuf,
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, bail};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
    time::Instant,
};
use tracing::{debug, error, info, warn};

use crate::{
    config::{Config, DetectLocal, LbAlgorithm, NodePortAddresses, ProxyMode},
    conntrack::{self, ConntrackSettings},
    dataplane::{
        ebpf::{self, ApplyError, EbpfDataplane, EbpfOptions},
        iptables::{self, DetectLocalMode, IptablesConfig, IptablesDataplane},
    },
    desired::{IpFamily, NodeContext, Protocol, ServicePortName, Snapshot},
    node::{NodeInputs, NodeManager, NodeSettings},
    node_services::{
        NodeServices, NodeServicesConfig,
        metrics::{IptablesTable, Metrics},
        trigger_times,
    },
    objects::{Changes, Kind, Objects, Store},
    source::{self, kubernetes::ClientOptions},
    sync_runner::{RunnerConfig, SyncReason, SyncRunner},
};

/// How often the eBPF dataplane's conntrack is garbage-collected. SNAT port reuse does not wait
/// for it (the datapath takes over dead flows' ports itself): the GC only keeps dead entries
/// from filling the LRU, so kube-proxy's default sync period is often enough, and a full walk
/// of the default 262 144 entries (~0.5 s) stays a small share of the agent's time.
const CONNTRACK_GC_INTERVAL: Duration = Duration::from_secs(30);
/// pkg/proxy/util `FullSyncPeriod`: the iptables runner's maximum interval.
const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

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
    remove_kube_proxy_modes();
    Ok(())
}

/// `--init-only`: the steps that need full root privileges, then return (upstream:
/// newProxyServer's platformSetup applies the conntrack sysctls, the proxier logs "System
/// initialized and --init-only specified" and returns before any rule is written). No API
/// server and no dataplane are touched.
pub fn init_only(config: &Config) {
    apply_process_settings(config);
    info!("System initialized and --init-only specified");
}

/// `--bind-address-hard-fail`: kube-proxy exits when its health or metrics server cannot bind
/// (server.go: the serve error goes to errCh instead of a retry loop). Checked before anything
/// is touched, by binding each address once; the servers bind again right after.
fn check_server_ports(config: &Config) -> anyhow::Result<()> {
    for (flag, address) in [
        ("--healthz-bind-address", config.healthz_bind_address),
        ("--metrics-bind-address", config.metrics_bind_address),
    ] {
        if let Some(address) = address {
            std::net::TcpListener::bind(address).with_context(|| {
                format!("{flag} {address}: cannot bind, and --bind-address-hard-fail is set")
            })?;
        }
    }
    Ok(())
}

/// kube-proxy's nftables tables and IPVS device; failures are logged, never fatal (upstream's
/// cleanup is best effort too).
fn remove_kube_proxy_modes() {
    let (_, errors) = iptables::kube_proxy_modes::remove();
    for error in errors {
        warn!(%error, "removing kube-proxy leftovers");
    }
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
    let source_name = source.name();
    info!(node = %node.name, mode = ?config.mode, source = source_name, "starting proxy-agent");

    if config.bind_address_hard_fail {
        check_server_ports(&config)?;
    }
    apply_process_settings(&config);
    // As kube-proxy's platformCleanup at start: its nftables/IPVS modes' state would keep
    // intercepting Service traffic next to ours.
    remove_kube_proxy_modes();
    let mut dataplane = Dataplane::start(&config)?;
    // /healthz /livez, health check node ports, /metrics /proxyMode — for the mode actually
    // running (after a fallback, iptables).
    let node_services = NodeServices::start(&NodeServicesConfig {
        healthz_bind_address: config.healthz_bind_address,
        metrics_bind_address: config.metrics_bind_address,
        node_required: matches!(source, Source::Kubernetes(_)),
        ..NodeServicesConfig::new(&node.name, dataplane.mode(), config.sync_period)
    });
    if let (Some(metrics), Dataplane::Ebpf(ebpf)) = (node_services.metrics().ebpf(), &dataplane) {
        let features: Vec<_> = ebpf
            .features()
            .states()
            .iter()
            .map(|state| (state.feature.name(), state.used()))
            .collect();
        metrics.kernel_features(&features);
    }
    for family in IpFamily::ALL {
        node_services.loop_started(family);
    }
    let mut last_sync_wall = SystemTime::UNIX_EPOCH;
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
            let events = client.clone();
            let event_node = node.name.clone();
            tokio::spawn(async move {
                source::kubernetes::post_starting_event(events, &event_node).await;
            });
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
    let mut conntrack_gc_at = Instant::now() + CONNTRACK_GC_INTERVAL;
    // iptables: ipt.Monitor checks the canaries every syncPeriod on its own timer, whatever
    // else is syncing (proxier.go NewProxier).
    let mut canary_at = Instant::now() + config.sync_period;
    // The Node object and the host's addresses → node settings (see `node/`).
    let mut node_manager = NodeManager::new(NodeInputs::from_config(&config), &node.name);
    // The drift check runs in this loop, never concurrently with a sync of the same maps.
    let (drift_requests, mut drift_rx) = tokio::sync::mpsc::channel(4);
    node_services.metrics().serve_drift_requests(drift_requests);
    let drift_period = config.ebpf.drift_check_period;
    let mut drift_at = Instant::now() + drift_period;

    let outcome = loop {
        // Nothing is programmed until every kind was listed once (kube-proxy's rule), so a
        // restart never programs a half-empty view; with NodeCIDR, until the Node has
        // podCIDRs (or the wait fails, as upstream's).
        let ready = match node_manager.ready(store.is_synced(), store.objects().node.as_ref()) {
            Ok(ready) => ready,
            Err(error) => break Err(error.into()),
        };
        let wake = if ready {
            runner.next_wakeup(Instant::now())
        } else {
            Instant::now() + node_manager.poll_interval(config.sync_period)
        };
        tokio::select! {
            update = rx.recv() => {
                let Some(update) = update else {
                    break Err(anyhow::anyhow!("the {source_name} source stopped"));
                };
                let mut changed = store.apply(update);
                // Drain what is already queued so a burst becomes one sync.
                while let Ok(update) = rx.try_recv() {
                    changed |= store.apply(update);
                }
                let pending = store.pending_changes();
                node_services.metrics().changes(
                    0,
                    0,
                    usize::try_from(pending.service_events).unwrap_or(usize::MAX),
                    usize::try_from(pending.slice_events).unwrap_or(usize::MAX),
                );
                if changed || (store.is_synced() && !synced_once) {
                    runner.request();
                    for family in IpFamily::ALL {
                        node_services.queued(family);
                    }
                }
            }
            // An address added or removed on the host: NodePort addresses, tc attachment.
            // Settings are recomputed now so that only a change the dataplane cares about costs
            // a sync (pods come with link-local addresses on their veths).
            () = node_manager.addresses_changed() => {
                debug!("host addresses changed");
                match node_manager.refresh(store.objects().node.as_ref()) {
                    Ok(Some(settings)) => {
                        if apply_node_settings(settings, &mut dataplane, &node_services) {
                            runner.request();
                        }
                    }
                    Ok(None) => {}
                    Err(error) => break Err(error.into()),
                }
            }
            () = tokio::time::sleep_until(wake) => {
                if !ready {
                    continue;
                }
                let Some(reason) = runner.due(Instant::now()) else {
                    continue;
                };
                let changes = store.take_changes();
                node_services
                    .metrics()
                    .changes(changes.service_events, changes.slice_events, 0, 0);
                match node_manager.refresh(store.objects().node.as_ref()) {
                    Ok(Some(settings)) => {
                        apply_node_settings(settings, &mut dataplane, &node_services);
                    }
                    Ok(None) => {}
                    Err(error) => break Err(error.into()),
                }
                // The first sync and a topology change recompute every Service.
                let all_services = !synced_once || changes.node.topology;
                if !synced_once || changes.node.any() {
                    // The node decides /healthz's nodeEligible.
                    node_services.node_changed(store.objects().node.as_ref());
                }
                synced_once = true;
                let scope = (!all_services).then_some(&changes.services);
                let update_started = Instant::now();
                let started_wall = SystemTime::now();
                let update = snapshot.update(store.objects(), &node.name, scope);
                for error in &update.new_errors {
                    warn!("{error}");
                }
                let changed = (!all_services).then_some(&update.changed);
                let ok = dataplane.apply(&snapshot, changed, reason, node_services.metrics());
                // Read before the sync is reported, so a scrape that sees the first sync's
                // samples also sees the datapath counters.
                if let (Some(ebpf), Dataplane::Ebpf(dataplane)) =
                    (node_services.metrics().ebpf(), &dataplane)
                {
                    let counters: Vec<(&'static str, u64)> =
                        dataplane.stats().into_iter().map(|(c, v)| (c.name(), v)).collect();
                    ebpf.datapath_counters(&counters);
                }
                if ok {
                    report_sync(&node_services, store.objects(), &changes, &snapshot,
                        update_started.elapsed(), last_sync_wall);
                    last_sync_wall = started_wall;
                }
                if ok && !other_mode_removed {
                    dataplane.remove_other_mode(&config);
                    other_mode_removed = true;
                }
                debug!(elapsed_us = update_started.elapsed().as_micros() as u64, "sync done");
                // A failed sync is retried after the retry interval (the sync period).
                runner.finished(Instant::now(), ok);
                log_snapshot_size(store.objects(), &snapshot);
            }
            // Its own timer, not the periodic sync's: a sync for changes resets that one, so
            // with Services changing more often than syncPeriod it would never come.
            () = tokio::time::sleep_until(canary_at), if dataplane.has_canary() => {
                if dataplane.check_canaries() {
                    runner.request();
                }
                canary_at = Instant::now() + config.sync_period;
            }
            () = tokio::time::sleep_until(conntrack_gc_at), if dataplane.has_conntrack() => {
                dataplane.conntrack_gc(node_services.metrics());
                conntrack_gc_at = Instant::now() + CONNTRACK_GC_INTERVAL;
            }
            () = tokio::time::sleep_until(drift_at), if synced_once && !drift_period.is_zero() => {
                let report = dataplane.drift(true, node_services.metrics(), &snapshot);
                if report.mode == "iptables" && !report.drift.is_empty() {
                    // iptables repairs with a full sync (the family is marked): now.
                    runner.request();
                }
                drift_at = Instant::now() + drift_period;
            }
            Some(reply) = drift_rx.recv() => {
                let report = if synced_once {
                    dataplane.drift(false, node_services.metrics(), &snapshot)
                } else {
                    crate::drift::DriftReport::not_checked(dataplane.mode_name(), "no sync yet")
                };
                // The requester may have gone (timeout): nothing to do then.
                let _ = reply.send(serde_json::to_string(&report).unwrap_or_default());
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
    node_services.shutdown();
    outcome.map(|_| ())
}

/// New node settings: to the dataplane (eBPF: node maps at the next apply; iptables: a full
/// sync of the families they change) and to the health check node ports.
/// Returns whether the dataplane needs a sync for them (eBPF: always, the node maps and tc
/// links are written by the apply and cost little; iptables: when a family's rules change).
fn apply_node_settings(
    settings: &NodeSettings,
    dataplane: &mut Dataplane,
    node_services: &NodeServices,
) -> bool {
    node_services.set_health_check_ips(settings.health_check_ips.clone());
    match dataplane {
        Dataplane::Ebpf(ebpf) => {
            ebpf.set_node(settings);
            true
        }
        Dataplane::Iptables(iptables) => iptables.set_node(settings),
    }
}

/// Health timestamps, sync metrics, health check node ports and network programming latency
/// after a successful sync of both families.
fn report_sync(
    node_services: &NodeServices,
    objects: &Objects,
    changes: &Changes,
    snapshot: &Snapshot,
    elapsed: Duration,
    previous_sync: SystemTime,
) {
    for family in IpFamily::ALL {
        node_services.synced(family, snapshot, elapsed);
    }
    let times = trigger_times(objects, &changes.services, previous_sync);
    for family in IpFamily::ALL {
        let of_family: Vec<SystemTime> = times
            .iter()
            .filter(|(f, _)| *f == family)
            .map(|(_, time)| *time)
            .collect();
        node_services.network_programmed(family, &of_family);
    }
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
                conntrack_capacity: config.ebpf.map_conntrack,
                lb: ebpf::LbOptions {
                    maglev: config.ebpf.lb_algorithm == LbAlgorithm::Maglev,
                    maglev_table_size: config.ebpf.maglev_table_size,
                    maglev_capacity: config.ebpf.map_maglev,
                },
                tc: ebpf::TcOptions {
                    interfaces: config.ebpf.interfaces.clone(),
                    node_port_cidrs: match &config.node_port_addresses {
                        NodePortAddresses::Cidrs(cidrs) => cidrs.clone(),
                        // `primary` is resolved from the Node object by the node settings,
                        // which replace these before the first sync.
                        NodePortAddresses::All | NodePortAddresses::Primary => Vec::new(),
                    },
                    cluster_cidrs: config.cluster_cidrs.clone(),
                    masquerade_all: config.masquerade_all,
                    localhost_node_ports: config.iptables.localhost_node_ports,
                    fast_path: config.ebpf.tc_fast_path,
                    tcx: true,
                },
                disabled_features: config.ebpf.disabled_features.clone(),
                icmp_ratelimit: None,
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

    fn mode(&self) -> ProxyMode {
        match self {
            Dataplane::Ebpf(_) => ProxyMode::Ebpf,
            Dataplane::Iptables(_) => ProxyMode::Iptables,
        }
    }

    /// eBPF: a sync costs O(changed Services), so there is no minimum interval beyond coalescing
    /// what is queued (`--iptables-min-sync-period` is, as its name says, for the iptables
    /// mode), and every sync period reconciles every map entry. iptables: kube-proxy's runner
    /// (proxier.go: min minSyncPeriod, retry syncPeriod, max `proxyutil.FullSyncPeriod`, an
    /// hour); the canary timer covers the sync period.
    fn runner_config(&self, config: &Config) -> RunnerConfig {
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

    /// Whether this dataplane has canary chains to watch (iptables).
    fn has_canary(&self) -> bool {
        matches!(self, Dataplane::Iptables(_))
    }

    /// Every sync period: the canary check (someone flushed our tables → full resync now).
    fn check_canaries(&mut self) -> bool {
        match self {
            Dataplane::Iptables(iptables) => iptables.check_canaries(),
            Dataplane::Ebpf(_) => false,
        }
    }

    /// The drift check (see `crate::drift`); with `repair`, what differs is fixed.
    fn drift(
        &mut self,
        repair: bool,
        metrics: &Metrics,
        snapshot: &Snapshot,
    ) -> crate::drift::DriftReport {
        match self {
            Dataplane::Ebpf(ebpf) => crate::drift::check_ebpf(ebpf, repair, metrics),
            Dataplane::Iptables(iptables) => {
                crate::drift::check_iptables(iptables, snapshot, repair, metrics)
            }
        }
    }

    fn mode_name(&self) -> &'static str {
        match self {
            Dataplane::Ebpf(_) => "ebpf",
            Dataplane::Iptables(_) => "iptables",
        }
    }

    /// Whether this dataplane has a conntrack of its own to garbage-collect (the tc programs'
    /// `KPR_CT`; the kernel's conntrack collects itself).
    fn has_conntrack(&self) -> bool {
        matches!(self, Dataplane::Ebpf(_))
    }

    /// Garbage collection of the eBPF dataplane's conntrack, every `CONNTRACK_GC_INTERVAL`.
    fn conntrack_gc(&mut self, metrics: &Metrics) {
        if let Dataplane::Ebpf(ebpf) = self
            && let Err(error) = ebpf.request_conntrack_gc(metrics.ebpf())
        {
            warn!(%error, "tc conntrack garbage collection failed");
        }
    }

    /// Applies the snapshot; `changed`: the service ports that changed (`None`: all may have).
    /// Returns whether everything was applied.
    fn apply(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
        reason: SyncReason,
        metrics: &Metrics,
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
                    conntrack_purged = summary.conntrack_purged,
                    conntrack_purge_queued = summary.conntrack_purge_queued,
                    elapsed_us = started.elapsed().as_micros() as u64,
                    "sync applied"
                );
                for (counter, value) in ebpf.stats() {
                    debug!(counter = counter.name(), value, "datapath counter");
                }
                // Names for `proxy-agent inspect`, kept current for what changed.
                let programmer = ebpf.programmer();
                match scope {
                    Some(changed) => {
                        for name in changed {
                            metrics
                                .set_service_ids(name.to_string(), programmer.service_ids_of(name));
                        }
                    }
                    None => metrics.replace_service_ids(
                        programmer
                            .owners()
                            .map(|name| (name.to_string(), programmer.service_ids_of(name)))
                            .collect(),
                    ),
                }
                // A failed map write, or a service port still not fitting in the maps, is a
                // failed sync as upstream counts one: /healthz turns unhealthy after the health
                // timeout and the runner retries after the sync period (the failed writes kept
                // their previous state; the periodic full reconcile retries them too).
                errors.is_empty() && ebpf.unfit_service_ports().is_empty()
            }
            Dataplane::Iptables(iptables) => {
                // The dataplane itself turns a partial sync into a full one when one is due
                // (hourly, after a failure or a canary flush).
                let mut ok = true;
                let families: Vec<IpFamily> = iptables.families().collect();
                for (family, result) in families.into_iter().zip(iptables.apply(snapshot, changed))
                {
                    match result {
                        Ok(report) => {
                            info!(
                                family = report.family.as_k8s(),
                                full = report.full,
                                changed = changed_count,
                                filter_rules = report.filter_rules,
                                nat_rules = report.nat_rules,
                                deleted_chains = report.deleted_chains,
                                elapsed_us = report.elapsed.as_micros() as u64,
                                "sync applied"
                            );
                            if let Some(ipt) = metrics.iptables() {
                                ipt.sync_duration(report.family, report.elapsed, report.full);
                                // proxier.go: the filter table is always written whole; nat's
                                // "last" counts only this sync's restore input.
                                let filter = report.filter_rules as u64;
                                ipt.rules(report.family, IptablesTable::Filter, filter, filter);
                                ipt.rules(
                                    report.family,
                                    IptablesTable::Nat,
                                    report.nat_rules as u64,
                                    report.nat_rules_written as u64,
                                );
                            }
                            // Flows DNATed to endpoints that went away must not stay pinned
                            // to them (kube-proxy's conntrack reconciler, after a good sync).
                            if needs_conntrack_cleanup(snapshot, changed, report.family) {
                                reconcile_conntrack(report.family, snapshot, metrics);
                            }
                        }
                        Err(error) => {
                            if let Some(ipt) = metrics.iptables() {
                                ipt.restore_failed(family, changed.is_some());
                            }
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

/// Whether a sync may have left stale UDP/SCTP conntrack entries: a full sync, or a changed
/// UDP/SCTP service port of this family.
fn needs_conntrack_cleanup(
    snapshot: &Snapshot,
    changed: Option<&BTreeSet<ServicePortName>>,
    family: IpFamily,
) -> bool {
    let stateful_datagrams =
        |name: &ServicePortName| matches!(name.protocol, Protocol::Udp | Protocol::Sctp);
    match changed {
        None => snapshot
            .family(family)
            .service_ports
            .keys()
            .any(stateful_datagrams),
        Some(changed) => changed.iter().any(stateful_datagrams),
    }
}

fn reconcile_conntrack(family: IpFamily, snapshot: &Snapshot, metrics: &Metrics) {
    let started = Instant::now();
    match conntrack::reconcile(family, snapshot.family(family)) {
        Ok(report) => {
            debug!(family = family.as_k8s(), ?report, "conntrack reconciled");
            if report.deleted > 0 {
                info!(
                    family = family.as_k8s(),
                    deleted = report.deleted,
                    "deleted stale conntrack entries"
                );
            }
            metrics.conntrack_reconciled(family, started.elapsed(), report.deleted as u64);
        }
        Err(error) => warn!(family = family.as_k8s(), %error, "conntrack cleanup failed"),
    }
}

/// Process settings from the configuration: the OOM score adjustment and the conntrack sysctls.
/// Neither is fatal: a container may not be allowed to change them (kube-proxy, too, only logs
/// a read-only /sys).
fn apply_process_settings(config: &Config) {
    if let Err(error) = std::fs::write("/proc/self/oom_score_adj", config.oom_score_adj.to_string())
    {
        warn!(value = config.oom_score_adj, %error, "cannot apply --oom-score-adj");
    }
    let settings = ConntrackSettings {
        max_per_core: config.conntrack.max_per_core,
        min: config.conntrack.min,
        tcp_established_timeout: Some(config.conntrack.tcp_established_timeout),
        tcp_close_wait_timeout: Some(config.conntrack.tcp_close_wait_timeout),
        tcp_be_liberal: config.conntrack.tcp_be_liberal,
        udp_timeout: Some(config.conntrack.udp_timeout),
        udp_stream_timeout: Some(config.conntrack.udp_stream_timeout),
    };
    let (written, errors) = conntrack::apply_sysctls(&settings, std::path::Path::new("/proc/sys"));
    debug!(written, "conntrack sysctls applied");
    for error in errors {
        warn!(%error, "conntrack sysctl not applied");
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
            // The Node's podCIDRs come with the node settings, before the first sync.
            DetectLocal::NodeCidr => DetectLocalMode::NodeCidr(Vec::new()),
            DetectLocal::BridgeInterface(name) => DetectLocalMode::BridgeInterface(name.clone()),
            DetectLocal::InterfaceNamePrefix(prefix) => {
                DetectLocalMode::InterfaceNamePrefix(prefix.clone())
            }
        },
        node_port_addresses: match &config.node_port_addresses {
            NodePortAddresses::Cidrs(cidrs) => cidrs.clone(),
            // `primary` is resolved from the Node object by the node settings, which replace
            // this before the first sync.
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
