//! The agent's main loop: source → store → desired state → dataplane, until a signal stops it.
//! `startup.rs` starts the source and the node's HTTP servers; `report.rs` turns what a sync
//! did into logs and metrics; `process.rs` holds what runs around the loop (`--cleanup`,
//! `--init-only`, process settings).

mod process;
mod report;
mod startup;

use std::{
    collections::BTreeSet,
    time::{Duration, SystemTime},
};

use anyhow::Context as _;
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
    task::JoinHandle,
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
    dataplane::{Dataplane, SyncOutcome},
    drift_checks::{self, DriftChecks, DriftReport},
    http_servers::{HttpServers, rest_client::RestClientMetrics},
    source,
    sync_runner::{SyncReason, SyncRunner},
    traffic_reads::{Taken, TrafficReads},
};
use proxy_dataplane_ebpf::FullPass;
use proxy_dataplane_iptables::CanaryReading;
use proxy_kernel::node::{NodeInputs, NodeManager, NodeSettings};
use proxy_model::{
    config::Config,
    desired::{IpFamily, NodeContext, ServicePortName, Snapshot},
    objects::{Changes, Store, Update},
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
    let mut store = Store::started_at(SystemTime::now());
    let source_name = source.name();
    let started = start_source(source, &node.name, &mut store);
    // On this worker, while the runtime's others run the source.
    // With `--tc-fast-path=auto` the node's forward chains decide the path the programs start
    // on, so that a node with a forwarding policy never runs a moment without it.
    let fast_path = tokio::task::block_in_place(|| crate::fast_path::start(&config));
    let dataplane = tokio::task::block_in_place(|| Dataplane::start(&config, fast_path.on))?;
    let forward_policy = if dataplane.mode() == ProxyMode::Ebpf {
        crate::fast_path::watch(&fast_path)
    } else {
        None
    };
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
    agent.forward_policy = forward_policy;
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
    conntrack_gc_at: Instant,
    /// iptables: ipt.Monitor checks the canaries every syncPeriod on its own timer, whatever
    /// else is syncing (proxier.go NewProxier).
    canary_at: Instant,
    drift_at: Instant,
    traffic_at: Instant,
    /// The per-Service traffic reading in flight (on a blocking thread).
    traffic_reads: TrafficReads,
    host_namespace_only: bool,
    /// The datapath's health checks ran for the periodic drift check due: it starts next.
    drift_prepared: bool,
    /// iptables: the canary reading in flight (on a blocking thread).
    canary_read: Option<JoinHandle<CanaryReading>>,
    /// eBPF: the read of the kernel's NATed flows after the first sync (on a blocking thread).
    kernel_flows_read: Option<JoinHandle<proxy_dataplane_ebpf::KernelNatFlows>>,
    /// eBPF: the periodic sync's full pass in flight, one step per loop turn.
    full_pass: Option<PeriodicPass>,
    /// eBPF with `--tc-fast-path=auto`: the forwarding policy watch's decisions.
    forward_policy: Option<mpsc::Receiver<proxy_model::forward_policy::ForwardPolicy>>,
}

/// How many changed Services and service ports a sync's leftovers must hold to be freed on the
/// blocking pool rather than on the loop.
const FREE_OFF_LOOP_FROM: usize = 1000;

/// Frees `value` on the blocking pool. A full sync's change sets at 50k Services are 100k heap
/// objects whose frees (and reference counts shared with the store) take tens of milliseconds,
/// which a change that came meanwhile would wait for.
fn free_off_loop<T: Send + 'static>(value: T) {
    tokio::task::spawn_blocking(move || drop(value));
}

/// What a sync took when it began, for its report.
struct SyncBegun {
    reason: SyncReason,
    changes: Changes,
    /// The snapshot's update and what else came before the dataplane's part.
    prepared: Duration,
}

