//! The agent's own form of a Service: the fields kube-proxy's `newBaseServiceInfo` reads and
//! nothing else. A source converts each Service as it arrives and drops the `k8s-openapi`
//! object (metadata, managed fields, selectors, status conditions are never read).
//!
//! Values are kept as written, not parsed: the desired-state computation reports an invalid
//! one naming the Service, the field and the value, and does so per IP family, as today.
//! Repeated strings (types, policies, port names, protocols) are interned.

use k8s_openapi::api::core::v1::Service;

use super::interned::{Name, intern};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    /// `spec.type` as written (`None`: ClusterIP).
    pub type_: Option<Name>,
    pub cluster_ip: Option<Box<str>>,
    pub cluster_ips: Option<Box<[Box<str>]>>,
    pub external_ips: Box<[Box<str>]>,
    pub external_traffic_policy: Option<Name>,
    pub internal_traffic_policy: Option<Name>,
    pub load_balancer_source_ranges: Box<[Box<str>]>,
    pub health_check_node_port: Option<i32>,
    pub session_affinity: Option<Name>,
    /// `spec.sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub affinity_timeout_seconds: Option<i32>,
    pub traffic_distribution: Option<Name>,
    pub ports: Box<[ServicePortSpec]>,
    /// `status.loadBalancer.ingress[]`.
    pub load_balancer_ingress: Box<[LoadBalancerIngress]>,
    /// `metadata.creationTimestamp` (seconds since the epoch) and `metadata.uid`: of two
    /// Services claiming one address, port and protocol, the older keeps it.
    pub created: Option<i64>,
    pub uid: Option<Box<str>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortSpec {
    pub name: Option<Name>,
    pub port: i32,
    pub protocol: Option<Name>,
    pub node_port: Option<i32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadBalancerIngress {
    pub ip: Option<Box<str>>,
    pub ip_mode: Option<Name>,
}

fn boxed(values: Option<&Vec<String>>) -> Box<[Box<str>]> {
    values
        .into_iter()
        .flatten()
        .map(|value| value.as_str().into())
        .collect()
}

impl From<&Service> for ServiceInfo {
    fn from(service: &Service) -> Self {
        let Some(spec) = &service.spec else {
            return Self::default();
        };
        let metadata = &service.metadata;
        let name = |value: &Option<String>| value.as_deref().map(intern);
        Self {
            type_: name(&spec.type_),
            cluster_ip: spec.cluster_ip.as_deref().map(Into::into),
            cluster_ips: spec.cluster_ips.as_ref().map(|ips| boxed(Some(ips))),
            external_ips: boxed(spec.external_ips.as_ref()),
            external_traffic_policy: name(&spec.external_traffic_policy),
            internal_traffic_policy: name(&spec.internal_traffic_policy),
            load_balancer_source_ranges: boxed(spec.load_balancer_source_ranges.as_ref()),
            health_check_node_port: spec.health_check_node_port,
            session_affinity: name(&spec.session_affinity),
            affinity_timeout_seconds: spec
                .session_affinity_config
                .as_ref()
                .and_then(|config| config.client_ip.as_ref())
                .and_then(|client_ip| client_ip.timeout_seconds),
            traffic_distribution: name(&spec.traffic_distribution),
            ports: spec
                .ports
                .iter()
                .flatten()
                .map(|port| ServicePortSpec {
                    name: name(&port.name),
                    port: port.port,
                    protocol: name(&port.protocol),
                    node_port: port.node_port,
                })
                .collect(),
            load_balancer_ingress: service
                .status
                .as_ref()
                .and_then(|status| status.load_balancer.as_ref())
                .and_then(|lb| lb.ingress.as_ref())
                .into_iter()
                .flatten()
                .map(|ingress| LoadBalancerIngress {
                    ip: ingress.ip.as_deref().map(Into::into),
                    ip_mode: name(&ingress.ip_mode),
                })
                .collect(),
            created: metadata
                .creation_timestamp
                .as_ref()
                .map(|time| time.0.as_second()),
            uid: metadata.uid.as_deref().map(Into::into),
        }
    }
}

impl From<Service> for ServiceInfo {
    fn from(service: Service) -> Self {
        Self::from(&service)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(yaml: &str) -> ServiceInfo {
        serde_yaml::from_str::<Service>(yaml)
            .expect("service yaml")
            .into()
    }

    #[test]
    fn keeps_what_the_proxy_reads() {
        let info = service(
            "metadata: {name: web, namespace: ns, labels: {app: web}}\n\
             spec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, \"fd00::10\"]\n  \
             externalIPs: [192.0.2.1]\n  externalTrafficPolicy: Local\n  internalTrafficPolicy: Cluster\n  \
             loadBalancerSourceRanges: [\" 10.0.0.0/8\"]\n  healthCheckNodePort: 30999\n  \
             sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n  \
             trafficDistribution: PreferClose\n  selector: {app: web}\n  \
             ports: [{name: http, port: 80, protocol: TCP, nodePort: 30080, targetPort: 8080}]\n\
             status: {loadBalancer: {ingress: [{ip: 203.0.113.1, ipMode: VIP}, {hostname: lb.example}]}}\n",
        );
        assert_eq!(info.type_.as_deref(), Some("LoadBalancer"));
        assert_eq!(info.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(info.cluster_ips.as_deref().map(<[_]>::len), Some(2));
        assert_eq!(&*info.external_ips[0], "192.0.2.1");
        assert_eq!(info.external_traffic_policy.as_deref(), Some("Local"));
        assert_eq!(info.internal_traffic_policy.as_deref(), Some("Cluster"));
        // As written: trimming and parsing are the desired state's, which reports bad values.
        assert_eq!(&*info.load_balancer_source_ranges[0], " 10.0.0.0/8");
        assert_eq!(info.health_check_node_port, Some(30999));
        assert_eq!(info.session_affinity.as_deref(), Some("ClientIP"));
        assert_eq!(info.affinity_timeout_seconds, Some(60));
        assert_eq!(info.traffic_distribution.as_deref(), Some("PreferClose"));
        assert_eq!(
            *info.ports,
            [ServicePortSpec {
                name: Some(intern("http")),
                port: 80,
                protocol: Some(intern("TCP")),
                node_port: Some(30080),
            }]
        );
        assert_eq!(info.load_balancer_ingress.len(), 2);
        assert_eq!(
            info.load_balancer_ingress[0].ip.as_deref(),
            Some("203.0.113.1")
        );
        assert_eq!(
            info.load_balancer_ingress[0].ip_mode.as_deref(),
            Some("VIP")
        );
        assert_eq!(info.load_balancer_ingress[1].ip, None);
    }

    #[test]
    fn fields_the_proxy_does_not_read_do_not_make_a_change() {
        let a = service(
            "metadata: {name: web, resourceVersion: \"1\"}\nspec: {clusterIP: 10.96.0.10, selector: {app: a}}\n",
        );
        let b = service(
            "metadata: {name: web, resourceVersion: \"2\", annotations: {x: y}}\nspec: {clusterIP: 10.96.0.10, selector: {app: b}}\n",
        );
        assert_eq!(a, b);
        let c = service("metadata: {name: web}\nspec: {clusterIP: 10.96.0.11}\n");
        assert_ne!(a, c);
        assert_eq!(service("metadata: {name: web}\n"), ServiceInfo::default());
    }
}
