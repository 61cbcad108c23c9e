//! [`NodeManager`]: the node settings over time, as kube-proxy's `NodeManager`
//! (pkg/proxy/node.go) — with `detectLocalMode: NodeCIDR`, no sync before the Node has
//! podCIDRs, failure after [`POD_CIDR_POLL_TIMEOUT`], exit when they change later — plus what
//! upstream only reads once at start and we follow at run time: the Node's addresses (node IPs,
//! `primary` NodePort addresses) and the host's addresses (netlink events).

use std::{collections::BTreeMap, time::Duration};

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::{
    addresses::{Interface, host_interfaces},
    links::Link,
    settings::{NodeInputs, NodeSettings},
    watch::AddressWatcher,
};
use proxy_model::{config::DetectLocal, objects::NodeInfo};

/// `NewNodeManager`: "we wait for at most 5 minutes for allocators to assign a PodCIDR to the
/// node after it is registered", polling every second.
pub const POD_CIDR_POLL_TIMEOUT: Duration = Duration::from_secs(5 * 60);
pub const POD_CIDR_POLL_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(
        "detectLocalMode NodeCIDR: node {node:?} has no spec.podCIDRs after {waited:?} ({reason}); \
         kube-proxy fails the same way — allocate the node's pod CIDRs or use another \
         detectLocalMode"
    )]
    NoPodCidrs {
        node: String,
        waited: Duration,
        reason: &'static str,
    },
    #[error(
        "detectLocalMode NodeCIDR: the podCIDRs of node {node:?} changed from {old:?} to {new:?}; \
         exiting so that the agent restarts with them (kube-proxy's NodeManager does the same)"
    )]
    PodCidrsChanged {
        node: String,
        old: Vec<String>,
        new: Vec<String>,
    },
}

/// The NodeCIDR wait, pure: `Ok(true)` once the Node has podCIDRs, `Ok(false)` while waiting,
/// an error once `elapsed` passed the timeout.
pub fn pod_cidr_wait(
    node_name: &str,
    node: Option<&NodeInfo>,
    elapsed: Duration,
) -> Result<bool, NodeError> {
    let reason = match node {
        None => "the Node does not exist",
        Some(node) if raw_pod_cidrs(node).is_empty() => "no PodCIDR allocated",
        Some(_) => return Ok(true),
    };
    if elapsed >= POD_CIDR_POLL_TIMEOUT {
        return Err(NodeError::NoPodCidrs {
            node: node_name.to_owned(),
            waited: elapsed,
            reason,
        });
    }
    Ok(false)
}

/// `OnNodeChange` with `watchPodCIDRs`: any difference from the podCIDRs the agent started
/// with is fatal. A deleted Node is not (the settings keep the last known podCIDRs' effect
/// until the agent restarts; upstream only logs deletion in most releases).
pub fn pod_cidrs_changed(
    node_name: &str,
    first: &[String],
    node: &NodeInfo,
) -> Result<(), NodeError> {
    let now = raw_pod_cidrs(node);
    if now == first {
        return Ok(());
    }
    Err(NodeError::PodCidrsChanged {
        node: node_name.to_owned(),
        old: first.to_vec(),
        new: now,
    })
}

fn raw_pod_cidrs(node: &NodeInfo) -> Vec<String> {
    node.pod_cidrs.iter().map(|cidr| cidr.to_string()).collect()
}

#[derive(Debug)]
pub struct NodeManager {
    inputs: NodeInputs,
    node_name: String,
    started: Instant,
    /// NodeCIDR mode: the podCIDRs syncing started with.
    first_pod_cidrs: Option<Vec<String>>,
    /// The Node as last seen: a deleted Node keeps its settings (upstream reads podCIDRs and
    /// node IPs once and keeps them), so a deletion does not switch local-traffic detection
    /// off or move NodePorts while the node drains.
    last_node: Option<NodeInfo>,
    current: Option<NodeSettings>,
    /// The last settings as logged at info.
    last_summary: String,
    watcher: Option<AddressWatcher>,
    /// The link facts (state, kind, master) last read: a change there re-assigns tc programs
    /// without changing any address (an interface going down or up).
    links: BTreeMap<String, Option<Link>>,
    links_changed: bool,
}

impl NodeManager {
    /// Starts watching the host's addresses (a failure is logged: the settings are then only
    /// re-read at each sync, the periodic one included). Must run inside a tokio runtime.
    pub fn new(inputs: NodeInputs, node_name: &str) -> Self {
        let watcher = match AddressWatcher::open() {
            Ok(watcher) => Some(watcher),
            Err(error) => {
                warn!(%error, "cannot watch the host's addresses; they are re-read at each sync only");
                None
            }
        };
        Self::with_watcher(inputs, node_name, watcher)
    }

    pub(super) fn with_watcher(
        inputs: NodeInputs,
        node_name: &str,
        watcher: Option<AddressWatcher>,
    ) -> Self {
        Self {
            inputs,
            node_name: node_name.to_owned(),
            started: Instant::now(),
            first_pod_cidrs: None,
            last_node: None,
            current: None,
            last_summary: String::new(),
            watcher,
            links: BTreeMap::new(),
            links_changed: false,
        }
    }

