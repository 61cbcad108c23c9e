//! The proxy health server (kube-proxy's `ProxyHealthServer`, `--healthz-bind-address`):
//! `/healthz` and `/livez`, answered from the sync timestamps of each IP family and from whether
//! the node is being deleted. `/healthz` also reports the datapath's own state (`datapath.rs`)
//! after upstream's fields, and is 503 when it says Service traffic is broken beyond repair;
//! `/livez` keeps upstream's meaning (the loop is alive) and ignores it.

use std::{
    collections::BTreeMap,
    fmt,
    sync::{Arc, Mutex, PoisonError, RwLock},
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{Response, StatusCode},
    routing::any,
};

use super::{
    datapath::DatapathHealth,
    http::{go_not_found, response},
    metrics::Metrics,
};
use proxy_model::{desired::IpFamily, objects::NodeInfo, time_format::Stamp};

/// The taint the Cluster Autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Where the health state reads the time; tests substitute a clock they advance.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> Stamp;
}

#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Stamp {
        Stamp::now()
    }
}

/// A clock that only moves when told to.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Stamp>,
}

impl ManualClock {
    pub fn new(start: Stamp) -> Self {
        Self {
            now: Mutex::new(start),
        }
    }

    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock().unwrap_or_else(PoisonError::into_inner);
        *now = now.plus(by);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Stamp {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug)]
struct HealthState {
    last_updated: BTreeMap<IpFamily, Stamp>,
    oldest_pending_queued: BTreeMap<IpFamily, Stamp>,
    node_eligible: bool,
    /// A missing Node makes the node ineligible (upstream's NodeEligible: `node == nil` →
    /// false). Off for the standalone source, whose folder may hold no Node.
    node_required: bool,
}

/// The proxy's health: kube-proxy's `ProxyHealthServer` state.
#[derive(Debug)]
pub struct ProxyHealth {
    clock: Arc<dyn Clock>,
    health_timeout: Duration,
    state: RwLock<HealthState>,
    /// The datapath's checks (`None` until the agent's loop records its first state).
    datapath: RwLock<Option<DatapathHealth>>,
}

/// The result of a health evaluation: upstream's `ProxyHealth` (proxy_health.go).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Every family that synced at least once is healthy.
    pub healthy: bool,
    /// The latest `Updated` of all families; `None`: Go's zero time.
    pub last_updated: Option<Stamp>,
    /// Per family that synced at least once: its last `Updated` and its health.
    pub status: Vec<(IpFamily, Stamp, bool)>,
}

impl ProxyHealth {
    /// `health_timeout`: how long a queued update may stay unsynced (kube-proxy: 2 × the sync
    /// period).
    pub fn new(health_timeout: Duration, clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            health_timeout,
            state: RwLock::new(HealthState {
                last_updated: BTreeMap::new(),
                oldest_pending_queued: BTreeMap::new(),
                // Eligible while starting up, until a node event says otherwise.
                node_eligible: true,
                node_required: false,
            }),
            datapath: RwLock::new(None),
        }
    }

    /// What the datapath's checks found (see `datapath.rs`), for `/healthz`.
    pub fn set_datapath(&self, datapath: DatapathHealth) {
        *self
            .datapath
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(datapath);
    }

    pub fn datapath(&self) -> Option<DatapathHealth> {
        self.datapath
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HealthState> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HealthState> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn now(&self) -> Stamp {
        self.clock.now()
    }

    /// A family's dataplane is in sync with everything received so far.
    pub fn updated(&self, family: IpFamily) {
        let now = self.clock.now();
        let mut state = self.write();
        state.oldest_pending_queued.remove(&family);
        state.last_updated.insert(family, now);
    }

    /// A change for a family arrived and awaits a sync; the oldest unsynced one counts.
    pub fn queued_update(&self, family: IpFamily) {
        let now = self.clock.now();
        self.write()
            .oldest_pending_queued
            .entry(family)
            .or_insert(now);
    }

    /// A missing Node (deleted, or never there) makes the node ineligible from now on.
    pub fn require_node(&self) {
        self.write().node_required = true;
    }

    /// The node object changed (`None`: there is none; ineligible when a Node is required,
    /// else the current eligibility stays).
    pub fn node_changed(&self, node: Option<&NodeInfo>) {
        let mut state = self.write();
        match node {
            Some(node) => state.node_eligible = node_eligible(node),
            None if state.node_required => state.node_eligible = false,
            None => {}
        }
    }

    pub fn node_eligible(&self) -> bool {
        self.read().node_eligible
    }

    /// Healthy unless a family that has synced at least once has an update queued for
    /// `health_timeout` or longer. Families that never synced do not count.
    pub fn health(&self) -> Health {
        let now = self.clock.now();
        let state = self.read();
        let mut health = Health {
            healthy: true,
            last_updated: None,
            status: Vec::new(),
        };
        for (family, updated) in &state.last_updated {
            if health
                .last_updated
                .is_none_or(|latest| updated.wall > latest.wall)
            {
                health.last_updated = Some(*updated);
            }
            let late = state
                .oldest_pending_queued
                .get(family)
                .is_some_and(|queued| now.since(queued) >= self.health_timeout);
            health.healthy &= !late;
            health.status.push((*family, *updated, !late));
        }
        health
    }

    pub fn is_healthy(&self) -> bool {
        self.health().healthy
    }
}

