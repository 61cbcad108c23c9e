//! `--bpf-socket-lb-host-namespace-only` (issue #17 item 3, service meshes): pods' sockets keep
//! the Service address and the tc program on the host side of their veths load-balances their
//! packets, so a sidecar capturing by Service address inside the pod (an iptables REDIRECT, as
//! Istio and Linkerd install) sees the ClusterIP as the original destination. Real traffic
//! from pod namespaces, both families, TCP and connected/unconnected UDP; a decoy answers on
//! every ClusterIP so untranslated traffic shows as `untranslated`. Needs root.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::thread;
use std::time::Duration;

use anyhow::Context as _;
use proxy_tests::client::{Attempt, Client, Mode, Proto, tally};
use proxy_tests::manifests::{
    Protocol, ServicePort, SlicePort, endpoint_slice_yaml_family, service_yaml_with,
};
use proxy_tests::netns::Netns;
use proxy_tests::scenario::{
    BACKEND_PORT, CLUSTER_IP, CLUSTER_IP6, SERVICE_PORT, Scenario, cluster_addr, cluster_addr6,
    is_pod, pod_endpoint_family,
};
use proxy_tests::topology::{Place, Topology};

const NAMESPACE: &str = "default";
const SERVICE: &str = "svc";
const OPTION: &str = "--bpf-socket-lb-host-namespace-only";
/// The pod whose processes are the clients (it is also an endpoint: hairpin).
const CLIENT_POD: usize = 1;
/// The sidecar stand-in's port, as Istio's outbound capture port.
const SIDECAR_PORT: u16 = 15001;
const SIDECAR: &str = "sidecar";
const ATTEMPTS: u32 = 40;

/// The three ways a client uses a ClusterIP.
const WAYS: [(Proto, Mode, &str); 3] = [
    (Proto::Tcp, Mode::Connect, "TCP"),
    (Proto::Udp, Mode::Connect, "connected UDP"),
    (Proto::Udp, Mode::Sendto, "unconnected UDP"),
];

/// Four pods serving on 8080 in both families, a decoy on both ClusterIPs.
fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    Ok(Scenario::with_families(4, true)?)
}

/// The dual-stack Service `svc`: `tcp` 80/TCP and `udp` 80/UDP → 8080, with `pods` as its
/// endpoints in both families. Slices first, so the Service never appears with an old set.
fn write_service(s: &Scenario, pods: &[usize]) -> anyhow::Result<()> {
    write_service_with(s, pods, None)
}

/// [`write_service`] with `sessionAffinity: ClientIP` when `affinity` has its timeout.
fn write_service_with(s: &Scenario, pods: &[usize], affinity: Option<u32>) -> anyhow::Result<()> {
    let ports = [("tcp", Protocol::Tcp), ("udp", Protocol::Udp)];
    let slice_ports: Vec<SlicePort> = ports
        .iter()
        .map(|(name, protocol)| SlicePort {
            name: (*name).into(),
            port: BACKEND_PORT,
            protocol: *protocol,
        })
        .collect();
    for ipv6 in [false, true] {
        let endpoints: Vec<_> = pods.iter().map(|&i| pod_endpoint_family(i, ipv6)).collect();
        let name = if ipv6 { "svc-v6" } else { "svc-v4" };
        s.manifests.write(
            &format!("{name}.yaml"),
            &endpoint_slice_yaml_family(NAMESPACE, name, SERVICE, &slice_ports, &endpoints, ipv6),
        )?;
    }
    let service_ports: Vec<ServicePort> = ports
        .iter()
        .map(|(name, protocol)| ServicePort {
            name: (*name).into(),
            port: SERVICE_PORT,
            protocol: *protocol,
        })
        .collect();
    let ips: Vec<IpAddr> = vec![CLUSTER_IP.into(), CLUSTER_IP6.into()];
    s.manifests.write(
        "svc.yaml",
        &service_yaml_with(NAMESPACE, SERVICE, &ips, &service_ports, affinity),
    )?;
    Ok(())
}

