//! The benchmark's cluster: one live Service (`bench/web`, the scenario's ClusterIP, backed by
//! the echo pods) and N-1 decoy Services with distinct ClusterIPs and endpoint IPs that fill the
//! maps and rules the way a real cluster does, as manifests files (for the agent) or as
//! in-memory objects (for the in-process measurements).

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::{Service, ServicePort as K8sServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{
    Endpoint as K8sEndpoint, EndpointConditions, EndpointPort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use proxy_model::objects::{EndpointSliceInfo, ObjectKey, ServiceInfo};

use crate::Result;
use crate::manifests::{Endpoint, ManifestsDir, Protocol, ServicePort, SlicePort};
use crate::scenario::{
    BACKEND_PORT, CLUSTER_IP, HOSTNAME, PORT_NAME, SERVICE_PORT, http_slice, pod_endpoint,
};

pub const NAMESPACE: &str = "bench";
pub const LIVE_SERVICE: &str = "web";
pub const LIVE_SLICE: &str = "web-1";
pub const LIVE_SLICE_FILE: &str = "web-slice.yaml";
/// Decoy Services per manifests file.
const DECOYS_PER_FILE: usize = 1000;

/// `services` Services in total (the live one included), `endpoints` endpoints per decoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    pub services: usize,
    pub endpoints: usize,
}

/// Which backends the live Service has: the benchmark flips between the two to measure how
/// long a change takes to reach the datapath.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiveSet {
    /// pod1 and pod2.
    A,
    /// pod3 only.
    B,
}

impl LiveSet {
    pub fn pods(self) -> &'static [usize] {
        match self {
            Self::A => &[1, 2],
            Self::B => &[3],
        }
    }

    /// Backend names that show the set is live.
    pub fn names(self) -> &'static [&'static str] {
        match self {
            Self::A => &["pod1", "pod2"],
            Self::B => &["pod3"],
        }
    }

    pub fn other(self) -> Self {
        match self {
            Self::A => Self::B,
            Self::B => Self::A,
        }
    }
}

/// Pods the live Service can use (see [`LiveSet`]).
pub const LIVE_PODS: usize = 3;

fn offset(base: Ipv4Addr, n: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(base).wrapping_add(u32::try_from(n).unwrap_or(u32::MAX)))
}

/// ClusterIP of decoy `i`: from 10.96.1.0 on, clear of the live 10.96.0.10.
pub fn decoy_cluster_ip(i: usize) -> Ipv4Addr {
    offset(Ipv4Addr::new(10, 96, 1, 0), i)
}

/// Endpoint `j` of decoy `i`: distinct addresses from 10.128.0.1 on (pods on other nodes).
pub fn decoy_endpoint_ip(w: Workload, i: usize, j: usize) -> Ipv4Addr {
    offset(Ipv4Addr::new(10, 128, 0, 1), i * w.endpoints + j)
}

/// The replacement address used by in-process change number `k`.
pub fn replacement_ip(k: usize) -> Ipv4Addr {
    offset(Ipv4Addr::new(10, 192, 0, 1), k)
}

fn decoy_name(i: usize) -> String {
    format!("svc-{i}")
}

fn decoy_node(i: usize) -> String {
    format!("node-{}", i % 50)
}

/// NodePort of the live Service (item 3: external clients through the node).
pub const LIVE_NODE_PORT: u16 = 30080;

/// The live Service: the scenario's ClusterIP Service made a NodePort (eTP Cluster) on
/// [`LIVE_NODE_PORT`], so that one Service serves items 1–3 and the Service counts stay exact.
pub fn live_service_yaml() -> String {
    let cluster = crate::scenario::http_service(NAMESPACE, LIVE_SERVICE, CLUSTER_IP);
    // The generator writes one port, last; its fields are indented by four spaces.
    format!("{cluster}    nodePort: {LIVE_NODE_PORT}\n").replace(
        "type: ClusterIP\n",
        "type: NodePort\n  externalTrafficPolicy: Cluster\n",
    )
}

impl Workload {
    pub fn decoys(self) -> usize {
        self.services.saturating_sub(1)
    }

    pub fn total_endpoints(self) -> usize {
        self.decoys() * self.endpoints + LiveSet::A.pods().len()
    }

