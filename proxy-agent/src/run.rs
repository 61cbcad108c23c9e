//! The agent's main loop: source → desired state → dataplane, until a signal stops it.

use std::{collections::BTreeSet, time::Instant};

use anyhow::{Context as _, bail};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};
use tracing::{debug, error, info, warn};

use crate::{
    config::{Config, ProxyMode},
    dataplane::ebpf::{EbpfDataplane, EbpfOptions},
    desired::{self, NodeContext},
    objects::{Kind, Objects, Store},
    source,
};

pub async fn run(config: Config) -> anyhow::Result<()> {
    if config.mode == ProxyMode::Iptables {
        bail!("--proxy-mode iptables is not implemented yet; use --proxy-mode ebpf");
    }
    let Some(manifests) = config.ebpf.manifests.clone() else {
        bail!("--manifests DIR is required (the Kubernetes API source is not implemented yet)");
    };
    if !manifests.is_dir() {
        bail!("--manifests {}: not a directory", manifests.display());
    }
    let node = NodeContext {
        name: node_name(config.hostname_override.as_deref())?,
    };
    info!(node = %node.name, mode = "ebpf", "starting proxy-agent");

    let mut dataplane = EbpfDataplane::start(&EbpfOptions {
        cgroup_path: config.ebpf.cgroup_path.clone(),
        bpf_root: config.ebpf.bpf_root.clone(),
        frontends_capacity: config.ebpf.map_frontends,
        backends_capacity: config.ebpf.map_backends,
    })
    .context("cannot start the eBPF dataplane")?;

    let (tx, mut rx) = mpsc::channel(64);
    let source_task = tokio::spawn(source::manifests::run(manifests, node.name.clone(), tx));
    let mut store = Store::default();
    // A manifests folder may hold no Node: that counts as listed.
    store.mark_synced(Kind::Node);
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut reported = BTreeSet::new();
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
                    synced_once = true;
                    store.take_changes();
                    sync(store.objects(), &node, &mut dataplane, &mut reported);
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
    outcome.map(|_| ())
}

/// One sync: compute the snapshot and apply it. Errors are logged once each (not on every sync)
/// and never stop the agent.
fn sync(
    objects: &Objects,
    node: &NodeContext,
    dataplane: &mut EbpfDataplane,
    reported: &mut BTreeSet<String>,
) {
    let started = Instant::now();
    let (snapshot, service_errors) = desired::compute(objects, node);
    let (summary, apply_errors) = dataplane.apply(&snapshot);
    let messages: BTreeSet<String> = service_errors
        .iter()
        .map(ToString::to_string)
        .chain(apply_errors.iter().map(ToString::to_string))
        .collect();
    for message in messages.difference(reported) {
        warn!("{message}");
    }
    *reported = messages;
    if summary.frontends_unsupported > 0 {
        warn!(
            count = summary.frontends_unsupported,
            "IPv6 frontends are not programmed yet by the eBPF dataplane"
        );
    }
    info!(
        frontends = snapshot.frontends.len(),
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