/// Starts the agent (tc's external program on `vext` only, so the pod veths are pod side, as
/// on a node whose pod interfaces carry no global address) and waits until a pod process
/// reaches a pod through each ClusterIP.
fn start(s: &mut Scenario, extra: &[&str]) -> anyhow::Result<()> {
    let mut args = vec!["--interfaces", "vext"];
    args.extend(extra);
    s.start_agent_with_args("ebpf", &args)?;
    let client = s.pod_client(CLIENT_POD)?;
    for target in [cluster_addr(), cluster_addr6()] {
        s.wait_for_datapath_with(&client, target, "answered by a pod", is_pod)?;
    }
    Ok(())
}

fn pod_index(backend: &str) -> anyhow::Result<usize> {
    backend
        .trim_start_matches("pod")
        .parse()
        .with_context(|| format!("pod index of {backend}"))
}

/// `ATTEMPTS` attempts of every way from the client pod to both ClusterIPs: each answered by
/// one of `endpoints`, every endpoint used, and the client socket's peer (getpeername, or
/// recvfrom's source) the ClusterIP. The backend sees the pod's own address (no SNAT), except
/// on a hairpin (the pod reached itself), which is masqueraded as kube-proxy does.
fn check_pod_traffic(s: &Scenario, endpoints: &[usize]) -> anyhow::Result<()> {
    let wanted: BTreeSet<String> = endpoints.iter().map(|i| format!("pod{i}")).collect();
    for target in [cluster_addr(), cluster_addr6()] {
        let ipv6 = target.is_ipv6();
        let own = Topology::pod_addr(CLIENT_POD, ipv6);
        for (proto, mode, what) in WAYS {
            let client = s.pod_client(CLIENT_POD)?.proto(proto).mode(mode);
            let attempts = client.run(target, ATTEMPTS)?;
            let counts = tally(&attempts);
            eprintln!("pod{CLIENT_POD} {what} to {target}: answers {counts:?}");
            for a in &attempts {
                let Attempt::Ok {
                    backend,
                    client,
                    peer,
                } = a
                else {
                    return Err(s.agent_error(format!("{what} {target}: {a:?}")).into());
                };
                s.ensure(wanted.contains(backend), || {
                    format!("{what} {target}: answer from {backend}, endpoints {wanted:?}")
                })?;
                s.ensure(*peer == target, || {
                    format!("{what} {target}: the pod's socket shows {peer}, not the Service")
                })?;
                let hairpin = pod_index(backend)? == CLIENT_POD;
                s.ensure((client.ip() == own) != hairpin, || {
                    format!("{what} {target}: {backend} saw client {client} (pod: {own})")
                })?;
            }
            let seen: BTreeSet<String> = counts.keys().cloned().collect();
            s.ensure(seen == wanted, || {
                format!("{what} {target}: every endpoint must answer: {counts:?}")
            })?;
        }
    }
    Ok(())
}

/// A mesh's capture inside the client pod: the sidecar stand-in on loopback (both families)
/// and an iptables/ip6tables REDIRECT of TCP to either ClusterIP's port to it.
fn install_sidecar(s: &mut Scenario) -> anyhow::Result<()> {
    let v4 = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), SIDECAR_PORT);
    let v6 = SocketAddr::new(Ipv6Addr::LOCALHOST.into(), SIDECAR_PORT);
    for listen in [v4, v6] {
        s.topo
            .start_sidecar(Place::Pod(CLIENT_POD), SIDECAR, listen)?;
    }
    let pod = s.topo.pod(CLIENT_POD)?;
    for (tool, ip) in [
        ("iptables", IpAddr::from(CLUSTER_IP)),
        ("ip6tables", IpAddr::from(CLUSTER_IP6)),
    ] {
        pod.exec(
            tool,
            &[
                "-t",
                "nat",
                "-A",
                "OUTPUT",
                "-p",
                "tcp",
                "-d",
                &ip.to_string(),
                "--dport",
                &SERVICE_PORT.to_string(),
                "-j",
                "REDIRECT",
                "--to-ports",
                &SIDECAR_PORT.to_string(),
            ],
        )?;
    }
    Ok(())
}

