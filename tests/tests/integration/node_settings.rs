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
    netns::on_thread_in,
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
        .sysctl("net.ipv4.conf.all.route_localnet", "0")?;
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
    // No localhost NodePorts with `primary`, so route_localnet is left alone.
    let localnet = route_localnet(&s)?;
    s.ensure(localnet == "0", || {
        format!("{mode}: route_localnet must stay 0 with primary, is {localnet}")
    })?;
    Ok(())
}

fn route_localnet(s: &Scenario) -> anyhow::Result<String> {
    Ok(s.topo
        .node()
        .exec("cat", &["/proc/sys/net/ipv4/conf/all/route_localnet"])?
        .trim()
        .to_owned())
}

/// The default nodePortAddresses with localhostNodePorts: the iptables mode serves 127/8 and
/// needs route_localnet (the control for the `primary` check above).
#[test]
fn iptables_match_all_sets_route_localnet() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.topo
        .node()
        .sysctl("net.ipv4.conf.all.route_localnet", "0")?;
    s.start_agent_with_args("iptables", &[])?;
    let client = ext_client(&s);
    s.wait_for_datapath_with(
        &client,
        node_port(Topology::node_ext_ip()),
        "NodePort on the node's address",
        is_pod,
    )?;
    let localnet = route_localnet(&s)?;
    s.ensure(localnet == "1", || format!("route_localnet is {localnet}"))?;
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

/// This node with `podCIDRs` (and the external link's address as its InternalIP).
fn node_with_pod_cidrs(pod_cidrs: &[&str]) -> String {
    let list: Vec<String> = pod_cidrs.iter().map(|c| format!("\"{c}\"")).collect();
    format!(
        "{}spec:\n  podCIDRs: [{}]\n",
        node_manifest(),
        list.join(", ")
    )
}

fn client_seen(a: &Attempt) -> Option<IpAddr> {
    match a {
        Attempt::Ok { client, .. } => Some(client.ip()),
        Attempt::Err(_) => None,
    }
}

/// A ClusterIP reached from outside the node is masqueraded exactly when the local-traffic
/// detector says the client is not local (kube-proxy's KUBE-SVC `<IfNotLocal> -j
/// KUBE-MARK-MASQ`), in both modes: no clusterCIDR → no detection, the pod sees the client;
/// BridgeInterface / InterfaceNamePrefix → traffic from the external link is not local;
/// NodeCIDR → the Node's podCIDRs decide; masqueradeAll → always.
#[test]
fn cluster_ip_from_outside_masquerades_by_detect_local_mode() -> anyhow::Result<()> {
    // (arguments, Node manifest, masqueraded): a masqueraded flow reaches the pod from a node
    // address (eBPF: the SNAT address; iptables: MASQUERADE's, the pod link's).
    let cases: [(&[&str], Option<String>, bool); 7] = [
        (&[], None, false),
        // ClusterCIDR with the client inside it: local, not masqueraded ...
        (&["--cluster-cidr", "10.10.0.0/24"], None, false),
        // ... unless masqueradeAll.
        (
            &["--cluster-cidr", "10.10.0.0/24", "--masquerade-all"],
            None,
            true,
        ),
        (
            &[
                "--detect-local-mode",
                "BridgeInterface",
                "--pod-bridge-interface",
                "cbr0",
            ],
            None,
            true,
        ),
        (
            &[
                "--detect-local-mode",
                "InterfaceNamePrefix",
                "--pod-interface-name-prefix",
                "vpod",
            ],
            None,
            true,
        ),
        (
            &["--detect-local-mode", "NodeCIDR"],
            Some(node_with_pod_cidrs(&["10.244.1.0/24"])),
            true,
        ),
        // The client inside the podCIDR counts as local: not masqueraded.
        (
            &["--detect-local-mode", "NodeCIDR"],
            Some(node_with_pod_cidrs(&["10.10.0.0/24"])),
            false,
        ),
    ];
    let client_ip = IpAddr::V4(Topology::ext_ip());
    for mode in ["ebpf", "iptables"] {
        for (args, node, masqueraded) in &cases {
            let mut s = setup()?;
            s.topo.ext().ip(&[
                "route",
                "add",
                &format!("{CLUSTER_IP}/32"),
                "via",
                &Topology::node_ext_ip().to_string(),
            ])?;
            if let Some(node) = node {
                s.manifests.write("node.yaml", node)?;
            }
            let mut all = args.to_vec();
            if mode == "ebpf" {
                all.extend(["--interfaces", "vext"]);
            }
            s.start_agent_with_args(mode, &all)?;
            let client = ext_client(&s);
            let answer = s.wait_for_datapath_with(
                &client,
                SocketAddr::new(IpAddr::V4(CLUSTER_IP), 80),
                "ClusterIP from outside",
                is_pod,
            )?;
            eprintln!("{mode} {args:?}: {answer:?}");
            let seen = client_seen(&answer);
            let ok = match (masqueraded, mode) {
                (false, _) => seen == Some(client_ip),
                (true, "ebpf") => seen == Some(IpAddr::V4(Topology::node_ext_ip())),
                (true, _) => seen.is_some_and(|ip| ip != client_ip),
            };
            s.ensure(ok, || {
                format!("{mode} {args:?}: masqueraded should be {masqueraded}: {answer:?}")
            })?;
        }
    }
    Ok(())
}

