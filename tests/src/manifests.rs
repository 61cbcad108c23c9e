//! A temporary manifests directory for the agent's file source, and YAML renderers for
//! Services and EndpointSlices.

use std::fmt::Write as _;
use std::fs;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use crate::{Result, RigError, unique_name};

/// A fresh directory under the system temp dir; removed (recursively) on drop.
#[derive(Debug)]
pub struct ManifestsDir {
    dir: PathBuf,
}

impl ManifestsDir {
    pub fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(unique_name("manifests"));
        fs::create_dir(&dir).map_err(|e| RigError::io(format!("creating {}", dir.display()), e))?;
        Ok(Self { dir })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Writes `file_name` atomically: the content goes to `.file_name.tmp` (the agent ignores
    /// dot-files) and is then renamed, so the agent never reads a half-written manifest.
    pub fn write(&self, file_name: &str, yaml: &str) -> Result<()> {
        let tmp = self.dir.join(format!(".{file_name}.tmp"));
        let dst = self.dir.join(file_name);
        fs::write(&tmp, yaml).map_err(|e| RigError::io(format!("writing {}", tmp.display()), e))?;
        fs::rename(&tmp, &dst)
            .map_err(|e| RigError::io(format!("renaming to {}", dst.display()), e))
    }

    pub fn remove(&self, file_name: &str) -> Result<()> {
        let path = self.dir.join(file_name);
        fs::remove_file(&path).map_err(|e| RigError::io(format!("removing {}", path.display()), e))
    }
}

impl Drop for ManifestsDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("rig: removing {} failed: {e}", self.dir.display());
        }
    }
}

/// Kubernetes port protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub fn as_k8s(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        }
    }
}

/// A port of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
}

/// A port of an EndpointSlice (the backends' port, matched to the Service port by name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
}

/// One endpoint of an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
}

impl Endpoint {
    /// A ready, serving, non-terminating endpoint.
    pub fn ready(ip: impl Into<IpAddr>) -> Self {
        Self {
            ip: ip.into(),
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            zone: None,
        }
    }

    /// An endpoint that is neither ready nor serving (e.g. failing its readiness probe).
    pub fn not_ready(ip: impl Into<IpAddr>) -> Self {
        Self {
            ready: false,
            serving: false,
            ..Self::ready(ip)
        }
    }
}

/// A v1 Service of type ClusterIP.
pub fn service_yaml(
    namespace: &str,
    name: &str,
    cluster_ip: Ipv4Addr,
    ports: &[ServicePort],
) -> String {
    service_yaml_with(namespace, name, &[cluster_ip.into()], ports, None)
}

