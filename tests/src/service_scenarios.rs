//! The end-to-end scenario table both dataplanes must pass: each scenario builds its topology,
//! writes Services and EndpointSlices, starts the agent in the given `--proxy-mode` and checks
//! real traffic (which pod answered, which client address it saw, what was refused or dropped).
//! `tests/tests/integration/service_scenarios_*.rs` run the table once per mode.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    time::Duration,
};

pub use crate::scenario::{NODE_PORT, ServiceSpec, web_service_yaml};
use crate::{
    Result, RigError,
    client::{Attempt, Client, tally},
    manifests::Endpoint,
    scenario::{
        BACKEND_PORT, CLUSTER_IP, HOSTNAME, PORT_NAME, SERVICE_PORT, Scenario, cluster_addr,
        http_slice, is_pod, pod_endpoint,
    },
    topology::{DECOY_NAME, Place, Topology},
};

/// An externalIP / load-balancer VIP routed to the node by the external client.
pub const VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const NAMESPACE: &str = "default";
const CONNECTIONS: u32 = 30;
/// How long a client waits before calling a connection dropped.
const DROP_TIMEOUT: Duration = Duration::from_millis(700);

/// The external client reaches `vip` through the node, as a router in front of it would.
fn route_via_node(s: &Scenario, vip: impl Into<std::net::IpAddr>) -> Result<()> {
    s.topo.ext().ip(&[
        "route",
        "add",
        &format!("{}/32", vip.into()),
        "via",
        &Topology::node_ext_ip().to_string(),
    ])?;
    Ok(())
}

fn setup(pods: usize, spec: &ServiceSpec, endpoints: &[Endpoint]) -> Result<Scenario> {
    crate::require_root();
    let s = Scenario::new(pods)?;
    s.manifests.write("web-svc.yaml", &web_service_yaml(spec))?;
    s.manifests.write(
        "web-slice.yaml",
        &http_slice(NAMESPACE, "web-1", "web", endpoints),
    )?;
    // The external client reaches VIPs through the node.
    route_via_node(&s, VIP)?;
    Ok(s)
}

/// Starts the agent. In eBPF mode the tc programs go on the node's link to the outside only:
/// the rig's pod veths carry addresses on the node side, which auto-detection would also take.
/// `ebpf` with TCX forced off (`--bpf-disable-feature tcx`): the tc programs attach as legacy
/// clsact filters, the path of kernels older than 6.6. Only the external-traffic scenarios
/// take it (`service_scenarios_ebpf_legacy_tc.rs`).
pub const EBPF_LEGACY_TC: &str = "ebpf-legacy-tc";
/// `ebpf` with `--tc-fast-path`: translated packets are redirected past the host's netfilter
/// (`service_scenarios_ebpf.rs` runs the scenarios whose packets take that path).
pub const EBPF_FAST_PATH: &str = "ebpf-fast-path";

/// `ebpf` with `--tc-fast-path` and XDP (`--bpf-xdp auto`) on `vext` and, where the scenario
/// has a second node, `vnode2`; the external client's and the second node's veths send
/// complete checksums, as packets from a wire have, and take XDP frames (NAPI on), so that
/// XDP, not only tc, carries the flows (`service_scenarios_ebpf.rs` runs the whole table so).
pub const EBPF_XDP: &str = "ebpf-xdp";

/// Whether `mode` runs the eBPF dataplane (any of the variants above).
fn is_ebpf(mode: &str) -> bool {
    mode.starts_with("ebpf")
}

fn start(s: &mut Scenario, mode: &str) -> Result<()> {
    let interfaces = if mode == EBPF_XDP {
        "vext,vnode2"
    } else {
        "vext"
    };
    start_on(s, mode, interfaces, &[])
}

/// Starts the agent of `mode` with `extra` arguments; eBPF modes get the external tc programs
/// on `interfaces` (an interface the scenario lacks is ignored).
fn start_on(s: &mut Scenario, mode: &str, interfaces: &str, extra: &[&str]) -> Result<()> {
    let mut args: Vec<&str> = Vec::new();
    if is_ebpf(mode) {
        args.extend(["--interfaces", interfaces]);
    }
    match mode {
        EBPF_LEGACY_TC => args.extend(["--bpf-disable-feature", "tcx"]),
        EBPF_FAST_PATH => args.push("--tc-fast-path"),
        EBPF_XDP => {
            args.push("--tc-fast-path");
            wire_like_links(s)?;
        }
        _ => {}
    }
    args.extend(extra);
    s.start_agent_with_args(if is_ebpf(mode) { "ebpf" } else { mode }, &args)?;
    Ok(())
}

/// Complete checksums and NAPI on the external client's eth0 and, if there is one, the
/// second node's: see [`EBPF_XDP`].
fn wire_like_links(s: &Scenario) -> Result<()> {
    for place in [Place::Ext, Place::RemoteNode] {
        if let Ok(netns) = s.topo.netns(place) {
            netns.exec("ethtool", &["-K", "eth0", "tx", "off", "gro", "on"])?;
        }
    }
    Ok(())
}

fn node_port_addr() -> SocketAddr {
    SocketAddrV4::new(Topology::node_ext_ip(), NODE_PORT).into()
}

/// Waits (bounded) until `target` answers from outside as `ready` says, then makes
/// [`CONNECTIONS`] connections from the external client; prints and returns them with their tally.
fn from_outside(
    s: &mut Scenario,
    target: SocketAddr,
    label: &str,
    ready: impl Fn(&Attempt) -> bool,
) -> Result<(Vec<Attempt>, BTreeMap<String, usize>)> {
    let client = s.external_client();
    s.wait_for_datapath_with(&client, target, label, ready)?;
    let attempts = client.run(target, CONNECTIONS)?;
    let counts = tally(&attempts);
    eprintln!("{label}: {counts:?}");
    Ok((attempts, counts))
}

/// With `externalTrafficPolicy: Cluster` the backend must see the node, not the client.
fn ensure_snat(s: &Scenario, attempts: &[Attempt]) -> Result<()> {
    for attempt in attempts {
        if let Attempt::Ok {
            client: seen,
            backend,
            ..
        } = attempt
        {
            s.ensure(
                seen.ip() != std::net::IpAddr::from(Topology::ext_ip()),
                || format!("{backend} saw the client address {seen}: eTP=Cluster must SNAT"),
            )?;
        }
    }
    Ok(())
}

fn pods_of(counts: &BTreeMap<String, usize>) -> Vec<&str> {
    counts
        .keys()
        .filter(|k| k.starts_with("pod"))
        .map(String::as_str)
        .collect()
}

/// NodePort with `externalTrafficPolicy: Cluster`: every pod is reached from outside, and the
/// pod sees the node's address (SNAT), not the client's.
pub fn node_port_cluster_policy(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    let mut s = setup(
        3,
        &spec,
        &[pod_endpoint(1), pod_endpoint(2), pod_endpoint(3)],
    )?;
    start(&mut s, mode)?;
    let (attempts, counts) = from_outside(
        &mut s,
        node_port_addr(),
        &format!("[{mode}] NodePort eTP=Cluster from outside"),
        is_pod,
    )?;
    s.ensure(
        pods_of(&counts).len() == 3 && attempts.iter().all(is_pod),
        || format!("all three pods must answer every connection: {counts:?}"),
    )?;
    ensure_snat(&s, &attempts)
}

/// NodePort with `externalTrafficPolicy: Local`: local endpoints only, and the pod sees the real
/// client address.
pub fn node_port_local_policy_preserves_the_client(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "NodePort",
        external_traffic_policy_local: true,
        ..ServiceSpec::default()
    };
    let remote = Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(Topology::pod_ip(3))
    };
    let mut s = setup(3, &spec, &[pod_endpoint(1), pod_endpoint(2), remote])?;
    start(&mut s, mode)?;
    let (attempts, counts) = from_outside(
        &mut s,
        node_port_addr(),
        &format!("[{mode}] NodePort eTP=Local from outside"),
        is_pod,
    )?;
    s.ensure(
        attempts.iter().all(is_pod) && !counts.contains_key("pod3"),
        || format!("only the local pods may answer: {counts:?}"),
    )?;
    for attempt in &attempts {
        if let Attempt::Ok {
            client: seen,
            backend,
            ..
        } = attempt
        {
            s.ensure(
                seen.ip() == std::net::IpAddr::from(Topology::ext_ip()),
                || format!("{backend} saw {seen}: eTP=Local must preserve the client address"),
            )?;
        }
    }
    Ok(())
}

/// `externalTrafficPolicy: Local` without a local endpoint: external traffic is dropped (not
/// refused, not sent to the remote endpoint), while the ClusterIP still works.
pub fn node_port_local_policy_without_local_endpoints_drops(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "NodePort",
        external_traffic_policy_local: true,
        ..ServiceSpec::default()
    };
    let remote = Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(Topology::pod_ip(1))
    };
    let mut s = setup(1, &spec, &[remote])?;
    start(&mut s, mode)?;
    let internal = s.cgroup_client();
    s.wait_for_datapath_with(
        &internal,
        cluster_addr(),
        "ClusterIP answered by pod1",
        is_pod,
    )?;
    let attempts = s
        .external_client()
        .timeout(DROP_TIMEOUT)
        .run(node_port_addr(), 3)?;
    let counts = tally(&attempts);
    eprintln!("[{mode}] NodePort eTP=Local, no local endpoint: {counts:?}");
    s.ensure(
        attempts
            .iter()
            .all(|a| *a == Attempt::Err("TIMEOUT".into())),
        || format!("external traffic must be dropped (time out): {counts:?}"),
    )
}