/// NodeCIDR: nothing is programmed until the Node has podCIDRs; a later change of them makes
/// the agent exit (to be restarted with them), as kube-proxy's NodeManager.
#[test]
fn node_cidr_waits_for_pod_cidrs_and_exits_when_they_change() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.manifests.write("node.yaml", &node_manifest())?;
    s.start_agent_with_args("iptables", &["--detect-local-mode", "NodeCIDR"])?;
    let client = ext_client(&s);
    // The agent is up (it serves its metrics) and has had its sources...
    let agent = s.agent()?;
    proxy_tests::wait::wait_until(
        "the agent's metrics served",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || agent.metrics().is_ok(),
    )
    .map_err(|e| agent.error(e.to_string()))?;
    // ...and time, not state, shows that no sync happens while the podCIDRs are missing.
    std::thread::sleep(Duration::from_secs(3));
    let before = client.once(node_port(Topology::node_ext_ip()))?;
    s.ensure(refused(&before), || {
        format!("no sync may happen before the Node has podCIDRs: {before:?}")
    })?;
    let syncs = s.agent()?.syncs();
    s.ensure(syncs == 0, || {
        format!("no sync may happen before the Node has podCIDRs: {syncs} in /metrics")
    })?;
    s.manifests
        .write("node.yaml", &node_with_pod_cidrs(&["10.244.1.0/24"]))?;
    s.wait_for_datapath_with(
        &client,
        node_port(Topology::node_ext_ip()),
        "NodePort once the podCIDRs are known",
        is_pod,
    )?;
    s.manifests
        .write("node.yaml", &node_with_pod_cidrs(&["10.244.9.0/24"]))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = s.agent()?.exit_status() {
            break status;
        }
        s.ensure(Instant::now() < deadline, || {
            "the agent must exit when the podCIDRs change".to_owned()
        })?;
        std::thread::sleep(Duration::from_millis(200));
    };
    let log = s.agent()?.log_contents();
    s.ensure(
        !status.success() && log.contains("podCIDRs of node"),
        || format!("exit {status}; log: {log}"),
    )?;
    Ok(())
}

/// The addresses in the pinned `KPR_NODE_ADDRS` and the `KPR_NODE_CONFIG` flags.
fn node_maps(s: &mut Scenario) -> anyhow::Result<(Vec<IpAddr>, u32)> {
    use aya::maps::{Array, HashMap, Map, MapData};
    use proxy_common::{NodeAddrKey, NodeConfig, family, map_names};
    let dir = s
        .agent()?
        .bpf_root()
        .join(proxy_dataplane_ebpf::PIN_DIR_NAME);
    let addrs: HashMap<MapData, NodeAddrKey, u8> = HashMap::try_from(Map::from_map_data(
        MapData::from_pin(dir.join(map_names::NODE_ADDRS))?,
    )?)?;
    let mut list: Vec<IpAddr> = addrs
        .keys()
        .filter_map(Result::ok)
        .filter_map(|k| match k.family {
            family::V4 => Some(IpAddr::V4(Ipv4Addr::from(k.addr[0].to_ne_bytes()))),
            family::V6 => Some(IpAddr::V6(proxy_dataplane_ebpf::ip6_from_map(k.addr))),
            _ => None,
        })
        .collect();
    list.sort();
    let config: Array<MapData, NodeConfig> = Array::try_from(Map::from_map_data(
        MapData::from_pin(dir.join(map_names::NODE_CONFIG))?,
    )?)?;
    Ok((list, config.get(&0, 0)?.flags))
}

