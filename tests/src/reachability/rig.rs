//! The matrix rig: the two-node topology made to look like a real node, the Services of
//! every shape, and the agent.
//!
//! ```text
//!            ext (outside world; does not forward)           node (agent)                 node2 (no agent)
//!   10.10.0.2 + 10.11.0.2 (lo)  ──vext── 10.10.0.1  default via ext    vnode2 10.20.0.1 ── 10.20.0.2
//!   fd00:10::2 + fd00:11::2     ──────── fd00:10::1                            fd00:20::1 ── fd00:20::2
//!   LB IPs of the ipMode Proxy shape on lo,          vlocal (veth) 10.30.0.1 fd00:30::1    rpod1..3 10.245.<i>.2
//!   served by the `lb-proxy` echo server             pod1..3 10.244.<i>.2 fd00:244:<i>::2        fd00:245:<i>::2
//! ```
//!
//! [`MatrixRig::with_wiring`] builds the same node with its pods wired by a CNI reference
//! plugin ([`PodWiring::Cni`]): on the bridge `cni0` or behind `ptp` veths, at the addresses
//! `host-local` gave them (10.244.0.0/24, fd00:244::/64), which the Services' endpoints and the
//! clients' own addresses then use.
//!
//! Drop order (fields): the agent first (it detaches from its cgroup and namespaces), then the
//! manifests, the cgroup, and the topology (echo servers, then namespaces).

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use super::cells::{
    BACKEND_PORT, CLUSTER_CIDR, Cell, Client as CellClient, EXT2_IP, EXT2_IP6, Family,
    LB_PROXY_NAME, NODE_UNLISTED_IP, NODE_UNLISTED_IP6, NODEPORT_ADDRESSES, SERVICE_PORT, Shape,
};
use crate::agent::{Agent, AgentConfig, AgentSource};
use crate::cgroup::ChildCgroup;
use crate::client::{Attempt, Client};
use crate::manifests::{Endpoint, ManifestsDir, Protocol, SlicePort, endpoint_slice_yaml_family};
use crate::scenario::HOSTNAME;
use crate::topology::{Place, PodWiring, Topology};
use crate::{Result, RigError};

/// nodeName of node2's endpoints.
pub const REMOTE_NODE_NAME: &str = "kpr-node2";
/// Per-attempt connect/read timeout: a dropped connection shows as TIMEOUT after this. Longer
/// than TCP's first SYN retransmission (1 s): Linux treats an ICMPv6 port unreachable for
/// the first SYN as a soft error and only fails the connect (ECONNREFUSED) when the
/// retransmitted SYN is rejected again (seen on 6.18; IPv4 fails at once), so with a shorter
/// timeout every IPv6 REJECT would look like a DROP.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(1500);
/// Bound for the agent to program every Service.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// The interfaces that get the tc programs in eBPF mode: the node's links to the outside and
/// to node2 (the pod veths carry addresses auto-detection would also take).
pub const TC_INTERFACES: &str = "vext,vnode2";

/// The matrix rig. See the module docs for the picture.
#[derive(Debug)]
pub struct MatrixRig {
    agent: Option<Agent>,
    manifests: ManifestsDir,
    cgroup: ChildCgroup,
    topo: Topology,
    node_addresses: Vec<IpAddr>,
}

impl MatrixRig {
    /// Builds the topology, starts every echo server and writes every shape's Service and
    /// EndpointSlices (the agent is not started yet).
    pub fn new() -> Result<Self> {
        Self::with_wiring(PodWiring::Routed)
    }