/// A NodePort Service without endpoints refuses external connections (kube-proxy's REJECT).
pub fn node_port_without_endpoints_is_refused(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    let mut s = setup(1, &spec, &[])?;
    start(&mut s, mode)?;
    let client = s.external_client().timeout(DROP_TIMEOUT);
    let refused = |a: &Attempt| *a == Attempt::Err("ECONNREFUSED".into());
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort refused", refused)?;
    let attempts = client.run(node_port_addr(), 5)?;
    eprintln!(
        "[{mode}] NodePort without endpoints: {:?}",
        tally(&attempts)
    );
    s.ensure(attempts.iter().all(refused), || {
        format!("expected ECONNREFUSED: {attempts:?}")
    })
}

/// The load-balancer IP of [`external_ip_and_load_balancer_service`].
const EXTERNAL_LB_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 20);

/// A LoadBalancer Service on pods 1 and 2 with the externalIP [`VIP`] and the load-balancer IP
/// [`EXTERNAL_LB_IP`], which the external client routes via the node.
fn external_ip_and_load_balancer_service() -> Result<Scenario> {
    let spec = ServiceSpec {
        type_: "LoadBalancer",
        external_ips: vec![VIP],
        load_balancer_ip: Some(EXTERNAL_LB_IP),
        ..ServiceSpec::default()
    };
    let s = setup(2, &spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    route_via_node(&s, EXTERNAL_LB_IP)?;
    Ok(s)
}

/// Connections from outside to `addr`'s Service port: every one answered, by both pods.
fn both_pods_answer_from_outside(
    s: &mut Scenario,
    mode: &str,
    name: &str,
    addr: Ipv4Addr,
) -> Result<()> {
    let target = SocketAddr::from(SocketAddrV4::new(addr, SERVICE_PORT));
    let label = format!("[{mode}] {name} {target} from outside");
    let (attempts, counts) = from_outside(s, target, &label, is_pod)?;
    s.ensure(
        attempts.iter().all(is_pod) && pods_of(&counts).len() == 2,
        || format!("{name}: both pods must answer every connection: {counts:?}"),
    )
}

/// externalIPs and load-balancer VIPs reach the pods from outside.
pub fn external_ip_and_load_balancer_ip_reach_pods(mode: &str) -> Result<()> {
    let mut s = external_ip_and_load_balancer_service()?;
    start(&mut s, mode)?;
    for (name, addr) in [("externalIP", VIP), ("LB VIP", EXTERNAL_LB_IP)] {
        both_pods_answer_from_outside(&mut s, mode, name, addr)?;
    }
    Ok(())
}

/// With kube-proxy's `AllowServiceExternalIPs` gate off (the deprecated field's switch,
/// planned to be upstream's default in 1.40: KEP-5707) a Service's externalIPs are not served:
/// a connection from outside to one reaches no pod, while the same Service's load-balancer IP
/// still does. Setting the gate is warned about as upstream warns about a deprecated gate.
pub fn external_ips_are_not_served_with_their_gate_off(mode: &str) -> Result<()> {
    let mut s = external_ip_and_load_balancer_service()?;
    start_on(
        &mut s,
        mode,
        "vext",
        &["--feature-gates=AllowServiceExternalIPs=false"],
    )?;
    // The load balancer IP answers: the Service is programmed.
    both_pods_answer_from_outside(&mut s, mode, "LB VIP", EXTERNAL_LB_IP)?;
    let vip_target = SocketAddr::from(SocketAddrV4::new(VIP, SERVICE_PORT));
    let attempts = s
        .external_client()
        .timeout(DROP_TIMEOUT)
        .run(vip_target, 5)?;
    eprintln!(
        "[{mode}] externalIP {vip_target} with the gate off: {:?}",
        tally(&attempts)
    );
    s.ensure(!attempts.iter().any(is_pod), || {
        format!("no pod may answer the externalIP with its gate off: {attempts:?}")
    })?;
    let warning = "Setting deprecated feature gate AllowServiceExternalIPs=false. It will be \
                   removed in a future release.";
    let logged = s.agent()?.log_contents().contains(warning);
    s.ensure(logged, || format!("the agent logs {warning:?}"))
}

/// A load balancer's status that lists `0.0.0.0` and `127.0.0.1` next to a real VIP (a buggy
/// LB controller, or anyone allowed to write `services/status`): the unspecified and loopback
/// addresses are never programmed, so the node's own listeners on the Service's port keep
/// their connections, from outside to the node's address and from the node to 127.0.0.1,
/// while the real VIP still reaches the pods. kube-proxy writes `-d 0.0.0.0/32` and
/// `-d 127.0.0.1/32` rules, which outside packets never match (DNAT of 127.0.0.1 from the node
/// is not done either: KUBE-SERVICES is reached from OUTPUT but the rule matches only the VIP).
pub fn unusable_load_balancer_ips_never_capture_node_ports(mode: &str) -> Result<()> {
    let lb = Ipv4Addr::new(192, 0, 2, 20);
    let spec = ServiceSpec {
        type_: "LoadBalancer",
        load_balancer_ip: Some(lb),
        ..ServiceSpec::default()
    };
    let mut s = setup(2, &spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    let hostile = web_service_yaml(&spec).replace(
        &format!("ingress: [{{ip: {lb}}}]"),
        &format!("ingress: [{{ip: 0.0.0.0}}, {{ip: 127.0.0.1}}, {{ip: {lb}}}]"),
    );
    s.ensure(hostile.contains("0.0.0.0"), || {
        format!("the status must list 0.0.0.0: {hostile}")
    })?;
    s.manifests.write("web-svc.yaml", &hostile)?;
    route_via_node(&s, lb)?;
    // What a node process (sshd, the kubelet, etcd on loopback) looks like on the Service's
    // port: the answers name it.
    const NODE_PROCESS: &str = "node-process";
    let node_address = SocketAddr::from(SocketAddrV4::new(Topology::node_ext_ip(), SERVICE_PORT));
    let loopback = SocketAddr::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, SERVICE_PORT));
    s.topo.start_echo(Place::Node, NODE_PROCESS, node_address)?;
    s.topo.start_echo(Place::Node, NODE_PROCESS, loopback)?;
    start(&mut s, mode)?;
    let vip = SocketAddr::from(SocketAddrV4::new(lb, SERVICE_PORT));
    let (attempts, _) = from_outside(&mut s, vip, &format!("[{mode}] LB VIP {vip}"), is_pod)?;
    s.ensure(attempts.iter().all(is_pod), || {
        format!("the real VIP must still reach the pods: {attempts:?}")
    })?;
    let node_client = local_client(&s, mode, Place::Node)?;
    let node_process = |a: &Attempt| a.backend() == Some(NODE_PROCESS);
    for (who, client, target) in [
        ("outside", s.external_client(), node_address),
        ("node", node_client, loopback),
    ] {
        let attempts = client.run(target, 10)?;
        eprintln!("[{mode}] {who} → {target}: {:?}", tally(&attempts));
        s.ensure(attempts.iter().all(node_process), || {
            format!(
                "{who} → {target}: the node's own listener must answer every time: {attempts:?}"
            )
        })?;
    }
    Ok(())
}

/// A ClusterIP Service `namespace/name` created at `created` that also names [`VIP`] as an
/// externalIP, with `pod` as its endpoint.
fn vip_claimant(
    namespace: &str,
    name: &str,
    created: &str,
    uid: &str,
    cluster_ip: Ipv4Addr,
) -> String {
    crate::scenario::http_service(namespace, name, cluster_ip)
        .replace(
            &format!("  namespace: {namespace:?}\n"),
            &format!(
                "  namespace: {namespace:?}\n  creationTimestamp: \"{created}\"\n  uid: {uid}\n"
            ),
        )
        .replace(
            "  ports:\n",
            &format!("  externalIPs: [\"{VIP}\"]\n  ports:\n"),
        )
}

/// How one side of a contest is written: its UID and the prefix of its manifest files.
struct Claimant {
    uid: &'static str,
    file: &'static str,
}

/// The older `kube-system/dns` (pod2) and the younger `aaa/web` (pod1), both claiming `VIP`:
/// their Services and slices, each under its own file prefix.
fn write_contest(s: &Scenario, older: Claimant, younger: Claimant) -> Result<()> {
    let older_svc = vip_claimant(
        "kube-system",
        "dns",
        "2024-01-01T00:00:00Z",
        older.uid,
        Ipv4Addr::new(10, 96, 0, 31),
    );
    let younger_svc = vip_claimant(
        "aaa",
        "web",
        "2025-06-01T00:00:00Z",
        younger.uid,
        Ipv4Addr::new(10, 96, 0, 30),
    );
    s.ensure(
        older_svc.contains("creationTimestamp") && younger_svc.contains("externalIPs"),
        || format!("the manifests must carry the age and the VIP: {older_svc}"),
    )?;
    s.manifests
        .write(&format!("{}-svc.yaml", older.file), &older_svc)?;
    s.manifests.write(
        &format!("{}-slice.yaml", older.file),
        &http_slice("kube-system", "dns-1", "dns", &[pod_endpoint(2)]),
    )?;
    s.manifests
        .write(&format!("{}-svc.yaml", younger.file), &younger_svc)?;
    s.manifests.write(
        &format!("{}-slice.yaml", younger.file),
        &http_slice("aaa", "web-1", "web", &[pod_endpoint(1)]),
    )
}

