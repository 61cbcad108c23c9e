//! The agent's main loop: source → store → desired state → dataplane, until a signal stops it.
//! `startup.rs` starts the source and the node's HTTP servers; `report.rs` turns what a sync
//! did into logs and metrics; `process.rs` holds what runs around the loop (`--cleanup`,
//! `--init-only`, process settings).

mod process;
mod report;
mod startup;

use std::time::{Duration, SystemTime};

use anyhow::Context as _;
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
    startup::{Source, start_http_servers, start_source},
};
use crate::{
    datapath_checks::DatapathChecks,
    dataplane::Dataplane,
    drift_checks::{self, DriftChecks, DriftReport},
    http_servers::{HttpServers, rest_client::RestClientMetrics},
    source,
    sync_runner::{SyncReason, SyncRunner},
    traffic_reads::{Taken, TrafficReads},
};
use proxy_kernel::node::{NodeInputs, NodeManager, NodeSettings};
use proxy_model::{
    config::Config,
    desired::{IpFamily, NodeContext, Snapshot},
    objects::{Store, Update},
    proxy_mode::ProxyMode,
};

/// How often the eBPF dataplane's conntrack is garbage-collected. SNAT port reuse does not wait
/// for it (the datapath takes over dead flows' ports itself): the GC only keeps dead entries
/// from filling the LRU, so kube-proxy's default sync period is often enough, and a full walk
/// of the default 262 144 entries (~0.5 s) stays a small share of the agent's time.
const CONNTRACK_GC_INTERVAL: Duration = Duration::from_secs(30);
/// How often the per-Service traffic counters are read into the metrics: a fraction of a
/// usual scrape interval, so a scrape sees counts at most this old.
const SERVICE_TRAFFIC_READ_PERIOD: Duration = Duration::from_secs(3);

pub async fn run(config: Config) -> anyhow::Result<()> {
    let node = NodeContext::new(&node_name(config.hostname_override.as_deref())?, None);
    // Before the client and the metrics server: the first has to record into what the second
    // serves, and the metrics server starts only once the dataplane's mode is known.
    let rest_client = RestClientMetrics::from_feature_gates();
    let source = Source::resolve(&config, &rest_client).await?;
    info!(node = %node.name, mode = ?config.mode, source = source.name(), "starting proxy-agent");
    if config.bind_address_hard_fail {
        check_server_ports(&config)?;
    }
    apply_process_settings(&config);
    let mut store = Store::default();
    let source_name = source.name();
    let started = start_source(source, &node.name, &mut store);
    // On this worker, while the runtime's others run the source.
    let dataplane = tokio::task::block_in_place(|| Dataplane::start(&config))?;
    // As kube-proxy's platformCleanup at start: its nftables/IPVS modes' state would keep
    // intercepting Service traffic next to ours. The eBPF mode registers no NAT of its own, so
    // it keeps kube-proxy's (emptied) nftables tables while its connections last.
    remove_kube_proxy_modes(
        (dataplane.mode() == ProxyMode::Ebpf).then_some(config.ebpf.mode_switch_drain_period),
    );
    let http_servers = start_http_servers(
        &config,
        &dataplane,
        &node.name,
        started.node_required,
        rest_client,
    );
    let mut agent = Agent::new(
        config,
        node,
        store,
        dataplane,
        http_servers,
        started.service_warnings,
    );
    let outcome = agent.serve(started.updates, source_name).await;
    started.task.abort();
    match &outcome {
        Ok(signal) => info!(signal, "shutting down"),
        Err(error) => error!(%error, "shutting down"),
    }
    agent.dataplane.shutdown();
    agent.http_servers.shutdown();
    outcome.map(|_| ())
}

/// Everything the loop keeps between its wake-ups.
struct Agent {
    config: Config,
    node: NodeContext,
    store: Store,
    snapshot: Snapshot,
    dataplane: Dataplane,
    http_servers: HttpServers,
    service_warnings: Option<source::kubernetes::ServiceWarnings>,
    runner: SyncRunner,
    /// The Node object and the host's addresses → node settings (see `proxy_kernel::node`).
    node_manager: NodeManager,
    drift: DriftChecks,
    /// The datapath's health checks, run with the periodic drift check (`/healthz`).
    datapath_checks: DatapathChecks,
    synced_once: bool,
    /// The node services follow the snapshot by the changed service ports of each sync; after
    /// a sync they did not see (a failed one), they look at everything again.
    report_all: bool,
    other_mode_removed: bool,
    last_sync_wall: SystemTime,
    conntrack_gc_at: Instant,
    /// iptables: ipt.Monitor checks the canaries every syncPeriod on its own timer, whatever
    /// else is syncing (proxier.go NewProxier).
    canary_at: Instant,
    drift_at: Instant,
    traffic_at: Instant,
    /// The per-Service traffic reading in flight (on a blocking thread).
    traffic_reads: TrafficReads,
    host_namespace_only: bool,
}

