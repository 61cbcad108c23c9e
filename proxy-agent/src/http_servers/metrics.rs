//! kube-proxy's metrics (`pkg/proxy/metrics`, subsystem `kubeproxy`) and ours (`kubeproxy_ebpf_`),
//! in one prometheus-client registry served on `--metrics-bind-address` with `/metrics`,
//! `/proxyMode` and `/healthz`, as kube-proxy's metrics server does.
//!
//! The histograms are `histogram.rs`'s: with the `NativeHistograms` feature gate (on by
//! default, as in kube-proxy 1.37) each also keeps native buckets with component-base's
//! options, which only the protobuf exposition carries (`protobuf.rs`, negotiated as expfmt
//! does); the text formats are the same either way.
//!
//! Names, types, labels, buckets and help strings follow kube-proxy. Help strings carry the
//! `[ALPHA] ` prefix that Kubernetes' component-base adds to every ALPHA metric. The registry
//! writes OpenMetrics text (a counter's `# TYPE` line names the family without `_total`);
//! `/metrics` answers the classic text format unless OpenMetrics is asked for
//! (`exposition.rs`). The nfacct counters are read from the kernel at each scrape, as
//! upstream's collector does. client-go's `rest_client_*` families (`rest_client.rs`) are
//! served here and fed by the API client, in both modes.
//!
//! The same server answers `/configz` (the effective configuration) and, with `--profiling`,
//! `/debug/flags/v` (klog's verbosity), as kube-proxy's metrics server does.
//!
//! Like kube-proxy's `RegisterMetrics(mode)`, the iptables-only metrics exist only in iptables
//! mode (fed through [`IptablesMetrics`]), and ours only in eBPF mode (fed through
//! [`EbpfMetrics`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{
        Arc, Mutex, OnceLock, PoisonError, RwLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header},
    routing::any,
};
use prometheus_client::{
    collector::Collector,
    encoding::{
        DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet, text::encode,
    },
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::exponential_buckets},
    registry::{Metric, Registry},
};
use tracing::{error, warn};

use super::{
    exposition::{self, Format},
    histogram::{HistogramVec, LabelPairs, NativeConfig, SeriesSnapshot},
    http::{go_not_found, response},
    protobuf,
    rest_client::{self, RestClientMetrics},
    service_traffic::{self, ServiceTrafficMetrics},
};
use proxy_common::StatIndex;
use proxy_model::{
    desired::{FamilySnapshot, IpFamily, ServicePort, ServicePortName},
    proxy_mode::ProxyMode,
};

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, EncodeLabelSet)]
struct FamilyLabel {
    ip_family: &'static str,
}

impl FamilyLabel {
    fn of(family: IpFamily) -> Self {
        Self {
            ip_family: family.as_k8s(),
        }
    }
}