/// Two Services name the same externalIP and port (CVE-2020-8554: any namespace user may
/// write `spec.externalIPs`): the older one keeps it whatever the names sort as (`aaa` comes
/// before `kube-system`), across an agent restart, in both modes; when it goes, the other
/// takes over. kube-proxy programs both and the first rule in map order wins.
pub fn contested_external_ip_stays_with_the_older_service(mode: &str) -> Result<()> {
    crate::require_root();
    let mut s = Scenario::new(2)?;
    write_contest(
        &s,
        Claimant {
            uid: "0000-older",
            file: "older",
        },
        Claimant {
            uid: "ffff-younger",
            file: "younger",
        },
    )?;
    route_via_node(&s, VIP)?;
    start(&mut s, mode)?;
    let target = SocketAddr::from(SocketAddrV4::new(VIP, SERVICE_PORT));
    let older_answers = |a: &Attempt| a.backend() == Some("pod2");
    for round in ["first start", "after a restart"] {
        if round != "first start" {
            let agent = s.agent()?;
            agent.stop()?;
            agent.restart()?;
        }
        // The running agent's own decision: its metrics say it synced and saw the conflict.
        let agent = s.agent()?;
        crate::wait::wait_until(
            &format!("{round}: the agent counts one frontend conflict"),
            crate::scenario::DATAPATH_TIMEOUT,
            Duration::from_millis(100),
            || {
                agent.metrics().is_ok_and(|metrics| {
                    metrics
                        .lines()
                        .any(|l| l == "kubeproxy_rs_frontend_conflicts 1")
                })
            },
        )?;
        let (attempts, counts) = from_outside(
            &mut s,
            target,
            &format!("[{mode}] contested {target}, {round}"),
            older_answers,
        )?;
        s.ensure(attempts.iter().all(older_answers), || {
            format!("{round}: only the older Service's pod may answer: {counts:?}")
        })?;
    }
    s.manifests.remove("older-svc.yaml")?;
    let younger_answers = |a: &Attempt| a.backend() == Some("pod1");
    let (attempts, counts) = from_outside(
        &mut s,
        target,
        &format!("[{mode}] {target} once the older Service is gone"),
        younger_answers,
    )?;
    s.ensure(attempts.iter().all(younger_answers), || {
        format!("the remaining Service takes the address: {counts:?}")
    })
}

/// Waits until the running agent has synced and counts `conflicts` frontend conflicts (its own
/// decision, whatever answers on the wire).
fn wait_for_conflicts(s: &mut Scenario, label: &str, conflicts: u32) -> Result<()> {
    let agent = s.agent()?;
    let line = format!("kubeproxy_rs_frontend_conflicts {conflicts}");
    crate::wait::wait_until(
        &format!("{label}: the agent counts {conflicts} frontend conflict(s)"),
        crate::scenario::DATAPATH_TIMEOUT,
        Duration::from_millis(100),
        || {
            agent
                .metrics()
                .is_ok_and(|metrics| metrics.lines().any(|l| l == line))
        },
    )
}

/// Whether the node's nat table still names `vip` (the iptables mode's rules for it).
fn iptables_names(s: &Scenario, vip: Ipv4Addr) -> Result<bool> {
    let nat = s.topo.node().exec("iptables-save", &["-t", "nat"])?;
    Ok(nat.contains(&format!("{vip}/32")))
}

/// [`contested_external_ip_stays_with_the_older_service`] across mode switches on one node:
/// the agent starts in iptables mode, is restarted in eBPF mode (twice: the second start adopts
/// the first's pinned maps) and then in iptables mode again. Everything that could sort the
/// claimants another way sorts the younger first — its namespace (`aaa` before
/// `kube-system`), its UID and its manifest file — so only the age keeps the address with the
/// older Service; its pod answers the contested address from outside after every switch, once
/// the mode switched to is the one that answers (the other mode's rules or programs gone).
/// When the older Service goes, the younger takes the address over.
pub fn contested_external_ip_stays_with_the_older_service_across_mode_switches() -> Result<()> {
    crate::require_root();
    let mut s = Scenario::new(2)?;
    write_contest(
        &s,
        Claimant {
            uid: "ffffffff-ffff-4fff-bfff-ffffffffffff",
            file: "z-older",
        },
        Claimant {
            uid: "00000000-0000-4000-8000-000000000000",
            file: "a-younger",
        },
    )?;
    route_via_node(&s, VIP)?;
    let target = SocketAddr::from(SocketAddrV4::new(VIP, SERVICE_PORT));
    let older_answers = |a: &Attempt| a.backend() == Some("pod2");
    let ebpf_args = ["--interfaces", "vext"];
    // Short, so that the eBPF mode's programs hand over to the iptables rules soon after the
    // switch back (they keep translating only flows they already carry).
    let iptables_args = ["--mode-switch-drain-period", "2s"];
    start_on(&mut s, "iptables", "vext", &iptables_args)?;
    // Restarts keep the agent's bpffs.
    let pin_dir = s
        .agent()?
        .bpf_root()
        .join(proxy_dataplane_ebpf::PIN_DIR_NAME);
    for phase in [
        "iptables, first start",
        "eBPF, after the switch from iptables",
        "eBPF, after a restart",
        "iptables, after the switch back",
    ] {
        if phase != "iptables, first start" {
            let agent = s.agent()?;
            agent.stop()?;
            if phase.starts_with("eBPF") {
                agent.restart_in_mode_with_args("ebpf", &ebpf_args)?;
            } else {
                agent.restart_in_mode_with_args("iptables", &iptables_args)?;
            }
        }
        wait_for_conflicts(&mut s, phase, 1)?;
        // The mode switched to answers alone: the other one's rules, or programs, are gone.
        let ebpf = phase.starts_with("eBPF");
        crate::wait::wait_until(
            &format!("{phase}: only this mode's datapath left"),
            crate::scenario::DATAPATH_TIMEOUT,
            Duration::from_millis(200),
            || {
                if ebpf {
                    iptables_names(&s, VIP).is_ok_and(|named| !named)
                } else {
                    !pin_dir.exists() && iptables_names(&s, VIP).is_ok_and(|named| named)
                }
            },
        )?;
        let (attempts, counts) = from_outside(
            &mut s,
            target,
            &format!("contested {target}, {phase}"),
            older_answers,
        )?;
        s.ensure(attempts.iter().all(older_answers), || {
            format!("{phase}: only the older Service's pod may answer: {counts:?}")
        })?;
    }
    s.manifests.remove("z-older-svc.yaml")?;
    wait_for_conflicts(&mut s, "the older Service gone", 0)?;
    let younger_answers = |a: &Attempt| a.backend() == Some("pod1");
    let (attempts, counts) = from_outside(
        &mut s,
        target,
        &format!("{target} once the older Service is gone"),
        younger_answers,
    )?;
    s.ensure(attempts.iter().all(younger_answers), || {
        format!("the remaining Service takes the address: {counts:?}")
    })
}

/// `loadBalancerSourceRanges`: a client inside the ranges reaches the LB VIP; after the ranges
/// change to exclude it, it gets nothing.
pub fn source_ranges_admit_only_listed_clients(mode: &str) -> Result<()> {
    let allowed = ServiceSpec {
        type_: "LoadBalancer",
        load_balancer_ip: Some(VIP),
        source_ranges: vec!["10.10.0.2/32"],
        ..ServiceSpec::default()
    };
    let mut s = setup(1, &allowed, &[pod_endpoint(1)])?;
    start(&mut s, mode)?;
    let target = SocketAddr::from(SocketAddrV4::new(VIP, SERVICE_PORT));
    let client = s.external_client().timeout(DROP_TIMEOUT);
    s.wait_for_datapath_with(&client, target, "allowed client reaches the pod", is_pod)?;
    let attempts = client.run(target, 5)?;
    eprintln!(
        "[{mode}] LB VIP, client inside the ranges: {:?}",
        tally(&attempts)
    );
    s.ensure(attempts.iter().all(is_pod), || {
        format!("allowed client: {attempts:?}")
    })?;

    let denied = ServiceSpec {
        source_ranges: vec!["10.99.0.0/24"],
        ..allowed
    };
    s.manifests
        .write("web-svc.yaml", &web_service_yaml(&denied))?;
    let dropped = |a: &Attempt| *a == Attempt::Err("TIMEOUT".into());
    s.wait_for_datapath_with(
        &client,
        target,
        "client outside the ranges dropped",
        dropped,
    )?;
    let attempts = client.run(target, 3)?;
    eprintln!(
        "[{mode}] LB VIP, client outside the ranges: {:?}",
        tally(&attempts)
    );
    s.ensure(attempts.iter().all(dropped), || {
        format!("denied client must get nothing: {attempts:?}")
    })
}

/// `sessionAffinity: ClientIP`: one client keeps its backend for many connections.
pub fn client_ip_affinity_keeps_the_backend(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        affinity_timeout: Some(60),
        ..ServiceSpec::default()
    };
    let mut s = setup(
        3,
        &spec,
        &[pod_endpoint(1), pod_endpoint(2), pod_endpoint(3)],
    )?;
    start(&mut s, mode)?;
    s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;
    let attempts = s.cgroup_client().run(cluster_addr(), CONNECTIONS)?;
    let counts = tally(&attempts);
    eprintln!("[{mode}] ClientIP affinity, {CONNECTIONS} connections: {counts:?}");
    s.ensure(counts.len() == 1 && attempts.iter().all(is_pod), || {
        format!("one backend must answer every connection: {counts:?}")
    })
}

/// Two nodes: a NodePort on this node (eTP Cluster) forwards to the only endpoint, a pod on the
/// second node; that pod sees this node's address (SNAT), so its reply comes back through here.
pub fn node_port_to_a_pod_on_another_node(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    let remote = Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(Topology::remote_pod_ip(1))
    };
    let mut s = setup(1, &spec, &[remote])?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    start(&mut s, mode)?;
    let is_remote = |a: &Attempt| a.backend() == Some("rpod1");
    let (attempts, counts) = from_outside(
        &mut s,
        node_port_addr(),
        &format!("[{mode}] NodePort on node A → pod on node B"),
        is_remote,
    )?;
    s.ensure(attempts.iter().all(is_remote), || {
        format!("every connection must reach rpod1 through node A: {counts:?}")
    })?;
    ensure_through_xdp(&mut s, mode, attempts.len())?;
    ensure_snat(&s, &attempts)
}

