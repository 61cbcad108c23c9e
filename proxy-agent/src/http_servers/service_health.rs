//! Health check node ports (kube-proxy's `ServiceHealthServer`): for every `LoadBalancer`
//! Service with `externalTrafficPolicy: Local`, an HTTP server on its `healthCheckNodePort` that
//! tells the cloud load balancer whether this node has a ready endpoint of the Service.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{
        Arc, PoisonError, RwLock,
        atomic::{AtomicBool, Ordering},
    },
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderName, HeaderValue, Response, StatusCode},
};
use tracing::{debug, error, info, warn};

use super::{
    health::ProxyHealth,
    http::{ServerHandle, listen, listen_exact, response, serve},
};
use proxy_model::{
    desired::{FamilySnapshot, ServicePortName, Snapshot},
    objects::ObjectKey,
};

/// Set on every answer (upstream since v1.33): the number of local endpoints, so load balancers
/// that support weights (GCE's WEIGHTED_MAGLEV) can spread traffic by it.
pub const ENDPOINT_WEIGHT_HEADER: &str = "x-load-balancing-endpoint-weight";

/// A health check node port that could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("node {node} failed to start healthcheck \"{service}\" on port {port}: {source}")]
pub struct ListenError {
    pub node: String,
    pub service: ObjectKey,
    pub port: u16,
    #[source]
    pub source: io::Error,
}

#[derive(Debug)]
struct Instance {
    port: u16,
    local_endpoints: usize,
    /// One per listen address; dropping them closes the port.
    servers: Vec<ServerHandle>,
}

type Instances = Arc<RwLock<BTreeMap<ObjectKey, Instance>>>;

/// The set of health check node port servers, kept in line with the snapshot on every sync.
#[derive(Debug)]
pub struct ServiceHealthServers {
    node_name: String,
    /// Behind a lock: the node settings may change the addresses at run time.
    listen_ips: RwLock<Vec<IpAddr>>,
    health: Arc<ProxyHealth>,
    instances: Instances,
    /// The next sync looks at every Service, whatever its scope.
    full_pending: AtomicBool,
}