/// TCP from the client pod to both ClusterIPs, with the sidecar capture installed.
fn captured(s: &Scenario, target: SocketAddr) -> anyhow::Result<Vec<Attempt>> {
    let attempts = s.pod_client(CLIENT_POD)?.run(target, 10)?;
    eprintln!("with the capture, TCP to {target}: {:?}", tally(&attempts));
    Ok(attempts)
}

#[test]
fn host_namespace_only_pods_keep_the_service_address_and_tc_balances_them() -> anyhow::Result<()> {
    let mut s = setup()?;
    // pod4 serves but is not an endpoint: an answer from it would be a bug. pod1, the client,
    // is an endpoint: its hairpin flows must work too.
    write_service(&s, &[1, 2, 3])?;
    start(&mut s, &[OPTION])?;
    check_pod_traffic(&s, &[1, 2, 3])?;

    // Host processes keep socket-level translation: the decoy on the ClusterIP (on the node's
    // lo, where no tc program runs) would answer an untranslated connection.
    for target in [cluster_addr(), cluster_addr6()] {
        let attempts = s.cgroup_client().run(target, 20)?;
        let counts = tally(&attempts);
        eprintln!("node process to {target}: {counts:?}");
        s.ensure(
            attempts
                .iter()
                .all(|a| matches!(a, Attempt::Ok { peer, .. } if *peer == target) && is_pod(a)),
            || format!("a node process must be translated at its socket: {counts:?}"),
        )?;
    }

    // A removed backend never answers a new connection once the update is in.
    write_service(&s, &[1, 2])?;
    for target in [cluster_addr(), cluster_addr6()] {
        let client = s.pod_client(CLIENT_POD)?;
        s.wait_for_batch(&client, target, 20, "removing pod3", |a| {
            is_pod(a) && a.backend() != Some("pod3")
        })?;
    }
    check_pod_traffic(&s, &[1, 2])?;

    // What a mesh needs: the capture inside the pod sees the Service address.
    install_sidecar(&mut s)?;
    for target in [cluster_addr(), cluster_addr6()] {
        for a in captured(&s, target)? {
            let ok = matches!(&a, Attempt::Ok { backend, client, peer }
                if backend == SIDECAR && *client == target && *peer == target);
            s.ensure(ok, || {
                format!("the sidecar must capture {target} with it as original destination: {a:?}")
            })?;
        }
    }
    Ok(())
}

/// Without the option (today's default): the pod's socket is translated at connect, so the
/// capture by Service address never matches — the packets already go to a backend — although
/// getpeername still shows the ClusterIP. This is what breaks sidecar meshes.
#[test]
fn socket_lb_in_pods_bypasses_a_sidecar_capturing_the_service_address() -> anyhow::Result<()> {
    let mut s = setup()?;
    write_service(&s, &[2, 3])?;
    start(&mut s, &[])?;
    install_sidecar(&mut s)?;
    for target in [cluster_addr(), cluster_addr6()] {
        let attempts = captured(&s, target)?;
        let counts = tally(&attempts);
        s.ensure(
            attempts
                .iter()
                .all(|a| matches!(a, Attempt::Ok { peer, .. } if *peer == target) && is_pod(a)),
            || format!("socket LB must send {target} past the capture to a pod: {counts:?}"),
        )?;
    }
    Ok(())
}