    /// Writes the live Service (with `live`) and every decoy into `dir`.
    pub fn write_manifests(self, dir: &ManifestsDir, live: LiveSet) -> Result<()> {
        dir.write("web-svc.yaml", &live_service_yaml())?;
        write_live_slice(dir, live)?;
        let port = [ServicePort {
            name: PORT_NAME.into(),
            port: SERVICE_PORT,
            protocol: Protocol::Tcp,
        }];
        let slice_port = [SlicePort {
            name: PORT_NAME.into(),
            port: BACKEND_PORT,
            protocol: Protocol::Tcp,
        }];
        let mut file = String::new();
        let mut endpoints = Vec::with_capacity(self.endpoints);
        for i in 0..self.decoys() {
            let name = decoy_name(i);
            file.push_str("---\n");
            file.push_str(&crate::manifests::service_yaml(
                NAMESPACE,
                &name,
                decoy_cluster_ip(i),
                &port,
            ));
            endpoints.clear();
            endpoints.extend((0..self.endpoints).map(|j| Endpoint {
                node_name: Some(decoy_node(i)),
                ..Endpoint::ready(decoy_endpoint_ip(self, i, j))
            }));
            file.push_str("---\n");
            file.push_str(&crate::manifests::endpoint_slice_yaml(
                NAMESPACE,
                &format!("{name}-1"),
                &name,
                &slice_port,
                &endpoints,
            ));
            if (i + 1) % DECOYS_PER_FILE == 0 || i + 1 == self.decoys() {
                dir.write(&format!("decoys-{:03}.yaml", i / DECOYS_PER_FILE), &file)?;
                file.clear();
            }
        }
        Ok(())
    }

    /// The same cluster as a source delivers it: Services and EndpointSlices in the agent's
    /// own form (each converted as it is built, as the sources do).
    pub fn objects(
        self,
        live: LiveSet,
    ) -> (
        BTreeMap<ObjectKey, ServiceInfo>,
        BTreeMap<ObjectKey, EndpointSliceInfo>,
    ) {
        self.build(
            live,
            |service| ServiceInfo::from(&service),
            |slice| EndpointSliceInfo::from(&slice),
        )
    }

    /// The same cluster as API objects (what the API test server serves).
    pub fn api_objects(
        self,
        live: LiveSet,
    ) -> (
        BTreeMap<ObjectKey, Service>,
        BTreeMap<ObjectKey, EndpointSlice>,
    ) {
        self.build(live, |service| service, |slice| slice)
    }

    fn build<V, S>(
        self,
        live: LiveSet,
        service_as: impl Fn(Service) -> V,
        convert: impl Fn(EndpointSlice) -> S,
    ) -> (BTreeMap<ObjectKey, V>, BTreeMap<ObjectKey, S>) {
        (
            self.build_services(service_as),
            self.build_slices(live, convert),
        )
    }

    /// The Services alone, in the agent's form (the memory breakdown measures them apart).
    pub fn services(self) -> BTreeMap<ObjectKey, ServiceInfo> {
        self.build_services(|service| ServiceInfo::from(&service))
    }

    /// The EndpointSlices alone, in the agent's form.
    pub fn slices(self, live: LiveSet) -> BTreeMap<ObjectKey, EndpointSliceInfo> {
        self.build_slices(live, |slice| EndpointSliceInfo::from(&slice))
    }

    fn build_services<V>(self, service_as: impl Fn(Service) -> V) -> BTreeMap<ObjectKey, V> {
        let mut services = BTreeMap::new();
        services.insert(
            key(LIVE_SERVICE),
            service_as(service(LIVE_SERVICE, CLUSTER_IP)),
        );
        for i in 0..self.decoys() {
            let name = decoy_name(i);
            services.insert(key(&name), service_as(service(&name, decoy_cluster_ip(i))));
        }
        services
    }

    fn build_slices<S>(
        self,
        live: LiveSet,
        convert: impl Fn(EndpointSlice) -> S,
    ) -> BTreeMap<ObjectKey, S> {
        let mut slices = BTreeMap::new();
        slices.insert(key(LIVE_SLICE), convert(live_slice(live)));
        for i in 0..self.decoys() {
            let name = decoy_name(i);
            let endpoints = (0..self.endpoints)
                .map(|j| endpoint(decoy_endpoint_ip(self, i, j), &decoy_node(i)))
                .collect();
            let slice_name = format!("{name}-1");
            slices.insert(
                key(&slice_name),
                convert(slice(&slice_name, &name, endpoints)),
            );
        }
        slices
    }