/// A v1 Service of type ClusterIP with one ClusterIP per family (the first is primary;
/// two make it `RequireDualStack`) and optionally `sessionAffinity: ClientIP` with a timeout.
pub fn service_yaml_with(
    namespace: &str,
    name: &str,
    cluster_ips: &[IpAddr],
    ports: &[ServicePort],
    affinity_timeout: Option<u32>,
) -> String {
    let quoted = |ips: &mut dyn Iterator<Item = String>| {
        ips.map(|ip| format!("\"{ip}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let primary = cluster_ips
        .first()
        .map(ToString::to_string)
        .unwrap_or_default();
    let ips = quoted(&mut cluster_ips.iter().map(ToString::to_string));
    let families = cluster_ips
        .iter()
        .map(|ip| if ip.is_ipv4() { "IPv4" } else { "IPv6" })
        .collect::<Vec<_>>()
        .join(", ");
    let policy = if cluster_ips.len() > 1 {
        "RequireDualStack"
    } else {
        "SingleStack"
    };
    let mut y = format!(
        "apiVersion: v1\n\
         kind: Service\n\
         metadata:\n  name: {name:?}\n  namespace: {namespace:?}\n\
         spec:\n  type: ClusterIP\n  clusterIP: \"{primary}\"\n  clusterIPs: [{ips}]\n\
         \x20 ipFamilies: [{families}]\n  ipFamilyPolicy: {policy}\n"
    );
    if let Some(timeout) = affinity_timeout {
        let _ = writeln!(
            y,
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: {timeout}"
        );
    }
    y.push_str("  ports:\n");
    for p in ports {
        // writeln! into a String cannot fail.
        let _ = writeln!(
            y,
            "  - name: {:?}\n    port: {}\n    protocol: {}\n    targetPort: {}",
            p.name,
            p.port,
            p.protocol.as_k8s(),
            p.port
        );
    }
    y
}

/// A discovery.k8s.io/v1 EndpointSlice owned by `service_name`; addressType IPv6 if the first
/// endpoint is IPv6, else IPv4 (see [`endpoint_slice_yaml_family`] for empty IPv6 slices).
pub fn endpoint_slice_yaml(
    namespace: &str,
    slice_name: &str,
    service_name: &str,
    ports: &[SlicePort],
    endpoints: &[Endpoint],
) -> String {
    let ipv6 = endpoints.first().is_some_and(|e| e.ip.is_ipv6());
    endpoint_slice_yaml_family(namespace, slice_name, service_name, ports, endpoints, ipv6)
}

/// An EndpointSlice with an explicit address type.
pub fn endpoint_slice_yaml_family(
    namespace: &str,
    slice_name: &str,
    service_name: &str,
    ports: &[SlicePort],
    endpoints: &[Endpoint],
    ipv6: bool,
) -> String {
    let address_type = if ipv6 { "IPv6" } else { "IPv4" };
    let mut y = format!(
        "apiVersion: discovery.k8s.io/v1\n\
         kind: EndpointSlice\n\
         metadata:\n  name: {slice_name:?}\n  namespace: {namespace:?}\n\
         \x20 labels:\n    kubernetes.io/service-name: {service_name:?}\n\
         addressType: {address_type}\n"
    );
    if ports.is_empty() {
        y.push_str("ports: []\n");
    } else {
        y.push_str("ports:\n");
    }
    for p in ports {
        let _ = writeln!(
            y,
            "- name: {:?}\n  port: {}\n  protocol: {}",
            p.name,
            p.port,
            p.protocol.as_k8s()
        );
    }
    if endpoints.is_empty() {
        y.push_str("endpoints: []\n");
    } else {
        y.push_str("endpoints:\n");
    }
    for e in endpoints {
        let _ = writeln!(
            y,
            "- addresses: [\"{}\"]\n  conditions:\n    ready: {}\n    serving: {}\n    terminating: {}",
            e.ip, e.ready, e.serving, e.terminating
        );
        if let Some(node) = &e.node_name {
            let _ = writeln!(y, "  nodeName: {node:?}");
        }
        if let Some(zone) = &e.zone {
            let _ = writeln!(y, "  zone: {zone:?}");
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_service_and_slice() {
        let svc = service_yaml(
            "demo",
            "web",
            Ipv4Addr::new(10, 96, 0, 10),
            &[ServicePort {
                name: "http".into(),
                port: 80,
                protocol: Protocol::Tcp,
            }],
        );
        assert!(svc.contains("clusterIP: \"10.96.0.10\""), "{svc}");
        assert!(
            svc.contains("  - name: \"http\"\n    port: 80\n    protocol: TCP"),
            "{svc}"
        );
        let slice = endpoint_slice_yaml(
            "demo",
            "web-abc",
            "web",
            &[SlicePort {
                name: "http".into(),
                port: 8080,
                protocol: Protocol::Tcp,
            }],
            &[Endpoint {
                node_name: Some("n1".into()),
                ..Endpoint::not_ready(Ipv4Addr::new(10, 244, 3, 2))
            }],
        );
        assert!(
            slice.contains("kubernetes.io/service-name: \"web\""),
            "{slice}"
        );
        assert!(slice.contains("- addresses: [\"10.244.3.2\"]\n  conditions:\n    ready: false\n    serving: false\n    terminating: false\n  nodeName: \"n1\""), "{slice}");
        let empty = endpoint_slice_yaml("demo", "e", "e", &[], &[]);
        assert!(empty.contains("endpoints: []"), "{empty}");
    }

    /// The agent parses manifests into k8s-openapi types: make sure ours deserialize.
    #[test]
    fn yaml_deserializes_into_k8s_types() -> Result<(), serde_yaml::Error> {
        use k8s_openapi::api::core::v1::Service;
        use k8s_openapi::api::discovery::v1::EndpointSlice;
        let svc: Service = serde_yaml::from_str(&service_yaml(
            "demo",
            "web",
            Ipv4Addr::new(10, 96, 0, 10),
            &[ServicePort {
                name: "http".into(),
                port: 80,
                protocol: Protocol::Tcp,
            }],
        ))?;
        let spec = svc.spec.unwrap_or_default();
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(spec.ports.unwrap_or_default().len(), 1);
        let slice: EndpointSlice = serde_yaml::from_str(&endpoint_slice_yaml(
            "demo",
            "web-1",
            "web",
            &[SlicePort {
                name: "http".into(),
                port: 8080,
                protocol: Protocol::Udp,
            }],
            &[
                Endpoint::ready(Ipv4Addr::new(10, 244, 1, 2)),
                Endpoint {
                    zone: Some("z1".into()),
                    ..Endpoint::not_ready(Ipv4Addr::new(10, 244, 2, 2))
                },
            ],
        ))?;
        assert_eq!(slice.address_type, "IPv4");
        assert_eq!(
            slice
                .metadata
                .labels
                .unwrap_or_default()
                .get("kubernetes.io/service-name"),
            Some(&"web".to_owned())
        );
        assert_eq!(slice.endpoints.len(), 2);
        let empty: EndpointSlice =
            serde_yaml::from_str(&endpoint_slice_yaml("demo", "e-1", "e", &[], &[]))?;
        assert!(empty.endpoints.is_empty());
        Ok(())
    }
}
