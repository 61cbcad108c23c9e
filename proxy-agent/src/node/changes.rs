//! Which Node updates matter. The kubelet rewrites its Node every few seconds (status
//! heartbeats: conditions, `lastHeartbeatTime`, images, resource versions); none of that changes
//! what the proxy does, so only the fields below count — kube-proxy likewise reacts only to
//! topology labels (`OnTopologyChange`), podCIDRs and node IPs (`NodeManager.OnNodeChange`)
//! and deletion/taints (`NodeEligibleHandler`).

use k8s_openapi::api::core::v1::Node;

/// Topology labels the endpoint selection reads (zone) or may read (region).
pub const TOPOLOGY_LABELS: [&str; 2] = [
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
];

/// What a Node update changed, by consumer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeChange {
    /// Topology labels: every Service's endpoint selection may change.
    pub topology: bool,
    /// `spec.podCIDRs` or `status.addresses`: the node settings (local detection, node IPs,
    /// `primary` NodePort addresses) may change.
    pub settings: bool,
    /// Deletion or taints: `/healthz`'s `nodeEligible`.
    pub health: bool,
}

impl NodeChange {
    pub fn any(self) -> bool {
        self.topology || self.settings || self.health
    }

    pub fn merge(&mut self, other: NodeChange) {
        self.topology |= other.topology;
        self.settings |= other.settings;
        self.health |= other.health;
    }
}

/// The relevant difference between two versions of this node (`None`: absent).
pub fn node_change(old: Option<&Node>, new: Option<&Node>) -> NodeChange {
    let (old, new) = match (old, new) {
        (None, None) => return NodeChange::default(),
        (Some(old), Some(new)) => (old, new),
        // Created or deleted: everything may differ.
        _ => {
            return NodeChange {
                topology: true,
                settings: true,
                health: true,
            };
        }
    };
    let label = |node: &Node, key: &str| {
        node.metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get(key))
            .cloned()
    };
    let topology = TOPOLOGY_LABELS
        .iter()
        .any(|key| label(old, key) != label(new, key));
    let pod_cidrs = |node: &Node| node.spec.as_ref().and_then(|s| s.pod_cidrs.clone());
    let addresses = |node: &Node| node.status.as_ref().and_then(|s| s.addresses.clone());
    let settings = pod_cidrs(old) != pod_cidrs(new) || addresses(old) != addresses(new);
    let taints = |node: &Node| node.spec.as_ref().and_then(|s| s.taints.clone());
    let health = old.metadata.deletion_timestamp != new.metadata.deletion_timestamp
        || taints(old) != taints(new);
    NodeChange {
        topology,
        settings,
        health,
    }
}