impl LabelPairs for FamilyLabel {
    fn label_pairs(&self) -> Vec<(&'static str, String)> {
        vec![("ip_family", self.ip_family.to_owned())]
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CodeLabel {
    code: &'static str,
}

// Fields in alphabetical order: Go's client sorts label names, and so the exposition matches.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PolicyLabel {
    ip_family: &'static str,
    traffic_policy: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TableLabel {
    ip_family: &'static str,
    table: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct MapLabel {
    map: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FeatureLabel {
    feature: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// A datapath event: its reason and what the datapath did (`StatAction`), so that drops are
/// one selector away (`action=~"dropped|rejected|passed_untranslated"`) while the series stay
/// one per reason.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DatapathLabel {
    reason: &'static str,
    action: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;
type HistogramFamily = HistogramVec<FamilyLabel>;

/// `ExponentialBuckets(0.001, 2, 15)`: 1 ms … 16.384 s, kube-proxy's sync duration buckets.
fn sync_duration_histogram(native: Option<NativeConfig>) -> HistogramFamily {
    HistogramVec::new(exponential_buckets(0.001, 2.0, 15), native)
}

/// kube-proxy's network programming buckets: component-base's `MergeBuckets` starts with a 0
/// bucket, then 0.25, 0.5, 1…59 by 1, 60…115 by 5, 120…300 by 30 (seconds).
pub fn network_programming_buckets() -> Vec<f64> {
    let mut buckets = vec![0.0, 0.25, 0.5];
    buckets.extend((1..=59).map(f64::from));
    buckets.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    buckets.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    buckets
}

fn network_programming_histogram(native: Option<NativeConfig>) -> HistogramFamily {
    HistogramVec::new(network_programming_buckets(), native)
}

fn seconds_since_epoch(time: SystemTime) -> f64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Metrics with their help text exactly as given: `Registry::register` appends a period, which
/// would make every help line differ from kube-proxy's.
#[derive(Debug, Default)]
struct Described {
    metrics: Vec<(&'static str, String, Box<dyn Metric>)>,
}

impl Described {
    fn add(&mut self, name: &'static str, help: impl Into<String>, metric: impl Metric) {
        self.metrics.push((name, help.into(), Box::new(metric)));
    }
}

impl Collector for Described {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, metric) in &self.metrics {
            // Like Go's client: a labelled metric without any series is not shown at all.
            if metric.is_empty() {
                continue;
            }
            let metric_encoder =
                encoder.encode_descriptor(name, help, None, metric.metric_type())?;
            metric.encode(metric_encoder)?;
        }
        Ok(())
    }
}

/// The agent's metrics. Cheap to share (`Arc`); every method takes `&self`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    mode: ProxyMode,
    sync_duration: HistogramFamily,
    sync_last_timestamp: Family<FamilyLabel, FloatGauge>,
    sync_last_queued_timestamp: Family<FamilyLabel, FloatGauge>,
    network_programming: HistogramFamily,
    endpoint_changes_pending: Gauge,
    endpoint_changes_total: Counter,
    service_changes_pending: Gauge,
    service_changes_total: Counter,
    no_local_endpoints: Family<PolicyLabel, Gauge>,
    /// The service ports counted there, per family (IPv4, IPv6).
    no_local_ports: Mutex<[NoLocalPorts; 2]>,
    healthz_total: Family<CodeLabel, Counter>,
    livez_total: Family<CodeLabel, Counter>,
    conntrack_deleted: Family<FamilyLabel, Counter>,
    conntrack_sync_duration: HistogramFamily,
    ignored_addresses: Family<ReasonLabel, Gauge>,
    frontend_conflicts: Gauge,
    iptables: Option<IptablesMetrics>,
    ebpf: Option<EbpfMetrics>,
    /// Per-Service traffic, both modes.
    service_traffic: Arc<ServiceTrafficMetrics>,
    /// client-go's `rest_client_*`, shared with the API client's layer.
    rest_client: RestClientMetrics,
    /// Every histogram family by name, for the protobuf exposition's snapshots.
    histograms: Vec<(&'static str, Box<dyn SnapshotFamily>)>,
    /// eBPF mode: reads service id → service port name when `/debug/ebpf/service-ids` is asked
    /// (set by the agent), so `proxy-agent inspect` can name what it reads from older pins.
    service_names: ServiceNamesSlot,
    /// Where `/debug/drift` asks the agent's loop for a drift report (JSON), set by the loop.
    drift_requests: Mutex<Option<DriftRequests>>,
    /// `/debug/drift`'s rate limit.
    drift_gate: Mutex<DriftGate>,
    /// The `/configz` body, set by the agent once its configuration is known.
    configz: RwLock<Option<String>>,
    /// `--profiling`: `/debug/flags/v` exists (upstream installs it with the pprof handlers).
    profiling: AtomicBool,
}

/// `/debug/drift` runs one check at a time, and at most [`DRIFT_REQUEST_BURST`] in a row, then
/// one per this: anyone who reaches the metrics port can ask, and each check reads every entry
/// of the service maps (or lists every rule). Other requests get 429 with `Retry-After`
/// (`inspect drift` waits and asks again).
pub const DRIFT_REQUEST_INTERVAL: Duration = Duration::from_secs(1);
/// Checks `/debug/drift` runs back to back before [`DRIFT_REQUEST_INTERVAL`] applies (a person
/// looking twice, a test polling).
pub const DRIFT_REQUEST_BURST: u32 = 5;

/// `/debug/drift`'s token bucket, and whether a check runs.
#[derive(Debug, Default)]
struct DriftGate {
    /// Tokens (checks allowed now) and when they were counted; `None`: a full bucket.
    tokens: Option<(f64, std::time::Instant)>,
    running: bool,
}

impl DriftGate {
    /// `Ok` when a check may start now (it is then running until [`Self::done`]); else how
    /// long to wait.
    fn enter(&mut self, now: std::time::Instant) -> Result<(), Duration> {
        if self.running {
            return Err(DRIFT_REQUEST_INTERVAL);
        }
        let burst = f64::from(DRIFT_REQUEST_BURST);
        let tokens = match self.tokens {
            None => burst,
            Some((tokens, at)) => (tokens
                + now.saturating_duration_since(at).as_secs_f64()
                    / DRIFT_REQUEST_INTERVAL.as_secs_f64())
            .min(burst),
        };
        if tokens < 1.0 {
            self.tokens = Some((tokens, now));
            return Err(DRIFT_REQUEST_INTERVAL.mul_f64(1.0 - tokens));
        }
        self.tokens = Some((tokens - 1.0, now));
        self.running = true;
        Ok(())
    }

    fn done(&mut self) {
        self.running = false;
    }
}

/// Ends a running `/debug/drift` check however its request ends (a client that goes away
/// drops the handler).
struct DriftGateGuard<'a>(&'a Mutex<DriftGate>);

impl Drop for DriftGateGuard<'_> {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).done();
    }
}

/// Requests for a drift report: each carries where to send the JSON answer.
/// Reads service id → `namespace/name:port` (the pinned `KPR_SERVICE_NAMES`).
pub type ServiceNamesReader = Box<dyn Fn() -> Result<BTreeMap<u32, String>, String> + Send + Sync>;

#[derive(Default)]
struct ServiceNamesSlot(OnceLock<Arc<ServiceNamesReader>>);

impl std::fmt::Debug for ServiceNamesSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceNamesSlot")
            .field("set", &self.0.get().is_some())
            .finish()
    }
}

pub type DriftRequests = tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<String>>;

const ALPHA: &str = "[ALPHA] ";

// The histogram families' names.
const SYNC_DURATION: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
const NETWORK_PROGRAMMING: &str = "kubeproxy_network_programming_duration_seconds";
const CONNTRACK_SYNC_DURATION: &str = "kubeproxy_conntrack_reconciler_sync_duration_seconds";
const SYNC_FULL_DURATION: &str = "kubeproxy_sync_full_proxy_rules_duration_seconds";
const SYNC_PARTIAL_DURATION: &str = "kubeproxy_sync_partial_proxy_rules_duration_seconds";

fn alpha(help: &str) -> String {
    format!("{ALPHA}{help}")
}

/// A histogram family of any label type, as the protobuf exposition reads it.
trait SnapshotFamily: std::fmt::Debug + Send + Sync {
    fn series_snapshots(&self) -> Vec<SeriesSnapshot>;
}

impl<L> SnapshotFamily for HistogramVec<L>
where
    L: Ord + Clone + LabelPairs + std::fmt::Debug + Send + Sync + 'static,
{
    fn series_snapshots(&self) -> Vec<SeriesSnapshot> {
        self.snapshots()
    }
}

impl Metrics {
    /// The metrics of `mode`, with native histograms when the `NativeHistograms` feature gate
    /// is on (component-base reads the gate once, before any histogram exists).
    pub fn new(mode: ProxyMode) -> Self {
        Self::with_native_histograms(
            mode,
            proxy_model::config::features::enabled(
                proxy_model::config::features::NATIVE_HISTOGRAMS,
            ),
        )
    }

