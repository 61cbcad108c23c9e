//! The agent's own form of this Node: what kube-proxy reacts to (topology labels, podCIDRs,
//! addresses, deletion and taints) and nothing else. The kubelet rewrites its Node every few
//! seconds (conditions, heartbeats, images); none of that is kept, so none of it is compared.

use k8s_openapi::api::core::v1::Node;

use super::interned::{Name, intern};

/// The zone label endpoint selection reads.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The region label, kept so a change of it counts as a topology change as upstream's does.
pub const REGION_LABEL: &str = "topology.kubernetes.io/region";

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub zone: Option<Box<str>>,
    pub region: Option<Box<str>>,
    /// `spec.podCIDRs` as written (parsed where used, which decides what a bad one means).
    pub pod_cidrs: Box<[Box<str>]>,
    /// `status.addresses`.
    pub addresses: Box<[NodeAddress]>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// `spec.taints`.
    pub taints: Box<[Taint]>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAddress {
    /// `InternalIP`, `ExternalIP`, `Hostname`, …
    pub type_: Name,
    pub address: Box<str>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taint {
    pub key: Box<str>,
    pub value: Option<Box<str>>,
    pub effect: Name,
}

impl From<&Node> for NodeInfo {
    fn from(node: &Node) -> Self {
        let label = |key: &str| {
            node.metadata
                .labels
                .as_ref()
                .and_then(|labels| labels.get(key))
                .map(|value| value.as_str().into())
        };
        let spec = node.spec.as_ref();
        Self {
            zone: label(ZONE_LABEL),
            region: label(REGION_LABEL),
            pod_cidrs: spec
                .and_then(|spec| spec.pod_cidrs.as_ref())
                .into_iter()
                .flatten()
                .map(|cidr| cidr.as_str().into())
                .collect(),
            addresses: node
                .status
                .as_ref()
                .and_then(|status| status.addresses.as_ref())
                .into_iter()
                .flatten()
                .map(|address| NodeAddress {
                    type_: intern(&address.type_),
                    address: address.address.as_str().into(),
                })
                .collect(),
            deleting: node.metadata.deletion_timestamp.is_some(),
            taints: spec
                .and_then(|spec| spec.taints.as_ref())
                .into_iter()
                .flatten()
                .map(|taint| Taint {
                    key: taint.key.as_str().into(),
                    value: taint.value.as_deref().map(Into::into),
                    effect: intern(&taint.effect),
                })
                .collect(),
        }
    }
}

impl From<Node> for NodeInfo {
    fn from(node: Node) -> Self {
        Self::from(&node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(yaml: &str) -> NodeInfo {
        serde_yaml::from_str::<Node>(yaml)
            .expect("node yaml")
            .into()
    }

    #[test]
    fn keeps_what_the_proxy_reacts_to() {
        let info = node(
            "metadata:\n  name: n1\n  deletionTimestamp: \"2025-01-02T03:04:05Z\"\n  \
             labels: {topology.kubernetes.io/zone: z1, topology.kubernetes.io/region: r1, other: x}\n\
             spec:\n  podCIDRs: [10.244.1.0/24, \"fd00:1::/64\"]\n  \
             taints: [{key: ToBeDeletedByClusterAutoscaler, value: \"1\", effect: NoSchedule}]\n\
             status:\n  addresses: [{type: InternalIP, address: 10.0.0.1}, {type: Hostname, address: n1}]\n",
        );
        assert_eq!(info.zone.as_deref(), Some("z1"));
        assert_eq!(info.region.as_deref(), Some("r1"));
        assert_eq!(info.pod_cidrs.len(), 2);
        assert_eq!(&*info.addresses[0].type_, "InternalIP");
        assert_eq!(&*info.addresses[0].address, "10.0.0.1");
        assert_eq!(&*info.addresses[1].type_, "Hostname");
        assert!(info.deleting);
        assert_eq!(&*info.taints[0].key, "ToBeDeletedByClusterAutoscaler");
        assert_eq!(info.taints[0].value.as_deref(), Some("1"));
        assert_eq!(&*info.taints[0].effect, "NoSchedule");
    }

    #[test]
    fn status_heartbeats_are_not_kept() {
        let a = node(
            "metadata: {name: n1, resourceVersion: \"1\"}\n\
             status: {conditions: [{type: Ready, status: \"True\", lastHeartbeatTime: \"2025-01-02T03:04:05Z\"}]}\n",
        );
        let b = node(
            "metadata: {name: n1, resourceVersion: \"2\"}\n\
             status: {conditions: [{type: Ready, status: \"True\", lastHeartbeatTime: \"2025-01-02T03:04:15Z\"}]}\n",
        );
        assert_eq!(a, b);
        assert_eq!(a, NodeInfo::default());
    }
}
