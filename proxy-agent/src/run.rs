//! The agent's main loop: source → desired state → dataplane, until a signal stops it.

use std::{collections::BTreeSet, time::Instant};

use anyhow::{Context as _, bail};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};
use tracing::{debug, error, info, warn};

use crate::{
    cli::{Args, ProxyMode},
    dataplane::{
        ebpf::{EbpfDataplane, EbpfOptions},
        iptables::{IptablesConfig, IptablesDataplane},
    },
    desired::{NodeContext, Snapshot},
    objects::{Kind, ObjectKey, Objects, Store},
    source,
};

pub async fn run(args: Args) -> anyhow::Result<()> {
    let Some(manifests) = args.manifests.clone() else {
        bail!("--manifests DIR is required (the Kubernetes API source is not implemented yet)");
    };
    if !manifests.is_dir() {
        bail!("--manifests {}: not a directory", manifests.display());
    }
    let node = NodeContext::new(&node_name(args.hostname_override.as_deref())?, None);
    info!(node = %node.name, mode = ?args.proxy_mode, "starting proxy-agent");

    let mut dataplane = match args.proxy_mode {
        ProxyMode::Ebpf => Dataplane::Ebpf(Box::new(
            EbpfDataplane::start(&EbpfOptions {
                cgroup_path: args.cgroup_path.clone(),
                bpf_root: args.bpf_root.clone(),
                frontends_capacity: args.bpf_map_frontends,
                backends_capacity: args.bpf_map_backends,
            })
            .context("cannot start the eBPF dataplane")?,
        )),
        ProxyMode::Iptables => Dataplane::Iptables(
            IptablesDataplane::start(IptablesConfig::default())
                .context("cannot start the iptables dataplane")?,
        ),
    };
    // iptables: canary check and periodic resync every sync period (kube-proxy's max interval).
    let mut resync = tokio::time::interval(IptablesConfig::default().sync_period);

    let (tx, mut rx) = mpsc::channel(64);
    let source_task = tokio::spawn(source::manifests::run(manifests, node.name.clone(), tx));
    let mut store = Store::default();
    // A manifests folder may hold no Node: that counts as listed.
    store.mark_synced(Kind::Node);
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut snapshot = Snapshot::default();
    let mut synced_once = false;

    let outcome = loop {
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
                // The first sync waits until every kind was listed once, then runs even if the
                // last update changed nothing.
                if store.is_synced() && (changed || !synced_once) {
                    let changes = store.take_changes();
                    // The first sync, and any node change, recompute every Service.
                    let scope = (synced_once && !changes.node).then_some(&changes.services);
                    synced_once = true;
                    sync(store.objects(), &node, scope, &mut snapshot, &mut dataplane);
                }
            }
            _ = resync.tick(), if synced_once => {
                if let Dataplane::Iptables(iptables) = &mut dataplane {
                    let flushed = iptables.check_canaries();
                    let scope = (!flushed).then(BTreeSet::new);
                    sync_iptables(iptables, &snapshot, scope.as_ref());
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
    // Like kube-proxy, iptables rules stay in place on exit so traffic keeps flowing.
    if let Dataplane::Ebpf(ebpf) = dataplane {
        (*ebpf).shutdown();
    }
    outcome.map(|_| ())
}

/// One sync: update the snapshot for the changed Services and apply what changed. Problems are
/// logged once each (when they appear) and never stop the agent.
fn sync(
    objects: &Objects,
    node: &NodeContext,
    services: Option<&BTreeSet<ObjectKey>>,
    snapshot: &mut Snapshot,
    dataplane: &mut Dataplane,
) {
    let started = Instant::now();
    let update = snapshot.update(objects, &node.name, services);
    for error in &update.new_errors {
        warn!("{error}");
    }
    let scope = services.map(|_| &update.changed);
    let dataplane = match dataplane {
        Dataplane::Ebpf(ebpf) => ebpf,
        Dataplane::Iptables(iptables) => {
            sync_iptables(iptables, snapshot, scope);
            return;
        }
    };
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

/// The dataplane `--proxy-mode` selected.
#[derive(Debug)]
enum Dataplane {
    Ebpf(Box<EbpfDataplane>),
    Iptables(IptablesDataplane),
}

fn sync_iptables(
    dataplane: &mut IptablesDataplane,
    snapshot: &Snapshot,
    changed: Option<&BTreeSet<crate::desired::ServicePortName>>,
) {
    for result in dataplane.apply(snapshot, changed) {
        match result {
            Ok(report) => info!(
                family = report.family.as_k8s(),
                full = report.full,
                filter_rules = report.filter_rules,
                nat_rules = report.nat_rules,
                deleted_chains = report.deleted_chains,
                elapsed_us = report.elapsed.as_micros() as u64,
                "iptables sync applied"
            ),
            Err(error) => error!(%error, "iptables sync failed; the next sync is a full one"),
        }
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