/// A pod interface created after the agent started gets the pod-side program without waiting
/// for the periodic sync (30 s): the agent's netlink watch sees the new link. The interface is
/// wired as Calico does it — no address on the host side (IPv6 off, so no link-local address
/// event either), a /32 route, the pod's gateway an on-link address — so only the link
/// events can tell the agent.
#[test]
fn host_namespace_only_covers_a_pod_created_after_the_agent_started() -> anyhow::Result<()> {
    let mut s = setup()?;
    write_service(&s, &[2, 3])?;
    start(&mut s, &[OPTION])?;
    let late = LatePod::create(&s)?;
    // Outside the agent's cgroup: no socket hook runs for it at all, so only the pod-side tc
    // program can translate (the decoy answers otherwise).
    let client = Client::new(late.netns.path());
    // Bounded by the rig's datapath timeout (10 s), a third of the periodic sync.
    let first = s.wait_for_datapath_with(&client, cluster_addr(), "answered by a pod", is_pod)?;
    eprintln!("late pod, first answer: {first:?}");
    let attempts = client.run(cluster_addr(), 20)?;
    let counts = tally(&attempts);
    s.ensure(
        attempts.iter().all(|a| {
            matches!(a, Attempt::Ok { backend, client, peer }
                if (backend == "pod2" || backend == "pod3")
                    && *peer == cluster_addr()
                    && client.ip() == IpAddr::from(LatePod::ADDRESS))
        }),
        || format!("the late pod's connections must reach pod2/pod3 via tc: {counts:?}"),
    )?;
    Ok(())
}

/// A pod namespace linked to the node after the agent started (`vlate`), Calico style.
struct LatePod {
    netns: Netns,
}

impl LatePod {
    const ADDRESS: Ipv4Addr = Ipv4Addr::new(10, 244, 200, 2);
    /// The pod's on-link gateway: an address of the node (on `vext`), so the node answers its
    /// ARP on `vlate` (`arp_ignore` 0) although `vlate` has no address.
    const GATEWAY: &str = "10.10.0.1";

    fn create(s: &Scenario) -> anyhow::Result<Self> {
        let netns = Netns::new("late")?;
        let node = s.topo.node();
        node.ip(&[
            "link",
            "add",
            "vlate",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            netns.name(),
        ])?;
        node.sysctl("net.ipv6.conf.vlate.disable_ipv6", "1")?;
        node.ip(&["link", "set", "vlate", "up"])?;
        node.ip(&[
            "route",
            "add",
            &format!("{}/32", Self::ADDRESS),
            "dev",
            "vlate",
        ])?;
        netns.ip(&[
            "addr",
            "add",
            &format!("{}/32", Self::ADDRESS),
            "dev",
            "eth0",
        ])?;
        netns.ip(&["link", "set", "eth0", "up"])?;
        netns.ip(&[
            "route",
            "add",
            Self::GATEWAY,
            "dev",
            "eth0",
            "scope",
            "link",
        ])?;
        netns.ip(&[
            "route",
            "add",
            "default",
            "via",
            Self::GATEWAY,
            "dev",
            "eth0",
        ])?;
        Ok(Self { netns })
    }
}

