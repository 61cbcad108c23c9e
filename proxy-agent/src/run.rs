//! The agent's main loop: source → desired state → dataplane, until a signal stops it.

use std::{
    collections::BTreeSet,
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
    cli::{Args, ProxyMode},
    dataplane::ebpf::{EbpfDataplane, EbpfOptions},
    desired::{IpFamily, NodeContext, Snapshot},
    node_services::{NodeServices, NodeServicesConfig, trigger_times},
    objects::{Changes, Kind, ObjectKey, Objects, Store},
    source,
    sync_runner::{RunnerConfig, SyncReason, SyncRunner},
};

/// Sync pacing in eBPF mode. A sync costs O(changed Services) there, so no minimum interval is
/// needed beyond coalescing what is already queued; the periodic full reconcile repairs anything a
/// failed incremental apply left behind.
const EBPF_RUNNER: RunnerConfig = RunnerConfig {
    min_interval: Duration::ZERO,
    max_interval: Duration::from_secs(30),
    burst: 2,
};

pub async fn run(args: Args) -> anyhow::Result<()> {
    if args.proxy_mode == ProxyMode::Iptables {
        bail!("--proxy-mode iptables is not implemented yet; use --proxy-mode ebpf");
    }
    let Some(manifests) = args.manifests.clone() else {
        bail!("--manifests DIR is required (the Kubernetes API source is not implemented yet)");
    };
    if !manifests.is_dir() {
        bail!("--manifests {}: not a directory", manifests.display());
    }
    let node = NodeContext::new(&node_name(args.hostname_override.as_deref())?, None);
    info!(node = %node.name, mode = "ebpf", "starting proxy-agent");

    let mut dataplane = EbpfDataplane::start(&EbpfOptions {
        cgroup_path: args.cgroup_path.clone(),
        bpf_root: args.bpf_root.clone(),
        frontends_capacity: args.bpf_map_frontends,
        backends_capacity: args.bpf_map_backends,
    })
    .context("cannot start the eBPF dataplane")?;

    // node-services: /healthz /livez, health check node ports, /metrics /proxyMode.
    let node_services = NodeServices::start(&NodeServicesConfig {
        healthz_bind_address: args.healthz_bind_address.0,
        metrics_bind_address: args.metrics_bind_address.0,
        ..NodeServicesConfig::new(&node.name, args.proxy_mode, EBPF_RUNNER.max_interval)
    });
    for family in IpFamily::ALL {
        node_services.loop_started(family);
    }
    let mut last_sync_wall = SystemTime::UNIX_EPOCH;

    let (tx, mut rx) = mpsc::channel(64);
    let source_task = tokio::spawn(source::manifests::run(manifests, node.name.clone(), tx));
    let mut store = Store::default();
    // A manifests folder may hold no Node: that counts as listed.
    store.mark_synced(Kind::Node);
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut snapshot = Snapshot::default();
    let mut synced_once = false;
    let mut runner = SyncRunner::new(EBPF_RUNNER, Instant::now());

    let outcome = loop {
        // Nothing is programmed until every kind was listed once (kube-proxy's rule), so a
        // restart never programs a half-empty view.
        let wake = if store.is_synced() {
            runner.next_wakeup(Instant::now())
        } else {
            Instant::now() + EBPF_RUNNER.max_interval
        };
        tokio::select! {
            update = rx.recv() => {
                let Some(update) = update else {
                    break Err(anyhow::anyhow!("the manifests source stopped"));
                };
                let mut changed = store.apply(update);
                // Drain what is already queued so a burst becomes one sync.
                while let Ok(update) = rx.try_recv() {
                    changed |= store.apply(update);
                }
                if changed || (store.is_synced() && !synced_once) {
                    runner.request();
                    // node-services: a change awaits a sync.
                    IpFamily::ALL.iter().for_each(|&family| node_services.queued(family));
                }
            }
            () = tokio::time::sleep_until(wake) => {
                if !store.is_synced() {
                    continue;
                }
                let Some(reason) = runner.due(Instant::now()) else {
                    continue;
                };
                let changes = store.take_changes();
                // The first sync, a node change and the periodic resync cover every Service.
                let full = !synced_once || changes.node || reason == SyncReason::Periodic;
                // node-services: the node decides /healthz's nodeEligible.
                if changes.node || !synced_once {
                    node_services.node_changed(store.objects().node.as_ref());
                }
                synced_once = true;
                let scope = (!full).then_some(&changes.services);
                let started = Instant::now();
                let started_wall = SystemTime::now();
                sync(store.objects(), &node, scope, &mut snapshot, &mut dataplane);
                report_sync(
                    &node_services,
                    store.objects(),
                    &changes,
                    &snapshot,
                    started.elapsed(),
                    full,
                    last_sync_wall,
                );
                last_sync_wall = started_wall;
                if let Some(ebpf) = node_services.metrics().ebpf() {
                    let counters: Vec<(&'static str, u64)> =
                        dataplane.stats().into_iter().map(|(c, v)| (c.name(), v)).collect();
                    ebpf.datapath_counters(&counters);
                }
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

/// node-services: health timestamps, sync metrics, health check node ports and network
/// programming latency after a sync of both families.
fn report_sync(
    node_services: &NodeServices,
    objects: &Objects,
    changes: &Changes,
    snapshot: &Snapshot,
    elapsed: Duration,
    full: bool,
    previous_sync: SystemTime,
) {
    for family in IpFamily::ALL {
        node_services.synced(family, snapshot, elapsed, full);
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

/// One sync: update the snapshot for the changed Services and apply what changed. Problems are
/// logged once each (when they appear) and never stop the agent.
fn sync(
    objects: &Objects,
    node: &NodeContext,
    services: Option<&BTreeSet<ObjectKey>>,
    snapshot: &mut Snapshot,
    dataplane: &mut EbpfDataplane,
) {
    let started = Instant::now();
    let update = snapshot.update(objects, &node.name, services);
    for error in &update.new_errors {
        warn!("{error}");
    }
    let scope = services.map(|_| &update.changed);
    let (summary, apply_errors) = dataplane.apply(snapshot, scope);
    for error in &apply_errors {
        warn!("{error}");
    }
    if summary.frontends_unsupported > 0 {
        warn!(
            count = summary.frontends_unsupported,
            "IPv6 frontends are not programmed yet by the eBPF dataplane"
        );
    }
    info!(
        service_ports = snapshot.v4.service_ports.len() + snapshot.v6.service_ports.len(),
        changed = update.changed.len(),
        written = summary.frontends_written,
        removed = summary.frontends_removed,
        unchanged = summary.frontends_unchanged,
        elapsed_us = started.elapsed().as_micros() as u64,
        "sync applied"
    );
    for (counter, value) in dataplane.stats() {
        debug!(counter = counter.name(), value, "datapath counter");
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
