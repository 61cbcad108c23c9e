//! Endpoint selection, following kube-proxy's `CategorizeEndpoints` (pkg/proxy/topology.go).
//! Topology hints and trafficDistribution come with the control-plane work; until then every
//! ready endpoint is usable cluster-wide.

use std::net::IpAddr;

/// One endpoint of a Service port, with the conditions selection depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    pub addr: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
}

impl EndpointInfo {
    fn is_serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }

    fn is_local(&self, node_name: &str) -> bool {
        self.node_name.as_deref() == Some(node_name)
    }
}

/// The endpoints new connections may use.
///
/// Cluster policy: the ready endpoints; if there are none, the serving-and-terminating ones
/// (so connections keep working while a Deployment rolls). Local policy: the same two steps
/// restricted to endpoints on this node.
pub fn select_endpoints<'a>(
    endpoints: &'a [EndpointInfo],
    local_only: bool,
    node_name: &str,
) -> Vec<&'a EndpointInfo> {
    let eligible = |e: &&EndpointInfo| !local_only || e.is_local(node_name);
    let ready: Vec<&EndpointInfo> = endpoints
        .iter()
        .filter(eligible)
        .filter(|e| e.ready)
        .collect();
    if !ready.is_empty() {
        return ready;
    }
    endpoints
        .iter()
        .filter(eligible)
        .filter(|e| e.is_serving_terminating())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(last: u8, ready: bool, serving: bool, terminating: bool, node: &str) -> EndpointInfo {
        EndpointInfo {
            addr: IpAddr::from([10, 0, 0, last]),
            port: 80,
            ready,
            serving,
            terminating,
            node_name: Some(node.to_owned()),
        }
    }

    fn lasts(selected: &[&EndpointInfo]) -> Vec<u8> {
        selected
            .iter()
            .map(|e| match e.addr {
                IpAddr::V4(v4) => v4.octets()[3],
                IpAddr::V6(_) => 0,
            })
            .collect()
    }

    #[test]
    fn ready_endpoints_win_over_terminating_ones() {
        let eps = [ep(1, true, true, false, "a"), ep(2, false, true, true, "b")];
        assert_eq!(lasts(&select_endpoints(&eps, false, "a")), [1]);
    }

    #[test]
    fn serving_terminating_endpoints_are_the_fallback() {
        let eps = [
            ep(1, false, false, false, "a"),
            ep(2, false, true, true, "b"),
            ep(3, false, false, true, "b"),
        ];
        assert_eq!(lasts(&select_endpoints(&eps, false, "a")), [2]);
    }

    #[test]
    fn not_ready_not_serving_endpoints_are_never_used() {
        let eps = [
            ep(1, false, false, false, "a"),
            ep(2, false, false, true, "a"),
        ];
        assert!(select_endpoints(&eps, false, "a").is_empty());
    }

    #[test]
    fn local_policy_keeps_only_this_nodes_endpoints() {
        let eps = [ep(1, true, true, false, "a"), ep(2, true, true, false, "b")];
        assert_eq!(lasts(&select_endpoints(&eps, true, "b")), [2]);
        assert!(select_endpoints(&eps, true, "c").is_empty());
    }

    #[test]
    fn local_policy_falls_back_to_local_terminating_not_remote_ready() {
        let eps = [ep(1, true, true, false, "a"), ep(2, false, true, true, "b")];
        assert_eq!(lasts(&select_endpoints(&eps, true, "b")), [2]);
    }
}
