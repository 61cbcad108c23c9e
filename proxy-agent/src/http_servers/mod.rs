//! Node services shared by both proxy modes: the proxy health server (`/healthz`, `/livez`),
//! health check node ports for `externalTrafficPolicy: Local` load balancers, and the metrics
//! server (`/metrics`, `/proxyMode`), with kube-proxy's behaviour.
//!
//! - `health.rs`: health state per IP family + the `/healthz` `/livez` server.
//! - `datapath.rs`: the datapath's state in `/healthz`'s body and when it makes it 503.
//! - `service_health.rs`: one server per health check node port.
//! - `metrics.rs`: the registry, kube-proxy's `kubeproxy_*` metrics and our `kubeproxy_ebpf_*`.
//! - `histogram.rs`: kube-proxy's histograms, classic and native (client_golang's algorithm).
//! - `rest_client.rs`: client-go's `rest_client_*` families, fed by the API client.
//! - `exposition.rs`: `/metrics` content negotiation and the classic text format.
//! - `protobuf.rs`: the protobuf exposition (`io.prometheus.client.MetricFamily`, delimited).
//! - `http.rs`: serving (Go-like listeners and headers).
//!
//! [`HttpServers`] is the handle the agent's loop calls.

pub mod build_info;
pub mod datapath;
pub mod exposition;
pub mod health;
pub mod histogram;
pub mod http;
pub mod metrics;
pub mod protobuf;
pub mod rest_client;
pub mod service_health;
pub mod service_traffic;

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::{Duration, SystemTime},
};

use axum::Router;
use tokio::task::JoinHandle;
use tracing::{error, info};

use self::{
    health::{Clock, ProxyHealth, SystemClock},
    http::{ServerHandle, listen, serve},
    metrics::Metrics,
    rest_client::RestClientMetrics,
    service_health::ServiceHealthServers,
};
use proxy_model::{
    desired::{IpFamily, ServicePortName, Snapshot},
    objects::NodeInfo,
    proxy_mode::ProxyMode,
};

/// kube-proxy's `--healthz-bind-address` default.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 10256);
/// kube-proxy's `--metrics-bind-address` default.
pub const DEFAULT_METRICS_BIND_ADDRESS: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10249);
/// kube-proxy retries a server whose address cannot be bound this often.
const BIND_RETRY: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct HttpServersConfig {
    pub node_name: String,
    pub mode: ProxyMode,
    /// `None`: no health server (kube-proxy: empty `--healthz-bind-address`).
    pub healthz_bind_address: Option<SocketAddr>,
    /// `None`: no metrics server.
    pub metrics_bind_address: Option<SocketAddr>,
    /// How long a queued change may stay unsynced before the proxy is unhealthy (kube-proxy:
    /// 2 × the sync period).
    pub health_timeout: Duration,
    /// The node addresses health check node ports listen on; empty: all.
    pub node_port_addresses: Vec<IpAddr>,
    /// A missing Node makes `/healthz` fail (the API source; a manifests folder may hold
    /// no Node).
    pub node_required: bool,
    /// The API client's request metrics, which `/metrics` serves (see [`RestClientMetrics`]).
    pub rest_client: RestClientMetrics,
}

impl HttpServersConfig {
    /// kube-proxy's defaults for a node and a mode, given the sync period.
    pub fn new(node_name: &str, mode: ProxyMode, sync_period: Duration) -> Self {
        Self {
            node_name: node_name.to_owned(),
            mode,
            healthz_bind_address: Some(DEFAULT_HEALTHZ_BIND_ADDRESS),
            metrics_bind_address: Some(DEFAULT_METRICS_BIND_ADDRESS),
            health_timeout: sync_period * 2,
            node_port_addresses: Vec::new(),
            node_required: false,
            rest_client: RestClientMetrics::from_feature_gates(),
        }
    }
}

/// A server that is listening, or still trying to bind its address.
#[derive(Debug)]
enum Server {
    Running(ServerHandle),
    Retrying(JoinHandle<()>),
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Server::Retrying(task) = self {
            task.abort();
        }
    }
}

/// Starts `router` on `addr`; a bind failure is logged and retried every 5 s (kube-proxy's
/// behaviour without `--bind-address-hard-fail`), never fatal.
fn start_server(addr: SocketAddr, router: Router, name: &'static str) -> Server {
    let attempt =
        move |router: Router| listen(addr).and_then(|listener| serve(listener, router, name));
    match attempt(router.clone()) {
        Ok(handle) => {
            info!(server = name, address = %handle.local_addr(), "serving");
            Server::Running(handle)
        }
        Err(error) => {
            error!(server = name, %addr, %error, "cannot start server, retrying every 5s");
            Server::Retrying(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(BIND_RETRY).await;
                    match attempt(router.clone()) {
                        Ok(handle) => {
                            info!(server = name, address = %handle.local_addr(), "serving");
                            // Held until the task is aborted, which closes the server.
                            std::future::pending::<()>().await;
                            drop(handle);
                        }
                        Err(error) => error!(server = name, %addr, %error, "cannot start server"),
                    }
                }
            }))
        }
    }
}