impl Agent {
    fn new(
        config: Config,
        node: NodeContext,
        store: Store,
        dataplane: Dataplane,
        http_servers: HttpServers,
        service_warnings: Option<source::kubernetes::ServiceWarnings>,
    ) -> Self {
        let now = Instant::now();
        Self {
            runner: SyncRunner::new(dataplane.runner_config(&config), now),
            node_manager: NodeManager::new(NodeInputs::from_config(&config), &node.name),
            host_namespace_only: config.ebpf.socket_lb_host_namespace_only
                && dataplane.mode() == ProxyMode::Ebpf,
            conntrack_gc_at: now + CONNTRACK_GC_INTERVAL,
            canary_at: now + config.sync_period,
            drift_at: now + config.ebpf.drift_check_period,
            traffic_at: now + SERVICE_TRAFFIC_READ_PERIOD,
            traffic_reads: TrafficReads::new(
                config
                    .ebpf
                    .bpf_root
                    .join(proxy_dataplane_ebpf::PIN_DIR_NAME),
            ),
            drift: DriftChecks::default(),
            datapath_checks: DatapathChecks::new(&dataplane, http_servers.health()),
            snapshot: Snapshot::default(),
            synced_once: false,
            report_all: true,
            other_mode_removed: false,
            last_sync_wall: SystemTime::UNIX_EPOCH,
            config,
            node,
            store,
            dataplane,
            http_servers,
            service_warnings,
        }
    }

