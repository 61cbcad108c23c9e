//! Which interfaces get the external tc program by default, and which address external
//! traffic to a remote backend is masqueraded to, with the real agent and
//! real traffic: an external client reaches a NodePort on the node whose only endpoint is a pod
//! on a second node. Needs root.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use proxy_tests::client::{Attempt, Client, tally};
use proxy_tests::manifests::Endpoint;
use proxy_tests::netns::Netns;
use proxy_tests::scenario::{BACKEND_PORT, DATAPATH_TIMEOUT, Scenario, http_slice};
use proxy_tests::topology::Topology;

const NAMESPACE: &str = "default";
const SERVICE: &str = "web";
const NODE_PORT: u16 = 30080;
/// Docker's bridge on every node holds the same address (172.17.0.1 in real life): private
/// ranges here, sorting before the node's real interfaces by name and address alike.
const DOCKER0: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const DOCKER0_6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x17, 0, 0, 0, 0, 0, 1);

fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::with_families(1, true)?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    s.topo.start_remote_pod_echoes6(BACKEND_PORT)?;
    s.manifests.write("svc.yaml", &dual_stack_node_port())?;
    for (slice, ipv6) in [("web-4", false), ("web-6", true)] {
        let remote = Endpoint {
            node_name: Some("other-node".into()),
            ..Endpoint::ready(Topology::remote_pod_addr(1, ipv6))
        };
        s.manifests.write(
            &format!("{slice}.yaml"),
            &http_slice(NAMESPACE, slice, SERVICE, &[remote]),
        )?;
    }
    Ok(s)
}

/// A dual-stack NodePort Service `web` (TCP 80 → 8080), eTP Cluster.
fn dual_stack_node_port() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {SERVICE}\n  namespace: {NAMESPACE}\n\
         spec:\n  type: NodePort\n  clusterIP: \"10.96.0.20\"\n\
         \x20 clusterIPs: [\"10.96.0.20\", \"fd00:96::20\"]\n  ipFamilies: [IPv4, IPv6]\n\
         \x20 ipFamilyPolicy: RequireDualStack\n  externalTrafficPolicy: Cluster\n\
         \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
         \x20   nodePort: {NODE_PORT}\n"
    )
}

/// Gives `netns` a bridge `docker0` holding Docker's addresses with a container's veth as its
/// port, so that it is running.
fn add_docker0(netns: &Netns) -> anyhow::Result<()> {
    netns.ip(&["link", "add", "docker0", "type", "bridge"])?;
    netns.ip(&["addr", "add", &format!("{DOCKER0}/24"), "dev", "docker0"])?;
    netns.ip(&[
        "-6",
        "addr",
        "add",
        &format!("{DOCKER0_6}/64"),
        "dev",
        "docker0",
        "nodad",
    ])?;
    netns.ip(&["link", "set", "docker0", "up"])?;
    netns.ip(&["link", "add", "dvc", "type", "veth", "peer", "name", "dvp"])?;
    netns.ip(&["link", "set", "dvc", "master", "docker0"])?;
    netns.ip(&["link", "set", "dvc", "up"])?;
    netns.ip(&["link", "set", "dvp", "up"])?;
    Ok(())
}

/// The index of `interface` in `netns`.
fn ifindex(netns: &Netns, interface: &str) -> anyhow::Result<u32> {
    let text = netns.exec("cat", &[&format!("/sys/class/net/{interface}/ifindex")])?;
    Ok(text.trim().parse()?)
}

fn has_external_program(pins: &Path, index: u32) -> bool {
    pins.join(format!("kpr_tc_external_if{index}_link"))
        .exists()
}

fn client_seen(a: &Attempt) -> Option<IpAddr> {
    match a {
        Attempt::Ok { client, .. } => Some(client.ip()),
        Attempt::Err(_) => None,
    }
}

/// The addresses the remote pod saw for 10 connections through `target`, each answered by it.
fn remote_pod_sees(s: &mut Scenario, target: SocketAddr) -> anyhow::Result<Vec<IpAddr>> {
    let client = Client::new(s.topo.ext().path()).timeout(Duration::from_millis(1500));
    let is_remote = |a: &Attempt| a.backend() == Some("rpod1");
    let first = s.wait_for_datapath_with(&client, target, "the remote pod answered", is_remote)?;
    eprintln!("{target}: {first:?}");
    let attempts = client.run(target, 10)?;
    s.ensure(attempts.iter().all(is_remote), || {
        format!(
            "{target}: every connection must reach rpod1: {:?}",
            tally(&attempts)
        )
    })?;
    Ok(attempts.iter().filter_map(client_seen).collect())
}