    /// In-process change `k`: decoy `k mod decoys` gets its first endpoint replaced (a pod
    /// rescheduled: one endpoint leaves, another arrives). Returns the slice key, the new slice
    /// and the Service it belongs to. Without decoys, the live Service flips sets.
    pub fn change(self, k: usize) -> (ObjectKey, EndpointSlice, BTreeSet<ObjectKey>) {
        if self.decoys() == 0 {
            let set = if k.is_multiple_of(2) {
                LiveSet::B
            } else {
                LiveSet::A
            };
            let endpoints = set
                .pods()
                .iter()
                .map(|&i| endpoint(crate::topology::Topology::pod_ip(i), HOSTNAME))
                .collect();
            return (
                key(LIVE_SLICE),
                slice(LIVE_SLICE, LIVE_SERVICE, endpoints),
                BTreeSet::from([key(LIVE_SERVICE)]),
            );
        }
        let i = k % self.decoys();
        let name = decoy_name(i);
        let endpoints = (0..self.endpoints)
            .map(|j| {
                let ip = if j == 0 {
                    replacement_ip(k)
                } else {
                    decoy_endpoint_ip(self, i, j)
                };
                endpoint(ip, &decoy_node(i))
            })
            .collect();
        let slice_name = format!("{name}-1");
        (
            key(&slice_name),
            slice(&slice_name, &name, endpoints),
            BTreeSet::from([key(&name)]),
        )
    }
}

/// The live Service's EndpointSlice with `live` as its endpoints, as a typed object (what
/// [`write_live_slice`] writes).
pub fn live_slice(live: LiveSet) -> EndpointSlice {
    let endpoints = live
        .pods()
        .iter()
        .map(|&i| endpoint(crate::topology::Topology::pod_ip(i), HOSTNAME))
        .collect();
    slice(LIVE_SLICE, LIVE_SERVICE, endpoints)
}

/// Rewrites only the live Service's EndpointSlice file (atomically, via rename).
pub fn write_live_slice(dir: &ManifestsDir, live: LiveSet) -> Result<()> {
    let endpoints: Vec<_> = live.pods().iter().map(|&i| pod_endpoint(i)).collect();
    dir.write(
        LIVE_SLICE_FILE,
        &http_slice(NAMESPACE, LIVE_SLICE, LIVE_SERVICE, &endpoints),
    )
}

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: NAMESPACE.into(),
        name: name.into(),
    }
}

fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some(NAMESPACE.into()),
        ..ObjectMeta::default()
    }
}

/// What [`crate::manifests::service_yaml`] writes, as a typed object.
fn service(name: &str, cluster_ip: Ipv4Addr) -> Service {
    Service {
        metadata: meta(name),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: Some(cluster_ip.to_string()),
            cluster_ips: Some(vec![cluster_ip.to_string()]),
            ip_families: Some(vec!["IPv4".into()]),
            ip_family_policy: Some("SingleStack".into()),
            ports: Some(vec![K8sServicePort {
                name: Some(PORT_NAME.into()),
                port: i32::from(SERVICE_PORT),
                protocol: Some("TCP".into()),
                target_port: Some(IntOrString::Int(i32::from(SERVICE_PORT))),
                ..K8sServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn endpoint(ip: Ipv4Addr, node: &str) -> K8sEndpoint {
    K8sEndpoint {
        addresses: vec![ip.to_string()],
        conditions: Some(EndpointConditions {
            ready: Some(true),
            serving: Some(true),
            terminating: Some(false),
        }),
        node_name: Some(node.into()),
        ..K8sEndpoint::default()
    }
}

fn slice(name: &str, service: &str, endpoints: Vec<K8sEndpoint>) -> EndpointSlice {
    let mut metadata = meta(name);
    metadata.labels = Some(BTreeMap::from([(
        "kubernetes.io/service-name".to_owned(),
        service.to_owned(),
    )]));
    EndpointSlice {
        metadata,
        address_type: "IPv4".into(),
        endpoints,
        ports: Some(vec![EndpointPort {
            name: Some(PORT_NAME.into()),
            port: Some(i32::from(BACKEND_PORT)),
            protocol: Some("TCP".into()),
            ..EndpointPort::default()
        }]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoy_addresses_are_distinct_and_clear_of_the_live_service() {
        let w = Workload {
            services: 30_000,
            endpoints: 10,
        };
        assert_eq!(decoy_cluster_ip(0), Ipv4Addr::new(10, 96, 1, 0));
        assert_ne!(decoy_cluster_ip(29_998), CLUSTER_IP);
        assert_eq!(decoy_endpoint_ip(w, 1, 0), Ipv4Addr::new(10, 128, 0, 11));
        assert!(decoy_endpoint_ip(w, 29_998, 9) < replacement_ip(0));
        assert_eq!(w.total_endpoints(), 29_999 * 10 + 2);
    }

    #[test]
    fn objects_match_the_workload() {
        let w = Workload {
            services: 5,
            endpoints: 3,
        };
        let (services, slices) = w.objects(LiveSet::A);
        assert_eq!(services.len(), 5);
        assert_eq!(slices.len(), 5);
        let (slice_key, slice, changed) = w.change(7);
        assert!(slices.contains_key(&slice_key));
        assert_eq!(slice.endpoints.len(), 3);
        assert_eq!(changed.len(), 1);
    }
}