    /// [`MatrixRig::new`] with the node's pods wired as `wiring` says.
    pub fn with_wiring(wiring: PodWiring) -> Result<Self> {
        crate::require_root();
        let mut topo = Topology::with_wiring(3, wiring)?;
        topo.start_pod_echoes(BACKEND_PORT)?;
        topo.start_pod_echoes6(BACKEND_PORT)?;
        topo.add_remote_node(3, BACKEND_PORT)?;
        topo.start_remote_pod_echoes6(BACKEND_PORT)?;
        topo.route_node_via_ext()?;
        // The kernel rate-limits the ICMP errors it sends per destination (1 s by default),
        // and the matrix makes many REJECTed connections from the same clients within a
        // second: without this, most REJECTs would look like drops. kube-proxy's REJECT
        // is what the matrix tests, not the kernel's rate limit.
        topo.node().sysctl("net.ipv4.icmp_ratelimit", "0")?;
        topo.node().sysctl("net.ipv6.icmp.ratelimit", "0")?;

        // A local address outside --nodeport-addresses, on an interface of its own; the
        // external client reaches it through its default route via the node. A veth pair
        // with both ends in the node stands in for a dummy interface (the dummy module may
        // be missing on the host).
        let node = topo.node();
        node.ip(&[
            "link",
            "add",
            "vlocal",
            "type",
            "veth",
            "peer",
            "name",
            "vlocal-peer",
        ])?;
        node.ip(&["link", "set", "vlocal-peer", "up"])?;
        node.ip(&[
            "addr",
            "add",
            &format!("{NODE_UNLISTED_IP}/24"),
            "dev",
            "vlocal",
        ])?;
        node.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{NODE_UNLISTED_IP6}/64"),
            "dev",
            "vlocal",
            "nodad",
        ])?;
        node.ip(&["link", "set", "vlocal", "up"])?;

        // The external client's second address (outside the source ranges); the node
        // reaches it by its default route.
        let ext = topo.ext();
        ext.ip(&["addr", "add", &format!("{EXT2_IP}/32"), "dev", "lo"])?;
        ext.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{EXT2_IP6}/128"),
            "dev",
            "lo",
            "nodad",
        ])?;

        // The cloud load balancer of the ipMode Proxy shape holds its ingress IPs itself.
        for family in Family::ALL {
            let ip = Shape::LbProxy.lb_ip(family);
            let prefix = if family.is_v6() { "128" } else { "32" };
            let mut args = vec!["addr", "add"];
            let cidr = format!("{ip}/{prefix}");
            args.extend([cidr.as_str(), "dev", "lo"]);
            if family.is_v6() {
                args.insert(0, "-6");
                args.push("nodad");
            }
            topo.ext().ip(&args)?;
            topo.start_echo(Place::Ext, LB_PROXY_NAME, SocketAddr::new(ip, SERVICE_PORT))?;
        }

        let manifests = ManifestsDir::new()?;
        let pod_addr = |i: usize, family: Family| topo.pod_address(i, family.is_v6());
        for shape in Shape::ALL {
            manifests.write(
                &format!("{}.yaml", shape.service_name()),
                &shape_yaml_with(shape, &pod_addr)?,
            )?;
        }
        let node_addresses = addresses(&topo.node().ip(&["-o", "addr", "show"])?);
        Ok(Self {
            agent: None,
            manifests,
            cgroup: ChildCgroup::new()?,
            topo,
            node_addresses,
        })
    }

    /// Starts the agent in `mode` with the matrix configuration (the same for both modes,
    /// plus the tc interfaces in eBPF mode).
    pub fn start_agent(&mut self, mode: &str) -> Result<()> {
        let mut extra_args = vec![
            "--cluster-cidr".to_owned(),
            CLUSTER_CIDR.to_owned(),
            "--nodeport-addresses".to_owned(),
            NODEPORT_ADDRESSES.to_owned(),
        ];
        if mode == "ebpf" {
            extra_args.extend(["--interfaces".to_owned(), TC_INTERFACES.to_owned()]);
        }
        let config = AgentConfig {
            source: AgentSource::Manifests(self.manifests.path().to_path_buf()),
            proxy_mode: Some(mode.to_owned()),
            cgroup_path: self.cgroup.path().to_path_buf(),
            hostname: HOSTNAME.into(),
            netns: Some(self.topo.node().path()),
            extra_args,
            binary: None,
        };
        self.agent = Some(Agent::start(&config)?);
        Ok(())
    }

    /// Waits (bounded by [`READY_TIMEOUT`]) until the eTP=Cluster Service answers from a pod
    /// (ClusterIP) and from outside (NodePort) in both families: one sync programs every
    /// Service. Returns what was still not ready — the matrix runs anyway and shows it.
    pub fn wait_ready(&mut self) -> Result<Vec<String>> {
        let probes: Vec<Cell> = Family::ALL
            .into_iter()
            .flat_map(|family| {
                [
                    (super::Frontend::ClusterIp, CellClient::Pod),
                    (super::Frontend::NodePortExternal, CellClient::External),
                ]
                .map(|(frontend, client)| Cell {
                    shape: Shape::EtpCluster,
                    frontend,
                    client,
                    family,
                })
            })
            .collect();
        let start = Instant::now();
        let mut pending = probes;
        while !pending.is_empty() && start.elapsed() < READY_TIMEOUT {
            let mut still = Vec::new();
            for cell in pending {
                let answered = matches!(
                    self.client(&cell)?.once(cell.target())?,
                    Attempt::Ok { ref backend, .. } if backend.ends_with("pod2")
                );
                if !answered {
                    still.push(cell);
                }
            }
            pending = still;
            if !self.agent_running() {
                break;
            }
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        Ok(pending
            .iter()
            .map(|c| format!("not ready after {READY_TIMEOUT:?}: {}", c.id()))
            .collect())
    }

    pub fn agent_running(&mut self) -> bool {
        self.agent.as_mut().is_some_and(Agent::is_running)
    }

    /// The last lines of the agent's log.
    pub fn agent_log_tail(&self, lines: usize) -> String {
        self.agent
            .as_ref()
            .map(|a| a.log_tail(lines))
            .unwrap_or_default()
    }

    /// Stops the agent (the rig stays).
    pub fn stop_agent(&mut self) -> Result<()> {
        match self.agent.take() {
            Some(mut agent) => agent.stop().map(drop),
            None => Ok(()),
        }
    }

    /// Writes one more manifest next to the shapes' (before the agent starts, or as a change
    /// it picks up): tests that add Services of their own to the matrix rig.
    pub fn write_manifest(&self, file_name: &str, yaml: &str) -> Result<()> {
        self.manifests.write(file_name, yaml)
    }

    /// The node's network namespace, where `proxy-agent inspect` runs.
    pub fn node_netns(&self) -> std::path::PathBuf {
        self.topo.node().path()
    }

    /// The running agent's bpffs root (eBPF mode), if an agent runs.
    pub fn bpf_root(&self) -> Option<&std::path::Path> {
        self.agent.as_ref().map(Agent::bpf_root)
    }

    /// Every address of the node namespace (read from the kernel once the rig is built).
    pub fn node_addresses(&self) -> &[IpAddr] {
        &self.node_addresses
    }

    /// The client's own address in `cell` (None for host clients, which use the node's): a
    /// pod's is the one its wiring gave it.
    pub fn client_address(&self, cell: &Cell) -> Option<IpAddr> {
        match cell.client.local_pod() {
            Some(i) => self.topo.pod_address(i, cell.family.is_v6()).ok(),
            None => cell.client.own_address(cell.family),
        }
    }

    /// The client of a cell, with the matrix's per-attempt timeout.
    pub fn client(&self, cell: &Cell) -> Result<Client> {
        let cgroup = self.cgroup.path();
        let client = match cell.client {
            CellClient::Pod | CellClient::Hairpin => {
                let i = cell.client.local_pod().unwrap_or(1);
                Client::new(self.topo.pod(i)?.path()).in_cgroup(cgroup)
            }
            CellClient::RemotePod => Client::new(self.topo.netns(Place::RemotePod(1))?.path()),
            CellClient::Host | CellClient::Localhost => {
                Client::new(self.topo.node().path()).in_cgroup(cgroup)
            }
            CellClient::External => Client::new(self.topo.ext().path()),
            CellClient::ExternalOutsideRanges => {
                let own = cell
                    .client
                    .own_address(cell.family)
                    .ok_or_else(|| RigError::Other("second external address".into()))?;
                Client::new(self.topo.ext().path()).bind(own)
            }
        };
        Ok(client.timeout(ATTEMPT_TIMEOUT))
    }
}