/// In [`EBPF_XDP`] mode, that XDP carried the flows to a pod on the second node: at least one
/// later client packet and one reply per connection (SYN-ACK, ACK, data, FIN) went through it.
fn ensure_through_xdp(s: &mut Scenario, mode: &str, connections: usize) -> Result<()> {
    if mode != EBPF_XDP {
        return Ok(());
    }
    let agent = s.agent()?;
    let forward = agent.datapath_counter(proxy_common::StatIndex::XdpEstablished)?;
    let replies = agent.datapath_counter(proxy_common::StatIndex::XdpReplyTranslated)?;
    let connections = connections as u64;
    s.ensure(forward >= connections && replies >= connections, || {
        format!(
            "XDP carried {forward} client packets and {replies} replies for {connections} \
             connections"
        )
    })
}

/// `sessionAffinity: ClientIP` for an external client: every connection through the NodePort
/// reaches the same backend.
pub fn node_port_client_ip_affinity(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "NodePort",
        affinity_timeout: Some(60),
        ..ServiceSpec::default()
    };
    let mut s = setup(
        3,
        &spec,
        &[pod_endpoint(1), pod_endpoint(2), pod_endpoint(3)],
    )?;
    start(&mut s, mode)?;
    let (attempts, counts) = from_outside(
        &mut s,
        node_port_addr(),
        &format!("[{mode}] NodePort with ClientIP affinity from outside"),
        is_pod,
    )?;
    s.ensure(counts.len() == 1 && attempts.iter().all(is_pod), || {
        format!("one backend must answer every connection of the client: {counts:?}")
    })
}

/// A client in `place` (the remote node or one of its pods) whose packets reach this node on
/// its second external link (`vnode2`), not on `vext`.
fn client_at(s: &Scenario, place: Place) -> Result<Client> {
    Ok(Client::new(s.topo.netns(place)?.path()))
}

/// TCP segments received so far in `place` (the backend's own kernel counter), once it has
/// stood still for 300 ms: the last FIN/ACK of a connection that just ended may still be on its
/// way, and must not be blamed on the next phase. Bounded: 10 reads.
fn received(s: &Scenario, place: Place) -> Result<u64> {
    let netns = s.topo.netns(place)?;
    let mut last = netns.tcp_segments_received()?;
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(300));
        let now = netns.tcp_segments_received()?;
        if now == last {
            break;
        }
        last = now;
    }
    Ok(last)
}

/// Runs `count` attempts from each client to `target` that must all get nothing (no answer from
/// anyone); prints the tallies, returns the attempts made.
fn expect_nothing(
    s: &Scenario,
    clients: &[(&str, &Client)],
    target: SocketAddr,
    count: u32,
    mode: &str,
) -> Result<u32> {
    let mut attempted = 0;
    for (who, client) in clients {
        let attempts = client.run(target, count)?;
        attempted += count;
        let counts = tally(&attempts);
        eprintln!("[{mode}] {who} → {target}: {count} attempted, {counts:?}");
        s.ensure(attempts.iter().all(|a| a.backend().is_none()), || {
            format!("{who} → {target} must get nothing: {counts:?}")
        })?;
    }
    Ok(attempted)
}

/// `loadBalancerSourceRanges` never leak, with upstream's scope (kube-proxy's KUBE-FW chain):
/// the ranges filter traffic to the LB IP only. Two nodes, the agent's node owns the LB IP and
/// has two external links (`vext` to the external client, `vnode2` to the second node). Clients
/// outside the ranges (the external client on `vext`, a pod behind the second node on `vnode2`,
/// a local pod whose connect() the eBPF socket hooks see) get nothing from the LB IP and the backend's kernel never receives a segment while they try;
/// the client inside the ranges (the second node itself, on `vnode2`) gets through, and so does
/// the external client on the NodePort and the ClusterIP, which upstream does not filter.
pub fn source_ranges_never_leak(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "LoadBalancer",
        load_balancer_ip: Some(VIP),
        source_ranges: vec!["10.20.0.2/32"],
        ..ServiceSpec::default()
    };
    let mut s = setup(2, &spec, &[pod_endpoint(1)])?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    route_via_node(&s, CLUSTER_IP)?;
    start_on(&mut s, mode, "vext,vnode2", &[])?;
    let lb = SocketAddr::from(SocketAddrV4::new(VIP, SERVICE_PORT));
    let inside = client_at(&s, Place::RemoteNode)?.timeout(DROP_TIMEOUT);
    s.wait_for_datapath_with(
        &inside,
        lb,
        "client inside the ranges reaches the pod",
        is_pod,
    )?;

    let outside_ext = s.external_client().timeout(DROP_TIMEOUT);
    let outside_rpod = client_at(&s, Place::RemotePod(1))?.timeout(DROP_TIMEOUT);
    // A local pod (in eBPF mode in the agent's cgroup: the socket hooks see its connect()).
    let outside_pod = s.pod_client(2)?.timeout(DROP_TIMEOUT);
    let before = received(&s, Place::Pod(1))?;
    let attempted = expect_nothing(
        &s,
        &[
            (
                "external client 10.10.0.2 (outside, via vext)",
                &outside_ext,
            ),
            (
                "rpod1 10.245.1.2 (outside, via node2 and vnode2)",
                &outside_rpod,
            ),
            ("local pod2 10.244.2.2 (outside, socket path)", &outside_pod),
        ],
        lb,
        5,
        mode,
    )?;
    let leaked = received(&s, Place::Pod(1))? - before;
    eprintln!(
        "[{mode}] LB IP from outside the ranges: {attempted} attempted, {leaked} TCP segments \
         reached the backend"
    );
    s.ensure(leaked == 0, || {
        format!("{leaked} segments from clients outside the ranges reached the backend")
    })?;
    // The node itself (10.10.0.1, outside the ranges): in eBPF mode the socket hook fails its
    // connect() at once where kube-proxy drops (EHOSTUNREACH), one drop counted per connect.
    if is_ebpf(mode) {
        let node_client = local_client(&s, mode, Place::Node)?.timeout(DROP_TIMEOUT);
        let counter = proxy_common::StatIndex::SockDroppedSourceRange;
        let before = s.agent()?.datapath_counter(counter)?;
        let attempts = node_client.run(lb, 3)?;
        let counted = s.agent()?.datapath_counter(counter)? - before;
        eprintln!(
            "[{mode}] LB IP from the node (outside the ranges): {:?}, {} {counted}",
            tally(&attempts),
            counter.name()
        );
        s.ensure(
            attempts
                .iter()
                .all(|a| *a == Attempt::Err("EHOSTUNREACH".into()))
                && counted == 3,
            || format!("3 connects from the node must fail, counted: {attempts:?}, {counted}"),
        )?;
    }

    let attempts = inside.run(lb, 10)?;
    let answered = received(&s, Place::Pod(1))? - before;
    eprintln!(
        "[{mode}] LB IP from node2 10.20.0.2 (inside, via vnode2): {:?}, backend received {answered} \
         segments",
        tally(&attempts)
    );
    s.ensure(attempts.iter().all(is_pod) && answered > 0, || {
        format!("the client inside the ranges must get through: {attempts:?}")
    })?;

    for (what, target) in [
        ("NodePort", node_port_addr()),
        ("ClusterIP", cluster_addr()),
    ] {
        let attempts = outside_ext.run(target, 5)?;
        eprintln!(
            "[{mode}] {what} {target} from the external client (not filtered, as upstream): {:?}",
            tally(&attempts)
        );
        s.ensure(attempts.iter().all(is_pod), || {
            format!("{what} is not subject to loadBalancerSourceRanges upstream: {attempts:?}")
        })?;
    }
    Ok(())
}