fn v4(list: &[IpAddr]) -> Vec<IpAddr> {
    list.iter().copied().filter(IpAddr::is_ipv4).collect()
}

/// The contract with the datapath: `KPR_NODE_ADDRS` holds exactly the NodePort addresses,
/// loopback ones listed when explicit CIDRs include them, the LOCALHOST_NODEPORTS flag for
/// match-all; and it follows an address added and removed at run time.
#[test]
fn ebpf_node_maps_hold_the_node_port_addresses() -> anyhow::Result<()> {
    use proxy_common::node_flags::LOCALHOST_NODEPORTS;
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let node_ip = IpAddr::V4(Topology::node_ext_ip());
    let pod_side = IpAddr::V4(Topology::pod_gateway(1));

    // Default: every address but loopback, plus the flag.
    let mut s = setup()?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    s.wait_for_datapath_with(
        &ext_client(&s),
        node_port(Topology::node_ext_ip()),
        "NodePort",
        is_pod,
    )?;
    let (addrs, flags) = node_maps(&mut s)?;
    // (The rig's decoy ClusterIP on lo is a local address too, as for `--dst-type LOCAL`.)
    s.ensure(
        addrs.contains(&node_ip)
            && addrs.contains(&pod_side)
            && !addrs.iter().any(IpAddr::is_loopback)
            && flags & LOCALHOST_NODEPORTS != 0,
        || format!("default: {addrs:?} flags {flags:#x}"),
    )?;
    drop(s);

    // Explicit CIDRs with loopback: listed one by one, no flag; then an address comes and goes.
    let mut s = setup()?;
    start_with_loopback_node_ports(&mut s)?;
    let (addrs, flags) = node_maps(&mut s)?;
    s.ensure(
        // IPv4 CIDRs only: IPv6 matches all (upstream's NewNodePortAddresses), never ::1.
        v4(&addrs) == [node_ip, lo]
            && !addrs.contains(&IpAddr::V6(std::net::Ipv6Addr::LOCALHOST))
            && flags & LOCALHOST_NODEPORTS == 0,
        || format!("CIDRs: {addrs:?} flags {flags:#x}"),
    )?;
    let new = IpAddr::V4(NEW_ADDR);
    s.topo
        .node()
        .ip(&["addr", "add", &format!("{NEW_ADDR}/24"), "dev", "vext"])?;
    wait_for_addrs(&mut s, &[node_ip, new, lo])?;
    s.topo
        .node()
        .ip(&["addr", "del", &format!("{NEW_ADDR}/24"), "dev", "vext"])?;
    wait_for_addrs(&mut s, &[node_ip, lo])?;
    drop(s);

    // primary: the Node's IP only.
    let mut s = setup()?;
    s.manifests.write("node.yaml", &node_manifest())?;
    s.start_agent_with_args(
        "ebpf",
        &["--interfaces", "vext", "--nodeport-addresses", "primary"],
    )?;
    s.wait_for_datapath_with(
        &ext_client(&s),
        node_port(Topology::node_ext_ip()),
        "NodePort",
        is_pod,
    )?;
    let (addrs, flags) = node_maps(&mut s)?;
    s.ensure(
        v4(&addrs) == [node_ip] && flags & LOCALHOST_NODEPORTS == 0,
        || format!("primary: {addrs:?} flags {flags:#x}"),
    )?;
    Ok(())
}

