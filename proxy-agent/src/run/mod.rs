//! The agent's main loop: source → store → desired state → dataplane, until a signal stops it.
//! `report.rs` turns what a sync did into logs and metrics; `process.rs` holds what runs
//! around the loop (`--cleanup`, `--init-only`, process settings).

mod process;
mod report;

use std::{
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

pub use self::process::{cleanup, init_only, limit_malloc_arenas};
use self::{
    process::{apply_process_settings, check_server_ports, node_name, remove_kube_proxy_modes},
    report::{log_snapshot_size, record_conntrack_gc, record_sync, report_sync},
};
use crate::{
    dataplane::Dataplane,
    http_servers::{HttpServers, HttpServersConfig},
    source::{self, kubernetes::ClientOptions},
    sync_runner::SyncRunner,
};
use proxy_kernel::node::{NodeInputs, NodeManager, NodeSettings};
use proxy_model::{
    config::Config,
    desired::{IpFamily, NodeContext, Snapshot},
    objects::{Kind, Store},
    proxy_mode::ProxyMode,
};

/// How often the eBPF dataplane's conntrack is garbage-collected. SNAT port reuse does not wait
/// for it (the datapath takes over dead flows' ports itself): the GC only keeps dead entries
/// from filling the LRU, so kube-proxy's default sync period is often enough, and a full walk
/// of the default 262 144 entries (~0.5 s) stays a small share of the agent's time.
const CONNTRACK_GC_INTERVAL: Duration = Duration::from_secs(30);

/// Where the objects come from.
enum Source {
    Manifests(PathBuf),
    Kubernetes(kube::Client, source::kubernetes::Encoding),
}

impl Source {
    fn name(&self) -> &'static str {
        match self {
            Self::Manifests(_) => "manifests",
            Self::Kubernetes(..) => "kubernetes",
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
                qps: config.client_connection.qps,
                burst: config.client_connection.burst,
            })
            .await?,
            source::kubernetes::Encoding::new(
                &config.client_connection.content_type,
                &config.client_connection.accept_content_types,
            )?,
        ),
    };
    let source_name = source.name();
    info!(node = %node.name, mode = ?config.mode, source = source_name, "starting proxy-agent");

    if config.bind_address_hard_fail {
        check_server_ports(&config)?;
    }
    apply_process_settings(&config);
    // The source reads (a manifests folder, the API server's lists) while the programs load:
    // the kernel's verifier takes seconds for the tc programs, and neither waits for the other
    // (nothing is programmed before the dataplane has started and every kind was listed).
    let node_required = matches!(source, Source::Kubernetes(..));
    let (tx, mut rx) = mpsc::channel(64);
    let mut store = Store::default();
    let mut service_warnings = None;
    let source_task = match source {
        Source::Manifests(dir) => {
            // A manifests folder may hold no Node: that counts as listed.
            store.mark_synced(Kind::Node);
            tokio::spawn(source::manifests::run(dir, node.name.clone(), tx))
        }
        // The Node is watched like the other kinds: the first sync waits for its list.
        Source::Kubernetes(client, encoding) => {
            let name = node.name.clone();
            let events = client.clone();
            let event_node = node.name.clone();
            service_warnings = Some(source::kubernetes::service_warnings(
                client.clone(),
                &node.name,
            ));
            tokio::spawn(async move {
                source::kubernetes::post_starting_event(events, &event_node).await;
            });
            tokio::spawn(async move {
                source::kubernetes::run(client, encoding, name, tx).await;
                Ok(())
            })
        }
    };
    // On this worker, while the runtime's others run the source.
    let mut dataplane = tokio::task::block_in_place(|| Dataplane::start(&config))?;
    // As kube-proxy's platformCleanup at start: its nftables/IPVS modes' state would keep
    // intercepting Service traffic next to ours. The eBPF mode registers no NAT of its own, so
    // it keeps kube-proxy's (emptied) nftables tables while its connections last.
    remove_kube_proxy_modes(
        (dataplane.mode() == proxy_model::proxy_mode::ProxyMode::Ebpf)
            .then_some(config.ebpf.mode_switch_drain_period),
    );
    // /healthz /livez, health check node ports, /metrics /proxyMode — for the mode actually
    // running (after a fallback, iptables).
    let http_servers = HttpServers::start(&HttpServersConfig {
        healthz_bind_address: config.healthz_bind_address,
        metrics_bind_address: config.metrics_bind_address,
        node_required,
        ..HttpServersConfig::new(&node.name, dataplane.mode(), config.sync_period)
    });
    http_servers
        .metrics()
        .set_debug(config.configz.clone(), config.enable_profiling);
    if let Some(iptables) = http_servers.metrics().iptables() {
        iptables.read_nfacct_with(Box::new(|name| {
            proxy_dataplane_iptables::nfacct::packets(name).map_err(|e| e.to_string())
        }));
    }
    if let (Some(metrics), Dataplane::Ebpf(ebpf)) = (http_servers.metrics().ebpf(), &dataplane) {
        let features: Vec<_> = ebpf
            .features()
            .states()
            .iter()
            .map(|state| (state.feature.name(), state.used()))
            .collect();
        metrics.kernel_features(&features);
    }
    for family in IpFamily::ALL {
        http_servers.loop_started(family);
    }
    let mut last_sync_wall = SystemTime::UNIX_EPOCH;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut snapshot = Snapshot::default();
    let mut synced_once = false;
    // The node services follow the snapshot by the changed service ports of each sync; after a
    // sync they did not see (a failed one), they look at everything again.
    let mut report_all = true;
    let mut other_mode_removed = false;
    let runner_config = dataplane.runner_config(&config);
    let mut runner = SyncRunner::new(runner_config, Instant::now());
    let mut conntrack_gc_at = Instant::now() + CONNTRACK_GC_INTERVAL;
    // iptables: ipt.Monitor checks the canaries every syncPeriod on its own timer, whatever
    // else is syncing (proxier.go NewProxier).
    let mut canary_at = Instant::now() + config.sync_period;
    // The Node object and the host's addresses → node settings (see `node/`).
    let mut node_manager = NodeManager::new(NodeInputs::from_config(&config), &node.name);
    // The drift checks read the kernel's state and compare it off this loop; the loop takes
    // their results, leaving out what it wrote meanwhile, and repairs (never concurrently with
    // a sync).
    let (drift_requests, mut drift_rx) = tokio::sync::mpsc::channel(4);
    http_servers.metrics().serve_drift_requests(drift_requests);
    let drift_period = config.ebpf.drift_check_period;
    let host_namespace_only =
        config.ebpf.socket_lb_host_namespace_only && dataplane.mode() == ProxyMode::Ebpf;
    let mut drift_at = Instant::now() + drift_period;
    let mut drift = crate::drift_checks::DriftChecks::default();

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
        // Generations the eBPF map writer retired are deleted when their grace ends even if no
        // sync comes (a removed Service's slots, a switched-out backend set).
        let retire_at = dataplane.next_retirement().map(Instant::from_std);
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
                http_servers.metrics().changes(
                    0,
                    0,
                    usize::try_from(pending.service_events).unwrap_or(usize::MAX),
                    usize::try_from(pending.slice_events).unwrap_or(usize::MAX),
                );
                if changed || (store.is_synced() && !synced_once) {
                    runner.request();
                    for family in IpFamily::ALL {
                        http_servers.queued(family);
                    }
                }
            }
            // An address added or removed on the host: NodePort addresses, tc attachment.
            // Settings are recomputed now so that only a change the dataplane cares about costs
            // a sync (pods come with link-local addresses on their veths).
            () = node_manager.addresses_changed() => {
                debug!("host addresses or links changed");
                match node_manager.refresh(store.objects().node.as_ref()) {
                    Ok(Some(settings)) => {
                        if apply_node_settings(settings, &mut dataplane, &http_servers) {
                            runner.request();
                        }
                    }
                    Ok(None) => {}
                    Err(error) => break Err(error.into()),
                }
                // A new pod's Service traffic is load-balanced only once its interface has the
                // tc program, which the sync attaches: do not wait for the periodic one. A link
                // that went down or up changes which interfaces are external (and the SNAT
                // address) without changing an address.
                if node_manager.take_links_changed() || host_namespace_only {
                    runner.request();
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
                http_servers
                    .metrics()
                    .changes(changes.service_events, changes.slice_events, 0, 0);
                match node_manager.refresh(store.objects().node.as_ref()) {
                    Ok(Some(settings)) => {
                        apply_node_settings(settings, &mut dataplane, &http_servers);
                    }
                    Ok(None) => {}
                    Err(error) => break Err(error.into()),
                }
                // The first sync and a topology change recompute every Service.
                let all_services = !synced_once || changes.node.topology;
                if !synced_once || changes.node.any() {
                    // The node decides /healthz's nodeEligible.
                    http_servers.node_changed(store.objects().node.as_ref());
                }
                synced_once = true;
                let scope = (!all_services).then_some(&changes.services);
                let update_started = Instant::now();
                let started_wall = SystemTime::now();
                let update = snapshot.update(store.objects(), &node.name, scope);
                for error in &update.new_errors {
                    warn!("{error}");
                }
                report_service_problems(
                    &update, &snapshot, store.objects(), service_warnings.as_ref(), &http_servers);
                let changed = (!all_services).then_some(&update.changed);
                let outcome = dataplane.sync(&snapshot, changed, reason);
                record_sync(&outcome, reason, changed.map(|c| c.len()), http_servers.metrics());
                let ok = outcome.ok();
                // Read before the sync is reported, so a scrape that sees the first sync's
                // samples also sees the datapath counters.
                if let Some(ebpf) = http_servers.metrics().ebpf() {
                    let counters = dataplane.datapath_counters();
                    for (counter, value) in &counters {
                        debug!(counter, value, "datapath counter");
                    }
                    ebpf.datapath_counters(&counters);
                }
                if ok {
                    let scope = if report_all { None } else { changed };
                    report_sync(&http_servers, store.objects(), &changes, &snapshot, scope,
                        update_started.elapsed(), last_sync_wall);
                    last_sync_wall = started_wall;
                }
                report_all = !ok;
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
            () = tokio::time::sleep_until(retire_at.unwrap_or(wake)), if retire_at.is_some() => {
                if dataplane.retire_generations() {
                    runner.request();
                }
            }
            () = tokio::time::sleep_until(conntrack_gc_at), if dataplane.has_conntrack() => {
                if let Some(progress) = dataplane.conntrack_gc() {
                    record_conntrack_gc(&progress, http_servers.metrics());
                }
                conntrack_gc_at = Instant::now() + CONNTRACK_GC_INTERVAL;
            }
            () = tokio::time::sleep_until(drift_at),
                if synced_once && !drift_period.is_zero() && drift.periodic_idle() => {
                // Read and compared on another thread; the result is taken (and repaired) by
                // the branch below. In place only when no thread can start.
                if !drift.start_periodic(&mut dataplane, &snapshot) {
                    let report = crate::drift_checks::check(
                        &mut dataplane, true, http_servers.metrics(), &snapshot);
                    if report.mode == "iptables" && !report.drift.is_empty() {
                        // iptables repairs with a full sync (the family is marked): now.
                        runner.request();
                    }
                }
                drift_at = Instant::now() + drift_period;
            }
            done = drift.done() => {
                let periodic_due = !drift_period.is_zero() && Instant::now() >= drift_at;
                let finished = drift.finish(
                    done, &mut dataplane, &snapshot, http_servers.metrics(), periodic_due);
                if finished.sync_needed {
                    // iptables repairs with a full sync (the family is marked): now.
                    runner.request();
                }
            }
            // `/debug/drift` (rate limited by the metrics server): read off the loop, answered
            // when the reading is back.
            Some(reply) = drift_rx.recv() => {
                if synced_once {
                    drift.request(reply, &mut dataplane, &snapshot);
                } else {
                    let report =
                        crate::drift_checks::DriftReport::not_checked(dataplane.mode_name(), "no sync yet");
                    // The requester may have gone (timeout): nothing to do then.
                    let _ = reply.send(serde_json::to_string(&report).unwrap_or_default());
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
    http_servers.shutdown();
    outcome.map(|_| ())
}

/// New node settings: to the dataplane and to the health check node ports. Returns whether the
/// dataplane needs a sync for them.
fn apply_node_settings(
    settings: &NodeSettings,
    dataplane: &mut Dataplane,
    http_servers: &HttpServers,
) -> bool {
    http_servers.set_health_check_ips(settings.health_check_ips.clone());
    dataplane.set_node(settings)
}

/// What the desired state refused, as metrics, and each newly refused field of a Service as a
/// Warning Event on it (API source).
fn report_service_problems(
    update: &proxy_model::desired::SnapshotUpdate,
    snapshot: &Snapshot,
    objects: &proxy_model::objects::Objects,
    events: Option<&source::kubernetes::ServiceWarnings>,
    http_servers: &HttpServers,
) {
    let mut ignored = std::collections::BTreeMap::new();
    for reason in snapshot
        .errors()
        .filter_map(|error| error.unusable_reason())
    {
        *ignored.entry(reason).or_insert(0) += 1;
    }
    http_servers
        .metrics()
        .service_problems(&ignored, snapshot.conflicts());
    let Some(events) = events else {
        return;
    };
    for error in &update.new_errors {
        if let Some((service, reason)) = error.event() {
            events.post(source::kubernetes::ServiceEvent {
                namespace: service.namespace.to_string(),
                name: service.name.to_string(),
                uid: objects
                    .services
                    .get(service)
                    .and_then(|info| info.uid.as_deref())
                    .map(str::to_owned),
                reason,
                note: error.to_string(),
            });
        }
    }
}
