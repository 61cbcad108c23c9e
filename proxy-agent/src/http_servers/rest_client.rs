//! client-go's REST client metrics as kube-proxy serves them (component-base's
//! `metrics/prometheus/restclient`, registered into the legacy registry): the families, fed by
//! the API client's tower layer (`source/kubernetes/request_metrics.rs`) and served by
//! `metrics.rs`'s `Metrics`.
//!
//! They exist before the metrics server does: the API client is built first (a bad flag fails
//! before anything touches the kernel), so the agent creates these two families, gives a clone
//! to the client and another to the metrics. With the manifests source they stay without
//! series, and a family without series is not shown, as in client_golang.

use std::time::Duration;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
};

use super::histogram::{HistogramVec, LabelPairs, NativeConfig};

/// The counter's name as registered: the OpenMetrics encoder adds `_total`, so the exposition
/// shows `rest_client_requests_total`.
pub const REQUESTS: &str = "rest_client_requests";
pub const REQUESTS_HELP: &str =
    "[ALPHA] Number of HTTP requests, partitioned by status code, method, and host.";
pub const REQUEST_DURATION: &str = "rest_client_request_duration_seconds";
pub const REQUEST_DURATION_HELP: &str =
    "[ALPHA] Request latency in seconds. Broken down by verb, and host.";
/// component-base's `requestLatency` buckets.
pub const REQUEST_DURATION_BUCKETS: [f64; 12] = [
    0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
];
/// The `code` of a request that got no response (client-go's `sanitize`: errors are arbitrary
/// strings, unbounded as label values).
pub const ERROR_CODE: &str = "<error>";

// Fields in alphabetical order: Go's client sorts label names, and so the exposition matches.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct ResultLabels {
    code: String,
    host: String,
    method: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, EncodeLabelSet)]
pub(super) struct LatencyLabels {
    host: String,
    verb: String,
}

impl LabelPairs for LatencyLabels {
    fn label_pairs(&self) -> Vec<(&'static str, String)> {
        vec![("host", self.host.clone()), ("verb", self.verb.clone())]
    }
}

/// `rest_client_requests_total` and `rest_client_request_duration_seconds`. Cheap to clone:
/// clones share their series.
#[derive(Debug, Clone)]
pub struct RestClientMetrics {
    pub(super) requests: Family<ResultLabels, Counter>,
    pub(super) duration: HistogramVec<LatencyLabels>,
}

impl Default for RestClientMetrics {
    /// Classic buckets only.
    fn default() -> Self {
        Self::new(None)
    }
}

impl RestClientMetrics {
    /// `native`: the native bucket options of every histogram (`None`: classic only).
    pub fn new(native: Option<NativeConfig>) -> Self {
        Self {
            requests: Family::default(),
            duration: HistogramVec::new(REQUEST_DURATION_BUCKETS, native),
        }
    }

    /// With native buckets when the `NativeHistograms` feature gate is on, like the agent's
    /// other histograms (`Metrics::new`).
    pub fn from_feature_gates() -> Self {
        let native = proxy_model::config::features::enabled(
            proxy_model::config::features::NATIVE_HISTOGRAMS,
        )
        .then(NativeConfig::kube_proxy);
        Self::new(native)
    }

    /// A request's final reply: its status code, or `None` when it failed without one.
    /// `host`: the API server URL's host (and port, when the URL has one).
    pub fn request_done(&self, code: Option<u16>, method: &str, host: &str) {
        let code = code.map_or_else(|| ERROR_CODE.to_owned(), |code| code.to_string());
        self.requests
            .get_or_create(&ResultLabels {
                code,
                host: host.to_owned(),
                method: method.to_owned(),
            })
            .inc();
    }

    /// A request's latency (`verb`: its HTTP method).
    pub fn observe_duration(&self, verb: &str, host: &str, duration: Duration) {
        self.duration
            .get_or_create(&LatencyLabels {
                host: host.to_owned(),
                verb: verb.to_owned(),
            })
            .observe(duration.as_secs_f64());
    }

    /// The counter's value for (`code`, `method`, `host`); 0 when it has no series.
    pub fn requests(&self, code: &str, method: &str, host: &str) -> u64 {
        self.requests
            .get(&ResultLabels {
                code: code.to_owned(),
                host: host.to_owned(),
                method: method.to_owned(),
            })
            .map_or(0, |counter| counter.get())
    }

    /// How many latencies were observed for (`verb`, `host`).
    pub fn duration_count(&self, verb: &str, host: &str) -> u64 {
        self.duration
            .snapshots()
            .into_iter()
            .find(|(labels, _)| {
                labels.iter().all(|(name, value)| match *name {
                    "host" => value == host,
                    "verb" => value == verb,
                    _ => false,
                })
            })
            .map_or(0, |(_, snapshot)| snapshot.count)
    }
}
