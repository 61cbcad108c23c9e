//! The agent's main loop: source → desired state → dataplane, until a signal stops it.

use std::{collections::BTreeSet, path::PathBuf, time::Instant};

use anyhow::{Context as _, bail};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};
use tracing::{debug, error, info, warn};

use crate::{
    cli::{Args, ProxyMode},
    dataplane::ebpf::{EbpfDataplane, EbpfOptions},
    desired::{self, NodeContext},
    objects::{Kind, Objects, Store},
    source::{self, kubernetes::ClientOptions},
};

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

pub async fn run(args: Args) -> anyhow::Result<()> {
    if args.proxy_mode == ProxyMode::Iptables {
        bail!("--proxy-mode iptables is not implemented yet; use --proxy-mode ebpf");
    }
    let node = NodeContext {
        name: node_name(args.hostname_override.as_deref())?,
    };
    // Resolve the source before touching the kernel, so a bad flag fails fast.
    let source = match args.manifests.clone() {
        Some(manifests) => {
            if !manifests.is_dir() {
                bail!("--manifests {}: not a directory", manifests.display());
            }
            Source::Manifests(manifests)
        }
        None => Source::Kubernetes(
            source::kubernetes::client(&ClientOptions {
                kubeconfig: args.kubeconfig.clone(),
                master: args.master.clone(),
            })
            .await?,
        ),
    };
    info!(node = %node.name, mode = "ebpf", source = source.name(), "starting proxy-agent");

    let mut dataplane = EbpfDataplane::start(&EbpfOptions {
        cgroup_path: args.cgroup_path.clone(),
        bpf_root: args.bpf_root.clone(),
        frontends_capacity: args.bpf_map_frontends,
        backends_capacity: args.bpf_map_backends,
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
    let mut reported = BTreeSet::new();
    let mut synced_once = false;

    let outcome = loop {
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
