//! Node settings with real packets: an address added to the node at run time serves NodePorts
//! within a sync (netlink address events, not the periodic resync), in eBPF mode through the
//! tc program and in iptables mode with `--nodeport-addresses` CIDRs covering it; and
//! `--nodeport-addresses primary` serves only the Node object's IP. Needs root.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use proxy_tests::{
    client::{Attempt, Client},
    scenario::{HOSTNAME, Scenario, http_slice, is_pod, pod_endpoint},
    topology::Topology,
};

const NODE_PORT: u16 = 30090;
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
/// A second address on the node's external link, in the external client's subnet.
const NEW_ADDR: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 50);
/// Long enough that only the address event can bring the new address in before the wait ends.
const SYNC_PERIOD: &str = "5m";

fn node_port_service() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\n\
         spec:\n  type: NodePort\n  clusterIP: \"{CLUSTER_IP}\"\n  clusterIPs: [\"{CLUSTER_IP}\"]\n\
         \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
         \x20   nodePort: {NODE_PORT}\n"
    )
}

/// This node (`HOSTNAME`) with the external link's first address as its InternalIP.
fn node_manifest() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {HOSTNAME}\nstatus:\n  addresses:\n\
         \x20 - type: InternalIP\n    address: \"{}\"\n  - type: Hostname\n    address: {HOSTNAME}\n",
        Topology::node_ext_ip()
    )
}

fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let s = Scenario::new(1)?;
    s.manifests.write("svc.yaml", &node_port_service())?;
    s.manifests.write(
        "slice.yaml",
        &http_slice("default", "web-1", "web", &[pod_endpoint(1)]),
    )?;
    Ok(s)
}

fn ext_client(s: &Scenario) -> Client {
    Client::new(s.topo.ext().path()).timeout(Duration::from_millis(1500))
}

fn node_port(ip: Ipv4Addr) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), NODE_PORT)
}

fn refused(a: &Attempt) -> bool {
    matches!(a, Attempt::Err(reason) if reason.contains("ECONNREFUSED"))
}

/// Starts the agent, checks the NodePort on the node's first address, adds [`NEW_ADDR`] to
/// `vext` and waits until the NodePort answers there too, from the external namespace.
fn added_address_is_served(mode: &str, args: &[&str]) -> anyhow::Result<()> {
    let mut s = setup()?;
    let mut all = vec!["--iptables-sync-period", SYNC_PERIOD];
    all.extend_from_slice(args);
    s.start_agent_with_args(mode, &all)?;
    let client = ext_client(&s);
    s.wait_for_datapath_with(
        &client,
        node_port(Topology::node_ext_ip()),
        "NodePort on the node's address",
        is_pod,
    )?;
    s.topo
        .node()
        .ip(&["addr", "add", &format!("{NEW_ADDR}/24"), "dev", "vext"])?;
    let added = Instant::now();
    let answer = s.wait_for_datapath_with(
        &client,
        node_port(NEW_ADDR),
        "NodePort on the address added at run time",
        is_pod,
    )?;
    eprintln!(
        "{mode}: NodePort on {NEW_ADDR} answered after {:?}: {answer:?}",
        added.elapsed()
    );
    Ok(())
}

#[test]
fn ebpf_serves_a_node_port_on_an_address_added_at_run_time() -> anyhow::Result<()> {
    // Default nodePortAddresses (every address); the tc program only on the external link.
    added_address_is_served("ebpf", &["--interfaces", "vext"])
}

#[test]
fn iptables_serves_a_node_port_on_an_address_added_at_run_time() -> anyhow::Result<()> {
    // Explicit CIDRs: one `-d <ip> -j KUBE-NODEPORTS` rule per matching address, so the new
    // address needs new rules.
    added_address_is_served("iptables", &["--nodeport-addresses", "10.10.0.0/24"])
}

/// With `primary` and a Node whose InternalIP is the first address, a second address of the
/// same link does not serve NodePorts (before, `primary` meant every address).
fn primary_serves_only_the_node_ip(mode: &str, args: &[&str]) -> anyhow::Result<()> {
    let mut s = setup()?;
    s.manifests.write("node.yaml", &node_manifest())?;
    s.topo
        .node()
        .ip(&["addr", "add", &format!("{NEW_ADDR}/24"), "dev", "vext"])?;
    let mut all = vec!["--nodeport-addresses", "primary"];
    all.extend_from_slice(args);
    s.start_agent_with_args(mode, &all)?;
    let client = ext_client(&s);
    s.wait_for_datapath_with(
        &client,
        node_port(Topology::node_ext_ip()),
        "NodePort on the Node's InternalIP",
        is_pod,
    )?;
    let other = client.once(node_port(NEW_ADDR))?;
    s.ensure(refused(&other), || {
        format!("{mode}: NodePort on {NEW_ADDR} (not the node IP) must not be served: {other:?}")
    })?;
    Ok(())
}

#[test]
fn ebpf_primary_serves_only_the_node_ip() -> anyhow::Result<()> {
    primary_serves_only_the_node_ip("ebpf", &["--interfaces", "vext"])
}

#[test]
fn iptables_primary_serves_only_the_node_ip() -> anyhow::Result<()> {
    primary_serves_only_the_node_ip("iptables", &[])
}