/// `externalTrafficPolicy: Local` never sends external traffic to a pod on another node. First
/// the only endpoint is remote (`rpod1` behind the second node): the NodePort and the LB IP,
/// reached on either external link, answer nothing and the remote pod's kernel receives not one
/// segment, while the ClusterIP (internal traffic, not subject to the policy) does reach it.
/// Then a local endpoint joins: external clients are answered by it alone, it sees their real
/// addresses, and the remote pod still receives nothing from them.
pub fn local_policy_never_reaches_a_remote_pod(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "LoadBalancer",
        external_traffic_policy_local: true,
        load_balancer_ip: Some(VIP),
        ..ServiceSpec::default()
    };
    let remote = Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(Topology::remote_pod_ip(1))
    };
    let mut s = setup(1, &spec, std::slice::from_ref(&remote))?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    start_on(&mut s, mode, "vext,vnode2", &[])?;
    let is_remote = |a: &Attempt| a.backend() == Some("rpod1");
    // In iptables mode every process of the node is translated; in eBPF mode the cgroup's.
    let internal = if is_ebpf(mode) {
        s.cgroup_client()
    } else {
        s.outside_client()
    };
    s.wait_for_datapath_with(
        &internal,
        cluster_addr(),
        "ClusterIP reaches rpod1",
        is_remote,
    )?;

    let ext = s.external_client().timeout(DROP_TIMEOUT);
    let node2 = client_at(&s, Place::RemoteNode)?.timeout(DROP_TIMEOUT);
    let lb = SocketAddr::from(SocketAddrV4::new(VIP, SERVICE_PORT));
    let node_port_b = SocketAddr::from(SocketAddrV4::new(Topology::node_link_ip(), NODE_PORT));
    let before = received(&s, Place::RemotePod(1))?;
    let mut attempted = 0;
    for target in [node_port_addr(), lb] {
        attempted += expect_nothing(&s, &[("external client (via vext)", &ext)], target, 3, mode)?;
    }
    for target in [node_port_b, lb] {
        attempted += expect_nothing(&s, &[("node2 (via vnode2)", &node2)], target, 3, mode)?;
    }
    let leaked = received(&s, Place::RemotePod(1))? - before;
    eprintln!(
        "[{mode}] eTP=Local, endpoint only on the other node: {attempted} external attempts, \
         {leaked} TCP segments reached rpod1"
    );
    s.ensure(leaked == 0, || {
        format!("{leaked} segments of external traffic reached the remote pod")
    })?;
    let attempts = internal.run(cluster_addr(), 5)?;
    let reached = received(&s, Place::RemotePod(1))? - before;
    eprintln!(
        "[{mode}] ClusterIP from the node: {:?}, rpod1 received {reached} segments",
        tally(&attempts)
    );
    s.ensure(attempts.iter().all(is_remote) && reached > 0, || {
        format!("the ClusterIP must still reach rpod1 (and its counter move): {attempts:?}")
    })?;

    s.manifests.write(
        "web-slice.yaml",
        &http_slice(NAMESPACE, "web-1", "web", &[pod_endpoint(1), remote]),
    )?;
    s.wait_for_datapath_with(&ext, node_port_addr(), "local pod answers", is_pod)?;
    let before = received(&s, Place::RemotePod(1))?;
    for (who, client, source, targets) in [
        (
            "external client",
            &ext,
            Topology::ext_ip(),
            [node_port_addr(), lb],
        ),
        (
            "node2",
            &node2,
            Topology::remote_node_ip(),
            [node_port_b, lb],
        ),
    ] {
        for target in targets {
            let attempts = client.run(target, 10)?;
            eprintln!(
                "[{mode}] eTP=Local with a local endpoint, {who} → {target}: {:?}",
                tally(&attempts)
            );
            for attempt in &attempts {
                let seen = match attempt {
                    Attempt::Ok {
                        backend, client, ..
                    } if backend == "pod1" => client.ip(),
                    other => {
                        return Err(s.agent_error(format!(
                            "{who} → {target}: only the local pod may answer: {other:?}"
                        )));
                    }
                };
                s.ensure(seen == std::net::IpAddr::from(source), || {
                    format!("{who} → {target}: pod1 saw {seen}, not the client {source}")
                })?;
            }
        }
    }
    let leaked = received(&s, Place::RemotePod(1))? - before;
    eprintln!("[{mode}] eTP=Local with a local endpoint: rpod1 received {leaked} TCP segments");
    s.ensure(leaked == 0, || {
        format!("{leaked} segments of external traffic reached the remote pod")
    })
}

/// Node name used by local endpoints (for callers building their own slices).
pub fn local_node() -> &'static str {
    HOSTNAME
}

/// Untranslated traffic marker, re-exported for the tests.
pub fn decoy() -> &'static str {
    DECOY_NAME
}

/// Wraps a scenario result so a failing scenario reports its name.
pub fn named(name: &str, result: Result<()>) -> Result<()> {
    result.map_err(|e| RigError::Other(format!("scenario {name}: {e}")))
}