impl Drop for MatrixRig {
    fn drop(&mut self) {
        // Explicit: the agent must go before its cgroup and namespaces whatever the field
        // order.
        if let Some(mut agent) = self.agent.take()
            && let Err(e) = agent.stop()
        {
            eprintln!("rig: stopping the agent failed: {e}");
        }
    }
}

/// Addresses in `ip -o addr show` output.
fn addresses(text: &str) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        while let Some(word) = words.next() {
            if (word == "inet" || word == "inet6")
                && let Some(addr) = words.next()
                && let Some(ip) = addr.split('/').next().and_then(|ip| ip.parse().ok())
            {
                out.push(ip);
            }
        }
    }
    out
}

/// The Service (dual-stack, one port `http` 80 → 8080 with the shape's NodePort) and one
/// EndpointSlice per family of `shape`, as one multi-document manifest, for routed pods.
pub fn shape_yaml(shape: Shape) -> String {
    let routed = |i: usize, family: Family| Ok(Topology::pod_addr(i, family.is_v6()));
    shape_yaml_with(shape, &routed).unwrap_or_default()
}

/// [`shape_yaml`] with this node's pod `i` at `pod_addr(i, family)`.
pub fn shape_yaml_with(
    shape: Shape,
    pod_addr: &dyn Fn(usize, Family) -> Result<IpAddr>,
) -> Result<String> {
    let name = shape.service_name();
    let quoted = |ips: &[IpAddr]| {
        ips.iter()
            .map(|ip| format!("\"{ip}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let cluster_ips: Vec<IpAddr> = Family::ALL.map(|f| shape.cluster_ip(f)).to_vec();
    let type_ = if shape.is_load_balancer() {
        "LoadBalancer"
    } else {
        "NodePort"
    };
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  \
         type: {type_}\n  clusterIP: \"{}\"\n  clusterIPs: [{}]\n  ipFamilies: [IPv4, IPv6]\n  \
         ipFamilyPolicy: RequireDualStack\n  ports:\n  - {{name: http, port: {SERVICE_PORT}, \
         targetPort: {BACKEND_PORT}, protocol: TCP, nodePort: {}}}\n",
        cluster_ips[0],
        quoted(&cluster_ips),
        shape.node_port(),
    );
    if shape.etp_local() {
        y.push_str("  externalTrafficPolicy: Local\n");
    }
    if shape.itp_local() {
        y.push_str("  internalTrafficPolicy: Local\n");
    }
    if shape.affinity() {
        y.push_str(
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}\n",
        );
    }
    if shape.has_external_ips() {
        let ips = Family::ALL.map(|f| shape.external_ip(f));
        y.push_str(&format!("  externalIPs: [{}]\n", quoted(&ips)));
    }
    if !shape.source_ranges().is_empty() {
        y.push_str(&format!(
            "  loadBalancerSourceRanges: [{}]\n",
            shape.source_ranges().join(", ")
        ));
    }
    if shape.is_load_balancer() {
        let ingress: Vec<String> = Family::ALL
            .iter()
            .map(|f| {
                format!(
                    "{{ip: \"{}\", ipMode: {}}}",
                    shape.lb_ip(*f),
                    shape.ip_mode()
                )
            })
            .collect();
        y.push_str(&format!(
            "status:\n  loadBalancer:\n    ingress: [{}]\n",
            ingress.join(", ")
        ));
    }
    let port = SlicePort {
        name: "http".into(),
        port: BACKEND_PORT,
        protocol: Protocol::Tcp,
    };
    for family in Family::ALL {
        let mut endpoints = Vec::new();
        for b in shape.endpoints() {
            endpoints.push(Endpoint {
                ip: if b.remote {
                    Topology::remote_pod_addr(b.index, family.is_v6())
                } else {
                    pod_addr(b.index, family)?
                },
                ready: !b.terminating,
                serving: true,
                terminating: b.terminating,
                node_name: Some(if b.remote { REMOTE_NODE_NAME } else { HOSTNAME }.into()),
                zone: None,
            });
        }
        y.push_str("---\n");
        y.push_str(&endpoint_slice_yaml_family(
            "default",
            &format!("{name}-{}", if family.is_v6() { "v6" } else { "v4" }),
            &name,
            std::slice::from_ref(&port),
            &endpoints,
            family.is_v6(),
        ));
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ip_addr_output() {
        let text = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n\
                    1: lo    inet6 ::1/128 scope host \\       valid_lft forever\n\
                    2: vext    inet 10.10.0.1/24 scope global vext\\       valid_lft forever\n";
        let got = addresses(text);
        assert_eq!(got.len(), 3);
        assert!(got.contains(&"10.10.0.1".parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))));
    }

    /// The agent parses manifests into k8s-openapi types: make sure ours deserialize, with
    /// the fields the shapes depend on.
    #[test]
    fn shape_yaml_deserializes() -> Result<(), serde_yaml::Error> {
        use k8s_openapi::api::core::v1::Service;
        use k8s_openapi::api::discovery::v1::EndpointSlice;
        use serde::Deserialize;
        for shape in Shape::ALL {
            let text = shape_yaml(shape);
            let mut docs = serde_yaml::Deserializer::from_str(&text);
            let svc = Service::deserialize(docs.next().ok_or_else(no_doc)?)?;
            let spec = svc.spec.unwrap_or_default();
            assert_eq!(spec.cluster_ips.unwrap_or_default().len(), 2);
            assert_eq!(
                spec.external_traffic_policy.as_deref() == Some("Local"),
                shape.etp_local()
            );
            let ingress = svc
                .status
                .and_then(|s| s.load_balancer)
                .and_then(|lb| lb.ingress)
                .unwrap_or_default();
            assert_eq!(ingress.len(), if shape.is_load_balancer() { 2 } else { 0 });
            for doc in docs {
                let slice = EndpointSlice::deserialize(doc)?;
                assert_eq!(slice.endpoints.len(), shape.endpoints().len());
            }
        }
        Ok(())
    }

    fn no_doc() -> serde_yaml::Error {
        serde::de::Error::custom("no document")
    }
}