    fn watches_pod_cidrs(&self) -> bool {
        self.inputs.detect_local == DetectLocal::NodeCidr
    }

    /// Whether syncing may start: every kind listed (`listed`) and, with NodeCIDR, the Node has
    /// podCIDRs. Fails after [`POD_CIDR_POLL_TIMEOUT`] without them.
    pub fn ready(&mut self, listed: bool, node: Option<&NodeInfo>) -> Result<bool, NodeError> {
        if self.first_pod_cidrs.is_some() || !self.watches_pod_cidrs() {
            return Ok(listed);
        }
        let ready = pod_cidr_wait(&self.node_name, node, self.started.elapsed())?;
        if ready && let Some(node) = node {
            let cidrs = raw_pod_cidrs(node);
            info!(node = %self.node_name, pod_cidrs = ?cidrs, "the node's podCIDRs are known");
            self.first_pod_cidrs = Some(cidrs);
        }
        Ok(listed && ready)
    }

    /// When [`NodeManager::ready`] is false: how long to wait before checking again.
    pub fn poll_interval(&self, otherwise: Duration) -> Duration {
        if self.watches_pod_cidrs() && self.first_pod_cidrs.is_none() {
            POD_CIDR_POLL_INTERVAL
        } else {
            otherwise
        }
    }

    /// Recomputes the settings from the Node and the host's current addresses; returns them
    /// when they differ from the last ones (always the first time). Fails when the podCIDRs
    /// changed in NodeCIDR mode.
    pub fn refresh(&mut self, node: Option<&NodeInfo>) -> Result<Option<&NodeSettings>, NodeError> {
        if let (Some(first), Some(node)) = (&self.first_pod_cidrs, node) {
            pod_cidrs_changed(&self.node_name, first, node)?;
        }
        let interfaces = match host_interfaces() {
            Ok(interfaces) => interfaces,
            Err(error) => {
                warn!(%error, "cannot list the host's addresses; node settings unchanged");
                return Ok(None);
            }
        };
        let links: BTreeMap<String, Option<Link>> = interfaces
            .iter()
            .map(|(name, i)| (name.clone(), i.link.clone()))
            .collect();
        if links != self.links {
            self.links = links;
            self.links_changed = true;
        }
        Ok(self.update(node, &interfaces))
    }

    pub(super) fn update(
        &mut self,
        node: Option<&NodeInfo>,
        interfaces: &BTreeMap<String, Interface>,
    ) -> Option<&NodeSettings> {
        match node {
            Some(node) if self.last_node.as_ref() != Some(node) => {
                self.last_node = Some(node.clone());
            }
            Some(_) => {}
            None if self.last_node.is_some() => {
                debug!(node = %self.node_name, "the Node is gone; keeping its last settings");
            }
            None => {}
        }
        let settings = NodeSettings::compute(&self.inputs, self.last_node.as_ref(), interfaces);
        if self.current.as_ref() == Some(&settings) {
            return None;
        }
        // Pods come and go with link-local addresses on their veths, which change the
        // match-all address lists: those changes are logged at debug only.
        let summary = format!(
            "node IPs {} {}, NodePort addresses {:?} {:?}, localhost NodePorts {}, podCIDRs {:?}, \
             local detection {:?}",
            settings.v4.node_ip,
            settings.v6.node_ip,
            NodePortsLog(&settings.v4),
            NodePortsLog(&settings.v6),
            settings.v4.localhost_node_ports,
            settings.pod_cidrs,
            settings.detect_local,
        );
        if summary != self.last_summary {
            info!(node = %self.node_name, "node settings: {summary}");
            self.last_summary = summary;
        } else {
            debug!(
                v4 = ?settings.v4.node_port_ips,
                v6 = ?settings.v6.node_port_ips,
                "node addresses changed"
            );
        }
        self.current = Some(settings);
        self.current.as_ref()
    }

    /// Whether a link changed state, kind or master since the last call (which tc programs
    /// the interfaces get may then differ although no address changed).
    pub fn take_links_changed(&mut self) -> bool {
        std::mem::take(&mut self.links_changed)
    }

    /// Resolves when the host's addresses changed (never without a watcher). Cancel safe.
    pub async fn addresses_changed(&mut self) {
        let Some(watcher) = &self.watcher else {
            return std::future::pending().await;
        };
        if let Err(error) = watcher.changed().await {
            warn!(%error, "address watch failed; the host's addresses are re-read at each sync only");
            self.watcher = None;
        }
    }
}

/// NodePort addresses for the log: "all" or the list.
struct NodePortsLog<'a>(&'a super::settings::FamilySettings);

impl std::fmt::Debug for NodePortsLog<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.node_ports.match_all {
            f.write_str("all")
        } else {
            f.debug_list().entries(&self.0.node_port_ips).finish()
        }
    }
}