/// Expands to one `#[test]` per scenario of the table, run with `--proxy-mode $mode`, so each
/// mode's test file is one line and the table cannot drift between modes.
/// The agent is SIGKILLed and restarted twice while clients keep going: new connections to
/// the ClusterIP (from a pod-like process) and to the NodePort (from outside), and one
/// established TCP stream to each. No attempt may fail, and each stream must stay the
/// connection it was (`#1`): the datapath lives in the kernel (pinned maps and programs, or
/// rules and conntrack), not in the agent.
pub fn agent_restarts_under_load_fail_nothing(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    let mut s = setup(2, &spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    start(&mut s, mode)?;
    let cluster_client = if is_ebpf(mode) {
        s.cgroup_client()
    } else {
        s.outside_client()
    };
    s.wait_for_datapath_with(
        &cluster_client,
        cluster_addr(),
        "ClusterIP answered",
        is_pod,
    )?;
    let outside = s.external_client();
    s.wait_for_datapath_with(&outside, node_port_addr(), "NodePort answered", is_pod)?;

    use crate::client::Mode;
    let loads = [
        (
            "ClusterIP connections",
            cluster_client.clone(),
            cluster_addr(),
            Mode::Connect,
            5,
            700,
        ),
        (
            "NodePort connections",
            outside.clone(),
            node_port_addr(),
            Mode::Connect,
            5,
            700,
        ),
        (
            "ClusterIP TCP stream",
            cluster_client,
            cluster_addr(),
            Mode::TcpStream,
            10,
            400,
        ),
        (
            "NodePort TCP stream",
            outside,
            node_port_addr(),
            Mode::TcpStream,
            10,
            400,
        ),
    ];
    let spawned = std::time::Instant::now();
    let threads: Vec<_> = loads
        .into_iter()
        .map(|(what, client, target, client_mode, interval_ms, count)| {
            let client = client
                .mode(client_mode)
                .interval(Duration::from_millis(interval_ms));
            (
                what,
                std::thread::spawn(move || client.run_timed(target, count)),
            )
        })
        .collect();
    // (killed, restarted) in ms since the clients were spawned.
    let mut outages = Vec::new();
    for _ in 0..2 {
        // Pacing: the load runs between the outages, and each outage (no agent for this long)
        // is what the connections must get through.
        std::thread::sleep(Duration::from_millis(800));
        s.agent()?.kill()?;
        let killed = spawned.elapsed().as_millis() as u64;
        std::thread::sleep(Duration::from_millis(600));
        s.agent()?.restart()?;
        outages.push((killed, spawned.elapsed().as_millis() as u64));
    }
    for (what, thread) in threads {
        let attempts = thread
            .join()
            .map_err(|_| RigError::Other(format!("{what}: client thread panicked")))??;
        let during = attempts
            .iter()
            .filter(|(_, at)| {
                outages
                    .iter()
                    .any(|(killed, restarted)| (*killed..restarted + 300).contains(at))
            })
            .count();
        let answers: Vec<Attempt> = attempts.into_iter().map(|(a, _)| a).collect();
        let counts = tally(&answers);
        let failed = answers.iter().filter(|a| !is_pod(a)).count();
        eprintln!(
            "[{mode}] {what}: {} attempts, {failed} failed, {during} while an agent was down \
             or starting; outages (killed, restarted) ms {outages:?}; answers {counts:?}",
            answers.len()
        );
        s.ensure(during > 0, || {
            format!("{what}: the load must overlap the outages")
        })?;
        s.ensure(failed == 0, || {
            format!("{what}: nothing may fail across agent restarts: {counts:?}")
        })?;
        if what.ends_with("stream") {
            s.ensure(
                answers
                    .iter()
                    .all(|a| a.backend().is_some_and(|b| b.ends_with("#1"))),
                || format!("{what}: the established connection must survive: {counts:?}"),
            )?;
        }
    }
    Ok(())
}

/// A rolling update: 10 established TCP streams through the NodePort (from outside) and 4 to
/// the ClusterIP (from the node), then pod2 starts terminating (`ready: false, serving: true,
/// terminating: true`) while pod1 stays ready. kube-proxy stops sending new connections to pod2
/// but leaves the established ones alone (it never flushes TCP conntrack), so every stream keeps
/// its connection (`#1`) and answers throughout, while new connections go to pod1 only.
pub fn rolling_update_drains_established_connections(mode: &str) -> Result<()> {
    use crate::client::Mode;
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    let mut s = setup(2, &spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    start(&mut s, mode)?;
    let node_client = local_client(&s, mode, Place::Node)?;
    s.wait_for_datapath_with(&node_client, cluster_addr(), "ClusterIP answered", is_pod)?;
    let outside = s.external_client();
    s.wait_for_datapath_with(&outside, node_port_addr(), "NodePort answered", is_pod)?;
    let streams: Vec<_> = (0..14)
        .map(|i| {
            let (client, target) = if i < 10 {
                (outside.clone(), node_port_addr())
            } else {
                (node_client.clone(), cluster_addr())
            };
            let client = client
                .mode(Mode::TcpStream)
                .interval(Duration::from_millis(100));
            std::thread::spawn(move || client.run(target, 30))
        })
        .collect();
    // Every stream connected before pod2 starts terminating.
    s.wait_for_tcp_streams(14)?;
    let terminating = Endpoint {
        ready: false,
        serving: true,
        terminating: true,
        ..pod_endpoint(2)
    };
    s.manifests.write(
        "web-slice.yaml",
        &http_slice(NAMESPACE, "web-1", "web", &[pod_endpoint(1), terminating]),
    )?;
    let only_pod1 = |a: &Attempt| a.backend() == Some("pod1");
    let fresh = s.wait_for_batch(
        &outside,
        node_port_addr(),
        8,
        "new connections avoid the terminating pod2",
        only_pod1,
    )?;
    let mut on_pod2 = 0;
    for (i, stream) in streams.into_iter().enumerate() {
        let attempts = stream
            .join()
            .map_err(|_| RigError::Other(format!("stream {i}: client thread panicked")))??;
        let counts = tally(&attempts);
        eprintln!("[{mode}] stream {i} across pod2's termination: {counts:?}");
        on_pod2 += usize::from(counts.keys().any(|k| k.starts_with("pod2")));
        s.ensure(
            counts.len() == 1
                && attempts
                    .iter()
                    .all(|a| a.backend().is_some_and(|b| b.ends_with("#1"))),
            || format!("stream {i} must keep its one connection: {counts:?}"),
        )?;
    }
    eprintln!(
        "[{mode}] {on_pod2} of 14 streams drained on the terminating pod2; new connections: {:?}",
        tally(&fresh)
    );
    s.ensure(on_pod2 > 0, || {
        "no stream ran on pod2: the test proves nothing".into()
    })?;
    s.ensure(fresh.iter().all(only_pod1), || {
        format!(
            "new connections must avoid the terminating pod: {:?}",
            tally(&fresh)
        )
    })
}

/// QUIC, RADIUS and DTLS clients send from one unconnected UDP socket with `sendto()`.
/// kube-proxy DNATs a UDP 5-tuple once, when its conntrack entry is created, so every datagram
/// of such a socket reaches the same backend while sockets spread over the backends; a backend
/// that joins later does not move it; when its backend leaves, kube-proxy deletes the stale UDP
/// conntrack entries and the socket's next datagram picks a live backend, which it then keeps.
pub fn unconnected_udp_sockets_keep_their_backend(mode: &str) -> Result<()> {
    use crate::{
        client::Mode,
        manifests::{Protocol, ServicePort, SlicePort, endpoint_slice_yaml, service_yaml},
    };
    crate::require_root();
    let mut s = Scenario::new(3)?;
    let slice = |pods: &[usize]| {
        let endpoints: Vec<Endpoint> = pods.iter().map(|&i| pod_endpoint(i)).collect();
        let port = SlicePort {
            name: "dns".into(),
            port: BACKEND_PORT,
            protocol: Protocol::Udp,
        };
        endpoint_slice_yaml(NAMESPACE, "dns-1", "dns", &[port], &endpoints)
    };
    let port = ServicePort {
        name: "dns".into(),
        port: 53,
        protocol: Protocol::Udp,
    };
    s.manifests.write(
        "dns-svc.yaml",
        &service_yaml(NAMESPACE, "dns", CLUSTER_IP, &[port]),
    )?;
    s.manifests.write("dns-slice.yaml", &slice(&[1, 2, 3]))?;
    start(&mut s, mode)?;
    let target = SocketAddr::from(SocketAddrV4::new(CLUSTER_IP, 53));
    let client = local_client(&s, mode, Place::Pod(1))?.mode(Mode::SendtoSocket);
    s.wait_for_datapath_with(&client, target, "UDP ClusterIP answered", is_pod)?;
    let mut chosen = std::collections::BTreeSet::new();
    for socket in 0..8 {
        let attempts = client.run(target, 6)?;
        let counts = tally(&attempts);
        eprintln!("[{mode}] unconnected UDP socket {socket}: {counts:?}");
        s.ensure(counts.len() == 1 && attempts.iter().all(is_pod), || {
            format!("socket {socket}: every datagram must reach one backend: {counts:?}")
        })?;
        chosen.extend(counts.into_keys());
    }
    s.ensure(chosen.len() > 1, || {
        format!("8 sockets must spread over the backends: {chosen:?}")
    })?;

    // One socket across a scale-up and the removal of its backend.
    s.manifests.write("dns-slice.yaml", &slice(&[1]))?;
    let only_pod1 = |a: &Attempt| a.backend() == Some("pod1");
    let fresh = local_client(&s, mode, Place::Pod(1))?.mode(Mode::Sendto);
    s.wait_for_batch(&fresh, target, 8, "pod1 alone", only_pod1)?;
    let runner = client.clone().interval(Duration::from_millis(100));
    let long = std::thread::spawn(move || runner.run(target, 80));
    // Pacing: the socket's history on pod1 (at least 20 answers, checked below) spans the
    // scale-up.
    std::thread::sleep(Duration::from_millis(2000));
    s.manifests.write("dns-slice.yaml", &slice(&[1, 2, 3]))?;
    let scaled_up = std::time::Instant::now();
    // The socket stays on pod1 while pod2 and pod3 are programmed: a new socket reaches them.
    let joined = |a: &Attempt| matches!(a.backend(), Some("pod2" | "pod3"));
    let newcomer = local_client(&s, mode, Place::Pod(1))?.mode(Mode::Sendto);
    s.wait_for_datapath_with(&newcomer, target, "pod2 or pod3 joined", joined)?;
    // Pacing, as above: the history on pod1 goes on for a while after the scale-up.
    std::thread::sleep(Duration::from_millis(3000).saturating_sub(scaled_up.elapsed()));
    s.manifests.write("dns-slice.yaml", &slice(&[2, 3]))?;
    let attempts = long
        .join()
        .map_err(|_| RigError::Other("UDP client thread panicked".into()))??;
    let names: Vec<String> = attempts.iter().map(Attempt::label).collect();
    eprintln!(
        "[{mode}] one unconnected socket across pod2/pod3 joining and pod1 leaving: {names:?}"
    );
    let first_other = names
        .iter()
        .position(|n| n != "pod1")
        .unwrap_or(names.len());
    let (before, after) = names.split_at(first_other);
    s.ensure(
        before.len() >= 20
            && !after.is_empty()
            && (after[0] == "pod2" || after[0] == "pod3")
            && after.iter().all(|n| *n == after[0]),
        || {
            format!(
                "the socket must stay on pod1 until it leaves (also while pod2/pod3 join), then \
                 keep one live backend: {names:?}"
            )
        },
    )
}

/// A long-lived unconnected UDP socket (a statsd or syslog sender, one source port for ever)
/// of a pod sends to a Service's ClusterIP while the Service is deleted and, a little later,
/// another Service is created with the same ClusterIP and port (the address reused). Its
/// datagrams stop reaching the deleted Service's backend once the deletion is programmed —
/// kube-proxy 1.37 deletes a deleted UDP Service's conntrack entries, which each datagram
/// would otherwise keep alive, steering the flow to the old backend's address for as long as
/// the sender sends — and reach the new owner's backend once it is programmed.
pub fn a_udp_sender_leaves_a_deleted_service_and_follows_its_reused_address(
    mode: &str,
) -> Result<()> {
    use crate::{
        client::Mode,
        manifests::{Protocol, ServicePort, SlicePort, endpoint_slice_yaml, service_yaml},
    };
    crate::require_root();
    let mut s = Scenario::new(2)?;
    let write = |s: &Scenario, name: &str, pod: usize| -> Result<()> {
        let slice_port = SlicePort {
            name: "dns".into(),
            port: BACKEND_PORT,
            protocol: Protocol::Udp,
        };
        let port = ServicePort {
            name: "dns".into(),
            port: 53,
            protocol: Protocol::Udp,
        };
        s.manifests.write(
            &format!("{name}-slice.yaml"),
            &endpoint_slice_yaml(
                NAMESPACE,
                &format!("{name}-1"),
                name,
                &[slice_port],
                &[pod_endpoint(pod)],
            ),
        )?;
        s.manifests.write(
            &format!("{name}-svc.yaml"),
            &service_yaml(NAMESPACE, name, CLUSTER_IP, &[port]),
        )
    };
    write(&s, "statsd", 1)?;
    start(&mut s, mode)?;
    let target = SocketAddr::from(SocketAddrV4::new(CLUSTER_IP, 53));
    let client = local_client(&s, mode, Place::Pod(2))?
        .mode(Mode::SendtoSocket)
        .timeout(Duration::from_millis(300));
    s.wait_for_datapath_with(&client, target, "UDP ClusterIP answered by pod1", |a| {
        a.backend() == Some("pod1")
    })?;
    let runner = client.clone().interval(Duration::from_millis(100));
    let sender = std::thread::spawn(move || runner.run(target, 60));
    // Pacing: the socket's flow through pod1 is established before the deletion.
    std::thread::sleep(Duration::from_millis(1500));
    s.manifests.remove("statsd-svc.yaml")?;
    s.manifests.remove("statsd-slice.yaml")?;
    let fresh = local_client(&s, mode, Place::Pod(2))?
        .mode(Mode::Sendto)
        .timeout(Duration::from_millis(300));
    s.wait_for_datapath_with(&fresh, target, "the deleted Service unanswered", |a| {
        !is_pod(a)
    })?;
    // Pacing: the address stays unowned for a while (the flow must show the gap).
    std::thread::sleep(Duration::from_millis(2000));
    write(&s, "metrics", 2)?;
    let attempts = sender
        .join()
        .map_err(|_| RigError::Other("UDP sender thread panicked".into()))??;
    let names: Vec<String> = attempts.iter().map(Attempt::label).collect();
    eprintln!("[{mode}] one unconnected socket across the deletion and the reuse: {names:?}");
    let first_gap = names
        .iter()
        .position(|n| n != "pod1")
        .unwrap_or(names.len());
    let (before, after) = names.split_at(first_gap);
    let gap = after.iter().take_while(|n| !n.starts_with("pod")).count();
    s.ensure(
        before.len() >= 5
            && gap >= 3
            && after.iter().all(|n| n != "pod1")
            && after.last().is_some_and(|n| n == "pod2"),
        || {
            format!(
                "the socket must reach pod1, then no pod while the address is unowned (not \
                 the deleted Service's backend), then pod2: {names:?}"
            )
        },
    )
}

/// Java and .NET open dual-stack AF_INET6 sockets and dial IPv4 Services as IPv4-mapped IPv6
/// addresses (`::ffff:10.96.0.10`): the kernel sends IPv4 packets, so kube-proxy's IPv4 rules
/// translate them. Every connection from the node and from a pod reaches a pod, and
/// getpeername() shows the mapped Service address that was dialled.
pub fn ipv4_mapped_ipv6_clients_reach_ipv4_services(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    let mut s = setup(2, &spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    start(&mut s, mode)?;
    let mapped =
        |ip: Ipv4Addr, port: u16| SocketAddr::new(std::net::IpAddr::V6(ip.to_ipv6_mapped()), port);
    let targets = [
        mapped(crate::scenario::CLUSTER_IP, SERVICE_PORT),
        mapped(Topology::node_ext_ip(), NODE_PORT),
    ];
    let node_client = local_client(&s, mode, Place::Node)?;
    s.wait_for_datapath_with(&node_client, targets[0], "mapped ClusterIP", is_pod)?;
    for (who, place) in [("node", Place::Node), ("pod2", Place::Pod(2))] {
        let client = local_client(&s, mode, place)?;
        for target in targets {
            let attempts = client.run(target, 10)?;
            let counts = tally(&attempts);
            eprintln!("[{mode}] {who} → {target} (AF_INET6, IPv4-mapped): {counts:?}");
            s.ensure(attempts.iter().all(is_pod), || {
                format!("{who} → {target}: every connection must reach a pod: {counts:?}")
            })?;
            for attempt in &attempts {
                if let Attempt::Ok { peer, .. } = attempt {
                    s.ensure(*peer == target, || {
                        format!("{who}: getpeername() shows {peer}, not the dialled {target}")
                    })?;
                }
            }
        }
    }
    Ok(())
}

/// The node's own clients and its pods, the way each mode translates them: in eBPF mode
/// processes in the agent's cgroup (the socket hooks), in iptables mode any process.
fn local_client(s: &Scenario, mode: &str, place: Place) -> Result<Client> {
    let netns = s.topo.netns(place)?.path();
    Ok(if is_ebpf(mode) {
        Client::new(netns).in_cgroup(s.cgroup.path())
    } else {
        Client::new(netns)
    })
}

/// Whether `addr` belongs to the node namespace (a masqueraded or node-chosen source).
fn is_node_address(addr: std::net::IpAddr) -> bool {
    [
        std::net::IpAddr::from(Topology::node_ext_ip()),
        Topology::node_link_ip().into(),
    ]
    .contains(&addr)
        || (1..=3).any(|i| addr == std::net::IpAddr::from(Topology::pod_gateway(i)))
}

/// A NodePort reached from the node itself (a node address, another node address, 127.0.0.1)
/// and from one of its pods, with `externalTrafficPolicy: Local` and endpoints on both nodes:
/// kube-proxy's final `KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS` rule
/// (from OUTPUT and PREROUTING) catches them, and KUBE-EXT short-circuits the node's own traffic
/// ("route LOCAL traffic", masqueraded) and its pods' ("pod traffic", with the local-traffic
/// detector, not masqueraded) to KUBE-SVC: every endpoint answers, the local one and the one on
/// the other node, while from outside only the local one would.
pub fn node_port_from_the_node_and_its_pods(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "NodePort",
        external_traffic_policy_local: true,
        ..ServiceSpec::default()
    };
    let remote = Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(Topology::remote_pod_ip(1))
    };
    let mut s = setup(2, &spec, &[pod_endpoint(1), remote])?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    // The pod-traffic short-circuit needs kube-proxy's local-traffic detector.
    start_on(
        &mut s,
        mode,
        "vext,vnode2",
        &["--cluster-cidr", "10.244.0.0/16"],
    )?;
    let node_client = local_client(&s, mode, Place::Node)?;
    let pod_client = local_client(&s, mode, Place::Pod(2))?;
    let answered = |a: &Attempt| matches!(a.backend(), Some("pod1" | "rpod1"));
    s.wait_for_datapath_with(
        &node_client,
        node_port_addr(),
        "NodePort from the node",
        answered,
    )?;
    let link = SocketAddr::from(SocketAddrV4::new(Topology::node_link_ip(), NODE_PORT));
    let localhost = SocketAddr::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, NODE_PORT));
    let cases = [
        ("node", &node_client, node_port_addr()),
        ("node", &node_client, link),
        ("node", &node_client, localhost),
        ("pod2", &pod_client, node_port_addr()),
        ("pod2", &pod_client, link),
    ];
    for (who, client, target) in cases {
        let attempts = client.run(target, 20)?;
        let counts = tally(&attempts);
        eprintln!("[{mode}] {who} → NodePort {target} (eTP=Local): {counts:?}");
        s.ensure(attempts.iter().all(answered) && counts.len() == 2, || {
            format!("{who} → {target}: pod1 and rpod1 must both answer, nothing else: {counts:?}")
        })?;
        for attempt in &attempts {
            if let Attempt::Ok {
                client: seen,
                backend,
                ..
            } = attempt
            {
                let expected = if who == "node" {
                    is_node_address(seen.ip())
                } else {
                    seen.ip() == std::net::IpAddr::from(Topology::pod_ip(2))
                };
                s.ensure(expected, || {
                    format!(
                        "{who} → {target}: {backend} saw {seen}: the node's traffic comes \
                             from a node address, a pod's keeps the pod address"
                    )
                })?;
            }
        }
    }
    Ok(())
}