/// A `docker0` bridge (with a container's veth, so it is running) holding an address that
/// sorts first, and a NIC that is down with an address: neither gets the external program, and
/// NodePort traffic to a pod on another node — which has a `docker0` with the same address, as
/// every Docker host does — is masqueraded to an address that node routes back here, in both
/// families. Before, docker0's address became the SNAT address and the remote pod's replies
/// went to the remote node's own docker0. Once the down interface comes up it gets the
/// external program (a link event re-assigns the programs).
#[test]
fn container_bridges_and_down_interfaces_are_not_external() -> anyhow::Result<()> {
    let mut s = setup()?;
    let node = s.topo.node();
    add_docker0(node)?;
    // Down: its peer is, so it has no carrier.
    node.ip(&[
        "link", "add", "aaa0", "type", "veth", "peer", "name", "aaa0p",
    ])?;
    node.ip(&["addr", "add", "10.1.0.1/24", "dev", "aaa0"])?;
    node.ip(&["link", "set", "aaa0", "up"])?;
    let remote = s.topo.netns(proxy_tests::topology::Place::RemoteNode)?;
    add_docker0(remote)?;
    let (docker0, aaa0) = (ifindex(node, "docker0")?, ifindex(node, "aaa0")?);
    // The default selection: no --interfaces.
    s.start_agent_with_args("ebpf", &[])?;
    let pins = s.agent()?.bpf_root().join("kubeproxy-rs");

    let mut seen = Vec::new();
    for node_ip in [
        IpAddr::V4(Topology::node_ext_ip()),
        "fd00:10::1".parse::<IpAddr>()?,
    ] {
        seen.extend(remote_pod_sees(
            &mut s,
            SocketAddr::new(node_ip, NODE_PORT),
        )?);
    }
    eprintln!("the remote pod saw {seen:?}");
    let routable: [IpAddr; 4] = [
        Topology::node_ext_ip().into(),
        Topology::node_link_ip().into(),
        "fd00:10::1".parse()?,
        Topology::node_link_ip6().into(),
    ];
    s.ensure(seen.iter().all(|ip| routable.contains(ip)), || {
        format!("SNAT must use an uplink's address, the remote pod saw {seen:?}")
    })?;
    let vext = ifindex(s.topo.node(), "vext")?;
    s.ensure(has_external_program(&pins, vext), || {
        "vext is external".to_owned()
    })?;
    s.ensure(!has_external_program(&pins, docker0), || {
        "docker0 must not get the external program".to_owned()
    })?;
    s.ensure(!has_external_program(&pins, aaa0), || {
        "a down interface must not get the external program".to_owned()
    })?;

    s.topo.node().ip(&["link", "set", "aaa0p", "up"])?;
    proxy_tests::wait::wait_until(
        "the interface that came up gets the external program",
        DATAPATH_TIMEOUT,
        Duration::from_millis(50),
        || has_external_program(&pins, aaa0),
    )?;
    Ok(())
}

/// Two uplinks (`vext` towards the client, `vnode2` towards the second node), both external by
/// default: a NodePort flow to the pod behind `vnode2` is masqueraded to `vnode2`'s address, as
/// MASQUERADE takes the outgoing interface's, in both families — not to `vext`'s, the first
/// external interface's (the node's SNAT address, which still applies when the route leaves
/// by an interface that is not external: `external_tc.rs`'s remote test with
/// `--interfaces vext`).
#[test]
fn snat_source_is_the_address_of_the_backends_egress_interface() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.start_agent_with_args("ebpf", &[])?;
    for (node_ip, egress) in [
        (
            IpAddr::V4(Topology::node_ext_ip()),
            IpAddr::V4(Topology::node_link_ip()),
        ),
        (
            "fd00:10::1".parse::<IpAddr>()?,
            IpAddr::V6(Topology::node_link_ip6()),
        ),
    ] {
        let seen = remote_pod_sees(&mut s, SocketAddr::new(node_ip, NODE_PORT))?;
        eprintln!("through {node_ip}: the remote pod saw {seen:?}");
        s.ensure(seen.iter().all(|ip| *ip == egress), || {
            format!("through {node_ip}: the remote pod must see {egress}, saw {seen:?}")
        })?;
    }
    Ok(())
}