/// A pod's long-lived UDP flow (one connected socket, a DNS-style retry loop) to a backend that
/// leaves the Service moves to a live backend: the agent purges the pod-side tc conntrack
/// entries of removed backends as it does for external flows (otherwise every datagram would
/// refresh the entry and the flow would stay on the removed pod for good).
#[test]
fn host_namespace_only_udp_flow_leaves_a_removed_backend() -> anyhow::Result<()> {
    let mut s = setup()?;
    write_service(&s, &[2])?;
    start(&mut s, &[OPTION])?;
    let streams: Vec<_> = [cluster_addr(), cluster_addr6()]
        .into_iter()
        .map(|target| {
            let client = s
                .pod_client(CLIENT_POD)
                .map(|c| {
                    c.mode(Mode::Stream)
                        .timeout(Duration::from_millis(300))
                        .interval(Duration::from_millis(50))
                })
                .map_err(anyhow::Error::from)?;
            Ok((target, thread::spawn(move || client.run(target, 60))))
        })
        .collect::<anyhow::Result<_>>()?;
    // Both flows started on pod2 before it is removed. pod2 keeps serving: only the purge can
    // move the flows off it.
    s.wait_for_udp_flows(&[Place::Pod(CLIENT_POD)], 2)?;
    write_service(&s, &[3])?;
    for (target, stream) in streams {
        let attempts = stream
            .join()
            .map_err(|_| anyhow::anyhow!("client thread panicked"))??;
        let labels: Vec<String> = attempts.iter().map(Attempt::label).collect();
        eprintln!("connected UDP stream from pod{CLIENT_POD} to {target}: {labels:?}");
        let first_live = labels.iter().position(|l| l == "pod3");
        s.ensure(labels.first().is_some_and(|l| l == "pod2"), || {
            format!("{target}: the stream must start on pod2: {labels:?}")
        })?;
        s.ensure(
            first_live.is_some_and(|i| labels[i..].iter().all(|l| l == "pod3")),
            || {
                format!(
                    "{target}: after the update the stream must move to pod3 for good: {labels:?}"
                )
            },
        )?;
    }
    Ok(())
}

/// `sessionAffinity: ClientIP` holds on the pod-side tc path: every flow of the client pod to a
/// service port (TCP; UDP connected or not), in each family, goes to the one backend its first
/// flow chose (the datapath's affinity entry, keyed there by the pod's address; affinity is per
/// service port, as kube-proxy's `recent` lists are per KUBE-SVC chain).
#[test]
fn host_namespace_only_keeps_session_affinity_per_pod() -> anyhow::Result<()> {
    let mut s = setup()?;
    write_service_with(&s, &[2, 3, 4], Some(10_800))?;
    start(&mut s, &[OPTION])?;
    for target in [cluster_addr(), cluster_addr6()] {
        let mut backends: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
        for (proto, mode, what) in WAYS {
            let client = s.pod_client(CLIENT_POD)?.proto(proto).mode(mode);
            let attempts = client.run(target, 20)?;
            let counts = tally(&attempts);
            eprintln!("affinity, pod{CLIENT_POD} {what} to {target}: {counts:?}");
            for a in &attempts {
                let Attempt::Ok { backend, peer, .. } = a else {
                    return Err(s.agent_error(format!("{what} {target}: {a:?}")).into());
                };
                s.ensure(*peer == target, || {
                    format!("{what} {target}: the pod's socket shows {peer}")
                })?;
                backends
                    .entry(proto.as_arg())
                    .or_default()
                    .insert(backend.clone());
            }
        }
        s.ensure(
            backends.len() == 2
                && backends.values().all(|set| {
                    set.len() == 1
                        && set
                            .iter()
                            .all(|b| ["pod2", "pod3", "pod4"].contains(&b.as_str()))
                }),
            || format!("{target}: each service port must keep one endpoint per pod: {backends:?}"),
        )?;
    }
    Ok(())
}