    /// The metrics of `mode`; `native_histograms`: whether histograms keep native buckets.
    pub fn with_native_histograms(mode: ProxyMode, native_histograms: bool) -> Self {
        let native = native_histograms.then(NativeConfig::kube_proxy);
        Self::with_parts(mode, native, RestClientMetrics::new(native))
    }

    /// The metrics of `mode`, serving `rest_client`'s families (the API client's, created
    /// before the metrics: see [`RestClientMetrics`]). Native buckets as in [`Self::new`].
    pub fn with_rest_client(mode: ProxyMode, rest_client: RestClientMetrics) -> Self {
        let native = proxy_model::config::features::enabled(
            proxy_model::config::features::NATIVE_HISTOGRAMS,
        )
        .then(NativeConfig::kube_proxy);
        Self::with_parts(mode, native, rest_client)
    }

    fn with_parts(
        mode: ProxyMode,
        native: Option<NativeConfig>,
        rest_client: RestClientMetrics,
    ) -> Self {
        let mut described = Described::default();
        let sync_duration = sync_duration_histogram(native);
        let sync_last_timestamp = Family::default();
        let sync_last_queued_timestamp = Family::default();
        let network_programming = network_programming_histogram(native);
        let endpoint_changes_pending = Gauge::default();
        let endpoint_changes_total = Counter::default();
        let service_changes_pending = Gauge::default();
        let service_changes_total = Counter::default();
        let no_local_endpoints = Family::default();
        let healthz_total = Family::default();
        let livez_total = Family::default();
        let conntrack_deleted = Family::default();
        let conntrack_sync_duration = sync_duration_histogram(native);
        let ignored_addresses = Family::default();
        let frontend_conflicts = Gauge::default();

        described.add(
            "kubernetes_build_info",
            super::build_info::HELP,
            super::build_info::family(),
        );
        described.add(
            SYNC_DURATION,
            alpha("SyncProxyRules latency in seconds"),
            sync_duration.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            alpha("The last time proxy rules were successfully synced"),
            sync_last_timestamp.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            alpha("The last time a sync of proxy rules was queued"),
            sync_last_queued_timestamp.clone(),
        );
        described.add(
            NETWORK_PROGRAMMING,
            alpha("In Cluster Network Programming Latency in seconds"),
            network_programming.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            alpha("Pending proxy rules Endpoint changes"),
            endpoint_changes_pending.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            alpha("Cumulative proxy rules Endpoint changes"),
            endpoint_changes_total.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            alpha("Pending proxy rules Service changes"),
            service_changes_pending.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_service_changes",
            alpha("Cumulative proxy rules Service changes"),
            service_changes_total.clone(),
        );
        described.add(
            // A gauge despite the name (kube-proxy's choice).
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            alpha("Number of services with a Local traffic policy and no endpoints"),
            no_local_endpoints.clone(),
        );
        described.add(
            "kubeproxy_proxy_healthz",
            alpha("Cumulative proxy healthz HTTP status"),
            healthz_total.clone(),
        );
        described.add(
            "kubeproxy_proxy_livez",
            alpha("Cumulative proxy livez HTTP status"),
            livez_total.clone(),
        );
        described.add(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            alpha("Cumulative conntrack flows deleted by conntrack reconciler"),
            conntrack_deleted.clone(),
        );
        described.add(
            CONNTRACK_SYNC_DURATION,
            alpha("ReconcileConntrackFlowsLatency latency in seconds"),
            conntrack_sync_duration.clone(),
        );
        // The project's own, in both modes: what the desired state refused to program.
        described.add(
            "kubeproxy_rs_ignored_addresses",
            "Addresses in Services and EndpointSlices that are never programmed (unspecified, loopback, link-local, multicast or broadcast), by reason",
            ignored_addresses.clone(),
        );
        described.add(
            "kubeproxy_rs_frontend_conflicts",
            "Frontends (address, port, protocol) a Service names but an older Service owns",
            frontend_conflicts.clone(),
        );
        // client-go's, in both modes (and hidden while they have no series).
        described.add(
            rest_client::REQUEST_DURATION,
            rest_client::REQUEST_DURATION_HELP,
            rest_client.duration.clone(),
        );
        described.add(
            rest_client::REQUESTS,
            rest_client::REQUESTS_HELP,
            rest_client.requests.clone(),
        );
        let iptables = (mode == ProxyMode::Iptables)
            .then(|| IptablesMetrics::register(&mut described, native));
        let ebpf = (mode == ProxyMode::Ebpf).then(|| EbpfMetrics::register(&mut described));
        let service_traffic = Arc::new(register_service_traffic(&mut described));
        let mut histograms: Vec<(&'static str, Box<dyn SnapshotFamily>)> = vec![
            (SYNC_DURATION, Box::new(sync_duration.clone())),
            (NETWORK_PROGRAMMING, Box::new(network_programming.clone())),
            (
                CONNTRACK_SYNC_DURATION,
                Box::new(conntrack_sync_duration.clone()),
            ),
            (
                rest_client::REQUEST_DURATION,
                Box::new(rest_client.duration.clone()),
            ),
        ];
        if let Some(iptables) = &iptables {
            histograms.push((
                SYNC_FULL_DURATION,
                Box::new(iptables.sync_full_duration.clone()),
            ));
            histograms.push((
                SYNC_PARTIAL_DURATION,
                Box::new(iptables.sync_partial_duration.clone()),
            ));
        }
        let mut registry = Registry::default();
        registry.register_collector(Box::new(described));
        Self {
            registry,
            mode,
            sync_duration,
            sync_last_timestamp,
            sync_last_queued_timestamp,
            network_programming,
            endpoint_changes_pending,
            endpoint_changes_total,
            service_changes_pending,
            service_changes_total,
            no_local_endpoints,
            no_local_ports: Mutex::default(),
            healthz_total,
            livez_total,
            conntrack_deleted,
            conntrack_sync_duration,
            ignored_addresses,
            frontend_conflicts,
            iptables,
            ebpf,
            service_traffic,
            rest_client,
            histograms,
            service_names: ServiceNamesSlot::default(),
            drift_requests: Mutex::default(),
            drift_gate: Mutex::default(),
            configz: RwLock::default(),
            profiling: AtomicBool::new(false),
        }
    }