impl ServiceHealthServers {
    /// `node_ips`: the node addresses `--nodeport-addresses` selects; empty means every address
    /// (one dual-stack wildcard listener per port).
    pub fn new(node_name: &str, node_ips: Vec<IpAddr>, health: Arc<ProxyHealth>) -> Self {
        let listen_ips = if node_ips.is_empty() {
            vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)]
        } else {
            node_ips
        };
        Self {
            node_name: node_name.to_owned(),
            listen_ips: RwLock::new(listen_ips),
            health,
            instances: Arc::default(),
            full_pending: AtomicBool::new(true),
        }
    }

    /// Opens, keeps or closes servers so there is exactly one per Service of `services` (name →
    /// health check node port); a Service whose port changed gets a new server. Ports that
    /// cannot be opened are returned (and logged); they are tried again on the next call.
    /// Must run inside a tokio runtime.
    pub fn sync_services(&self, services: &BTreeMap<ObjectKey, u16>) -> Vec<ListenError> {
        self.sync_services_within(services, |_| true)
    }

    /// [`Self::sync_services`] for the Services `within` selects; the others keep their ports.
    fn sync_services_within(
        &self,
        services: &BTreeMap<ObjectKey, u16>,
        within: impl Fn(&ObjectKey) -> bool,
    ) -> Vec<ListenError> {
        let mut instances = self
            .instances
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        instances.retain(|service, instance| {
            let keep = !within(service) || services.get(service) == Some(&instance.port);
            if !keep {
                info!(%service, port = instance.port, "closing healthcheck");
            }
            keep
        });
        let mut errors = Vec::new();
        for (service, &port) in services {
            if instances.contains_key(service) {
                continue;
            }
            match self.open(service, port) {
                Ok(servers) => {
                    info!(%service, port, "opened healthcheck");
                    instances.insert(
                        service.clone(),
                        Instance {
                            port,
                            local_endpoints: 0,
                            servers,
                        },
                    );
                }
                Err(source) => {
                    let error = ListenError {
                        node: self.node_name.clone(),
                        service: service.clone(),
                        port,
                        source,
                    };
                    warn!(reason = "FailedToStartServiceHealthcheck", "{error}");
                    errors.push(error);
                }
            }
        }
        errors
    }

    /// The addresses health check node ports listen on from now on (the node settings'
    /// `health_check_ips`; `[0.0.0.0]`: every address of both families). When they change,
    /// every open port is closed so that the next sync reopens it on the new addresses.
    pub fn set_listen_ips(&self, ips: Vec<IpAddr>) {
        let ips = if ips.is_empty() {
            vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)]
        } else {
            ips
        };
        let mut current = self
            .listen_ips
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if *current != ips {
            info!(addresses = ?ips, "health check node ports move to new addresses");
            *current = ips;
            drop(current);
            self.close_all();
        }
    }

    /// Listens on every address, or on none: a partial set is closed so that the next sync
    /// retries the whole port.
    fn open(&self, service: &ObjectKey, port: u16) -> io::Result<Vec<ServerHandle>> {
        let listen_ips = self
            .listen_ips
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        // A lone 0.0.0.0 is Go's "every address" (dual-stack); in a per-family list an
        // unspecified address means only its own family.
        let dual_stack_wildcard = listen_ips == [IpAddr::V4(Ipv4Addr::UNSPECIFIED)];
        let mut servers = Vec::with_capacity(listen_ips.len());
        for ip in &listen_ips {
            let addr = SocketAddr::new(*ip, port);
            let listener = if dual_stack_wildcard {
                listen(addr)?
            } else {
                listen_exact(addr)?
            };
            let router = Router::new().fallback(health_check).with_state(Handler {
                service: service.clone(),
                instances: Arc::clone(&self.instances),
                health: Arc::clone(&self.health),
            });
            servers.push(serve(listener, router, "service-healthcheck")?);
        }
        Ok(servers)
    }

    /// Sets the local ready endpoint counts; Services not in `counts` report 0.
    pub fn sync_endpoints(&self, counts: &BTreeMap<ObjectKey, usize>) {
        self.sync_endpoints_within(counts, |_| true);
    }

    fn sync_endpoints_within(
        &self,
        counts: &BTreeMap<ObjectKey, usize>,
        within: impl Fn(&ObjectKey) -> bool,
    ) {
        let mut instances = self
            .instances
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        for (service, instance) in instances.iter_mut() {
            if !within(service) {
                continue;
            }
            let count = counts.get(service).copied().unwrap_or(0);
            if instance.local_endpoints != count {
                debug!(%service, count, "reporting endpoints for healthcheck");
            }
            instance.local_endpoints = count;
        }
    }

    /// Both syncs from a snapshot; with `scope`, only the Services of those service ports
    /// changed since the last call (a walk of every port took 7 ms of each sync at 50k
    /// Services). A full pass follows a change of the listen addresses and a port that failed
    /// to open, so that its retry does not wait for a change of its Service.
    pub fn sync(
        &self,
        snapshot: &Snapshot,
        scope: Option<&BTreeSet<ServicePortName>>,
    ) -> Vec<ListenError> {
        let full_pending = self.full_pending.swap(false, Ordering::AcqRel);
        let errors = match scope.filter(|_| !full_pending) {
            None => {
                let services = health_check_node_ports(snapshot);
                let errors = self.sync_services(&services);
                self.sync_endpoints(&local_ready_endpoints(snapshot, &services));
                errors
            }
            Some(scope) => {
                let within: BTreeSet<&ObjectKey> = scope.iter().map(|name| &name.service).collect();
                let services = health_check_node_ports_of(snapshot, within.iter().copied());
                let is_within = |service: &ObjectKey| within.contains(service);
                let errors = self.sync_services_within(&services, is_within);
                self.sync_endpoints_within(&local_ready_endpoints(snapshot, &services), is_within);
                errors
            }
        };
        if !errors.is_empty() {
            self.full_pending.store(true, Ordering::Release);
        }
        errors
    }

    /// The open servers: Service → (port, bound addresses).
    pub fn open_ports(&self) -> BTreeMap<ObjectKey, (u16, Vec<SocketAddr>)> {
        let instances = self
            .instances
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        instances
            .iter()
            .map(|(service, instance)| {
                (
                    service.clone(),
                    (
                        instance.port,
                        instance
                            .servers
                            .iter()
                            .map(ServerHandle::local_addr)
                            .collect(),
                    ),
                )
            })
            .collect()
    }

    /// Closes every server.
    pub fn close_all(&self) {
        self.instances
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.full_pending.store(true, Ordering::Release);
    }
}