/// A periodic sync whose full pass runs in steps (see `Agent::full_pass_step`).
struct PeriodicPass {
    pass: FullPass,
    /// The service ports the sync that started it changed in the snapshot.
    changed: BTreeSet<ServicePortName>,
    begun: SyncBegun,
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
            full_pass: None,
            forward_policy: None,
            canary_read: None,
            kernel_flows_read: None,
            drift_prepared: false,
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
            // The select only says what happened; the work is done below, timed, so that what
            // holds the loop (and the changes behind it) shows in the debug log.
            let event = tokio::select! {
                update = updates.recv() => match update {
                    Some(update) => Event::Update(update),
                    None => anyhow::bail!("the {source_name} source stopped"),
                },
                () = self.node_manager.addresses_changed() => Event::HostChanged,
                // Not ready: the wake-up polls the node again.
                () = tokio::time::sleep_until(wake) => Event::Wake { ready },
                // Its own timer, not the periodic sync's: a sync for changes resets that one, so
                // with Services changing more often than syncPeriod it would never come.
                () = tokio::time::sleep_until(self.canary_at),
                    if self.dataplane.has_canary() && self.canary_read.is_none() => Event::Canary,
                reading = canary_read_done(&mut self.canary_read) => Event::CanaryDone(reading),
                flows = joined(&mut self.kernel_flows_read) => Event::KernelFlowsRead(flows),
                // A forwarding policy that appeared must apply at once: handled in its own
                // turn, which costs a tc refresh (milliseconds), not a sync.
                policy = forward_policy_changed(&mut self.forward_policy) => {
                    Event::ForwardPolicy(policy)
                }
                () = tokio::time::sleep_until(retire_at.unwrap_or(wake)), if retire_at.is_some() => {
                    Event::Retire
                }
                () = tokio::time::sleep_until(self.conntrack_gc_at),
                    if self.dataplane.has_conntrack() => Event::ConntrackGc,
                () = tokio::time::sleep_until(self.drift_at),
                    if self.synced_once && !drift_period.is_zero() && self.drift.periodic_idle() => {
                    if self.drift_prepared {
                        Event::DriftDue
                    } else {
                        Event::DriftPrepare
                    }
                }
                done = self.drift.done() => Event::DriftDone(done),
                () = tokio::time::sleep_until(self.traffic_at),
                    if self.synced_once && traffic_enabled && self.traffic_reads.idle() => {
                    Event::TrafficDue
                }
                Some(taken) = self.traffic_reads.done() => Event::TrafficDone(taken),
                // `/debug/drift` (rate limited by the metrics server): read off the loop,
                // answered when the reading is back.
                Some(reply) = drift_rx.recv() => Event::DriftRequest(reply),
                // The periodic full pass goes on whenever nothing else is ready (the select
                // picks among ready branches at random: a change waits one step at most).
                () = std::future::ready(()), if self.full_pass.is_some() => Event::FullPassStep,
                // The names a first sync left (eBPF): right after it, in a turn of their own.
                () = std::future::ready(()), if self.dataplane.names_pending() => {
                    Event::ServiceNames
                }
                // As the full pass: the eBPF drift check's record is copied a step per turn,
                // so a change that comes meanwhile waits for one step, not the whole copy.
                () = std::future::ready(()), if self.drift.copying() => Event::DriftCopyStep,
                _ = sigint.recv() => return Ok("SIGINT"),
                _ = sigterm.recv() => return Ok("SIGTERM"),
            };
            let turn = event.name();
            let started = Instant::now();
            match event {
                Event::Update(update) => {
                    self.take_updates(update, &mut updates);
                    // A change is synced in this turn when the runner allows it now (always in
                    // eBPF mode, where the minimum interval is zero): no timer round trip, which
                    // tokio rounds up to the next millisecond.
                    self.sync_if_due(ready)?;
                }
                Event::HostChanged => self.host_changed()?,
                Event::Wake { ready } => self.sync_if_due(ready)?,
                Event::Canary => self.start_canary_read(),
                Event::CanaryDone(reading) => self.canaries_read(reading),
                Event::KernelFlowsRead(flows) => {
                    // A read that failed adopts nothing; the programs stop waiting for it all
                    // the same.
                    let flows = flows
                        .inspect_err(|error| warn!(%error, "the read of the kernel's NATed flows did not finish"))
                        .unwrap_or_default();
                    self.dataplane.adopt_kernel_nat_flows(&flows);
                }
                Event::Retire => {
                    if self.dataplane.retire_generations() {
                        self.runner.request();
                    }
                }
                Event::ConntrackGc => self.conntrack_gc(),
                Event::DriftPrepare => self.prepare_periodic_drift_check(),
                Event::DriftDue => self.start_periodic_drift_check(),
                Event::DriftCopyStep => self.drift.copy_step(&mut self.dataplane),
                Event::DriftDone(done) => {
                    let periodic_due = !drift_period.is_zero() && Instant::now() >= self.drift_at;
                    let finished = self.drift.finish(
                        done,
                        &mut self.dataplane,
                        &self.snapshot,
                        self.http_servers.metrics(),
                        periodic_due,
                    );
                    if finished.sync_needed {
                        // iptables repairs with a full sync (the family is marked): now.
                        self.runner.request();
                    }
                    if let Some(report) = &finished.periodic {
                        self.datapath_checks.after_drift_check(
                            report,
                            &mut self.dataplane,
                            self.http_servers.health(),
                        );
                    }
                }
                Event::TrafficDue => {
                    self.traffic_reads.start(&self.dataplane);
                    self.traffic_at = Instant::now() + SERVICE_TRAFFIC_READ_PERIOD;
                }
                Event::TrafficDone(taken) => self.record_service_traffic(taken),
                Event::DriftRequest(reply) => self.answer_drift_request(reply),
                Event::FullPassStep => self.full_pass_step()?,
                Event::ServiceNames => self.dataplane.write_pending_names(&self.snapshot),
                Event::ForwardPolicy(Some(policy)) => self.forward_policy_changed(&policy),
                Event::ForwardPolicy(None) => {
                    warn!("the forwarding policy watch stopped: the fast path stays as it is");
                    self.forward_policy = None;
                }
            }
            debug!(
                turn,
                elapsed_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                "loop turn"
            );
        }
    }

    /// `--tc-fast-path=auto`: the node's forwarding policy changed; the path follows now.
    fn forward_policy_changed(&mut self, policy: &proxy_model::forward_policy::ForwardPolicy) {
        crate::fast_path::log_decision(policy);
        if let Some(on) = self.dataplane.set_fast_path(policy.fast_path_safe())
            && let Some(metrics) = self.http_servers.metrics().ebpf()
        {
            metrics.fast_path_active(on);
        }
    }

    /// A sync when the runner says one is due now (and the node is ready for it).
    fn sync_if_due(&mut self, ready: bool) -> anyhow::Result<()> {
        if !ready {
            return Ok(());
        }
        match self.runner.due(Instant::now()) {
            // The pass in flight is the periodic sync: one for changes meanwhile.
            Some(SyncReason::Periodic) if self.full_pass.is_some() => {
                self.sync(SyncReason::Changes)
            }
            Some(reason) => self.sync(reason),
            None => Ok(()),
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
    /// eBPF's periodic sync only starts here: its full pass runs in steps between the loop's
    /// other work ([`Agent::full_pass_step`]) and is reported when its last step is done.
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
        let begun = SyncBegun {
            reason,
            changes,
            prepared: update_started.elapsed(),
        };
        if reason == SyncReason::Periodic
            && self.dataplane.steps_full_pass()
            && let Some(changed) = changed
        {
            // Its first step (with the changes this sync took) in this turn: a pass that fits
            // in one step is done here, as a sync in one go would be.
            self.runner.pass_started(Instant::now());
            self.full_pass = Some(PeriodicPass {
                pass: FullPass::new(changed),
                changed: changed.clone(),
                begun,
            });
            return self.full_pass_step();
        }
        let outcome = self.dataplane.sync(&self.snapshot, changed, reason);
        self.synced(outcome, &begun, changed, update_started.elapsed());
        if update.changed.len() + begun.changes.services.len() >= FREE_OFF_LOOP_FROM {
            free_off_loop((update, begun));
        }
        Ok(())
    }

    /// The next step of the periodic full pass in flight; its end is reported as the periodic
    /// sync (with the changes the sync that started it took).
    fn full_pass_step(&mut self) -> anyhow::Result<()> {
        let Some(mut pass) = self.full_pass.take() else {
            return Ok(());
        };
        match self
            .dataplane
            .full_pass_step(&self.snapshot, &mut pass.pass)
        {
            Some(outcome) => {
                debug!(steps = pass.pass.steps(), "periodic full pass done");
                // Its time is the steps' own, not the loop's other work between them.
                let elapsed = pass.begun.prepared + pass.pass.work;
                self.synced(outcome, &pass.begun, Some(&pass.changed), elapsed);
            }
            None => self.full_pass = Some(pass),
        }
        Ok(())
    }

    /// What a sync did, reported: logs, metrics, the node services, the runner. `elapsed`: its
    /// duration for the metrics.
    fn synced(
        &mut self,
        outcome: SyncOutcome,
        begun: &SyncBegun,
        changed: Option<&BTreeSet<ServicePortName>>,
        elapsed: Duration,
    ) {
        let reporting = Instant::now();
        let metrics = self.http_servers.metrics();
        record_sync(
            &outcome,
            begun.reason,
            changed.map(|c| c.len()),
            begun.prepared,
            metrics,
        );
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
                &begun.changes,
                &self.snapshot,
                scope,
                elapsed,
            );
        }
        self.report_all = !ok;
        if ok && !self.other_mode_removed {
            self.kernel_flows_read = self.dataplane.remove_other_mode(&self.config);
            self.other_mode_removed = true;
        }
        // What the report took after the sync (`sync applied` is logged before it): the loop's
        // time after a sync that the next change may wait for.
        debug!(
            elapsed_us = elapsed.as_micros() as u64,
            reported_us = reporting.elapsed().as_micros() as u64,
            "sync done"
        );
        // A failed sync is retried after the retry interval (the sync period). A full pass in
        // steps keeps a retry that a sync for changes between its steps scheduled: the pass
        // may have gone past that sync's service ports before it.
        if begun.reason == SyncReason::Periodic && self.dataplane.steps_full_pass() {
            self.runner.pass_finished(Instant::now(), ok);
        } else {
            self.runner.finished(Instant::now(), ok);
        }
        log_snapshot_size(self.store.objects(), &self.snapshot);
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

    /// The canaries are listed on a blocking thread (a process per family, polls after a
    /// flush): the loop goes on syncing meanwhile, and settles the reading when it is back.
    fn start_canary_read(&mut self) {
        if let Some(reader) = self.dataplane.canary_reader() {
            self.canary_read = Some(tokio::task::spawn_blocking(move || reader.run()));
        }
    }

    /// A canary reading: a flush recreates them and requests the full resync now; `None` (the
    /// thread failed) is tried again at the next period.
    fn canaries_read(&mut self, reading: Option<CanaryReading>) {
        self.canary_at = Instant::now() + self.config.sync_period;
        let Some(reading) = reading else {
            return;
        };
        let missing = self.dataplane.settle_canaries(&reading);
        if missing {
            self.runner.request();
        }
        self.datapath_checks
            .canary_checked(!missing, self.http_servers.health());
    }

    fn conntrack_gc(&mut self) {
        if let Some(progress) = self.dataplane.conntrack_gc() {
            record_conntrack_gc(&progress, self.http_servers.metrics());
        }
        self.conntrack_gc_at = Instant::now() + CONNTRACK_GC_INTERVAL;
    }

    /// The datapath's health checks (the attachments are repaired there, between syncs; see
    /// `datapath_checks`), in a turn of their own before the maps' check starts in the next
    /// one (whose copy of the record then goes a step per turn): the self-test's runs are
    /// milliseconds at 50k Services, and a change that comes meanwhile waits for them only.
    fn prepare_periodic_drift_check(&mut self) {
        self.datapath_checks
            .before_drift_check(&mut self.dataplane, self.http_servers.health());
        self.drift_prepared = true;
    }

    /// Read and compared on another thread; the loop takes the result (and repairs) when it is
    /// done. In place only when no thread can start.
    fn start_periodic_drift_check(&mut self) {
        self.drift_prepared = false;
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

/// The canary reading in flight, when it is back (pending forever when there is none); `None`
/// when its thread failed (logged).
async fn canary_read_done(read: &mut Option<JoinHandle<CanaryReading>>) -> Option<CanaryReading> {
    let Some(task) = read.as_mut() else {
        return std::future::pending().await;
    };
    let reading = task.await;
    *read = None;
    reading
        .inspect_err(|error| warn!(%error, "the iptables canary check did not finish"))
        .ok()
}

/// The blocking task in `task` joined (pending forever while there is none).
async fn joined<T>(task: &mut Option<JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    let Some(running) = task.as_mut() else {
        return std::future::pending().await;
    };
    let result = running.await;
    *task = None;
    result
}

/// The forwarding policy watch's next decision (pending forever without a watch); `None` when
/// its thread ended.
async fn forward_policy_changed(
    watch: &mut Option<mpsc::Receiver<proxy_model::forward_policy::ForwardPolicy>>,
) -> Option<proxy_model::forward_policy::ForwardPolicy> {
    match watch.as_mut() {
        Some(receiver) => receiver.recv().await,
        None => std::future::pending().await,
    }
}

/// What woke the loop up (see `Agent::serve`).
enum Event {
    Update(Update),
    HostChanged,
    /// The sync runner's wake-up (or, not ready, the node poll).
    Wake {
        ready: bool,
    },
    Canary,
    CanaryDone(Option<CanaryReading>),
    KernelFlowsRead(Result<proxy_dataplane_ebpf::KernelNatFlows, tokio::task::JoinError>),
    Retire,
    ConntrackGc,
    /// The datapath's health checks that come before the periodic drift check.
    DriftPrepare,
    DriftDue,
    /// A step of the eBPF drift check's record copy.
    DriftCopyStep,
    DriftDone(drift_checks::Done),
    TrafficDue,
    TrafficDone(Taken),
    DriftRequest(drift_checks::Reply),
    FullPassStep,
    ServiceNames,
    /// `--tc-fast-path=auto`: a new decision on the node's forwarding policy (`None`: the
    /// watch ended).
    ForwardPolicy(Option<proxy_model::forward_policy::ForwardPolicy>),
}

impl Event {
    /// Its name in the loop's debug log.
    fn name(&self) -> &'static str {
        match self {
            Event::Update(_) => "updates",
            Event::HostChanged => "host changed",
            Event::Wake { .. } => "sync runner",
            Event::Canary => "iptables canary read start",
            Event::CanaryDone(_) => "iptables canary read finish",
            Event::KernelFlowsRead(_) => "kernel NAT flows read finish",
            Event::Retire => "retire generations",
            Event::ConntrackGc => "conntrack gc",
            Event::DriftPrepare => "datapath checks",
            Event::DriftDue => "drift check start",
            Event::DriftCopyStep => "drift check copy step",
            Event::DriftDone(_) => "drift check finish",
            Event::TrafficDue => "traffic read start",
            Event::TrafficDone(_) => "traffic read finish",
            Event::DriftRequest(_) => "drift request",
            Event::FullPassStep => "full pass step",
            Event::ServiceNames => "service names",
            Event::ForwardPolicy(_) => "forwarding policy changed",
        }
    }
}
