//! The agent's main loop: source → desired state → dataplane, until a signal stops it.

use std::{collections::BTreeSet, path::PathBuf, time::Duration};

use anyhow::{Context as _, bail};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
    time::Instant,
};
use tracing::{debug, error, info, warn};

use crate::{
    config::{Config, ProxyMode},
    dataplane::ebpf::{self, EbpfDataplane, EbpfOptions},
    desired::{NodeContext, Snapshot},
    objects::{Kind, ObjectKey, Objects, Store},
    source::{self, kubernetes::ClientOptions},
    sync_runner::{RunnerConfig, SyncReason, SyncRunner},
};

/// Sync pacing in eBPF mode. A sync costs O(changed Services) there, so no minimum interval is
/// needed beyond coalescing what is already queued (`--iptables-min-sync-period` is, as its name
/// says, for the iptables mode); the periodic full reconcile every sync period repairs anything a
/// failed incremental apply left behind.
fn ebpf_runner(config: &Config) -> RunnerConfig {
    RunnerConfig {
        min_interval: Duration::ZERO,
        max_interval: config.sync_period,
        burst: 2,
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

/// `--cleanup`: removes everything the agent installed (pinned maps and links, which detaches
/// the programs), then returns.
pub fn cleanup(config: &Config) -> anyhow::Result<()> {
    let removed = ebpf::cleanup(&config.ebpf.bpf_root).context("--cleanup failed")?;
    info!(removed, "cleanup done");
    Ok(())
}

pub async fn run(config: Config) -> anyhow::Result<()> {
    if config.mode == ProxyMode::Iptables {
        bail!("--proxy-mode iptables is not implemented yet; use --proxy-mode ebpf");
    }
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
    info!(node = %node.name, mode = "ebpf", source = source.name(), "starting proxy-agent");

    let mut dataplane = EbpfDataplane::start(&EbpfOptions {
        cgroup_path: config.ebpf.cgroup_path.clone(),
        bpf_root: config.ebpf.bpf_root.clone(),
        frontends_capacity: config.ebpf.map_frontends,
        backends_capacity: config.ebpf.map_backends,
    })
    .context("cannot start the eBPF dataplane")?;

    let (tx, mut rx) = mpsc::channel(64);
    let source_name = source.name();
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
    let runner_config = ebpf_runner(&config);
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
                    break Err(anyhow::anyhow!("the {source_name} source stopped"));
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
                let changes = store.take_changes();
                // The first sync, a node change and the periodic resync cover every Service.
                let full = !synced_once || changes.node || reason == SyncReason::Periodic;
                synced_once = true;
                let scope = (!full).then_some(&changes.services);
                sync(store.objects(), &node, scope, &mut snapshot, &mut dataplane);
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
            "frontends the eBPF dataplane cannot program (mixed-family backends)"
        );
    }
    info!(
        service_ports = snapshot.v4.service_ports.len() + snapshot.v6.service_ports.len(),
        changed = update.changed.len(),
        written = summary.frontends_written,
        removed = summary.frontends_removed,
        unchanged = summary.frontends_unchanged,
        removed_backends = summary.removed_backends.len(),
        udp_sockets_destroyed = summary.udp_sockets_destroyed,
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