/// An LB IP guarded by `loadBalancerSourceRanges`, dialled from the node and its pods (the
/// node has a default route towards the outside, as real nodes do). kube-proxy's KUBE-FW chain
/// judges the packets' source: the node (its address on the way out, 10.10.0.1, is in the
/// ranges) and pod2 (in the ranges) reach the backend, masqueraded (KUBE-EXT, eTP Cluster);
/// pod3, outside the ranges, gets nothing (KUBE-PROXY-FIREWALL DROP).
pub fn guarded_load_balancer_ip_from_local_clients(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        type_: "LoadBalancer",
        load_balancer_ip: Some(VIP),
        source_ranges: vec!["10.10.0.1/32", "10.244.2.0/24"],
        ..ServiceSpec::default()
    };
    let mut s = setup(3, &spec, &[pod_endpoint(1)])?;
    s.topo.node().ip(&[
        "route",
        "add",
        "default",
        "via",
        &Topology::ext_ip().to_string(),
    ])?;
    start(&mut s, mode)?;
    let lb = SocketAddr::from(SocketAddrV4::new(VIP, SERVICE_PORT));
    let node_client = local_client(&s, mode, Place::Node)?.timeout(DROP_TIMEOUT);
    s.wait_for_datapath_with(&node_client, lb, "the node reaches the LB IP", is_pod)?;
    for (who, place) in [("node", Place::Node), ("pod2", Place::Pod(2))] {
        let client = local_client(&s, mode, place)?.timeout(DROP_TIMEOUT);
        let attempts = client.run(lb, 8)?;
        let counts = tally(&attempts);
        eprintln!("[{mode}] {who} (inside the ranges) → guarded LB IP: {counts:?}");
        s.ensure(attempts.iter().all(is_pod), || {
            format!("{who} is inside the ranges and must reach pod1: {counts:?}")
        })?;
        for attempt in &attempts {
            if let Attempt::Ok { client: seen, .. } = attempt {
                s.ensure(is_node_address(seen.ip()), || {
                    format!("{who} → LB IP (eTP Cluster) must be masqueraded, pod1 saw {seen}")
                })?;
            }
        }
    }
    let outside = local_client(&s, mode, Place::Pod(3))?.timeout(DROP_TIMEOUT);
    let attempts = outside.run(lb, 3)?;
    let counts = tally(&attempts);
    eprintln!("[{mode}] pod3 (outside the ranges) → guarded LB IP: {counts:?}");
    s.ensure(
        attempts
            .iter()
            .all(|a| *a == Attempt::Err("TIMEOUT".into())),
        || format!("pod3 is outside the ranges and must be dropped: {counts:?}"),
    )
}

/// `internalTrafficPolicy: Local` with the only endpoint on another node: kube-proxy DROPs the
/// node's and its pods' ClusterIP traffic (`"has no local endpoints" -j DROP`, filter
/// KUBE-SERVICES from OUTPUT and FORWARD): the client times out. The eBPF socket hooks cannot
/// drop a packet that does not exist yet; they fail the connect at once with EHOSTUNREACH
/// (a documented difference: the same "unreachable", minutes earlier).
pub fn internal_policy_local_without_local_endpoints(mode: &str) -> Result<()> {
    let spec = ServiceSpec {
        internal_traffic_policy_local: true,
        ..ServiceSpec::default()
    };
    let remote = Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(Topology::pod_ip(1))
    };
    let mut s = setup(2, &spec, &[remote])?;
    // As on a real node: the ClusterIP is no local address (the rig's decoy would answer a
    // pod's packet from INPUT, which kube-proxy's DROP in FORWARD never sees), and packets to
    // it would follow the default route out.
    s.topo
        .node()
        .ip(&["addr", "del", &format!("{CLUSTER_IP}/32"), "dev", "lo"])?;
    s.topo.node().ip(&[
        "route",
        "add",
        "default",
        "via",
        &Topology::ext_ip().to_string(),
    ])?;
    start(&mut s, mode)?;
    let expected = if is_ebpf(mode) {
        "EHOSTUNREACH"
    } else {
        "TIMEOUT"
    };
    let failed = |a: &Attempt| *a == Attempt::Err(expected.into());
    let node_client = local_client(&s, mode, Place::Node)?.timeout(DROP_TIMEOUT);
    s.wait_for_datapath_with(&node_client, cluster_addr(), "ClusterIP dropped", failed)?;
    let dropped = |s: &mut Scenario| -> Result<u64> {
        if is_ebpf(mode) {
            s.agent()?
                .datapath_counter(proxy_common::StatIndex::SockDroppedNoLocal)
        } else {
            Ok(0)
        }
    };
    let dropped_before = dropped(&mut s)?;
    for (who, place) in [("node", Place::Node), ("pod2", Place::Pod(2))] {
        let client = local_client(&s, mode, place)?.timeout(DROP_TIMEOUT);
        let attempts = client.run(cluster_addr(), 3)?;
        let counts = tally(&attempts);
        eprintln!("[{mode}] {who} → ClusterIP, iTP=Local without local endpoints: {counts:?}");
        s.ensure(attempts.iter().all(failed), || {
            format!("{who}: expected {expected} on every attempt: {counts:?}")
        })?;
    }
    // In eBPF mode each failed connect is one drop, counted by its reason.
    if is_ebpf(mode) {
        let counted = dropped(&mut s)? - dropped_before;
        s.ensure(counted == 6, || {
            format!("6 connects failed, sock_dropped_no_local_endpoints counted {counted}")
        })?;
    }
    Ok(())
}