    /// Runs until a signal (its name) or an error that stops the agent.
    async fn serve(
        &mut self,
        mut updates: mpsc::Receiver<Update>,
        source_name: &str,
    ) -> anyhow::Result<&'static str> {
        let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
        let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
        // The drift checks read the kernel's state and compare it off this loop; the loop takes
        // their results, leaving out what it wrote meanwhile, and repairs (never concurrently
        // with a sync).
        let (drift_requests, mut drift_rx) = mpsc::channel(4);
        self.http_servers
            .metrics()
            .serve_drift_requests(drift_requests);
        let drift_period = self.config.ebpf.drift_check_period;
        let traffic = &self.http_servers.metrics().service_traffic().clone();
        traffic.set_limits(
            self.config.ebpf.service_traffic_max_series,
            self.config.ebpf.service_traffic_endpoints,
        );
        let traffic_enabled = traffic.enabled();
        loop {
            // Nothing is programmed until every kind was listed once (kube-proxy's rule), so a
            // restart never programs a half-empty view; with NodeCIDR, until the Node has
            // podCIDRs (or the wait fails, as upstream's).
            let ready = self
                .node_manager
                .ready(self.store.is_synced(), self.store.objects().node.as_ref())?;
            let wake = if ready {
                self.runner.next_wakeup(Instant::now())
            } else {
                Instant::now() + self.node_manager.poll_interval(self.config.sync_period)
            };
            // Generations the eBPF map writer retired are deleted when their grace ends even if
            // no sync comes (a removed Service's slots, a switched-out backend set).
            let retire_at = self.dataplane.next_retirement().map(Instant::from_std);
            tokio::select! {
                update = updates.recv() => {
                    let Some(update) = update else {
                        anyhow::bail!("the {source_name} source stopped");
                    };
                    self.take_updates(update, &mut updates);
                }
                () = self.node_manager.addresses_changed() => self.host_changed()?,
                // Not ready: the wake-up polls the node again.
                () = tokio::time::sleep_until(wake) => {
                    if let Some(reason) = ready.then(|| self.runner.due(Instant::now())).flatten() {
                        self.sync(reason)?;
                    }
                }
                // Its own timer, not the periodic sync's: a sync for changes resets that one, so
                // with Services changing more often than syncPeriod it would never come.
                () = tokio::time::sleep_until(self.canary_at), if self.dataplane.has_canary() => {
                    self.check_canaries();
                }
                () = tokio::time::sleep_until(retire_at.unwrap_or(wake)), if retire_at.is_some() => {
                    if self.dataplane.retire_generations() {
                        self.runner.request();
                    }
                }
                () = tokio::time::sleep_until(self.conntrack_gc_at),
                    if self.dataplane.has_conntrack() => self.conntrack_gc(),
                () = tokio::time::sleep_until(self.drift_at),
                    if self.synced_once && !drift_period.is_zero() && self.drift.periodic_idle() => {
                    self.start_periodic_drift_check();
                }
                done = self.drift.done() => {
                    let periodic_due = !drift_period.is_zero() && Instant::now() >= self.drift_at;
                    let finished = self.drift.finish(
                        done, &mut self.dataplane, &self.snapshot, self.http_servers.metrics(),
                        periodic_due);
                    if finished.sync_needed {
                        // iptables repairs with a full sync (the family is marked): now.
                        self.runner.request();
                    }
                    if let Some(report) = &finished.periodic {
                        self.datapath_checks.after_drift_check(
                            report, &mut self.dataplane, self.http_servers.health());
                    }
                }
                () = tokio::time::sleep_until(self.traffic_at),
                    if self.synced_once && traffic_enabled && self.traffic_reads.idle() => {
                    self.traffic_reads.start(&self.dataplane);
                    self.traffic_at = Instant::now() + SERVICE_TRAFFIC_READ_PERIOD;
                }
                Some(taken) = self.traffic_reads.done() => self.record_service_traffic(taken),
                // `/debug/drift` (rate limited by the metrics server): read off the loop,
                // answered when the reading is back.
                Some(reply) = drift_rx.recv() => self.answer_drift_request(reply),
                _ = sigint.recv() => return Ok("SIGINT"),
                _ = sigterm.recv() => return Ok("SIGTERM"),
            }
        }
    }

    /// Updates from the source into the store; what is already queued too, so a burst becomes
    /// one sync.
    fn take_updates(&mut self, first: Update, updates: &mut mpsc::Receiver<Update>) {
        let mut changed = self.store.apply(first);
        while let Ok(update) = updates.try_recv() {
            changed |= self.store.apply(update);
        }
        let pending = self.store.pending_changes();
        self.http_servers.metrics().changes(
            0,
            0,
            usize::try_from(pending.service_events).unwrap_or(usize::MAX),
            usize::try_from(pending.slice_events).unwrap_or(usize::MAX),
        );
        if changed || (self.store.is_synced() && !self.synced_once) {
            self.runner.request();
            for family in IpFamily::ALL {
                self.http_servers.queued(family);
            }
        }
    }

    /// An address added or removed on the host: NodePort addresses, tc attachment. Settings are
    /// recomputed now so that only a change the dataplane cares about costs a sync (pods come
    /// with link-local addresses on their veths).
    fn host_changed(&mut self) -> anyhow::Result<()> {
        debug!("host addresses or links changed");
        if let Some(settings) = self
            .node_manager
            .refresh(self.store.objects().node.as_ref())?
            && apply_node_settings(settings, &mut self.dataplane, &self.http_servers)
        {
            self.runner.request();
        }
        // A new pod's Service traffic is load-balanced only once its interface has the tc
        // program, which the sync attaches: do not wait for the periodic one. A link that went
        // down or up changes which interfaces are external (and the SNAT address) without
        // changing an address.
        if self.node_manager.take_links_changed() || self.host_namespace_only {
            self.runner.request();
        }
        Ok(())
    }

    /// One sync: node settings, the snapshot's changed Services, the dataplane, the reports.
    fn sync(&mut self, reason: SyncReason) -> anyhow::Result<()> {
        let changes = self.store.take_changes();
        self.http_servers
            .metrics()
            .changes(changes.service_events, changes.slice_events, 0, 0);
        if let Some(settings) = self
            .node_manager
            .refresh(self.store.objects().node.as_ref())?
        {
            apply_node_settings(settings, &mut self.dataplane, &self.http_servers);
        }
        // The first sync and a topology change recompute every Service.
        let all_services = !self.synced_once || changes.node.topology;
        if !self.synced_once || changes.node.any() {
            // The node decides /healthz's nodeEligible.
            self.http_servers
                .node_changed(self.store.objects().node.as_ref());
        }
        self.synced_once = true;
        let scope = (!all_services).then_some(&changes.services);
        let update_started = Instant::now();
        let started_wall = SystemTime::now();
        let update = self
            .snapshot
            .update(self.store.objects(), &self.node.name, scope);
        for error in &update.new_errors {
            warn!("{error}");
        }
        report_service_problems(
            &update,
            &self.snapshot,
            self.store.objects(),
            self.service_warnings.as_ref(),
            &self.http_servers,
        );
        let changed = (!all_services).then_some(&update.changed);
        if !self.other_mode_removed {
            self.dataplane.before_first_sync();
        }
        let outcome = self.dataplane.sync(&self.snapshot, changed, reason);
        let metrics = self.http_servers.metrics();
        record_sync(&outcome, reason, changed.map(|c| c.len()), metrics);
        let ok = outcome.ok();
        // Read before the sync is reported, so a scrape that sees the first sync's samples also
        // sees the datapath counters.
        if let Some(ebpf) = metrics.ebpf() {
            let counters = self.dataplane.datapath_counters();
            for (counter, value) in &counters {
                debug!(counter = counter.name(), value, "datapath counter");
            }
            ebpf.datapath_counters(&counters);
        }
        if ok {
            let scope = if self.report_all { None } else { changed };
            report_sync(
                &self.http_servers,
                self.store.objects(),
                &changes,
                &self.snapshot,
                scope,
                update_started.elapsed(),
                self.last_sync_wall,
            );
            self.last_sync_wall = started_wall;
        }
        self.report_all = !ok;
        if ok && !self.other_mode_removed {
            self.dataplane.remove_other_mode(&self.config);
            self.other_mode_removed = true;
        }
        debug!(
            elapsed_us = update_started.elapsed().as_micros() as u64,
            "sync done"
        );
        // A failed sync is retried after the retry interval (the sync period).
        self.runner.finished(Instant::now(), ok);
        log_snapshot_size(self.store.objects(), &self.snapshot);
        Ok(())
    }

    /// A per-Service traffic reading into the metrics; a failed one is logged and tried again
    /// at the next period.
    fn record_service_traffic(&mut self, taken: Taken) {
        match self.traffic_reads.finish(taken, &self.dataplane) {
            Ok(reading) => self
                .http_servers
                .metrics()
                .service_traffic()
                .record(&reading),
            Err(error) => warn!(%error, "cannot read the per-Service traffic counters"),
        }
    }

    fn check_canaries(&mut self) {
        let missing = self.dataplane.check_canaries();
        if missing {
            self.runner.request();
        }
        self.datapath_checks
            .canary_checked(!missing, self.http_servers.health());
        self.canary_at = Instant::now() + self.config.sync_period;
    }

    fn conntrack_gc(&mut self) {
        if let Some(progress) = self.dataplane.conntrack_gc() {
            record_conntrack_gc(&progress, self.http_servers.metrics());
        }
        self.conntrack_gc_at = Instant::now() + CONNTRACK_GC_INTERVAL;
    }

    /// Read and compared on another thread; the loop takes the result (and repairs) when it is
    /// done. In place only when no thread can start.
    /// The datapath's health checks first (the attachments are repaired there, between
    /// syncs; see `datapath_checks`), then the maps' check.
    fn start_periodic_drift_check(&mut self) {
        self.datapath_checks
            .before_drift_check(&mut self.dataplane, self.http_servers.health());
        if !self
            .drift
            .start_periodic(&mut self.dataplane, &self.snapshot)
        {
            let report = drift_checks::check(
                &mut self.dataplane,
                true,
                self.http_servers.metrics(),
                &self.snapshot,
            );
            if report.mode == "iptables" && !report.drift.is_empty() {
                // iptables repairs with a full sync (the family is marked): now.
                self.runner.request();
            }
            self.datapath_checks.after_drift_check(
                &report,
                &mut self.dataplane,
                self.http_servers.health(),
            );
        }
        self.drift_at = Instant::now() + self.config.ebpf.drift_check_period;
    }

    fn answer_drift_request(&mut self, reply: drift_checks::Reply) {
        if self.synced_once {
            self.drift
                .request(reply, &mut self.dataplane, &self.snapshot);
        } else {
            let report = DriftReport::not_checked(self.dataplane.mode_name(), "no sync yet");
            // The requester may have gone (timeout): nothing to do then.
            let _ = reply.send(serde_json::to_string(&report).unwrap_or_default());
        }
    }
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