    /// What `/configz` answers, and whether `/debug/flags/v` is served (`--profiling`).
    pub fn set_debug(&self, configz: String, profiling: bool) {
        *self.configz.write().unwrap_or_else(PoisonError::into_inner) = Some(configz);
        self.profiling.store(profiling, Ordering::Relaxed);
    }

    /// Lets `/debug/drift` reach the loop that owns the dataplane.
    pub fn serve_drift_requests(&self, requests: DriftRequests) {
        *self
            .drift_requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(requests);
    }

    pub fn mode(&self) -> ProxyMode {
        self.mode
    }

    /// Where `/debug/ebpf/service-ids` reads its names from (eBPF mode; set once).
    pub fn read_service_names_with(&self, reader: ServiceNamesReader) {
        let _ = self.service_names.0.set(Arc::new(reader));
    }

    /// The iptables dataplane's metrics (`None` in eBPF mode).
    pub fn iptables(&self) -> Option<&IptablesMetrics> {
        self.iptables.as_ref()
    }

    /// client-go's `rest_client_*` families.
    pub fn rest_client(&self) -> &RestClientMetrics {
        &self.rest_client
    }

    /// Per-Service traffic (both modes).
    pub fn service_traffic(&self) -> &Arc<ServiceTrafficMetrics> {
        &self.service_traffic
    }

    /// The eBPF dataplane's metrics (`None` in iptables mode).
    pub fn ebpf(&self) -> Option<&EbpfMetrics> {
        self.ebpf.as_ref()
    }

    /// The exposition in the classic text format (what `/metrics` answers by default).
    pub fn encode_text(&self) -> String {
        exposition::openmetrics_to_text(&self.encode())
    }

    /// The protobuf exposition: the families of the text format, each histogram written from
    /// one snapshot of it (with its native buckets when they are kept).
    pub fn encode_protobuf(&self) -> Vec<u8> {
        let families = exposition::families(&self.encode());
        let mut snapshots = protobuf::HistogramSnapshots::new();
        for (name, family) in &self.histograms {
            for (labels, snapshot) in family.series_snapshots() {
                let mut labels: Vec<(String, String)> = labels
                    .into_iter()
                    .map(|(label, value)| (label.to_owned(), value))
                    .collect();
                labels.sort();
                snapshots.insert(((*name).to_owned(), labels), snapshot);
            }
        }
        protobuf::encode(&families, &snapshots)
    }