/// Waits until the IPv4 part of `KPR_NODE_ADDRS` is `expected`.
fn wait_for_addrs(s: &mut Scenario, expected: &[IpAddr]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (addrs, _) = node_maps(s)?;
        let addrs = v4(&addrs);
        if addrs == expected {
            return Ok(());
        }
        s.ensure(Instant::now() < deadline, || {
            format!("KPR_NODE_ADDRS {addrs:?}, expected {expected:?}")
        })?;
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Without `--interfaces`, an interface that gets a global address at run time gets the
/// external program instead of the reply program, and back when the address goes.
#[test]
fn ebpf_tc_attachment_follows_addresses() -> anyhow::Result<()> {
    use proxy_common::program_names::{TC_EXTERNAL, TC_REPLY};
    let mut s = setup()?;
    let node = s.topo.node();
    // A veth pair inside the node (no dummy driver everywhere); kprdummy0 is the end watched.
    node.ip(&[
        "link",
        "add",
        "kprdummy0",
        "type",
        "veth",
        "peer",
        "name",
        "kprdummy1",
    ])?;
    node.ip(&["link", "set", "kprdummy0", "up"])?;
    node.ip(&["link", "set", "kprdummy1", "up"])?;
    let index: u32 = node
        .ip(&["-o", "link", "show", "kprdummy0"])?
        .split(':')
        .next()
        .and_then(|i| i.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no ifindex for kprdummy0"))?;
    s.start_agent_with_args("ebpf", &["--iptables-sync-period", SYNC_PERIOD])?;
    s.wait_for_datapath_with(
        &ext_client(&s),
        node_port(Topology::node_ext_ip()),
        "NodePort",
        is_pod,
    )?;
    let dir = s
        .agent()?
        .bpf_root()
        .join(proxy_dataplane_ebpf::PIN_DIR_NAME);
    let pin = |program: &str| dir.join(format!("{program}_if{index}_link"));
    let wait_for = |s: &mut Scenario, attached: &str, detached: &str| -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pin(attached).exists() || pin(detached).exists() {
            s.ensure(Instant::now() < deadline, || {
                format!("kprdummy0 should have {attached} and not {detached}")
            })?;
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    };
    wait_for(&mut s, TC_REPLY, TC_EXTERNAL)?;
    s.topo
        .node()
        .ip(&["addr", "add", "192.0.2.77/32", "dev", "kprdummy0"])?;
    wait_for(&mut s, TC_EXTERNAL, TC_REPLY)?;
    s.topo
        .node()
        .ip(&["addr", "del", "192.0.2.77/32", "dev", "kprdummy0"])?;
    wait_for(&mut s, TC_REPLY, TC_EXTERNAL)?;
    Ok(())
}

/// Whether a TCP connection to `addr` from inside the network namespace at `netns` succeeds
/// within a second.
fn tcp_connects(netns: &std::path::Path, addr: SocketAddr) -> anyhow::Result<bool> {
    Ok(on_thread_in(netns, move || {
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
    })?)
}

/// Health check node ports listen where NodePorts are served (upstream's
/// `newServiceHealthServer`): with `primary`, the Node's IP and not another address.
#[test]
fn health_check_node_port_listens_on_the_node_port_addresses() -> anyhow::Result<()> {
    const HEALTH_CHECK_PORT: u16 = 30998;
    let mut s = setup()?;
    let lb = node_port_service()
        .replace("type: NodePort", "type: LoadBalancer")
        .replace(
            "  ports:\n",
            &format!(
                "  externalTrafficPolicy: Local\n  healthCheckNodePort: {HEALTH_CHECK_PORT}\n  ports:\n"
            ),
        );
    s.manifests.write("svc.yaml", &lb)?;
    s.manifests.write("node.yaml", &node_manifest())?;
    s.topo
        .node()
        .ip(&["addr", "add", &format!("{NEW_ADDR}/24"), "dev", "vext"])?;
    s.start_agent_with_args("iptables", &["--nodeport-addresses", "primary"])?;
    let ext = s.topo.ext().path();
    let on_node_ip = SocketAddr::new(IpAddr::V4(Topology::node_ext_ip()), HEALTH_CHECK_PORT);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tcp_connects(&ext, on_node_ip)? {
        s.ensure(Instant::now() < deadline, || {
            format!("health check node port not listening on {on_node_ip}")
        })?;
        std::thread::sleep(Duration::from_millis(200));
    }
    let elsewhere = SocketAddr::new(IpAddr::V4(NEW_ADDR), HEALTH_CHECK_PORT);
    let connected = tcp_connects(&ext, elsewhere)?;
    s.ensure(!connected, || {
        format!("health check node port must not listen on {elsewhere}")
    })?;
    Ok(())
}

/// Kubelet heartbeats (Node status conditions) are not node changes: no sync, no full
/// iptables restore; a topology label change is one (a full sync).
#[test]
fn node_heartbeats_do_not_sync() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.manifests.write("node.yaml", &node_manifest())?;
    s.start_agent_with_args("iptables", &["--iptables-sync-period", SYNC_PERIOD])?;
    s.wait_for_datapath_with(
        &ext_client(&s),
        node_port(Topology::node_ext_ip()),
        "NodePort",
        is_pod,
    )?;
    let syncs = |s: &mut Scenario| -> anyhow::Result<u64> { Ok(s.agent()?.syncs()) };
    // The start settled: the first sync and anything queued behind it done.
    let agent = s.agent()?;
    proxy_tests::wait::wait_until(
        "the agent settled after its start",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || agent.settled(),
    )
    .map_err(|e| agent.error(e.to_string()))?;
    let before = syncs(&mut s)?;
    for beat in ["2026-01-01T00:00:10Z", "2026-01-01T00:00:20Z"] {
        let heartbeat = format!(
            "{}  conditions:\n  - type: Ready\n    status: \"True\"\n    lastHeartbeatTime: \"{beat}\"\n",
            node_manifest()
        );
        s.manifests.write("node.yaml", &heartbeat)?;
        // Time, not state: nothing shows a heartbeat read and ignored, so this gives a sync
        // it would wrongly cause the time to happen.
        std::thread::sleep(Duration::from_millis(1500));
    }
    let after = syncs(&mut s)?;
    s.ensure(after == before, || {
        format!("heartbeats caused syncs: {before} → {after} successful syncs")
    })?;
    let zone = node_manifest().replace(
        &format!("  name: {HOSTNAME}\n"),
        &format!("  name: {HOSTNAME}\n  labels:\n    topology.kubernetes.io/zone: z2\n"),
    );
    s.manifests.write("node.yaml", &zone)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while syncs(&mut s)? == after {
        s.ensure(Instant::now() < deadline, || {
            "a topology label change must cause a sync".to_owned()
        })?;
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// The MAC address of `dev` in `ns` (`ip -o link show`).
fn mac_of(ns: &proxy_tests::netns::Netns, dev: &str) -> anyhow::Result<[u8; 6]> {
    let line = ns.ip(&["-o", "link", "show", dev])?;
    let text = line
        .split_whitespace()
        .skip_while(|word| *word != "link/ether")
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("no MAC in {line:?}"))?;
    let mut mac = [0u8; 6];
    let bytes: Vec<&str> = text.split(':').collect();
    anyhow::ensure!(bytes.len() == 6, "MAC {text:?}");
    for (byte, hex) in mac.iter_mut().zip(bytes) {
        *byte = u8::from_str_radix(hex, 16)?;
    }
    Ok(mac)
}

/// Sends `frame` out of `dev` of the namespace at `netns` through a packet socket (no routing:
/// the frame goes as built) and returns the TCP segments to `port` from `from_port` that
/// arrive on `dev` within `wait`, as frames.
fn send_frame_and_listen(
    netns: &std::path::Path,
    dev: &'static str,
    frame: Vec<u8>,
    port: u16,
    from_port: u16,
    wait: Duration,
) -> anyhow::Result<Vec<Vec<u8>>> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    on_thread_in(netns, move || -> anyhow::Result<Vec<Vec<u8>>> {
        let ifindex = nix::net::if_::if_nametoindex(dev)?;
        let protocol = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); the descriptor is owned (and closed) by `socket` below.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                i32::from(protocol),
            )
        };
        anyhow::ensure!(
            fd >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let socket = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero sockaddr_ll is a valid value (filled in below).
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = protocol;
        addr.sll_ifindex = i32::try_from(ifindex)?;
        // SAFETY: `addr` is a sockaddr_ll of the size passed.
        let bound = unsafe {
            libc::bind(
                socket.as_raw_fd(),
                std::ptr::from_ref(&addr).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        anyhow::ensure!(bound == 0, "bind: {}", std::io::Error::last_os_error());
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: a valid socket and a timeval of the size passed.
        let set = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::from_ref(&timeout).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        anyhow::ensure!(set == 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
        // SAFETY: the buffer is `frame.len()` readable bytes; the socket is bound to `dev`.
        let sent = unsafe { libc::send(socket.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        anyhow::ensure!(
            usize::try_from(sent).ok() == Some(frame.len()),
            "send: {}",
            std::io::Error::last_os_error()
        );
        let deadline = Instant::now() + wait;
        let mut answers = Vec::new();
        let mut buf = vec![0u8; 4096];
        while Instant::now() < deadline {
            // SAFETY: the buffer is `buf.len()` writable bytes.
            let n =
                unsafe { libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            let Ok(n) = usize::try_from(n) else {
                continue; // the receive timeout
            };
            let got = &buf[..n];
            // IPv4 without options, TCP, from `from_port` to `port`.
            let tcp = got.len() >= 14 + 20 + 4
                && got[12..14] == [0x08, 0x00]
                && got[14] == 0x45
                && got[23] == 6;
            if tcp && got[34..36] == from_port.to_be_bytes() && got[36..38] == port.to_be_bytes() {
                answers.push(got.to_vec());
            }
        }
        Ok(answers)
    })?
}

/// The eBPF agent with NodePorts on loopback and the node's external network, once a NodePort
/// answers from outside.
fn start_with_loopback_node_ports(s: &mut Scenario) -> anyhow::Result<()> {
    s.start_agent_with_args(
        "ebpf",
        &[
            "--interfaces",
            "vext",
            "--nodeport-addresses",
            "127.0.0.0/8,10.10.0.0/24",
        ],
    )?;
    s.wait_for_datapath_with(
        &ext_client(s),
        node_port(Topology::node_ext_ip()),
        "NodePort",
        is_pod,
    )?;
    Ok(())
}

/// CVE-2020-8558 in eBPF mode: with loopback in `nodePortAddresses`, 127.0.0.1 is a NodePort
/// address (`KPR_NODE_ADDRS`) for the node's own processes only. A neighbour that routes
/// 127.0.0.1 to the node (a SYN to 127.0.0.1:<nodePort> in a frame to the node's MAC) gets no
/// answer, and the tc program counts the drop (kube-proxy's KUBE-FIREWALL rule drops it in
/// the iptables mode); a process of the node connecting to 127.0.0.1:<nodePort> still
/// reaches the Service.
#[test]
fn ebpf_localhost_node_ports_are_not_served_to_neighbours() -> anyhow::Result<()> {
    use proxy_common::StatIndex;
    use proxy_tests::packet::{L4, build};
    const CLIENT_PORT: u16 = 47_123;
    let mut s = setup()?;
    start_with_loopback_node_ports(&mut s)?;
    let (addrs, _) = node_maps(&mut s)?;
    s.ensure(addrs.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)), || {
        format!("127.0.0.1 is a NodePort address of the datapath: {addrs:?}")
    })?;
    let local = s.cgroup_client();
    let answer = s.wait_for_datapath_with(
        &local,
        node_port(Ipv4Addr::LOCALHOST),
        "localhost NodePort from the node",
        is_pod,
    )?;
    eprintln!("node → 127.0.0.1:{NODE_PORT}: {answer:?}");

    let dropped = s.agent()?.datapath_counter(StatIndex::TcDroppedLoopback)?;
    let mut frame = build(
        SocketAddr::new(IpAddr::V4(Topology::ext_ip()), CLIENT_PORT),
        node_port(Ipv4Addr::LOCALHOST),
        L4::TcpSyn,
        b"",
    );
    frame[0..6].copy_from_slice(&mac_of(s.topo.node(), "vext")?);
    frame[6..12].copy_from_slice(&mac_of(s.topo.ext(), "eth0")?);
    let answers = send_frame_and_listen(
        &s.topo.ext().path(),
        "eth0",
        frame,
        CLIENT_PORT,
        NODE_PORT,
        Duration::from_secs(2),
    )?;
    let after = s.agent()?.datapath_counter(StatIndex::TcDroppedLoopback)?;
    eprintln!(
        "neighbour → 127.0.0.1:{NODE_PORT}: {} answers, tc_dropped_loopback_destination {dropped} → {after}",
        answers.len()
    );
    s.ensure(answers.is_empty(), || {
        format!("a neighbour's SYN to 127.0.0.1 must get no answer: {answers:02x?}")
    })?;
    s.ensure(after > dropped, || {
        format!("the drop is counted: tc_dropped_loopback_destination {dropped} → {after}")
    })?;
    Ok(())
}