/// [`health_check_node_ports`] of the given Services only.
fn health_check_node_ports_of<'a>(
    snapshot: &Snapshot,
    services: impl Iterator<Item = &'a ObjectKey>,
) -> BTreeMap<ObjectKey, u16> {
    let mut ports = BTreeMap::new();
    for service in services {
        let port = [&snapshot.v4, &snapshot.v6]
            .into_iter()
            .flat_map(|family| family.of_service(service))
            .find_map(|port| port.health_check_node_port);
        if let Some(port) = port {
            ports.insert(service.clone(), port);
        }
    }
    ports
}

/// Every Service that needs a health check node port (`LoadBalancer`, `externalTrafficPolicy:
/// Local`, port set), with that port. The snapshot sets `health_check_node_port` only then.
pub fn health_check_node_ports(snapshot: &Snapshot) -> BTreeMap<ObjectKey, u16> {
    [&snapshot.v4, &snapshot.v6]
        .into_iter()
        .flat_map(|family| family.service_ports.values())
        .filter_map(|port| Some((port.name.service.clone(), port.health_check_node_port?)))
        .collect()
}

/// kube-proxy's `LocalReadyEndpoints` for the given Services: the number of distinct IPs of
/// local, ready endpoints over all ports of the Service (serving-but-terminating endpoints do not
/// count, so a node whose pods are shutting down drops out of the load balancer).
///
/// kube-proxy counts per IP family; with both families the larger count is reported, which is
/// what a single-stack node and a dual-stack pod (one IP of each family) both give.
pub fn local_ready_endpoints(
    snapshot: &Snapshot,
    services: &BTreeMap<ObjectKey, u16>,
) -> BTreeMap<ObjectKey, usize> {
    let mut counts = BTreeMap::new();
    for family in [&snapshot.v4, &snapshot.v6] {
        for (service, count) in family_local_ready(family, services) {
            let entry = counts.entry(service).or_insert(0);
            *entry = count.max(*entry);
        }
    }
    counts
}

fn family_local_ready(
    family: &FamilySnapshot,
    services: &BTreeMap<ObjectKey, u16>,
) -> BTreeMap<ObjectKey, usize> {
    services
        .keys()
        .map(|service| {
            let ips: BTreeSet<IpAddr> = family
                .of_service(service)
                .flat_map(|port| port.endpoints.iter())
                .filter(|endpoint| endpoint.is_local && endpoint.ready)
                .map(|endpoint| endpoint.addr)
                .collect();
            (service.clone(), ips.len())
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Handler {
    service: ObjectKey,
    instances: Instances,
    health: Arc<ProxyHealth>,
}

/// Every path and method: 200 when the Service has a local ready endpoint and the proxy is
/// healthy (node eligibility does not matter here), else 503; a JSON body indented with tabs.
async fn health_check(State(handler): State<Handler>) -> Response<Body> {
    let count = {
        let instances = handler
            .instances
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        match instances.get(&handler.service) {
            Some(instance) => instance.local_endpoints,
            None => {
                // A request on a connection accepted just before the server closed; kube-proxy
                // answers it with an empty 200.
                error!(service = %handler.service, "received request for closed healthcheck");
                return Response::new(Body::empty());
            }
        }
    };
    let healthy = handler.health.is_healthy();
    let status = if count != 0 && healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut response = response(
        status,
        "application/json",
        service_health_body(&handler.service, count, healthy),
    );
    response.headers_mut().insert(
        HeaderName::from_static(ENDPOINT_WEIGHT_HEADER),
        HeaderValue::from(count),
    );
    response
}

/// kube-proxy's body, byte for byte: tab indentation, no trailing newline.
pub fn service_health_body(service: &ObjectKey, local_endpoints: usize, healthy: bool) -> String {
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {local_endpoints},\n\t\"serviceProxyHealthy\": {healthy}\n}}",
        go_quote(&service.namespace),
        go_quote(&service.name)
    )
}

/// Go's `%q` for the strings that occur here (Kubernetes names: DNS labels, so plain ASCII;
/// anything else is escaped the way Go escapes it for ASCII input).
fn go_quote(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push_str(&format!("\\x{:02x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
