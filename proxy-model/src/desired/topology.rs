//! Which endpoints each traffic policy may use: kube-proxy's `CategorizeEndpoints`
//! (pkg/proxy/topology.go), including topology hints (PreferSameNode via node hints — the
//! PreferSameTrafficDistribution gate is on by default upstream — then PreferSameZone).

use super::{Endpoint, NodeContext, endpoints::RawEndpoint};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TopologyMode {
    None,
    SameNode,
    SameZone,
}

/// What a service port uses, from its policies.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub cluster: bool,
    pub local: bool,
}

/// Sets the `cluster`/`local` flags of every endpoint; returns the endpoints and whether the
/// service has any usable endpoint anywhere in the cluster.
pub fn categorize(
    raw: Vec<RawEndpoint>,
    usage: Usage,
    node: &NodeContext,
) -> (Vec<Endpoint>, bool) {
    let mut has_any = false;
    let mut cluster = vec![false; raw.len()];
    let mut local = vec![false; raw.len()];

    if usage.cluster {
        let prefer_same_node = crate::config::features::enabled(
            crate::config::features::PREFER_SAME_TRAFFIC_DISTRIBUTION,
        );
        let mode = topology_mode(&raw, node, prefer_same_node);
        for (i, e) in raw.iter().enumerate() {
            cluster[i] = e.ready && available_for_topology(e, mode, node);
        }
        // No ready endpoint anywhere (topology already fell back to "none" in that case):
        // use the serving and terminating ones, ignoring topology.
        if !cluster.contains(&true) {
            for (i, e) in raw.iter().enumerate() {
                cluster[i] = e.serving && e.terminating;
            }
        }
        has_any = cluster.contains(&true);
    }

    if usage.local {
        let mut local_ready = false;
        let mut local_serving_terminating = false;
        for e in &raw {
            if e.ready {
                has_any = true;
                local_ready |= e.is_local;
            } else if e.serving && e.terminating {
                has_any = true;
                local_serving_terminating |= e.is_local;
            }
        }
        for (i, e) in raw.iter().enumerate() {
            local[i] = e.is_local
                && if local_ready {
                    e.ready
                } else {
                    local_serving_terminating && e.serving && e.terminating
                };
        }
    }

    let endpoints = raw
        .into_iter()
        .enumerate()
        .map(|(i, e)| Endpoint {
            addr: e.addr,
            port: e.port,
            is_local: e.is_local,
            ready: e.ready,
            serving: e.serving,
            terminating: e.terminating,
            cluster: cluster[i],
            local: local[i],
        })
        .collect();
    (endpoints, has_any)
}

/// kube-proxy's `topologyModeFromHints`: hints are only honoured when every ready endpoint has
/// them and at least one is for this node (or zone); otherwise topology is ignored. Node hints
/// count only with the PreferSameTrafficDistribution gate on, as upstream.
fn topology_mode(
    endpoints: &[RawEndpoint],
    node: &NodeContext,
    prefer_same_node: bool,
) -> TopologyMode {
    let ready: Vec<&RawEndpoint> = endpoints.iter().filter(|e| e.ready).collect();
    if ready.is_empty() {
        return TopologyMode::None;
    }
    let all_have_node_hints = ready.iter().all(|e| !e.node_hints.is_empty());
    let any_for_node = ready.iter().any(|e| e.node_hints.contains(&node.name));
    if prefer_same_node && all_have_node_hints && any_for_node {
        return TopologyMode::SameNode;
    }
    let all_have_zone_hints = ready.iter().all(|e| !e.zone_hints.is_empty());
    let zone = node.zone.as_deref().unwrap_or_default();
    let any_for_zone = ready.iter().any(|e| e.zone_hints.iter().any(|z| z == zone));
    if all_have_zone_hints && any_for_zone {
        return TopologyMode::SameZone;
    }
    TopologyMode::None
}

fn available_for_topology(e: &RawEndpoint, mode: TopologyMode, node: &NodeContext) -> bool {
    match mode {
        TopologyMode::None => true,
        TopologyMode::SameNode => e.node_hints.contains(&node.name),
        TopologyMode::SameZone => {
            let zone = node.zone.as_deref().unwrap_or_default();
            e.zone_hints.iter().any(|z| z == zone)
        }
    }
}

#[cfg(test)]
mod tests;