    /// The exposition text (OpenMetrics).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(error) = encode(&mut out, &self.registry) {
            // Only a formatter error, which writing to a String never produces.
            warn!(%error, "cannot encode the metrics");
        }
        out
    }

    /// What the desired state currently refuses: addresses by reason (every reason has a
    /// sample, zero when none), and frontends lost to an older Service.
    pub fn service_problems(&self, ignored: &BTreeMap<&'static str, i64>, conflicts: usize) {
        for reason in proxy_model::ip_family::UNUSABLE_REASONS {
            self.ignored_addresses
                .get_or_create(&ReasonLabel { reason })
                .set(ignored.get(reason).copied().unwrap_or(0));
        }
        self.frontend_conflicts
            .set(i64::try_from(conflicts).unwrap_or(i64::MAX));
    }

    /// A sync was requested (kube-proxy's `Sync()` and the start of `SyncLoop`).
    pub fn sync_queued(&self, family: IpFamily, now: SystemTime) {
        self.sync_last_queued_timestamp
            .get_or_create(&FamilyLabel::of(family))
            .set(seconds_since_epoch(now));
    }

    /// A sync of one family succeeded after `duration`.
    pub fn sync_succeeded(&self, family: IpFamily, duration: Duration, now: SystemTime) {
        self.sync_duration
            .get_or_create(&FamilyLabel::of(family))
            .observe(duration.as_secs_f64());
        self.sync_last_timestamp
            .get_or_create(&FamilyLabel::of(family))
            .set(seconds_since_epoch(now));
    }

    /// Network programming latency: after a successful sync, one observation per changed
    /// EndpointSlice that had a `last-change-trigger-time` (later than the agent's start, which
    /// the caller checks as kube-proxy's change tracker does).
    pub fn network_programmed(
        &self,
        family: IpFamily,
        trigger_times: &[SystemTime],
        now: SystemTime,
    ) {
        let histogram = self
            .network_programming
            .get_or_create(&FamilyLabel::of(family));
        for trigger in trigger_times {
            let latency = now.duration_since(*trigger).unwrap_or_default();
            histogram.observe(latency.as_secs_f64());
        }
    }

    /// Change tracking: `seen_*` changes arrived since the last call, `pending_*` are not yet
    /// synced.
    pub fn changes(
        &self,
        seen_services: u64,
        seen_slices: u64,
        pending_services: usize,
        pending_slices: usize,
    ) {
        self.service_changes_total.inc_by(seen_services);
        self.endpoint_changes_total.inc_by(seen_slices);
        self.service_changes_pending
            .set(i64::try_from(pending_services).unwrap_or(i64::MAX));
        self.endpoint_changes_pending
            .set(i64::try_from(pending_slices).unwrap_or(i64::MAX));
    }

    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total` for one family, after a sync of
    /// `snapshot`; with `scope`, only those service ports changed since the last call.
    pub fn set_no_local_endpoints(
        &self,
        family: IpFamily,
        snapshot: &FamilySnapshot,
        scope: Option<&BTreeSet<ServicePortName>>,
    ) {
        let index = match family {
            IpFamily::V4 => 0,
            IpFamily::V6 => 1,
        };
        let counts = self
            .no_local_ports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)[index]
            .update(snapshot, scope);
        for (policy, count) in [("internal", counts.internal), ("external", counts.external)] {
            self.no_local_endpoints
                .get_or_create(&PolicyLabel {
                    ip_family: family.as_k8s(),
                    traffic_policy: policy,
                })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }

    pub(crate) fn healthz_answered(&self, status: StatusCode) {
        self.healthz_total
            .get_or_create(&CodeLabel {
                code: code_label(status),
            })
            .inc();
    }

    pub(crate) fn livez_answered(&self, status: StatusCode) {
        self.livez_total
            .get_or_create(&CodeLabel {
                code: code_label(status),
            })
            .inc();
    }

    /// One conntrack reconcile of one family (fed by the conntrack cleanup, later).
    pub fn conntrack_reconciled(&self, family: IpFamily, duration: Duration, deleted: u64) {
        self.conntrack_sync_duration
            .get_or_create(&FamilyLabel::of(family))
            .observe(duration.as_secs_f64());
        self.conntrack_deleted
            .get_or_create(&FamilyLabel::of(family))
            .inc_by(deleted);
    }
}

fn code_label(status: StatusCode) -> &'static str {
    if status == StatusCode::OK {
        "200"
    } else {
        "503"
    }
}

/// Counts of service ports whose Local policy leaves them without endpoints on this node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    pub internal: usize,
    pub external: usize,
}

/// kube-proxy's rule: a service port counts when it has usable endpoints somewhere in the
/// cluster, uses Local policy for that kind of traffic, and has no local endpoint (a service
/// without any endpoint is not counted: it is rejected, not black-holed by policy).
pub fn no_local_endpoints(snapshot: &FamilySnapshot) -> NoLocalEndpoints {
    NoLocalPorts::default().update(snapshot, None)
}

/// The service ports [`no_local_endpoints`] counts, kept between syncs: a sync of one Service
/// recounts its ports only (a walk of every port took 3 ms of each sync at 50k Services).
#[derive(Debug, Default)]
struct NoLocalPorts {
    internal: BTreeSet<ServicePortName>,
    external: BTreeSet<ServicePortName>,
}

impl NoLocalPorts {
    /// `scope`: the service ports that changed since the last update (`None`: all may have).
    fn update(
        &mut self,
        snapshot: &FamilySnapshot,
        scope: Option<&BTreeSet<ServicePortName>>,
    ) -> NoLocalEndpoints {
        match scope {
            None => {
                *self = Self::default();
                for (name, port) in &snapshot.service_ports {
                    self.add(name, port);
                }
            }
            Some(scope) => {
                for name in scope {
                    self.internal.remove(name);
                    self.external.remove(name);
                    if let Some(port) = snapshot.service_ports.get(name) {
                        self.add(name, port);
                    }
                }
            }
        }
        NoLocalEndpoints {
            internal: self.internal.len(),
            external: self.external.len(),
        }
    }

    fn add(&mut self, name: &ServicePortName, port: &ServicePort) {
        if !port.has_any_endpoints || port.local_endpoints().next().is_some() {
            return;
        }
        if port.internal_policy_local {
            self.internal.insert(name.clone());
        }
        // `external_policy_local` is only set for externally accessible services.
        if port.external_policy_local {
            self.external.insert(name.clone());
        }
    }
}

/// What only the iptables dataplane reports.
#[derive(Debug)]
pub struct IptablesMetrics {
    sync_full_duration: HistogramFamily,
    sync_partial_duration: HistogramFamily,
    restore_failures: Family<FamilyLabel, Counter>,
    partial_restore_failures: Family<FamilyLabel, Counter>,
    rules_total: Family<TableLabel, Gauge>,
    rules_last: Family<TableLabel, Gauge>,
    ct_state_invalid_dropped: NfacctMetric,
    localhost_nodeports_accepted: NfacctMetric,
    drift_repairs: Family<TableLabel, Counter>,
}

/// Reads an nfacct counter's packets by name; an error is logged (once) and the metric is then
/// absent from that scrape, as upstream's collector leaves it out.
pub type NfacctReader = Box<dyn Fn(&str) -> Result<u64, String> + Send + Sync>;

/// One of the iptables tables kube-proxy counts rules in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IptablesTable {
    Filter,
    Nat,
}

impl IptablesTable {
    fn label(self) -> &'static str {
        match self {
            IptablesTable::Filter => "filter",
            IptablesTable::Nat => "nat",
        }
    }
}

impl IptablesMetrics {
    fn register(described: &mut Described, native: Option<NativeConfig>) -> Self {
        let nfacct_reader = Arc::new(OnceLock::new());
        let this = Self {
            sync_full_duration: sync_duration_histogram(native),
            sync_partial_duration: sync_duration_histogram(native),
            restore_failures: Family::default(),
            partial_restore_failures: Family::default(),
            rules_total: Family::default(),
            rules_last: Family::default(),
            ct_state_invalid_dropped: NfacctMetric::new(
                proxy_kernel::iptables::nfacct::NFACCT_CT_STATE_INVALID,
                &nfacct_reader,
            ),
            localhost_nodeports_accepted: NfacctMetric::new(
                proxy_kernel::iptables::nfacct::NFACCT_LOCALHOST_NODEPORTS,
                &nfacct_reader,
            ),
            drift_repairs: Family::default(),
        };
        described.add(
            SYNC_FULL_DURATION,
            alpha("SyncProxyRules latency in seconds for full resyncs"),
            this.sync_full_duration.clone(),
        );
        described.add(
            SYNC_PARTIAL_DURATION,
            alpha("SyncProxyRules latency in seconds for partial resyncs"),
            this.sync_partial_duration.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures",
            alpha("Cumulative proxy iptables restore failures"),
            this.restore_failures.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
            alpha("Cumulative proxy iptables partial restore failures"),
            this.partial_restore_failures.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_iptables_total",
            alpha("Total number of iptables rules owned by kube-proxy"),
            this.rules_total.clone(),
        );
        described.add(
            "kubeproxy_sync_proxy_rules_iptables_last",
            alpha("Number of iptables rules written by kube-proxy in last sync"),
            this.rules_last.clone(),
        );
        described.add(
            "kubeproxy_iptables_ct_state_invalid_dropped_packets",
            alpha("packets dropped by iptables to work around conntrack problems"),
            this.ct_state_invalid_dropped.clone(),
        );
        described.add(
            "kubeproxy_iptables_localhost_nodeports_accepted_packets",
            alpha("Number of packets accepted on nodeports of loopback interface"),
            this.localhost_nodeports_accepted.clone(),
        );
        described.add(
            "kubeproxy_iptables_drift_repairs",
            "Chains (or the canary) the drift check found different from what the agent writes, repaired by a full sync",
            this.drift_repairs.clone(),
        );
        this
    }

    /// `chains` chains of `table` drifted and are rewritten by a full sync.
    pub fn drift_repaired(&self, family: IpFamily, table: &'static str, chains: u64) {
        self.drift_repairs
            .get_or_create(&TableLabel {
                ip_family: FamilyLabel::of(family).ip_family,
                table,
            })
            .inc_by(chains);
    }

    /// A sync's duration into the full or partial histogram (the common one is fed by
    /// [`Metrics::sync_succeeded`]).
    pub fn sync_duration(&self, family: IpFamily, duration: Duration, full: bool) {
        let histogram = if full {
            &self.sync_full_duration
        } else {
            &self.sync_partial_duration
        };
        histogram
            .get_or_create(&FamilyLabel::of(family))
            .observe(duration.as_secs_f64());
    }

    /// An `iptables-restore` failed; `partial` when it was a partial sync (both counters count).
    pub fn restore_failed(&self, family: IpFamily, partial: bool) {
        self.restore_failures
            .get_or_create(&FamilyLabel::of(family))
            .inc();
        if partial {
            self.partial_restore_failures
                .get_or_create(&FamilyLabel::of(family))
                .inc();
        }
    }

    /// Rule counts after a sync (`total`: owned; `last`: written by the last sync).
    pub fn rules(&self, family: IpFamily, table: IptablesTable, total: u64, last: u64) {
        let label = TableLabel {
            ip_family: family.as_k8s(),
            table: table.label(),
        };
        self.rules_total
            .get_or_create(&label)
            .set(i64::try_from(total).unwrap_or(i64::MAX));
        self.rules_last
            .get_or_create(&label)
            .set(i64::try_from(last).unwrap_or(i64::MAX));
    }

    /// How the nfacct counters `ct_state_invalid_dropped_pkts` and `localhost_nps_accepted_pkts`
    /// are read at each scrape (set once; before, and without nfacct, they are not exposed).
    pub fn read_nfacct_with(&self, reader: NfacctReader) {
        // Both metrics share the slot.
        let _ = self.ct_state_invalid_dropped.reader.set(reader);
    }
}

/// A counter whose value is an nfacct object's packet count, read when scraped (upstream's
/// `ctStateInvalidPacketsCollector` and its localhost NodePort twin: a const metric per scrape).
#[derive(Clone)]
struct NfacctMetric {
    name: &'static str,
    reader: Arc<OnceLock<NfacctReader>>,
    /// The reading of the current scrape: `is_empty` reads, `encode` writes it.
    reading: Arc<Mutex<Option<u64>>>,
    /// A failing read is logged once, not at every scrape.
    logged: Arc<AtomicBool>,
}

impl NfacctMetric {
    fn new(name: &'static str, reader: &Arc<OnceLock<NfacctReader>>) -> Self {
        Self {
            name,
            reader: Arc::clone(reader),
            reading: Arc::default(),
            logged: Arc::default(),
        }
    }
}

impl std::fmt::Debug for NfacctMetric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NfacctMetric")
            .field("name", &self.name)
            .finish()
    }
}

impl EncodeMetric for NfacctMetric {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let value = self
            .reading
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .unwrap_or(0);
        encoder.encode_counter::<NoLabelSet, u64, u64>(&value, None)
    }

    fn metric_type(&self) -> prometheus_client::metrics::MetricType {
        prometheus_client::metrics::MetricType::Counter
    }

    fn is_empty(&self) -> bool {
        let reading = self.reader.get().and_then(|read| match read(self.name) {
            Ok(packets) => Some(packets),
            Err(message) => {
                if !self.logged.swap(true, Ordering::Relaxed) {
                    error!(counter = self.name, error = %message, "failed to collect nfacct counter");
                }
                None
            }
        });
        *self.reading.lock().unwrap_or_else(PoisonError::into_inner) = reading;
        reading.is_none()
    }
}

fn register_service_traffic(described: &mut Described) -> ServiceTrafficMetrics {
    let this = ServiceTrafficMetrics::default();
    described.add(
        service_traffic::NEW_CONNECTIONS,
        "Connections (TCP, SCTP) and flows (UDP) given a backend, by Service port, protocol \
         and frontend kind",
        this.new_connections.clone(),
    );
    described.add(
        service_traffic::REJECTED,
        "Connections refused because the Service had no endpoints",
        this.rejected.clone(),
    );
    described.add(
        service_traffic::DROPPED,
        "Connections dropped, by reason: source_range (outside loadBalancerSourceRanges), \
         no_local_endpoints (a Local traffic policy without endpoints on this node)",
        this.dropped.clone(),
    );
    described.add(
        service_traffic::PACKETS,
        "Packets of the Service's flows, by direction (forward: client to backend; reply), \
         where the dataplane sees them (eBPF mode: the tc programs and XDP, not the socket \
         hooks)",
        this.packets.clone(),
    );
    described.add(
        service_traffic::BYTES,
        "IP bytes of the Service's flows, by direction, where the dataplane sees them",
        this.bytes.clone(),
    );
    described.add(
        service_traffic::ENDPOINT_NEW_CONNECTIONS,
        "Connections given to each endpoint (--service-traffic-endpoints)",
        this.endpoint_new_connections.clone(),
    );
    described.add(
        service_traffic::SERIES_CAPPED,
        "Service ports with traffic whose series --service-traffic-max-series left out",
        this.series_capped.clone(),
    );
    this
}

fn source_increase(previous: u64, value: u64) -> u64 {
    if value >= previous {
        value - previous
    } else {
        value
    }
}

/// Our eBPF dataplane's metrics.
#[derive(Debug)]
pub struct EbpfMetrics {
    map_entries: Family<MapLabel, Gauge>,
    map_capacity: Family<MapLabel, Gauge>,
    datapath: Family<DatapathLabel, Counter>,
    datapath_last: Mutex<BTreeMap<&'static str, u64>>,
    conntrack_entries: Gauge,
    conntrack_gc_runs: Counter,
    drift_repairs: Family<MapLabel, Counter>,
    kernel_features: Family<FeatureLabel, Gauge>,
    fast_path_active: Gauge,
}

impl EbpfMetrics {
    fn register(described: &mut Described) -> Self {
        let this = Self {
            map_entries: Family::default(),
            map_capacity: Family::default(),
            datapath: Family::default(),
            datapath_last: Mutex::default(),
            conntrack_entries: Gauge::default(),
            conntrack_gc_runs: Counter::default(),
            drift_repairs: Family::default(),
            kernel_features: Family::default(),
            fast_path_active: Gauge::default(),
        };
        described.add(
            "kubeproxy_ebpf_map_entries",
            "Entries in a BPF map of the eBPF dataplane",
            this.map_entries.clone(),
        );
        described.add(
            "kubeproxy_ebpf_map_capacity",
            "Maximum entries of a BPF map of the eBPF dataplane",
            this.map_capacity.clone(),
        );
        described.add(
            "kubeproxy_ebpf_datapath_events",
            "Datapath events counted by the eBPF programs, by reason and by what the datapath \
             did (action: dropped, rejected, passed_untranslated, translated, other)",
            this.datapath.clone(),
        );
        described.add(
            "kubeproxy_ebpf_conntrack_entries",
            "Entries in the eBPF dataplane's connection tracking map",
            this.conntrack_entries.clone(),
        );
        described.add(
            "kubeproxy_ebpf_conntrack_gc_runs",
            "Garbage collection runs over the eBPF dataplane's connection tracking map",
            this.conntrack_gc_runs.clone(),
        );
        described.add(
            "kubeproxy_ebpf_drift_repairs",
            "Entries of a BPF map the drift check found different from what the agent wrote, and repaired",
            this.drift_repairs.clone(),
        );
        described.add(
            "kubeproxy_ebpf_kernel_feature",
            "1 when the eBPF dataplane uses a kernel feature, 0 when it takes the path without it \
             (missing in the kernel or turned off by --bpf-disable-feature)",
            this.kernel_features.clone(),
        );
        described.add(
            "kubeproxy_ebpf_fast_path_active",
            "1 when translated external Service traffic takes the fast path (redirected past the \
             host's netfilter FORWARD, and through XDP with --bpf-xdp auto), 0 on the netfilter \
             path; with --tc-fast-path=auto it follows the node's forwarding policy",
            this.fast_path_active.clone(),
        );
        this
    }

    /// The path external traffic takes now: fast (1) or netfilter (0).
    pub fn fast_path_active(&self, on: bool) {
        self.fast_path_active.set(i64::from(on));
    }

    /// The probed kernel features the dataplane uses (1) or not (0).
    pub fn kernel_features(&self, features: &[(&'static str, bool)]) {
        for &(feature, used) in features {
            self.kernel_features
                .get_or_create(&FeatureLabel { feature })
                .set(i64::from(used));
        }
    }

    /// A map's fill level.
    pub fn map_usage(&self, map: &'static str, entries: u64, capacity: u64) {
        let label = MapLabel { map };
        self.map_entries
            .get_or_create(&label)
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
        self.map_capacity
            .get_or_create(&label)
            .set(i64::try_from(capacity).unwrap_or(i64::MAX));
    }

    /// A reading of the per-CPU datapath counters (summed over CPUs, cumulative).
    pub fn datapath_counters(&self, counters: &[(StatIndex, u64)]) {
        let mut last = self
            .datapath_last
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for &(index, value) in counters {
            let reason = index.name();
            let previous = last.insert(reason, value).unwrap_or(0);
            self.datapath
                .get_or_create(&DatapathLabel {
                    reason,
                    action: index.action().name(),
                })
                .inc_by(source_increase(previous, value));
        }
    }

    pub fn conntrack_entries(&self, entries: u64) {
        self.conntrack_entries
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    pub fn conntrack_gc_run(&self) {
        self.conntrack_gc_runs.inc();
    }

    /// `repaired` entries of `map` were found drifted and written back (or deleted).
    pub fn drift_repaired(&self, map: &'static str, repaired: u64) {
        self.drift_repairs
            .get_or_create(&MapLabel { map })
            .inc_by(repaired);
    }
}

/// `/metrics`, `/proxyMode` and `/healthz` (component-base's ping check, always `ok`); Go's 404
/// for anything else.
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/metrics", any(metrics_handler))
        .route("/proxyMode", any(proxy_mode_handler))
        .route("/debug/ebpf/service-ids", any(service_ids_handler))
        .route("/debug/drift", any(drift_handler))
        .route("/healthz", any(ping_handler))
        .route("/healthz/ping", any(ping_handler))
        .route("/configz", any(configz_handler))
        .route("/debug/flags/v", any(verbosity_handler))
        .route("/debug/flags", any(debug_flags_index))
        .route("/debug/flags/", any(debug_flags_index))
        .route("/debug/flags/{*rest}", any(debug_flags_index))
        .fallback(go_not_found)
        .with_state(metrics)
}

/// promhttp's handler: the format the `Accept` header negotiates (classic text by default).
async fn metrics_handler(
    State(metrics): State<Arc<Metrics>>,
    headers: HeaderMap,
) -> Response<Body> {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|value| value.to_str().ok());
    let negotiated = exposition::negotiate(accept);
    let body = match negotiated.format {
        Format::Text => Body::from(metrics.encode_text()),
        Format::OpenMetrics(_) => Body::from(metrics.encode()),
        Format::Protobuf => Body::from(metrics.encode_protobuf()),
    };
    let mut reply = Response::new(body);
    if let Ok(value) = HeaderValue::from_str(&negotiated.content_type) {
        reply.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    reply
}

/// component-base's configz handler: every method, JSON.
async fn configz_handler(State(metrics): State<Arc<Metrics>>) -> Response<Body> {
    let body = metrics
        .configz
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
        .unwrap_or_else(|| "{}".to_owned());
    response(StatusCode::OK, "application/json", body)
}

/// `routes.DebugFlags`' index (`/debug/flags`, and `/debug/flags/…` other than `v`): the HTML
/// page listing the one flag, only with `--profiling`.
async fn debug_flags_index(State(metrics): State<Arc<Metrics>>) -> Response<Body> {
    if !metrics.profiling.load(Ordering::Relaxed) {
        return go_not_found().await;
    }
    response(
        StatusCode::OK,
        // What Go's content sniffing answers for the template's `<html>`.
        "text/html; charset=utf-8",
        DEBUG_FLAGS_INDEX.to_owned(),
    )
}

/// component-base's index template rendered with the flag `v`.
const DEBUG_FLAGS_INDEX: &str = "<html>\n<head>\n<title>/debug/flags/</title>\n</head>\n<body>\n/debug/flags/<br>\n<br>\nflags:<br>\n<table>\n\n<tr>v<br>\n\n</table>\n<br>\nfull flags configurable<br>\n</body>\n</html>\n";

/// component-base's `StringFlagPutHandler(logs.GlogSetter)` under `routes.DebugFlags`: only
/// with `--profiling`; PUT sets the verbosity, any other method is 406.
async fn verbosity_handler(
    State(metrics): State<Arc<Metrics>>,
    method: Method,
    body: String,
) -> Response<Body> {
    if !metrics.profiling.load(Ordering::Relaxed) {
        return go_not_found().await;
    }
    let (status, text) = if method == Method::PUT {
        match proxy_model::logging::set_verbosity(&body) {
            Ok(text) => (StatusCode::OK, text),
            Err(text) => (StatusCode::BAD_REQUEST, text),
        }
    } else {
        (
            StatusCode::NOT_ACCEPTABLE,
            "unsupported http method".to_owned(),
        )
    };
    response(status, "text/plain", format!("{text}\n"))
}

async fn proxy_mode_handler(State(metrics): State<Arc<Metrics>>) -> Response<Body> {
    let mode = match metrics.mode() {
        ProxyMode::Ebpf => "ebpf",
        ProxyMode::Iptables => "iptables",
    };
    response(StatusCode::OK, "text/plain; charset=utf-8", mode.to_owned())
}

/// Ours: which Service each service id in the pinned maps belongs to (`proxy-agent inspect`).
async fn service_ids_handler(State(metrics): State<Arc<Metrics>>) -> Response<Body> {
    let Some(reader) = metrics.service_names.0.get().cloned() else {
        return response(StatusCode::OK, "application/json", "{}".to_owned());
    };
    // A map walk of a syscall per entry: tens of milliseconds at 50k Services, off the server's
    // workers.
    let names = tokio::task::spawn_blocking(move || reader())
        .await
        .unwrap_or_else(|error| Err(error.to_string()));
    match names.and_then(|names| serde_json::to_string(&names).map_err(|e| e.to_string())) {
        Ok(json) => response(StatusCode::OK, "application/json", json),
        Err(error) => response(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            format!("cannot read the service names: {error}\n"),
        ),
    }
}

/// Ours: the drift check without repair, read off the agent's loop (`proxy-agent inspect
/// drift`); rate limited ([`DRIFT_REQUEST_INTERVAL`]).
async fn drift_handler(State(metrics): State<Arc<Metrics>>) -> Response<Body> {
    let entered = metrics
        .drift_gate
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .enter(std::time::Instant::now());
    if let Err(wait) = entered {
        let mut reply = response(
            StatusCode::TOO_MANY_REQUESTS,
            "text/plain; charset=utf-8",
            "drift checks are rate limited: ask again later\n".to_owned(),
        );
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        reply
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        return reply;
    }
    let _running = DriftGateGuard(&metrics.drift_gate);
    let sender = metrics
        .drift_requests
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let Some(sender) = sender else {
        return response(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            "the drift check is not running\n".to_owned(),
        );
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    if sender.send(reply).await.is_err() {
        return response(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            "the agent's loop stopped\n".to_owned(),
        );
    }
    match answer.await {
        Ok(json) => response(StatusCode::OK, "application/json", json),
        Err(_) => response(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            "the agent's loop dropped the request\n".to_owned(),
        ),
    }
}

async fn ping_handler() -> Response<Body> {
    response(StatusCode::OK, "text/plain; charset=utf-8", "ok".to_owned())
}