/// Not eligible while being deleted or marked for deletion by the Cluster Autoscaler.
pub fn node_eligible(node: &NodeInfo) -> bool {
    !node.deleting && !node.taints.iter().any(|t| &*t.key == TO_BE_DELETED_TAINT)
}

/// A `time.Time` as Go's `MarshalJSON` writes it: RFC 3339 with as many fractional digits as
/// needed, in UTC (the agent's zone in its container); `None` is Go's zero time.
pub fn json_time(stamp: Option<Stamp>) -> String {
    let Some(stamp) = stamp else {
        return "0001-01-01T00:00:00Z".to_owned();
    };
    let Ok(timestamp) = jiff::Timestamp::try_from(stamp.wall) else {
        return "0001-01-01T00:00:00Z".to_owned();
    };
    let mut text = timestamp.strftime("%Y-%m-%dT%H:%M:%S").to_string();
    let nanos = timestamp.subsec_nanosecond();
    if nanos > 0 {
        let fraction = format!("{nanos:09}");
        text.push('.');
        text.push_str(fraction.trim_end_matches('0'));
    }
    text.push('Z');
    text
}

/// `/healthz` (with `node_eligible`) and `/livez` (without): `json.Marshal(ProxyHealth)` of
/// kube-proxy 1.33+, fields in the struct's order, families in Go's sorted map-key order.
pub fn health_body(
    health: &Health,
    last_updated: Option<Stamp>,
    now: Stamp,
    node_eligible: Option<bool>,
) -> String {
    use std::fmt::Write as _;
    let mut body = format!(
        r#"{{"lastUpdated":"{}","currentTime":"{}""#,
        json_time(last_updated),
        json_time(Some(now))
    );
    if let Some(eligible) = node_eligible {
        let _ = write!(body, r#","nodeEligible":{eligible}"#);
    }
    let _ = write!(body, r#","healthy":{}"#, health.healthy);
    if !health.status.is_empty() {
        let mut status = health.status.clone();
        status.sort_by_key(|(family, _, _)| family.as_k8s());
        body.push_str(r#","status":{"#);
        for (i, (family, updated, healthy)) in status.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            let _ = write!(
                body,
                r#""{}":{{"lastUpdated":"{}","healthy":{healthy}}}"#,
                family.as_k8s(),
                json_time(Some(*updated))
            );
        }
        body.push('}');
    }
    body.push('}');
    body
}

/// `/healthz`'s body: upstream's, then `datapath` (this agent's addition) when known.
pub fn healthz_body(
    health: &Health,
    last_updated: Option<Stamp>,
    now: Stamp,
    node_eligible: bool,
    datapath: Option<&DatapathHealth>,
) -> String {
    let mut body = health_body(health, last_updated, now, Some(node_eligible));
    if let Some(datapath) = datapath
        && let Ok(json) = serde_json::to_string(datapath)
    {
        body.pop();
        body.push_str(r#","datapath":"#);
        body.push_str(&json);
        body.push('}');
    }
    body
}

#[derive(Debug, Clone)]
struct Shared {
    health: Arc<ProxyHealth>,
    metrics: Arc<Metrics>,
}

/// `/healthz` and `/livez` (any method); Go's 404 for every other path.
pub fn router(health: Arc<ProxyHealth>, metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/healthz", any(healthz))
        .route("/livez", any(livez))
        .fallback(go_not_found)
        .with_state(Shared { health, metrics })
}

async fn healthz(State(shared): State<Shared>) -> Response<Body> {
    let node_eligible = shared.health.node_eligible();
    let health = shared.health.health();
    let now = shared.health.now();
    let datapath = shared.health.datapath();
    // Upstream's `healthy` field keeps its meaning (the syncs); the datapath's verdict only
    // adds to the status code, and says why in its own object.
    let datapath_healthy = datapath.as_ref().is_none_or(|datapath| datapath.healthy);
    let (status, last_updated) = if health.healthy && node_eligible && datapath_healthy {
        // kube-proxy reports "now" as lastUpdated while healthy, for compatibility with
        // releases where it was the time of the last sync loop run.
        (StatusCode::OK, Some(now))
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, health.last_updated)
    };
    shared.metrics.healthz_answered(status);
    let body = healthz_body(&health, last_updated, now, node_eligible, datapath.as_ref());
    response(status, "application/json", body)
}

async fn livez(State(shared): State<Shared>) -> Response<Body> {
    let health = shared.health.health();
    let now = shared.health.now();
    let (status, last_updated) = if health.healthy {
        (StatusCode::OK, Some(now))
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, health.last_updated)
    };
    shared.metrics.livez_answered(status);
    let body = health_body(&health, last_updated, now, None);
    response(status, "application/json", body)
}