/// The node services of a running agent. Create inside the tokio runtime; dropping it closes
/// every server.
#[derive(Debug)]
pub struct HttpServers {
    health: Arc<ProxyHealth>,
    metrics: Arc<Metrics>,
    service_health: ServiceHealthServers,
    healthz_server: Option<Server>,
    metrics_server: Option<Server>,
    /// Trigger times before this are not measured (kube-proxy's change tracker start).
    started: SystemTime,
}

impl HttpServers {
    pub fn start(config: &HttpServersConfig) -> Self {
        Self::start_with_clock(config, Arc::new(SystemClock))
    }

    pub fn start_with_clock(config: &HttpServersConfig, clock: Arc<dyn Clock>) -> Self {
        let started = clock.now().wall;
        let health = Arc::new(ProxyHealth::new(config.health_timeout, clock));
        if config.node_required {
            health.require_node();
        }
        let metrics = Arc::new(Metrics::with_rest_client(
            config.mode,
            config.rest_client.clone(),
        ));
        let service_health = ServiceHealthServers::new(
            &config.node_name,
            config.node_port_addresses.clone(),
            Arc::clone(&health),
        );
        let healthz_server = config.healthz_bind_address.map(|addr| {
            start_server(
                addr,
                health::router(Arc::clone(&health), Arc::clone(&metrics)),
                "healthz",
            )
        });
        let metrics_server = config
            .metrics_bind_address
            .map(|addr| start_server(addr, metrics::router(Arc::clone(&metrics)), "metrics"));
        Self {
            health,
            metrics,
            service_health,
            healthz_server,
            metrics_server,
            started,
        }
    }

    pub fn health(&self) -> &Arc<ProxyHealth> {
        &self.health
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn service_health(&self) -> &ServiceHealthServers {
        &self.service_health
    }

    /// Where `/healthz` is served, once bound.
    pub fn healthz_addr(&self) -> Option<SocketAddr> {
        match &self.healthz_server {
            Some(Server::Running(handle)) => Some(handle.local_addr()),
            _ => None,
        }
    }

    /// Where `/metrics` is served, once bound.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        match &self.metrics_server {
            Some(Server::Running(handle)) => Some(handle.local_addr()),
            _ => None,
        }
    }

    /// The sync loop starts (kube-proxy's `SyncLoop`): a family counts as updated once, so the
    /// proxy is healthy while its first sync is pending.
    pub fn loop_started(&self, family: IpFamily) {
        self.health.updated(family);
        self.metrics.sync_queued(family, self.health.now().wall);
    }

    /// A change for `family` arrived and a sync is requested (kube-proxy's `Sync()`).
    pub fn queued(&self, family: IpFamily) {
        self.health.queued_update(family);
        self.metrics.sync_queued(family, self.health.now().wall);
    }

    /// A sync of `families` succeeded in `duration` (`full`: every Service was resynced) and
    /// `snapshot` is what the dataplane now has. Opens/closes health check node ports (their
    /// errors are logged and retried on the next call), once for all the families: they cover
    /// both.
    /// (The iptables full/partial histograms are fed by the dataplane, which alone knows
    /// whether a family's restore was partial.)
    /// `scope`: the service ports that changed since the last call (`None`: all may have).
    pub fn synced(
        &self,
        families: &[IpFamily],
        snapshot: &Snapshot,
        scope: Option<&BTreeSet<ServicePortName>>,
        duration: Duration,
    ) {
        for &family in families {
            self.health.updated(family);
            let now = self.health.now().wall;
            self.metrics.sync_succeeded(family, duration, now);
            self.metrics
                .set_no_local_endpoints(family, snapshot.family(family), scope);
        }
        self.service_health.sync(snapshot, scope);
    }

    /// Where health check node ports listen (the node settings' `health_check_ips`).
    pub fn set_health_check_ips(&self, ips: Vec<IpAddr>) {
        self.service_health.set_listen_ips(ips);
    }

    /// The node object changed (deletion, taints): decides `nodeEligible` of `/healthz`.
    pub fn node_changed(&self, node: Option<&NodeInfo>) {
        self.health.node_changed(node);
    }

    /// After a successful sync: one network programming observation per trigger time (the
    /// store's `Changes::trigger_times`); times before the agent started are skipped.
    pub fn network_programmed(&self, family: IpFamily, trigger_times: &[SystemTime]) {
        let recent: Vec<SystemTime> = trigger_times
            .iter()
            .copied()
            .filter(|time| *time > self.started)
            .collect();
        self.metrics
            .network_programmed(family, &recent, self.health.now().wall);
    }

    /// Closes every server.
    pub fn shutdown(self) {
        self.service_health.close_all();
    }
}

#[cfg(test)]
mod tests;
