//! The proxy health server (kube-proxy's `ProxyHealthServer`, `--healthz-bind-address`):
//! `/healthz` and `/livez`, answered from the sync timestamps of each IP family and from whether
//! the node is being deleted.

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
use k8s_openapi::api::core::v1::Node;

use super::{
    http::{go_not_found, response},
    metrics::Metrics,
    time_format::{GO_ZERO_TIME, Stamp},
};
use crate::desired::IpFamily;

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
}

/// The proxy's health: kube-proxy's `ProxyHealthServer` state.
#[derive(Debug)]
pub struct ProxyHealth {
    clock: Arc<dyn Clock>,
    health_timeout: Duration,
    state: RwLock<HealthState>,
}

/// The result of a health evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    pub healthy: bool,
    /// The latest `Updated` of all families, or the unhealthy family's; `None`: Go's zero time.
    pub last_updated: Option<Stamp>,
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
            }),
        }
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

    /// The node object changed (`None`: not known, which keeps the current eligibility).
    pub fn node_changed(&self, node: Option<&Node>) {
        if let Some(node) = node {
            self.write().node_eligible = node_eligible(node);
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
        let mut last_updated: Option<Stamp> = None;
        for (family, updated) in &state.last_updated {
            if last_updated.is_none_or(|latest| updated.wall > latest.wall) {
                last_updated = Some(*updated);
            }
            let Some(queued) = state.oldest_pending_queued.get(family) else {
                continue;
            };
            if now.since(queued) < self.health_timeout {
                continue;
            }
            return Health {
                healthy: false,
                last_updated: Some(*updated),
            };
        }
        Health {
            healthy: true,
            last_updated,
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.health().healthy
    }
}

/// Not eligible while being deleted or marked for deletion by the Cluster Autoscaler.
pub fn node_eligible(node: &Node) -> bool {
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    !node
        .spec
        .as_ref()
        .and_then(|spec| spec.taints.as_ref())
        .is_some_and(|taints| taints.iter().any(|t| t.key == TO_BE_DELETED_TAINT))
}

fn go_time(stamp: Option<Stamp>) -> String {
    stamp.map_or_else(|| GO_ZERO_TIME.to_owned(), |s| s.go_string())
}

/// `/healthz`: kube-proxy's body, byte for byte — note the missing space after the first comma.
pub fn healthz_body(last_updated: &str, current_time: &str, node_eligible: bool) -> String {
    format!(
        r#"{{"lastUpdated": "{last_updated}","currentTime": "{current_time}", "nodeEligible": {node_eligible}}}"#
    )
}

/// `/livez`: like `/healthz` without `nodeEligible`.
pub fn livez_body(last_updated: &str, current_time: &str) -> String {
    format!(r#"{{"lastUpdated": "{last_updated}","currentTime": "{current_time}"}}"#)
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
    let (status, last_updated) = if health.healthy && node_eligible {
        // kube-proxy reports "now" as lastUpdated while healthy, for compatibility with
        // releases where it was the time of the last sync loop run.
        (StatusCode::OK, Some(now))
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, health.last_updated)
    };
    shared.metrics.healthz_answered(status);
    let body = healthz_body(&go_time(last_updated), &now.go_string(), node_eligible);
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
    let body = livez_body(&go_time(last_updated), &now.go_string());
    response(status, "application/json", body)
}
