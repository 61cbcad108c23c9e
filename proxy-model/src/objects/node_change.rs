//! Which Node updates matter. The kubelet rewrites its Node every few seconds (status
//! heartbeats: conditions, `lastHeartbeatTime`, images, resource versions); none of that changes
//! what the proxy does, so only the fields below count — kube-proxy likewise reacts only to
//! topology labels (`OnTopologyChange`), podCIDRs and node IPs (`NodeManager.OnNodeChange`)
//! and deletion/taints (`NodeEligibleHandler`).

use super::NodeInfo;

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
pub fn node_change(old: Option<&NodeInfo>, new: Option<&NodeInfo>) -> NodeChange {
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
    // The topology labels: the zone endpoint selection reads, the region it may read.
    let topology = old.zone != new.zone || old.region != new.region;
    let settings = old.pod_cidrs != new.pod_cidrs || old.addresses != new.addresses;
    let health = old.deleting != new.deleting || old.taints != new.taints;
    NodeChange {
        topology,
        settings,
        health,
    }
}