/// A Service without endpoints refuses a pod's connection on the tc path as the socket hooks
/// do (kube-proxy's REJECT: an ICMP port unreachable, which `connect()` reports as
/// ECONNREFUSED). A decoy answers on its ClusterIPs, so an untranslated connection would show.
#[test]
fn host_namespace_only_refuses_a_service_without_endpoints() -> anyhow::Result<()> {
    let mut s = setup()?;
    let lonely4 = Ipv4Addr::new(10, 96, 0, 11);
    let lonely6 = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x11);
    for ip in [IpAddr::from(lonely4), IpAddr::from(lonely6)] {
        s.topo.add_decoy(ip, SERVICE_PORT)?;
    }
    let port = ServicePort {
        name: "tcp".into(),
        port: SERVICE_PORT,
        protocol: Protocol::Tcp,
    };
    s.manifests.write(
        "lonely.yaml",
        &service_yaml_with(
            NAMESPACE,
            "lonely",
            &[lonely4.into(), lonely6.into()],
            &[port],
            None,
        ),
    )?;
    write_service(&s, &[2])?;
    start(&mut s, &[OPTION])?;
    let refused = |a: &Attempt| *a == Attempt::Err("ECONNREFUSED".into());
    for target in [
        SocketAddr::new(lonely4.into(), SERVICE_PORT),
        SocketAddr::new(lonely6.into(), SERVICE_PORT),
    ] {
        // Within the per-client ICMP budget (6 at once, then one a second), and a timeout that
        // lets a SYN retransmission get its refusal if one was over it.
        let client = s.pod_client(CLIENT_POD)?.timeout(Duration::from_secs(3));
        let attempts = client.run(target, 5)?;
        let counts = tally(&attempts);
        eprintln!("pod{CLIENT_POD} to {target} (no endpoints): {counts:?}");
        s.ensure(attempts.iter().all(refused), || {
            format!("{target}: every attempt must be refused: {counts:?}")
        })?;
    }
    Ok(())
}

/// A NodePort dialled by a pod at a node address (its gateway) is load-balanced on the tc path
/// with the socket hooks' NodePort frontend (the wildcard at a NodePort address): the pod's
/// socket keeps the node address, the backend sees the pod's own address. Nothing listens on
/// the node port, so an untranslated connection is refused; the client runs outside the agent's
/// cgroup, so only the tc program can have translated it.
#[test]
fn host_namespace_only_balances_a_node_port_dialled_by_a_pod() -> anyhow::Result<()> {
    const NODE_PORT: u16 = 30080;
    let mut s = setup()?;
    let slice_port = SlicePort {
        name: "tcp".into(),
        port: BACKEND_PORT,
        protocol: Protocol::Tcp,
    };
    for ipv6 in [false, true] {
        let endpoints = [pod_endpoint_family(2, ipv6), pod_endpoint_family(3, ipv6)];
        let name = if ipv6 { "np-v6" } else { "np-v4" };
        s.manifests.write(
            &format!("{name}.yaml"),
            &endpoint_slice_yaml_family(
                NAMESPACE,
                name,
                "np",
                std::slice::from_ref(&slice_port),
                &endpoints,
                ipv6,
            ),
        )?;
    }
    s.manifests.write(
        "np.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: np\n  namespace: {NAMESPACE}\n\
             spec:\n  type: NodePort\n  clusterIP: \"10.96.0.12\"\n\
             \x20 clusterIPs: [\"10.96.0.12\", \"fd00:96::12\"]\n  ipFamilies: [IPv4, IPv6]\n\
             \x20 ipFamilyPolicy: RequireDualStack\n\
             \x20 ports:\n  - name: tcp\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
             \x20   nodePort: {NODE_PORT}\n"
        ),
    )?;
    write_service(&s, &[2])?;
    start(&mut s, &[OPTION])?;
    for ipv6 in [false, true] {
        let target = SocketAddr::new(Topology::pod_gateway_addr(CLIENT_POD, ipv6), NODE_PORT);
        let own = Topology::pod_addr(CLIENT_POD, ipv6);
        // Outside the agent's cgroup, so no socket hook could be what translates it.
        let client = Client::new(s.topo.pod(CLIENT_POD)?.path());
        s.wait_for_datapath_with(&client, target, "answered by a pod", is_pod)?;
        let attempts = client.run(target, 20)?;
        let counts = tally(&attempts);
        eprintln!("pod{CLIENT_POD} to the NodePort {target}: {counts:?}");
        s.ensure(
            attempts.iter().all(|a| {
                matches!(a, Attempt::Ok { backend, client, peer }
                    if (backend == "pod2" || backend == "pod3")
                        && *peer == target
                        && client.ip() == own)
            }),
            || format!("{target}: pod2/pod3 must answer the pod, unmasqueraded: {counts:?}"),
        )?;
    }
    Ok(())
}