/// The dual-stack LoadBalancer Service `default/web` of [`host_network_backends`]: TCP 80 and
/// UDP 53 → 8080 (NodePorts 30080 and 30053), an externalIP and an LB IP per family.
fn host_network_service(policy: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: {NAMESPACE}}}\nspec:\n  \
         type: LoadBalancer\n  clusterIP: \"{CLUSTER_IP}\"\n  clusterIPs: [\"{CLUSTER_IP}\", \
         \"{}\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  \
         externalTrafficPolicy: {policy}\n  externalIPs: [\"{VIP}\", \"{VIP6}\"]\n  ports:\n  - \
         {{name: {PORT_NAME}, port: {SERVICE_PORT}, targetPort: {BACKEND_PORT}, protocol: TCP, \
         nodePort: {NODE_PORT}}}\n  - {{name: dns, port: 53, targetPort: {BACKEND_PORT}, \
         protocol: UDP, nodePort: {UDP_NODE_PORT}}}\nstatus:\n  loadBalancer:\n    ingress: \
         [{{ip: \"{HOST_LB}\"}}, {{ip: \"{HOST_LB6}\"}}]\n",
        crate::scenario::CLUSTER_IP6
    )
}

/// An IPv6 externalIP routed to the node by the external client.
const VIP6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0xfd00, 0x192, 0, 0, 0, 0, 0, 0x10);
/// The LB IPs of [`host_network_backends`].
const HOST_LB: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 20);
const HOST_LB6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0xfd00, 0x198, 0, 0, 0, 0, 0, 0x20);
const UDP_NODE_PORT: u16 = 30053;

/// Host-network backends (ingress controllers, DNS caches with `hostNetwork: true`): the
/// endpoints of a dual-stack LoadBalancer Service are a server listening in the node namespace
/// on the node's own address (`hostnet`) and one in the second node's namespace on that node's
/// address (`node2`). kube-proxy DNATs the external client's packet to the node address and
/// the host delivers it locally (INPUT: POSTROUTING's MASQUERADE never sees it, so the server
/// sees the client even with eTP Cluster); netfilter's conntrack translates the reply back on
/// its way out. With eTP Cluster both servers answer (the second node's masqueraded) on the
/// NodePort, the externalIP and the LB IP of both families over TCP, and on the NodePort over
/// UDP; with eTP Local only this node's. The client's connection is to the frontend it
/// dialled, and its UDP replies come from there (`recvfrom`).
pub fn host_network_backends(mode: &str) -> Result<()> {
    use std::net::IpAddr;

    use crate::{
        client::{Mode, Proto},
        manifests::endpoint_slice_yaml,
        scenario::http_and_dns_slice_ports,
    };
    crate::require_root();
    let mut s = Scenario::with_families(1, true)?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    let local: [IpAddr; 2] = [
        Topology::node_ext_ip().into(),
        Topology::node_ext_ip6().into(),
    ];
    let remote: [IpAddr; 2] = [
        Topology::remote_node_ip().into(),
        Topology::remote_node_ip6().into(),
    ];
    for ip in local {
        s.topo
            .start_echo(Place::Node, "hostnet", SocketAddr::new(ip, BACKEND_PORT))?;
    }
    for ip in remote {
        s.topo.start_echo(
            Place::RemoteNode,
            "node2",
            SocketAddr::new(ip, BACKEND_PORT),
        )?;
    }
    for (vip, via) in [
        (IpAddr::from(VIP), IpAddr::from(Topology::node_ext_ip())),
        (HOST_LB.into(), Topology::node_ext_ip().into()),
        (VIP6.into(), Topology::node_ext_ip6().into()),
        (HOST_LB6.into(), Topology::node_ext_ip6().into()),
    ] {
        s.topo
            .ext()
            .ip(&["route", "add", &vip.to_string(), "via", &via.to_string()])?;
    }
    let ports = http_and_dns_slice_ports();
    for (family, slice) in [(0, "web-4"), (1, "web-6")] {
        let endpoints = [
            Endpoint {
                node_name: Some(HOSTNAME.into()),
                ..Endpoint::ready(local[family])
            },
            Endpoint {
                node_name: Some("other-node".into()),
                ..Endpoint::ready(remote[family])
            },
        ];
        s.manifests.write(
            &format!("{slice}.yaml"),
            &endpoint_slice_yaml(NAMESPACE, slice, "web", &ports, &endpoints),
        )?;
    }
    s.manifests
        .write("web-svc.yaml", &host_network_service("Cluster"))?;
    start(&mut s, mode)?;
    let mut targets = Vec::new();
    for (proto, node_port, port) in [
        (Proto::Tcp, NODE_PORT, SERVICE_PORT),
        (Proto::Udp, UDP_NODE_PORT, 53),
    ] {
        for family in [0, 1] {
            let vips: [IpAddr; 2] = if family == 0 {
                [VIP.into(), HOST_LB.into()]
            } else {
                [VIP6.into(), HOST_LB6.into()]
            };
            targets.push((proto, SocketAddr::new(local[family], node_port)));
            // UDP to the NodePort only: every attempt is a new socket on a random port, and
            // one reused for another frontend of the same backend while the first flow lives
            // is dropped in eBPF mode (no SNAT: the reply entries clash, `tc_ct_reply_clash`;
            // netfilter remaps the source port). TCP flows end, which frees their tuple.
            if proto == Proto::Tcp {
                targets.extend(vips.map(|vip| (proto, SocketAddr::new(vip, port))));
            }
        }
    }
    // Each policy's wait and its measured run use source ports of their own. A tuple that an
    // earlier flow left in conntrack (UDP keeps it 30 s) goes on to that flow's backend, `node2`
    // included, as upstream does: its stale-flow cleanup only removes flows to endpoints that
    // stopped serving, and `node2` still serves cluster traffic. Targets differ by destination,
    // so they share a range.
    let port_ranges = [
        ["20000 26999", "27000 33999"],
        ["34000 40999", "41000 47999"],
    ];
    for (policy, [wait_ports, run_ports]) in ["Cluster", "Local"].into_iter().zip(port_ranges) {
        s.manifests
            .write("web-svc.yaml", &host_network_service(policy))?;
        let allowed: &[&str] = if policy == "Local" {
            &["hostnet"]
        } else {
            &["hostnet", "node2"]
        };
        let answered = |a: &Attempt| a.backend().is_some_and(|b| allowed.contains(&b));
        for &(proto, target) in &targets {
            let client_ip: IpAddr = if target.is_ipv6() {
                Topology::ext_ip6().into()
            } else {
                Topology::ext_ip().into()
            };
            let client = match proto {
                Proto::Tcp => s.external_client(),
                Proto::Udp => s.external_client().proto(proto).mode(Mode::Sendto),
            };
            let label =
                format!("[{mode}] eTP {policy}: {proto:?} {target} → host-network backends");
            // Under eTP Local a batch of 4 all answered by `hostnet` is also what the Cluster
            // policy gives 1 time in 16 before the change is applied: 16 in a row (1 in 65 536)
            // tell the new policy apart.
            let batch = if policy == "Local" { 16 } else { 4 };
            s.topo
                .ext()
                .sysctl("net.ipv4.ip_local_port_range", wait_ports)?;
            s.wait_for_batch(&client, target, batch, &label, answered)?;
            s.topo
                .ext()
                .sysctl("net.ipv4.ip_local_port_range", run_ports)?;
            let attempts = client.run(target, CONNECTIONS)?;
            let counts = tally(&attempts);
            eprintln!("{label}: {counts:?}");
            s.ensure(
                attempts.iter().all(answered) && counts.len() == allowed.len(),
                || format!("{label}: {allowed:?} must answer every attempt: {counts:?}"),
            )?;
            for attempt in &attempts {
                let Attempt::Ok {
                    backend,
                    client: seen,
                    peer,
                } = attempt
                else {
                    continue;
                };
                s.ensure(*peer == target, || {
                    format!("{label}: the client's peer is {peer}, not the dialled {target}")
                })?;
                let local_server = backend == "hostnet";
                s.ensure((seen.ip() == client_ip) == local_server, || {
                    format!(
                        "{label}: {backend} saw {seen}: the node's own server sees the client \
                         (local delivery is never masqueraded), the other node's the node"
                    )
                })?;
            }
        }
    }
    Ok(())
}

#[macro_export]
macro_rules! service_scenario_tests {
    ($mode:literal: $($scenario:ident),+ $(,)?) => {
        $(
            #[test]
            fn $scenario() -> anyhow::Result<()> {
                $crate::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
                Ok($crate::service_scenarios::$scenario($mode)?)
            }
        )+
    };
    ($mode:literal) => {
        $crate::service_scenario_tests!($mode:
            node_port_cluster_policy,
            node_port_local_policy_preserves_the_client,
            node_port_local_policy_without_local_endpoints_drops,
            node_port_without_endpoints_is_refused,
            external_ip_and_load_balancer_ip_reach_pods,
            unusable_load_balancer_ips_never_capture_node_ports,
            contested_external_ip_stays_with_the_older_service,
            source_ranges_admit_only_listed_clients,
            node_port_to_a_pod_on_another_node,
            client_ip_affinity_keeps_the_backend,
            node_port_client_ip_affinity,
            source_ranges_never_leak,
            local_policy_never_reaches_a_remote_pod,
            agent_restarts_under_load_fail_nothing,
            node_port_from_the_node_and_its_pods,
            guarded_load_balancer_ip_from_local_clients,
            internal_policy_local_without_local_endpoints,
            ipv4_mapped_ipv6_clients_reach_ipv4_services,
            rolling_update_drains_established_connections,
            unconnected_udp_sockets_keep_their_backend,
            host_network_backends,
        );
    };
}
