//! The tc programs under `BPF_PROG_TEST_RUN`: the real object is loaded (pins in a private
//! bpffs), Services are programmed through the real `EbpfDataplane` (snapshot → `MapWriter` →
//! maps), crafted frames go through `kpr_tc_external` / `kpr_tc_reply`, and the test checks the
//! action, every byte that matters and every checksum (recomputed here from scratch) of what
//! the program returns, plus the conntrack entries it wrote. Needs root.
//!
//! What test_run can check: parsing, frontend lookup, source ranges, backend choice, DNAT/SNAT
//! and the checksum updates (the skb is `CHECKSUM_NONE`, so the L4 checksums must be complete),
//! conntrack writes and reverse translation, the ICMP reject packet, and the action. What it
//! cannot: a redirect is only the return value (`TC_ACT_REDIRECT`), the packet is not sent,
//! so the egress interface and next-hop MAC that `bpf_redirect_neigh` would choose are not
//! observable; `CHECKSUM_PARTIAL` skbs (local veth traffic) do not occur. The fib lookup does
//! run, in the test's namespace, so its route (and forwarding) must exist there. The real-packet
//! tests (`external_tc.rs`) cover the rest.
#![expect(
    clippy::expect_used,
    reason = "test setup: a failed expectation is a failed test"
)]

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    ops::RangeInclusive,
    path::PathBuf,
};

use aya::maps::{HashMap as AyaHashMap, Map, MapData};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_agent::{
    dataplane::ebpf::{
        ConntrackMaps, EbpfDataplane, EbpfOptions, Feature, LbOptions, PIN_DIR_NAME, TcOptions,
        TcTestInput, reserved_ports,
    },
    desired::Snapshot,
    objects::{ObjectKey, Objects, ServiceInfo},
};
use proxy_common::{
    CtKey, CtKey4, CtValue, CtValue4, NodeAddrKey, StatIndex, TRANSLATED_MARK, ct_flags, family,
    map_names, program_names, proto,
};
use proxy_tests::{
    in_process::{InProcess, on_netns_thread},
    netns::Netns,
    packet::{
        L4, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP, Parsed, TC_ACT_OK, TC_ACT_REDIRECT,
        TC_ACT_SHOT, TC_ACT_UNSPEC, XDP_DROP, XDP_PASS, XDP_REDIRECT, build, crc32c, fragment,
        icmp_error, inet_checksum, l4_checksum, parse_checked, parse_fragment, quoted_packet,
        reassemble,
    },
};

const NODE: &str = "node";
const CLIENT: &str = "10.10.0.2";
const CLIENT6: &str = "fd00:10::2";
const NODE_IP: &str = "10.10.0.1";
const NODE_IP6: &str = "fd00:10::1";
const BACKEND: &str = "10.244.1.2";
const BACKEND6: &str = "fd00:244:1::2";
const LB_IP: &str = "198.51.100.10";
/// `--bpf-snat-port-range`'s default.
const SNAT_PORTS: RangeInclusive<u16> = reserved_ports::DEFAULT_RANGE;

/// The node namespace: `ext0` (external, 10.10.0.1 + fd00:10::1) and `pod0` (10.244.1.1 +
/// fd00:244:1::1, the pod side), each one end of a veth pair, forwarding on, and the agent's
/// dataplane loaded with its pins in a private bpffs.
struct Node {
    // Drop order: the dataplane's fds, then the bpffs (pins), cgroup and namespace.
    dataplane: EbpfDataplane,
    ext0: u32,
    pod0: u32,
    parts: InProcess,
    /// The node namespace (for helper processes).
    netns: PathBuf,
}

fn ifindex(name: &str) -> u32 {
    nix::net::if_::if_nametoindex(name).expect("ifindex")
}

/// Runs `f` on a thread inside a fresh node namespace (namespaces are per thread; the test_run
/// and the fib lookup it makes use the caller's namespace).
/// The node takes the redirect fast path (`--tc-fast-path`): these tests check the full
/// translation and `TC_ACT_REDIRECT` from one program; [`with_netfilter_node`] the default.
fn with_node(f: impl FnOnce(&mut Node) + Send + 'static) {
    with_node_lb(LbOptions::default(), f);
}

/// [`with_node`] on the default netfilter path: ingress rewrites destinations and returns
/// packets to the stack, `kpr_tc_egress` rewrites sources.
fn with_netfilter_node(f: impl FnOnce(&mut Node) + Send + 'static) {
    with_node_path(LbOptions::default(), false, None, SNAT_PORTS, f);
}

/// [`with_node`] with the given `--lb-algorithm` options; returns what `f` returns.
fn with_node_lb<R: Send + 'static>(
    lb: LbOptions,
    f: impl FnOnce(&mut Node) -> R + Send + 'static,
) -> R {
    with_node_path(lb, true, None, SNAT_PORTS, f)
}

fn with_node_path<R: Send + 'static>(
    lb: LbOptions,
    fast_path: bool,
    icmp_ratelimit: Option<std::time::Duration>,
    snat_ports: RangeInclusive<u16>,
    f: impl FnOnce(&mut Node) -> R + Send + 'static,
) -> R {
    with_node_features(
        lb,
        fast_path,
        icmp_ratelimit,
        snat_ports,
        BTreeSet::new(),
        f,
    )
}

/// [`with_node_path`] with kernel features turned off (`--bpf-disable-feature`).
fn with_node_features<R: Send + 'static>(
    lb: LbOptions,
    fast_path: bool,
    icmp_ratelimit: Option<std::time::Duration>,
    snat_ports: RangeInclusive<u16>,
    disabled_features: BTreeSet<Feature>,
    f: impl FnOnce(&mut Node) -> R + Send + 'static,
) -> R {
    with_node_options(
        lb,
        fast_path,
        icmp_ratelimit,
        snat_ports,
        disabled_features,
        |_| {},
        f,
    )
}

/// [`with_node`] (fast path) with the tc options changed by `tc` (e.g. `nodePortAddresses`).
fn with_node_tc(
    tc: impl FnOnce(&mut TcOptions) + Send + 'static,
    f: impl FnOnce(&mut Node) + Send + 'static,
) {
    with_node_options(
        LbOptions::default(),
        true,
        None,
        SNAT_PORTS,
        BTreeSet::new(),
        tc,
        f,
    );
}

/// [`with_node_features`] with the tc options changed by `tc`.
fn with_node_options<R: Send + 'static>(
    lb: LbOptions,
    fast_path: bool,
    icmp_ratelimit: Option<std::time::Duration>,
    snat_ports: RangeInclusive<u16>,
    disabled_features: BTreeSet<Feature>,
    tc: impl FnOnce(&mut TcOptions) + Send + 'static,
    f: impl FnOnce(&mut Node) -> R + Send + 'static,
) -> R {
    with_node_sized(
        lb,
        fast_path,
        icmp_ratelimit,
        snat_ports,
        disabled_features,
        tc,
        proxy_common::default_sizes::CT,
        f,
    )
}

/// [`with_node_options`] with a conntrack map of `conntrack_capacity` entries a family
/// (`--bpf-map-conntrack`).
#[expect(
    clippy::too_many_arguments,
    reason = "every knob of the node, spelled out"
)]
fn with_node_sized<R: Send + 'static>(
    lb: LbOptions,
    fast_path: bool,
    icmp_ratelimit: Option<std::time::Duration>,
    snat_ports: RangeInclusive<u16>,
    disabled_features: BTreeSet<Feature>,
    tc: impl FnOnce(&mut TcOptions) + Send + 'static,
    conntrack_capacity: u32,
    f: impl FnOnce(&mut Node) -> R + Send + 'static,
) -> R {
    proxy_tests::require_root();
    let ns = Netns::new("tcrun").expect("netns");
    for (dev, v4, v6) in [
        ("ext0", "10.10.0.1/24", "fd00:10::1/64"),
        ("pod0", "10.244.1.1/24", "fd00:244:1::1/64"),
    ] {
        // veth (the kernel here has no dummy driver); the peer stays unaddressed.
        let peer = format!("{dev}p");
        ns.ip(&["link", "add", dev, "type", "veth", "peer", "name", &peer])
            .expect("veth");
        ns.ip(&["link", "set", &peer, "up"]).expect("peer up");
        ns.ip(&["addr", "add", v4, "dev", dev]).expect("addr");
        ns.ip(&["-6", "addr", "add", v6, "dev", dev, "nodad"])
            .expect("addr6");
        ns.ip(&["link", "set", dev, "up"]).expect("up");
    }
    // Another LB client's network, for the allowed source range.
    ns.ip(&["route", "add", "203.0.113.0/24", "dev", "ext0"])
        .expect("route");
    ns.sysctl("net.ipv4.ip_forward", "1").expect("sysctl");
    ns.sysctl("net.ipv6.conf.all.forwarding", "1")
        .expect("sysctl");
    let path = ns.path();
    let result = on_netns_thread(path.clone(), move |parts| {
        let mut tc_options = TcOptions {
            interfaces: vec!["ext0".into()],
            cluster_cidrs: vec!["10.244.0.0/16".parse().expect("cidr")],
            fast_path,
            ..TcOptions::default()
        };
        tc(&mut tc_options);
        let options = EbpfOptions {
            cgroup_path: parts.cgroup_path(),
            bpf_root: parts.bpf_root(),
            frontends_capacity: 1024,
            max_frontends_per_service:
                proxy_agent::dataplane::ebpf::DEFAULT_MAX_FRONTENDS_PER_SERVICE,
            max_endpoints_per_service:
                proxy_agent::dataplane::ebpf::DEFAULT_MAX_ENDPOINTS_PER_SERVICE,
            backends_capacity: 1024,
            conntrack_capacity: Some(conntrack_capacity),
            dynamic_size_ratio: proxy_agent::dataplane::ebpf::map_sizes::DEFAULT_DYNAMIC_SIZE_RATIO,
            lb,
            tc: tc_options,
            disabled_features,
            icmp_ratelimit,
            snat_ports,
        };
        let dataplane = EbpfDataplane::start(&options).expect("dataplane");
        let mut node = Node {
            dataplane,
            ext0: ifindex("ext0"),
            pod0: ifindex("pod0"),
            parts,
            netns: path,
        };
        f(&mut node)
    })
    .expect("node thread");
    drop(ns);
    result
}

/// Services from the `metadata` and `spec` YAML of each (namespace `default`).
fn services_of(metas: &[&str]) -> BTreeMap<ObjectKey, ServiceInfo> {
    metas
        .iter()
        .map(|meta| {
            let yaml = format!("apiVersion: v1\nkind: Service\nmetadata: {meta}\n");
            let service: Service = serde_yaml::from_str(&yaml).expect("service yaml");
            let name = service.metadata.name.clone().expect("name");
            (key(&name), service.into())
        })
        .collect()
}

/// An EndpointSlice `name` of `service` with one ready endpoint `addr` on node `node`, ports
/// `http` (TCP 8080), `dns` (UDP 5353) and `diameter` (SCTP 3869).
fn slice_of(
    name: &str,
    service: &str,
    family: &str,
    addr: &str,
    node: &str,
) -> (ObjectKey, proxy_agent::objects::EndpointSliceInfo) {
    let yaml = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: {name}, namespace: default, labels: {{kubernetes.io/service-name: {service}}}}}\n\
         addressType: {family}\nports: [{{name: http, port: 8080, protocol: TCP}}, \
         {{name: dns, port: 5353, protocol: UDP}}, {{name: diameter, port: 3869, protocol: SCTP}}]\n\
         endpoints: [{{addresses: ['{addr}'], nodeName: {node}, conditions: {{ready: true}}}}]\n"
    );
    let slice: EndpointSlice = serde_yaml::from_str(&yaml).expect("slice yaml");
    (key(name), slice.into())
}

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "default".into(),
        name: name.into(),
    }
}

/// Services (all on this node's view):
/// - `web`: dual-stack NodePort, eTP Cluster; TCP 80→8080 on 30080, UDP 53→5353 on 30053,
///   SCTP 3868→3869 on 30868.
/// - `local`: NodePort TCP 30081 and SCTP 30870 (→3869), eTP Local.
/// - `lb`: LoadBalancer on `LB_IP`:80 with source ranges 203.0.113.0/24 and 10.244.1.128/25
///   (pods .128–.255 behind `pod0`), NodePort 30082.
/// - `empty`: dual-stack NodePort TCP 30083 and SCTP 30869 without endpoints.
fn program_services(node: &mut Node) {
    let services = [
        "{name: web, namespace: default}\nspec: {type: NodePort, clusterIP: 10.96.0.20, \
         clusterIPs: [10.96.0.20, 'fd00:96::20'], ipFamilies: [IPv4, IPv6], \
         ipFamilyPolicy: RequireDualStack, externalTrafficPolicy: Cluster, ports: [\
         {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}, \
         {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}, \
         {name: diameter, port: 3868, protocol: SCTP, targetPort: 3869, nodePort: 30868}]}",
        "{name: local, namespace: default}\nspec: {type: NodePort, clusterIP: 10.96.0.21, \
         externalTrafficPolicy: Local, ports: [\
         {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30081}, \
         {name: diameter, port: 3868, protocol: SCTP, targetPort: 3869, nodePort: 30870}]}",
        "{name: lb, namespace: default}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.22, \
         loadBalancerSourceRanges: [203.0.113.0/24, 10.244.1.128/25], ports: [\
         {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30082}]}\n\
         status: {loadBalancer: {ingress: [{ip: 198.51.100.10}]}}",
        "{name: empty, namespace: default}\nspec: {type: NodePort, clusterIP: 10.96.0.23, \
         clusterIPs: [10.96.0.23, 'fd00:96::23'], ipFamilies: [IPv4, IPv6], \
         ipFamilyPolicy: RequireDualStack, ports: [\
         {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30083}, \
         {name: diameter, port: 3868, protocol: SCTP, targetPort: 3869, nodePort: 30869}]}",
    ];
    let services = services_of(&services);
    let slice = |name: &str, service: &str, family: &str, addr: &str| {
        slice_of(name, service, family, addr, NODE)
    };
    let slices = BTreeMap::from([
        slice("web-4", "web", "IPv4", BACKEND),
        slice("web-6", "web", "IPv6", BACKEND6),
        slice("local-4", "local", "IPv4", BACKEND),
        slice("lb-4", "lb", "IPv4", BACKEND),
    ]);
    let objects = Objects::new(services, slices, None);
    let snapshot = Snapshot::compute(&objects, NODE);
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    assert!(errors.is_empty(), "snapshot errors: {errors:?}");
    let (summary, errors) = node.dataplane.apply(&snapshot, None);
    assert!(errors.is_empty(), "apply errors: {errors:?}");
    assert!(summary.frontends_written > 0, "{summary:?}");
}

fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("ip"), port)
}

/// Address words as the maps hold them (network order, IPv4 in word 0).
fn words(ip: IpAddr) -> [u32; 4] {
    match ip {
        IpAddr::V4(a) => [u32::from_ne_bytes(a.octets()), 0, 0, 0],
        IpAddr::V6(a) => {
            let o = a.octets();
            [0, 4, 8, 12].map(|i| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]))
        }
    }
}

fn ct_key(src: SocketAddr, dst: SocketAddr, proto: u8) -> CtKey {
    CtKey {
        src: words(src.ip()),
        dst: words(dst.ip()),
        sport: src.port().to_be(),
        dport: dst.port().to_be(),
        proto,
        family: if src.is_ipv4() {
            family::V4
        } else {
            family::V6
        },
        _pad: 0,
    }
}

fn ct_entry(node: &mut Node, key: &CtKey) -> Option<CtValue> {
    node.dataplane
        .conntrack_entries()
        .expect("conntrack")
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
}

/// Runs `program` on `frame` arriving on `ifindex`; returns the action and the parsed,
/// checksum-verified result.
fn run(node: &mut Node, program: &'static str, frame: &[u8], ifindex: u32) -> (i32, Parsed) {
    let out = node
        .dataplane
        .test_run_tc(program, frame, ifindex)
        .expect("test_run");
    let parsed = parse_checked(&out.packet)
        .unwrap_or_else(|e| panic!("{program}: output {:02x?}: {e}", out.packet));
    (out.action, parsed)
}

/// [`run`] on an skb that carries `mark`, also returning the frame and the mark it leaves with.
fn run_marked(
    node: &mut Node,
    program: &'static str,
    frame: &[u8],
    ifindex: u32,
    mark: u32,
) -> (i32, Vec<u8>, Parsed, u32) {
    let out = node
        .dataplane
        .test_run_tc_marked(program, frame, ifindex, mark)
        .expect("test_run");
    let parsed = parse_checked(&out.packet)
        .unwrap_or_else(|e| panic!("{program}: output {:02x?}: {e}", out.packet));
    (out.action, out.packet, parsed, out.mark)
}

/// [`run`], also returning the output frame (to feed the next program).
fn run_raw(
    node: &mut Node,
    program: &'static str,
    frame: &[u8],
    ifindex: u32,
) -> (i32, Vec<u8>, Parsed) {
    let out = node
        .dataplane
        .test_run_tc(program, frame, ifindex)
        .expect("test_run");
    let parsed = parse_checked(&out.packet)
        .unwrap_or_else(|e| panic!("{program}: output {:02x?}: {e}", out.packet));
    (out.action, out.packet, parsed)
}

/// A full round trip through a NodePort: the client's packet is DNATed (and SNATed unless
/// `preserve`), both conntrack entries exist, and the backend's reply is translated back.
fn round_trip(
    node: &mut Node,
    client: SocketAddr,
    frontend: SocketAddr,
    backend: SocketAddr,
    l4: L4,
    preserve: bool,
) {
    let frame = build(client, frontend, l4, b"ping");
    let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
    let what = format!("{l4:?} {client} → {frontend}");
    assert_eq!(action, TC_ACT_REDIRECT, "{what}: action");
    assert_eq!(out.destination(), backend, "{what}: DNAT");
    let node_ip: IpAddr = if client.is_ipv4() { NODE_IP } else { NODE_IP6 }
        .parse()
        .expect("ip");
    if preserve {
        assert_eq!(out.source(), client, "{what}: client kept (eTP Local)");
    } else {
        assert_eq!(out.src, node_ip, "{what}: SNAT address");
        assert!(
            SNAT_PORTS.contains(&out.sport()),
            "{what}: SNAT port {}",
            out.sport()
        );
    }
    assert!(out.l4.ends_with(b"ping"), "{what}: payload");

    // Conntrack: the forward entry under what the client sent, the reply entry under what the
    // backend will send.
    let proto = l4.proto();
    let forward = ct_entry(node, &ct_key(client, frontend, proto)).expect("forward entry");
    assert_eq!(forward.dst, words(backend.ip()), "{what}: forward entry");
    assert_eq!(forward.dport, backend.port().to_be());
    assert_eq!(forward.flags & ct_flags::SNAT != 0, !preserve);
    let reply_key = ct_key(backend, out.source(), proto);
    let reply = ct_entry(node, &reply_key).expect("reply entry");
    assert!(reply.flags & ct_flags::REPLY != 0);
    assert_eq!(reply.src, words(frontend.ip()));
    assert_eq!(reply.dst, words(client.ip()));

    // A second packet of the flow takes the same translation from conntrack.
    let (action, again) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
    assert_eq!(action, TC_ACT_REDIRECT);
    assert_eq!(
        (again.source(), again.destination()),
        (out.source(), out.destination())
    );

    // The backend answers (on the pod side): reverse translation back to the client.
    let answer = build(backend, out.source(), l4, b"pong");
    let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
    assert_eq!(action, TC_ACT_REDIRECT, "{what}: reply action");
    assert_eq!(back.source(), frontend, "{what}: reply source");
    assert_eq!(back.destination(), client, "{what}: reply destination");
    assert!(back.l4.ends_with(b"pong"));
}

/// The netfilter path (default): a NodePort flow's translation is split so that the host's
/// FORWARD/POSTROUTING see the client and the backend — ingress only rewrites destinations
/// and returns `TC_ACT_UNSPEC` (next program, then the stack), `kpr_tc_egress` rewrites
/// sources. With SNAT (eTP
/// Cluster) and without (eTP Local), TCP and UDP, IPv4 and IPv6.
#[test]
fn netfilter_path_splits_translation_between_ingress_and_egress() {
    with_netfilter_node(|node| {
        program_services(node);
        let cases = [
            (CLIENT, NODE_IP, 30080, BACKEND, 8080, L4::TcpSyn, false),
            (CLIENT, NODE_IP, 30053, BACKEND, 5353, L4::Udp, false),
            (CLIENT6, NODE_IP6, 30080, BACKEND6, 8080, L4::TcpSyn, false),
            (CLIENT, NODE_IP, 30081, BACKEND, 8080, L4::TcpSyn, true),
        ];
        for (i, (client, node_ip, node_port, backend, backend_port, l4, preserve)) in
            cases.into_iter().enumerate()
        {
            let client = sa(client, 41_000 + i as u16);
            let frontend = sa(node_ip, node_port);
            let backend = sa(backend, backend_port);
            let what = format!("{l4:?} {client} → {frontend}");
            // Ingress: DNAT only; the client stays the source for FORWARD.
            let frame = build(client, frontend, l4, b"ping");
            let (action, out_frame, out, mark) =
                run_marked(node, program_names::TC_EXTERNAL, &frame, node.ext0, 0);
            assert_eq!(
                action, TC_ACT_UNSPEC,
                "{what}: to the next program, then the stack"
            );
            assert_eq!(
                mark, TRANSLATED_MARK,
                "{what}: ingress marks what it translated"
            );
            assert_eq!(out.destination(), backend, "{what}: DNAT");
            assert_eq!(out.source(), client, "{what}: source untouched at ingress");

            // Egress of the pod side (after FORWARD/POSTROUTING): SNAT, or nothing.
            let (action, _, snat, mark) = run_marked(
                node,
                program_names::TC_EGRESS,
                &out_frame,
                node.pod0,
                TRANSLATED_MARK,
            );
            assert_eq!(mark, 0, "{what}: egress takes its mark bit off");
            assert_eq!(
                snat.destination(),
                backend,
                "{what}: egress keeps the backend"
            );
            let to_backend = if preserve {
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: not ours at egress");
                assert_eq!(snat.source(), client, "{what}: client kept (eTP Local)");
                client
            } else {
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: egress SNAT action");
                assert_eq!(snat.src, frontend.ip(), "{what}: SNAT address");
                assert!(
                    SNAT_PORTS.contains(&snat.sport()),
                    "{what}: SNAT port {}",
                    snat.sport()
                );
                let entry = ct_entry(node, &ct_key(client, backend, l4.proto()))
                    .expect("egress forward entry");
                assert_eq!(entry.flags & ct_flags::EGRESS, ct_flags::EGRESS);
                snat.source()
            };
            assert!(snat.l4.ends_with(b"ping"), "{what}: payload");

            // The backend answers on the pod side: ingress un-SNATs (destination only)...
            let answer = build(backend, to_backend, l4, b"pong");
            let (action, back_frame, back, mark) =
                run_marked(node, program_names::TC_REPLY, &answer, node.pod0, 0);
            assert_eq!(action, TC_ACT_UNSPEC, "{what}: reply to the stack");
            assert_eq!(mark, TRANSLATED_MARK, "{what}: the reply is marked too");
            assert_eq!(back.destination(), client, "{what}: reply destination");
            assert_eq!(
                back.source(),
                backend,
                "{what}: reply source still the backend"
            );
            // ...and egress of the external side puts the frontend back as its source.
            let (action, _, out, _) =
                run_marked(node, program_names::TC_EGRESS, &back_frame, node.ext0, mark);
            assert_eq!(action, TC_ACT_UNSPEC, "{what}: egress reply action");
            assert_eq!(out.source(), frontend, "{what}: reply source");
            assert_eq!(out.destination(), client, "{what}: reply destination");
            assert!(out.l4.ends_with(b"pong"));
        }

        // A flow without SNAT (eTP Local, 30081) from the first case's client tuple to its
        // backend while that SNATed flow lives: on the netfilter path both would show the
        // kernel the same tuple, and the egress entries keyed by it are the first flow's (they
        // would SNAT this one). The new flow takes the fast path (`ct_flags::BYPASS`): whole
        // at ingress and redirected, never marked for egress, the client's address kept; and
        // the first flow, whose egress reply entry held the tuple, moves to the fast path too.
        let client = sa(CLIENT, 41_000);
        let frame = build(client, sa(NODE_IP, 30081), L4::TcpSyn, b"again");
        let (action, _, out) = run_raw(node, program_names::TC_EXTERNAL, &frame, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT, "a held tuple takes the fast path");
        assert_eq!(out.destination(), sa(BACKEND, 8080));
        assert_eq!(out.source(), client, "client kept");
        for key in [
            ct_key(client, sa(NODE_IP, 30081), proto::TCP),
            ct_key(client, sa(NODE_IP, 30080), proto::TCP),
        ] {
            let entry = ct_entry(node, &key).expect("both flows' forward entries");
            assert_ne!(entry.flags & ct_flags::BYPASS, 0, "{key:?} bypasses");
        }

        // The client reaches the backend's pod address directly, from the port of the second
        // (SNATed, UDP) case's flow, whose egress entries are still there: nothing translated
        // this packet at ingress, so egress must not SNAT it.
        let client = sa(CLIENT, 41_001);
        let direct = build(client, sa(BACKEND, 5353), L4::Udp, b"direct");
        ct_entry(node, &ct_key(client, sa(BACKEND, 5353), proto::UDP))
            .expect("the SNATed UDP flow's egress entry is still tracked");
        let (action, out) = run(node, program_names::TC_EGRESS, &direct, node.pod0);
        assert_eq!(action, TC_ACT_UNSPEC);
        assert_eq!(
            (out.source(), out.destination()),
            (client, sa(BACKEND, 5353)),
            "a packet ingress did not translate keeps its addresses"
        );

        // Traffic egress has no entry for passes on, unchanged, to the next program.
        let unrelated = build(sa(CLIENT, 9), sa(BACKEND, 10), L4::Udp, b"x");
        let (action, out) = run(node, program_names::TC_EGRESS, &unrelated, node.pod0);
        assert_eq!(action, TC_ACT_UNSPEC);
        assert_eq!(
            (out.source(), out.destination()),
            (sa(CLIENT, 9), sa(BACKEND, 10))
        );
    });
}

/// ICMP errors about a translated flow's packets, on the netfilter path,
/// each program on a `CHECKSUM_COMPLETE` skb (the kernel checks `skb->csum`) and every
/// checksum of the result checked, the quote's included (IPv4 header, UDP over the whole
/// quoted datagram): a masqueraded UDP NodePort flow in both families, then
/// - the backend's port unreachable, sent to the SNAT address about the SNATed packet: the pod
///   side's ingress gives it the client as destination and the quote the client as source
///   (what the kernel's conntrack knows), the external side's egress the frontend as the
///   quote's destination and as the error's source (the backend answered for itself);
/// - fragmentation needed / packet too big from the node about the DNATed packet it could not
///   forward: egress gives the quote the frontend as destination, the error keeps its source;
/// - an error about another tuple, and one not addressed to the quoted packet's sender, pass
///   untouched.
#[test]
fn icmp_errors_about_translated_flows_are_translated_back() {
    with_netfilter_node(|node| {
        program_services(node);
        for (client, node_ip, backend, unreachable, too_big) in [
            (CLIENT, NODE_IP, BACKEND, (3, 3), (3, 4)),
            (CLIENT6, NODE_IP6, BACKEND6, (1, 4), (2, 0)),
        ] {
            let client = sa(client, 42_053);
            let frontend = sa(node_ip, 30053);
            let backend = sa(backend, 5353);
            let what = format!("UDP {client} → {frontend}");
            let frame = build(client, frontend, L4::Udp, b"ping");
            let (_, dnated_frame, dnated, mark) =
                run_marked(node, program_names::TC_EXTERNAL, &frame, node.ext0, 0);
            assert_eq!(dnated.destination(), backend, "{what}: DNAT");
            let (_, snated_frame, snated, _) = run_marked(
                node,
                program_names::TC_EGRESS,
                &dnated_frame,
                node.pod0,
                mark,
            );
            assert_eq!(snated.src, frontend.ip(), "{what}: SNAT address");
            let snat = snated.source();

            // The backend's port unreachable, to the SNAT address.
            let error = icmp_error(
                backend.ip(),
                snat.ip(),
                unreachable.0,
                unreachable.1,
                0,
                &snated_frame,
            );
            let (frame1, mark, _) = run_error(
                node,
                (program_names::TC_REPLY, node.pod0, 0),
                &error,
                ((backend.ip(), client.ip()), (client, backend)),
                &format!("{what}: ingress, to the client, quoting what conntrack knows"),
            );
            let (_, _, quote) = run_error(
                node,
                (program_names::TC_EGRESS, node.ext0, mark),
                &frame1,
                ((frontend.ip(), client.ip()), (client, frontend)),
                &format!("{what}: egress, from the frontend (the backend answered for itself)"),
            );
            assert!(quote.l4.ends_with(b"ping"), "{what}: quoted payload");

            // Too big for the pod's link: the node's error about the DNATed datagram.
            let error = icmp_error(
                frontend.ip(),
                client.ip(),
                too_big.0,
                too_big.1,
                1280,
                &dnated_frame,
            );
            let (frame3, _, _) = run_error(
                node,
                (program_names::TC_EGRESS, node.ext0, 0),
                &error,
                ((frontend.ip(), client.ip()), (client, frontend)),
                &format!("{what}: the node's too big keeps its addresses"),
            );
            let out = parse_checked(&frame3).expect("checked by run_error");
            assert_eq!(
                out.l4.get(4..8),
                Some(&1280u32.to_be_bytes()[..]),
                "{what}: the MTU stays"
            );

            // Not about a flow of ours, or not sent to the quoted packet's sender: untouched.
            let stranger = build(sa(&client.ip().to_string(), 9), backend, L4::Udp, b"x");
            let error = icmp_error(
                backend.ip(),
                client.ip(),
                unreachable.0,
                unreachable.1,
                0,
                &stranger,
            );
            for (program, ifindex) in [
                (program_names::TC_REPLY, node.pod0),
                (program_names::TC_EGRESS, node.ext0),
            ] {
                let (action, frame, _) = run_complete(node, program, &error, ifindex, 0, &what);
                assert_eq!(action, TC_ACT_UNSPEC);
                assert_eq!(
                    frame, error,
                    "{what}: {program} leaves another tuple's error alone"
                );
            }
            let error = icmp_error(
                backend.ip(),
                client.ip(),
                unreachable.0,
                unreachable.1,
                0,
                &snated_frame,
            );
            let (_, frame, _) =
                run_complete(node, program_names::TC_REPLY, &error, node.pod0, 0, &what);
            assert_eq!(frame, error, "{what}: an error to someone else is not ours");
        }
    });
}

/// Runs a program (`program`, ifindex, mark) on the ICMP error `error` in a
/// `CHECKSUM_COMPLETE` skb and checks what leaves: handed to the stack, with the `addresses`
/// (source, destination) and quoting a packet with the `quoted` ones, every checksum of both
/// true. Returns the frame, its mark and the quoted packet.
fn run_error(
    node: &mut Node,
    (program, ifindex, mark): (&'static str, u32, u32),
    error: &[u8],
    (addresses, quoted): ((IpAddr, IpAddr), (SocketAddr, SocketAddr)),
    what: &str,
) -> (Vec<u8>, u32, Parsed) {
    let (action, frame, mark) = run_complete(node, program, error, ifindex, mark, what);
    assert_eq!(action, TC_ACT_UNSPEC, "{what}: to the stack");
    let out = parse_checked(&frame).expect("checked by run_complete");
    let quote = quoted_packet(&out).unwrap_or_else(|e| panic!("{what}: quote: {e}"));
    assert_eq!((out.src, out.dst), addresses, "{what}: addresses");
    assert_eq!(
        (quote.source(), quote.destination()),
        quoted,
        "{what}: quoted addresses"
    );
    (frame, mark, quote)
}

/// Runs `program` on a `CHECKSUM_COMPLETE` skb (the kernel checks `skb->csum`), a fragment's
/// included: the frame is checked by the caller (a fragment's L4 checksum covers the whole
/// datagram; [`run_complete`] checks a whole packet's).
fn run_fragment(
    node: &mut Node,
    program: &'static str,
    frame: &[u8],
    ifindex: u32,
    mark: u32,
    what: &str,
) -> (i32, Vec<u8>, u32) {
    let input = TcTestInput {
        ifindex,
        mark,
        checksum_complete: true,
        local: false,
    };
    let out = node
        .dataplane
        .test_run_tc_with(program, frame, input)
        .unwrap_or_else(|e| panic!("{what}: {program} on a CHECKSUM_COMPLETE skb: {e}"));
    (out.action, out.packet, out.mark)
}

/// A 3000-byte UDP datagram from `client` to `frontend`, its first, middle and last fragments
/// (IP ID `id`), and the label the assertions use.
struct Fragmented {
    what: String,
    payload: Vec<u8>,
    datagram: Vec<u8>,
    pieces: Vec<Vec<u8>>,
}

fn three_fragments(client: SocketAddr, frontend: SocketAddr, id: u32) -> Fragmented {
    let what = format!("UDP {client} → {frontend}, fragmented");
    let payload: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    let datagram = build(client, frontend, L4::Udp, &payload);
    let pieces = fragment(&datagram, 1232, id);
    assert_eq!(pieces.len(), 3, "{what}: first, middle, last");
    Fragmented {
        what,
        payload,
        datagram,
        pieces,
    }
}

/// IP fragments of a translated UDP flow, on the netfilter path, both
/// families: the first, middle and last fragment of a 3000-byte datagram each get the flow's
/// translation — at ingress the backend as destination, at egress the SNAT address as source,
/// the later fragments by the ports their first fragment carried — and at each step they make
/// up the translated datagram with a valid UDP checksum. A later fragment whose first fragment
/// was lost passes untouched and is counted.
#[test]
fn fragments_of_a_flow_get_its_translation() {
    with_netfilter_node(|node| {
        program_services(node);
        for (client, node_ip, backend, id) in [
            (CLIENT, NODE_IP, BACKEND, 0x1234),
            (CLIENT6, NODE_IP6, BACKEND6, 0x5678_9abc),
        ] {
            let client = sa(client, 43_053);
            let frontend = sa(node_ip, 30053);
            let backend = sa(backend, 5353);
            let Fragmented {
                what,
                payload,
                datagram,
                pieces,
            } = three_fragments(client, frontend, id);

            let mut ingress = Vec::new();
            let mut ingress_frames = Vec::new();
            for (i, piece) in pieces.iter().enumerate() {
                let (action, out, mark) =
                    run_fragment(node, program_names::TC_EXTERNAL, piece, node.ext0, 0, &what);
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: fragment {i} to the stack");
                assert_eq!(mark, TRANSLATED_MARK, "{what}: fragment {i} marked");
                let f = parse_fragment(&out).unwrap_or_else(|e| panic!("{what}: {i}: {e}"));
                assert_eq!(
                    (f.src, f.dst),
                    (client.ip(), backend.ip()),
                    "{what}: fragment {i} DNATed"
                );
                ingress.push(f);
                ingress_frames.push(out);
            }
            let whole = reassemble(&ingress).unwrap_or_else(|e| panic!("{what}: ingress: {e}"));
            assert_eq!(
                (whole.source(), whole.destination()),
                (client, backend),
                "{what}: the datagram DNATed"
            );
            assert!(whole.l4.ends_with(&payload), "{what}: payload");

            let mut egress = Vec::new();
            for (i, frame) in ingress_frames.iter().enumerate() {
                let (action, out, _) = run_fragment(
                    node,
                    program_names::TC_EGRESS,
                    frame,
                    node.pod0,
                    TRANSLATED_MARK,
                    &what,
                );
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: fragment {i} on");
                let f = parse_fragment(&out).unwrap_or_else(|e| panic!("{what}: {i}: {e}"));
                assert_eq!(
                    (f.src, f.dst),
                    (frontend.ip(), backend.ip()),
                    "{what}: fragment {i} SNATed"
                );
                egress.push(f);
            }
            let whole = reassemble(&egress).unwrap_or_else(|e| panic!("{what}: egress: {e}"));
            assert_eq!(whole.destination(), backend, "{what}: to the backend");
            assert!(
                SNAT_PORTS.contains(&whole.sport()),
                "{what}: SNAT port {}",
                whole.sport()
            );

            // The first fragment of another datagram of the flow is lost: its middle one
            // cannot be matched to the flow.
            let before = stat(node, StatIndex::TcFragmentUntracked);
            let orphan = fragment(&datagram, 1232, id + 1).swap_remove(1);
            let (action, out, mark) = run_fragment(
                node,
                program_names::TC_EXTERNAL,
                &orphan,
                node.ext0,
                0,
                &what,
            );
            assert_eq!(action, TC_ACT_UNSPEC, "{what}: orphan to the stack");
            assert_eq!((out, mark), (orphan, 0), "{what}: orphan untouched");
            assert_eq!(
                stat(node, StatIndex::TcFragmentUntracked),
                before + 1,
                "{what}: orphan counted"
            );
        }
    });
}

/// The datagrams `KPR_FRAGMENTS` remembers, as (source, destination, protocol).
fn remembered_datagrams(node: &Node) -> BTreeSet<(IpAddr, IpAddr, u8)> {
    let ip = |words: [u32; 4], family: u8| match family {
        family::V4 => IpAddr::from(words[0].to_ne_bytes()),
        _ => IpAddr::V6(proxy_agent::dataplane::ebpf::ip6_from_map(words)),
    };
    node.dataplane
        .fragment_datagrams()
        .expect("fragment map")
        .into_iter()
        .map(|key| (ip(key.src, key.family), ip(key.dst, key.family), key.proto))
        .collect()
}

/// First fragments are remembered (`KPR_FRAGMENTS`, an LRU of 8192 datagrams) only for the
/// datagrams of flows, so that junk cannot evict them. Between the first fragment of a UDP
/// datagram to a NodePort (remembered: a new flow) and its later fragments, 20 000 first
/// fragments of other datagrams arrive — to a port no Service has on the node's address, to
/// a NodePort's port at an address that is not the node's, from ever other clients — and
/// leave no entry; the later fragments still get the flow's translation (the flood evicted
/// nothing; with every first fragment recorded it would have evicted the flow's). The
/// backend's fragmented reply is remembered too (a flow in the conntrack) and translated
/// back. Both families, netfilter path.
#[test]
fn only_first_fragments_of_flows_are_remembered() {
    const JUNK: u32 = 20_000;
    with_netfilter_node(|node| {
        program_services(node);
        let mut expected = BTreeSet::new();
        for (client, node_ip, backend, elsewhere, id) in [
            (CLIENT, NODE_IP, BACKEND, "10.10.0.99", 0x4321),
            (CLIENT6, NODE_IP6, BACKEND6, "fd00:10::99", 0x1357_9bdf),
        ] {
            let client = sa(client, 43_100);
            let frontend = sa(node_ip, 30053);
            let backend = sa(backend, 5353);
            let Fragmented {
                what,
                payload,
                datagram: _,
                pieces,
            } = three_fragments(client, frontend, id);
            let mut ingress = Vec::new();
            let (action, out, _) = run_fragment(
                node,
                program_names::TC_EXTERNAL,
                &pieces[0],
                node.ext0,
                0,
                &what,
            );
            assert_eq!(action, TC_ACT_UNSPEC, "{what}: first fragment");
            ingress.push(parse_fragment(&out).expect("first fragment"));
            expected.insert((client.ip(), frontend.ip(), PROTO_UDP));
            assert_eq!(
                remembered_datagrams(node),
                expected,
                "{what}: the first fragment of a new flow is remembered"
            );

            // The flood: first fragments of small datagrams to no frontend.
            let v4 = client.is_ipv4();
            for i in 0..JUNK {
                let port = 40_000 + (i % 20_000) as u16;
                let host = i % 200 + 2;
                let (src, dst) = if i % 2 == 0 {
                    let src = if v4 {
                        format!("203.0.113.{host}")
                    } else {
                        format!("fd00:10::{host:x}")
                    };
                    (sa(&src, port), sa(node_ip, port))
                } else {
                    let src = if v4 {
                        format!("10.10.0.{host}")
                    } else {
                        format!("fd00:10::1:{host:x}")
                    };
                    (sa(&src, port), sa(elsewhere, 30053))
                };
                let junk = build(src, dst, L4::Udp, &[0x5a; 64]);
                let first = fragment(&junk, 40, i).swap_remove(0);
                let out = node
                    .dataplane
                    .test_run_tc(program_names::TC_EXTERNAL, &first, node.ext0)
                    .expect("test_run");
                assert_eq!(
                    (out.action, out.packet == first),
                    (TC_ACT_UNSPEC, true),
                    "junk {src} → {dst}: to the stack untouched"
                );
            }
            assert_eq!(
                remembered_datagrams(node),
                expected,
                "{what}: no junk first fragment is remembered"
            );

            // The datagram's later fragments, after the flood.
            let untracked = stat(node, StatIndex::TcFragmentUntracked);
            for (i, piece) in pieces.iter().enumerate().skip(1) {
                let (action, out, mark) =
                    run_fragment(node, program_names::TC_EXTERNAL, piece, node.ext0, 0, &what);
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: fragment {i} to the stack");
                assert_eq!(mark, TRANSLATED_MARK, "{what}: fragment {i} translated");
                ingress.push(parse_fragment(&out).unwrap_or_else(|e| panic!("{what}: {i}: {e}")));
            }
            assert_eq!(stat(node, StatIndex::TcFragmentUntracked), untracked);
            let whole = reassemble(&ingress).unwrap_or_else(|e| panic!("{what}: ingress: {e}"));
            assert_eq!(
                (whole.source(), whole.destination()),
                (client, backend),
                "{what}: the datagram DNATed"
            );
            assert!(whole.l4.ends_with(&payload), "{what}: payload");

            // The backend's fragmented answer, to the flow's SNAT address and port.
            let forward = ct_entry(node, &ct_key(client, frontend, PROTO_UDP)).expect("flow");
            let snat = sa(node_ip, u16::from_be(forward.sport));
            let answer = build(backend, snat, L4::Udp, &payload);
            let what = format!("UDP {backend} → {snat}, fragmented");
            let mut back = Vec::new();
            for (i, piece) in fragment(&answer, 1232, id + 1).iter().enumerate() {
                let (action, out, mark) =
                    run_fragment(node, program_names::TC_REPLY, piece, node.pod0, 0, &what);
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: fragment {i} to the stack");
                assert_eq!(mark, TRANSLATED_MARK, "{what}: fragment {i} translated");
                let f = parse_fragment(&out).unwrap_or_else(|e| panic!("{what}: {i}: {e}"));
                assert_eq!(f.dst, client.ip(), "{what}: fragment {i} to the client");
                back.push(f);
            }
            expected.insert((backend.ip(), snat.ip(), PROTO_UDP));
            assert_eq!(
                remembered_datagrams(node),
                expected,
                "{what}: a reply's first fragment is remembered"
            );
            let whole = reassemble(&back).unwrap_or_else(|e| panic!("{what}: reply: {e}"));
            assert_eq!(whole.destination(), client, "{what}: back to the client");
        }
    });
}

/// Runs `program` on a `CHECKSUM_COMPLETE` skb: the kernel fails the run (`EBADMSG`) when
/// the program left `skb->csum` out of step with the packet, as a NIC that sums packets would
/// find ("hw csum failure"). Returns the action, the frame and the mark it leaves with.
fn run_complete(
    node: &mut Node,
    program: &'static str,
    frame: &[u8],
    ifindex: u32,
    mark: u32,
    what: &str,
) -> (i32, Vec<u8>, u32) {
    let (action, packet, mark) = run_fragment(node, program, frame, ifindex, mark, what);
    parse_checked(&packet)
        .unwrap_or_else(|e| panic!("{what}: {program}: output {packet:02x?}: {e}"));
    (action, packet, mark)
}

/// Every rewrite keeps a `CHECKSUM_COMPLETE` skb's `csum` true to the packet: IPv4 (address
/// changes move the header checksum too) and IPv6 (address and L4 checksum changes cancel
/// out, so `csum` must not move: `BPF_F_IPV6`, or on kernels without it the helper's IPv4-style
/// adjustment taken back), TCP and UDP, both directions, on the netfilter path (each half in
/// its own program) and the fast path, with the `l4-csum-ipv6` feature used and turned off.
#[test]
fn checksum_complete_skbs_keep_a_true_csum_through_every_rewrite() {
    for (fast_path, disabled) in [
        (false, BTreeSet::new()),
        (true, BTreeSet::new()),
        (false, BTreeSet::from([Feature::L4CsumIpv6])),
        (true, BTreeSet::from([Feature::L4CsumIpv6])),
    ] {
        with_node_features(
            LbOptions::default(),
            fast_path,
            None,
            SNAT_PORTS,
            disabled.clone(),
            move |node| {
                program_services(node);
                let cases = [
                    (CLIENT, NODE_IP, 30080, L4::TcpSyn),
                    (CLIENT, NODE_IP, 30053, L4::Udp),
                    (CLIENT6, NODE_IP6, 30080, L4::TcpSyn),
                    (CLIENT6, NODE_IP6, 30053, L4::Udp),
                ];
                for (i, (client, node_ip, node_port, l4)) in cases.into_iter().enumerate() {
                    let client = sa(client, 42_000 + i as u16);
                    let frontend = sa(node_ip, node_port);
                    let what = format!(
                        "{l4:?} {client} → {frontend} (fast path {fast_path}, disabled {disabled:?})"
                    );
                    let frame = build(client, frontend, l4, b"ping");
                    let (_, mut to_backend, mark) = run_complete(
                        node,
                        program_names::TC_EXTERNAL,
                        &frame,
                        node.ext0,
                        0,
                        &what,
                    );
                    if !fast_path {
                        (_, to_backend, _) = run_complete(
                            node,
                            program_names::TC_EGRESS,
                            &to_backend,
                            node.pod0,
                            mark,
                            &what,
                        );
                    }
                    let sent = parse_checked(&to_backend).expect("checked above");
                    assert_ne!(sent.destination(), frontend, "{what}: DNAT");
                    let answer = build(sent.destination(), sent.source(), l4, b"pong");
                    let (_, mut to_client, mark) =
                        run_complete(node, program_names::TC_REPLY, &answer, node.pod0, 0, &what);
                    if !fast_path {
                        (_, to_client, _) = run_complete(
                            node,
                            program_names::TC_EGRESS,
                            &to_client,
                            node.ext0,
                            mark,
                            &what,
                        );
                    }
                    let back = parse_checked(&to_client).expect("checked above");
                    assert_eq!(
                        (back.source(), back.destination()),
                        (frontend, client),
                        "{what}: reverse translation"
                    );
                }
            },
        );
    }
}

/// On the fast path the egress program passes everything it did not send itself (see
/// `host_network_backends_are_delivered_locally_and_answered_at_egress`): ingress did the
/// whole translation.
#[test]
fn fast_path_egress_passes_everything() {
    with_node(|node| {
        program_services(node);
        let client = sa(CLIENT, 42_000);
        let frame = build(client, sa(NODE_IP, 30053), L4::Udp, b"ping");
        let (action, out_frame, out) = run_raw(node, program_names::TC_EXTERNAL, &frame, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        let (action, again) = run(node, program_names::TC_EGRESS, &out_frame, node.pod0);
        assert_eq!(action, TC_ACT_UNSPEC);
        assert_eq!(
            (again.source(), again.destination()),
            (out.source(), out.destination())
        );
        // No egress entries were written.
        let entries = node.dataplane.conntrack_entries().expect("conntrack");
        assert!(
            entries.iter().all(|(_, v)| v.flags & ct_flags::EGRESS == 0),
            "{entries:?}"
        );
    });
}

/// Services with host-network backends: `hostnet`, a dual-stack NodePort (eTP Cluster) whose
/// endpoints are the node's own `ext0` addresses (TCP 80→8080 on 30090, UDP 53→5353 on 30091),
/// and `podlocal`, a NodePort (eTP Local, TCP 30092) to the pod `BACKEND`.
fn host_network_snapshot() -> Snapshot {
    let services = [
        "{name: hostnet, namespace: default}\nspec: {type: NodePort, clusterIP: 10.96.0.50, \
         clusterIPs: [10.96.0.50, 'fd00:96::50'], ipFamilies: [IPv4, IPv6], \
         ipFamilyPolicy: RequireDualStack, externalTrafficPolicy: Cluster, ports: [\
         {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30090}, \
         {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30091}]}",
        "{name: podlocal, namespace: default}\nspec: {type: NodePort, clusterIP: 10.96.0.51, \
         externalTrafficPolicy: Local, ports: [\
         {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30092}]}",
    ];
    let services = services_of(&services);
    let slice = |name: &str, service: &str, family: &str, addr: &str| {
        slice_of(name, service, family, addr, NODE)
    };
    let slices = BTreeMap::from([
        slice("hostnet-4", "hostnet", "IPv4", NODE_IP),
        slice("hostnet-6", "hostnet", "IPv6", NODE_IP6),
        slice("podlocal-4", "podlocal", "IPv4", BACKEND),
    ]);
    Snapshot::compute(&Objects::new(services, slices, None), NODE)
}

/// Host-network backends, on both paths: a NodePort whose backend is an address of
/// the node itself is DNATed and handed to the stack for local delivery, never SNATed (the
/// node's own address as the source would be a martian, and kube-proxy's MASQUERADE never sees
/// a locally delivered packet), with a `HOST_BACKEND` reply entry; the backend's answer, which
/// leaves the node's own stack unmarked, gets the frontend as its source at egress. Egress
/// leaves alone the same packet received on an interface, and a locally sent packet whose
/// entry is a pod backend's.
#[test]
fn host_network_backends_are_delivered_locally_and_answered_at_egress() {
    for fast_path in [false, true] {
        with_node_path(
            LbOptions::default(),
            fast_path,
            None,
            SNAT_PORTS,
            move |node| {
                let (summary, errors) = node.dataplane.apply(&host_network_snapshot(), None);
                assert!(errors.is_empty(), "apply errors: {errors:?}");
                assert!(summary.frontends_written > 0, "{summary:?}");
                let path = if fast_path {
                    "fast path"
                } else {
                    "netfilter path"
                };
                let cases = [
                    (CLIENT, NODE_IP, 30090, 8080, L4::TcpSyn),
                    (CLIENT, NODE_IP, 30091, 5353, L4::Udp),
                    (CLIENT6, NODE_IP6, 30090, 8080, L4::TcpSyn),
                    (CLIENT6, NODE_IP6, 30091, 5353, L4::Udp),
                ];
                for (i, (client, node_ip, node_port, backend_port, l4)) in
                    cases.into_iter().enumerate()
                {
                    let client = sa(client, 43_000 + i as u16);
                    let frontend = sa(node_ip, node_port);
                    let backend = sa(node_ip, backend_port);
                    let what = format!("{path}: {l4:?} {client} → {frontend}");
                    let frame = build(client, frontend, l4, b"ping");
                    let (action, _, out, mark) =
                        run_marked(node, program_names::TC_EXTERNAL, &frame, node.ext0, 0);
                    let (expected_action, expected_mark) = if fast_path {
                        // No forwarding route: up the stack, to the local socket.
                        (TC_ACT_OK, 0)
                    } else {
                        (TC_ACT_UNSPEC, TRANSLATED_MARK)
                    };
                    assert_eq!(action, expected_action, "{what}: action");
                    assert_eq!(mark, expected_mark, "{what}: mark");
                    assert_eq!(out.destination(), backend, "{what}: DNAT to the node");
                    assert_eq!(out.source(), client, "{what}: never SNATed");
                    assert!(out.l4.ends_with(b"ping"), "{what}: payload");
                    let forward = ct_entry(node, &ct_key(client, frontend, l4.proto()))
                        .expect("forward entry");
                    assert_eq!(forward.flags & ct_flags::SNAT, 0, "{what}: forward entry");
                    let reply = ct_entry(node, &ct_key(backend, client, l4.proto()))
                        .expect("reply entry under the backend's own packet");
                    assert_eq!(
                        reply.flags & (ct_flags::REPLY | ct_flags::HOST_BACKEND | ct_flags::EGRESS),
                        ct_flags::REPLY | ct_flags::HOST_BACKEND,
                        "{what}: reply entry flags"
                    );

                    // The backend's answer leaves the node's own stack: egress of `ext0`.
                    let answer = build(backend, client, l4, b"pong");
                    let local = |local| TcTestInput {
                        ifindex: node.ext0,
                        local,
                        ..TcTestInput::default()
                    };
                    let sent = local(true);
                    let run = node
                        .dataplane
                        .test_run_tc_with(program_names::TC_EGRESS, &answer, sent)
                        .expect("test_run");
                    let back = parse_checked(&run.packet).expect("egress output");
                    assert_eq!(run.action, TC_ACT_UNSPEC, "{what}: egress action");
                    assert_eq!(back.source(), frontend, "{what}: reply from the frontend");
                    assert_eq!(back.destination(), client, "{what}: reply destination");
                    assert!(back.l4.ends_with(b"pong"), "{what}: reply payload");

                    // The same tuple received on an interface is not the local socket's.
                    let received = local(false);
                    let run = node
                        .dataplane
                        .test_run_tc_with(program_names::TC_EGRESS, &answer, received)
                        .expect("test_run");
                    let untouched = parse_checked(&run.packet).expect("egress output");
                    assert_eq!(run.action, TC_ACT_UNSPEC);
                    assert_eq!(
                        (untouched.source(), untouched.destination()),
                        (backend, client),
                        "{what}: a received packet is not a host backend's reply"
                    );
                }

                // A pod backend's flow (eTP Local, no SNAT): its reply entry is keyed by the pod's
                // packet, but only a packet from the pod, translated at ingress, is its reply.
                let client = sa(CLIENT, 43_100);
                let frame = build(client, sa(NODE_IP, 30092), L4::TcpSyn, b"ping");
                let (_, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                assert_eq!(out.destination(), sa(BACKEND, 8080), "{path}: pod flow");
                let answer = build(sa(BACKEND, 8080), client, L4::TcpSyn, b"pong");
                let input = TcTestInput {
                    ifindex: node.ext0,
                    local: true,
                    ..TcTestInput::default()
                };
                let run = node
                    .dataplane
                    .test_run_tc_with(program_names::TC_EGRESS, &answer, input)
                    .expect("test_run");
                let untouched = parse_checked(&run.packet).expect("egress output");
                assert_eq!(run.action, TC_ACT_UNSPEC);
                assert_eq!(
                    untouched.source(),
                    sa(BACKEND, 8080),
                    "{path}: an unmarked packet of a pod backend's flow is not egress's"
                );
            },
        );
    }
}

#[test]
fn node_port_translation_both_families_and_protocols() {
    with_node(|node| {
        program_services(node);
        round_trip(
            node,
            sa(CLIENT, 40_000),
            sa(NODE_IP, 30080),
            sa(BACKEND, 8080),
            L4::TcpSyn,
            false,
        );
        round_trip(
            node,
            sa(CLIENT, 40_001),
            sa(NODE_IP, 30053),
            sa(BACKEND, 5353),
            L4::Udp,
            false,
        );
        round_trip(
            node,
            sa(CLIENT6, 40_002),
            sa(NODE_IP6, 30080),
            sa(BACKEND6, 8080),
            L4::TcpSyn,
            false,
        );
        round_trip(
            node,
            sa(CLIENT6, 40_003),
            sa(NODE_IP6, 30053),
            sa(BACKEND6, 5353),
            L4::Udp,
            false,
        );
    });
}

/// IPv4 flows are kept in `KPR_CT4`, in entries sized for IPv4 (a 16-byte key
/// and a 32-byte value, against 40 and 56 bytes in `KPR_CT6`), IPv6 flows in `KPR_CT6`; each
/// flow's entry is in its family's map and not in the other. Until the client's ACK a TCP
/// flow is in its family's unanswered flows' map (`KPR_CT4_NEW`, sized as `KPR_CT4`).
#[test]
fn ipv4_flows_are_kept_in_entries_sized_for_ipv4() {
    with_node(|node| {
        program_services(node);
        let four = (sa(CLIENT, 40_100), sa(NODE_IP, 30080));
        let six = (sa(CLIENT6, 40_101), sa(NODE_IP6, 30080));
        round_trip(node, four.0, four.1, sa(BACKEND, 8080), L4::TcpSyn, false);
        round_trip(node, six.0, six.1, sa(BACKEND6, 8080), L4::TcpSyn, false);
        let pins = node.parts.bpf.path().join(PIN_DIR_NAME);
        let open = |name: &str| MapData::from_pin(pins.join(name)).expect("conntrack pin");
        let unanswered = open(map_names::CT4_NEW);
        let info = unanswered.info().expect("map info");
        assert_eq!((info.key_size(), info.value_size()), (16, 32));
        let unanswered = AyaHashMap::<MapData, CtKey4, CtValue4>::try_from(
            Map::from_map_data(unanswered).expect("map"),
        )
        .expect("KPR_CT4_NEW");
        let key4 = CtKey4::narrow(&ct_key(four.0, four.1, proto::TCP));
        assert!(
            unanswered.get(&key4, 0).is_ok(),
            "the IPv4 flow in KPR_CT4_NEW before the client's ACK"
        );
        for (client, frontend) in [four, six] {
            let ack = build(client, frontend, L4::TcpAck, b"");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{client}: ACK");
        }
        assert!(
            unanswered.get(&key4, 0).is_err(),
            "the IPv4 flow moved out of KPR_CT4_NEW by the client's ACK"
        );
        let (v4, v6) = (open(map_names::CT4), open(map_names::CT6));
        let sizes = |map: &MapData| {
            let info = map.info().expect("map info");
            (info.key_size(), info.value_size())
        };
        assert_eq!(sizes(&v4), (16, 32));
        assert_eq!(sizes(&v6), (40, 56));
        let narrow =
            AyaHashMap::<MapData, CtKey4, CtValue4>::try_from(Map::from_map_data(v4).expect("map"))
                .expect("KPR_CT4");
        let wide =
            AyaHashMap::<MapData, CtKey, CtValue>::try_from(Map::from_map_data(v6).expect("map"))
                .expect("KPR_CT6");
        let key4 = ct_key(four.0, four.1, proto::TCP);
        let key6 = ct_key(six.0, six.1, proto::TCP);
        let forward4 = narrow
            .get(&CtKey4::narrow(&key4), 0)
            .expect("the IPv4 flow in KPR_CT4");
        assert_eq!(forward4.widen().dst, words(sa(BACKEND, 8080).ip()));
        assert!(
            wide.get(&key4, 0).is_err(),
            "the IPv4 flow is not in KPR_CT6"
        );
        assert_eq!(
            wide.get(&key6, 0).expect("the IPv6 flow in KPR_CT6").dst,
            words(sa(BACKEND6, 8080).ip())
        );
        assert!(
            wide.keys().flatten().all(|k| k.family == family::V6),
            "KPR_CT6 holds IPv6 flows only"
        );
    });
}

#[test]
fn local_policy_keeps_the_client_address() {
    with_node(|node| {
        program_services(node);
        round_trip(
            node,
            sa(CLIENT, 41_000),
            sa(NODE_IP, 30081),
            sa(BACKEND, 8080),
            L4::TcpSyn,
            true,
        );
    });
}

#[test]
fn source_ranges_drop_before_nat() {
    with_node(|node| {
        program_services(node);
        let frame = build(sa(CLIENT, 42_000), sa(LB_IP, 80), L4::TcpSyn, b"");
        let out = node
            .dataplane
            .test_run_tc(program_names::TC_EXTERNAL, &frame, node.ext0)
            .expect("test_run");
        assert_eq!(out.action, TC_ACT_SHOT, "outside the source range");
        assert_eq!(out.packet, frame, "a dropped packet is not rewritten");
        assert!(
            ct_entry(node, &ct_key(sa(CLIENT, 42_000), sa(LB_IP, 80), 6)).is_none(),
            "no conntrack entry for a dropped packet"
        );
        // Inside the range: translated.
        round_trip(
            node,
            sa("203.0.113.5", 42_001),
            sa(LB_IP, 80),
            sa(BACKEND, 8080),
            L4::TcpSyn,
            false,
        );
    });
}

/// The addresses the datapath answers NodePorts on (`KPR_NODE_ADDRS`, through its pin).
fn node_port_addresses(node: &Node) -> Vec<IpAddr> {
    let pin = node
        .parts
        .bpf
        .path()
        .join(PIN_DIR_NAME)
        .join(map_names::NODE_ADDRS);
    let map = MapData::from_pin(pin).expect("pinned node addresses");
    let map =
        AyaHashMap::<MapData, NodeAddrKey, u8>::try_from(Map::from_map_data(map).expect("map"))
            .expect("hash map");
    map.keys()
        .map(|key| {
            let key = key.expect("key");
            match key.family {
                family::V4 => IpAddr::from(key.addr[0].to_ne_bytes()),
                _ => IpAddr::V6(proxy_agent::dataplane::ebpf::ip6_from_map(key.addr)),
            }
        })
        .collect()
}

/// CVE-2020-8558: with loopback in `nodePortAddresses` (and localhost NodePorts on),
/// 127.0.0.1 is a NodePort address of the datapath for the node's own processes; a neighbour
/// that routes 127.0.0.1 to the node must not reach the Service through it (kube-proxy's
/// KUBE-FIREWALL rule drops such packets). A packet to 127.0.0.1:<nodePort> — TCP and UDP,
/// from a client's address or a spoofed loopback one — and to another 127/8 address and to
/// `::1`, arriving on the external interface or on a pod's, is dropped before any lookup and
/// counted, by tc and by XDP, and leaves no conntrack entry; the same packet to the node IP
/// is translated.
#[test]
fn loopback_node_ports_are_not_served_to_the_outside() {
    with_node_tc(
        |tc| {
            tc.node_port_cidrs = ["127.0.0.0/8", "10.10.0.0/24", "::1/128", "fd00:10::/64"]
                .map(|cidr| cidr.parse().expect("cidr"))
                .to_vec();
            tc.localhost_node_ports = true;
        },
        |node| {
            program_services(node);
            let localhost: IpAddr = "127.0.0.1".parse().expect("ip");
            let addrs = node_port_addresses(node);
            assert!(
                addrs.contains(&localhost),
                "{addrs:?}: 127.0.0.1 is a NodePort address of the datapath"
            );
            let cases = [
                (sa(CLIENT, 41_000), sa("127.0.0.1", 30080), L4::TcpSyn),
                (sa(CLIENT, 41_001), sa("127.0.0.1", 30053), L4::Udp),
                (sa("127.0.0.1", 41_002), sa("127.0.0.1", 30080), L4::TcpSyn),
                (sa(CLIENT, 41_003), sa("127.0.0.53", 30053), L4::Udp),
                (sa(CLIENT6, 41_004), sa("::1", 30080), L4::TcpSyn),
                (sa(CLIENT6, 41_005), sa("::1", 30053), L4::Udp),
            ];
            for (client, target, l4) in cases {
                let frame = build(client, target, l4, b"ping");
                for (program, ifindex, side) in [
                    (program_names::TC_EXTERNAL, node.ext0, "external"),
                    (program_names::TC_REPLY, node.pod0, "pod"),
                ] {
                    let what = format!("{l4:?} {client} → {target} on the {side} interface");
                    let dropped = stat(node, StatIndex::TcDroppedLoopback);
                    let (action, _) = run(node, program, &frame, ifindex);
                    assert_eq!(action, TC_ACT_SHOT, "{what}: dropped");
                    assert_eq!(
                        stat(node, StatIndex::TcDroppedLoopback),
                        dropped + 1,
                        "{what}: counted"
                    );
                    assert!(
                        ct_entry(node, &ct_key(client, target, l4.proto())).is_none(),
                        "{what}: no flow"
                    );
                }
                let what = format!("{l4:?} {client} → {target} in XDP");
                let dropped = stat(node, StatIndex::XdpDroppedLoopback);
                let (action, _) = run_xdp(node, &frame);
                assert_eq!(action, XDP_DROP, "{what}: dropped");
                assert_eq!(
                    stat(node, StatIndex::XdpDroppedLoopback),
                    dropped + 1,
                    "{what}: counted"
                );
            }
            // The node's own address is served as before, by tc and by XDP.
            round_trip(
                node,
                sa(CLIENT, 41_010),
                sa(NODE_IP, 30080),
                sa(BACKEND, 8080),
                L4::TcpSyn,
                false,
            );
            let frame = build(sa(CLIENT, 41_011), sa(NODE_IP, 30053), L4::Udp, b"ping");
            let (action, _) = run_xdp(node, &frame);
            assert_ne!(
                action, XDP_DROP,
                "a datagram to the node IP is not XDP's to drop"
            );
            let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "a datagram to the node IP");
            assert_eq!(out.destination(), sa(BACKEND, 5353));
        },
    );
}

/// A pod's packets to an LB IP guarded by source ranges (the socket hooks leave them alone):
/// `kpr_tc_reply` on the pod's veth judges the pod's address like kube-proxy's KUBE-FW chain,
/// then DNATs and masquerades (KUBE-EXT, eTP Cluster); outside the ranges they are dropped.
/// Other frontends are not its business: a pod's packet to a NodePort passes untouched.
#[test]
fn pods_reach_guarded_lb_ips_through_the_reply_program() {
    with_node(|node| {
        program_services(node);
        let lb = sa(LB_IP, 80);
        let outside = sa("10.244.1.7", 43_000);
        let frame = build(outside, lb, L4::TcpSyn, b"");
        let out = node
            .dataplane
            .test_run_tc(program_names::TC_REPLY, &frame, node.pod0)
            .expect("test_run");
        assert_eq!(out.action, TC_ACT_SHOT, "a pod outside the ranges");
        assert!(ct_entry(node, &ct_key(outside, lb, 6)).is_none());

        let inside = sa("10.244.1.200", 43_001);
        let frame = build(inside, lb, L4::TcpSyn, b"ping");
        let (action, out) = run(node, program_names::TC_REPLY, &frame, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT, "a pod inside the ranges");
        assert_eq!(out.destination(), sa(BACKEND, 8080), "DNAT");
        assert_eq!(
            out.src,
            NODE_IP.parse::<IpAddr>().expect("ip"),
            "masqueraded"
        );
        let (action, again) = run(node, program_names::TC_REPLY, &frame, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(
            (again.source(), again.destination()),
            (out.source(), out.destination()),
            "the flow's next packet takes its conntrack entry"
        );
        let answer = build(sa(BACKEND, 8080), out.source(), L4::TcpSyn, b"pong");
        let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT, "the backend's reply");
        assert_eq!((back.source(), back.destination()), (lb, inside));

        let node_port = build(inside, sa(NODE_IP, 30080), L4::TcpSyn, b"");
        let out = node
            .dataplane
            .test_run_tc(program_names::TC_REPLY, &node_port, node.pod0)
            .expect("test_run");
        assert_eq!(
            out.action, TC_ACT_UNSPEC,
            "TC_ACT_UNSPEC (TCX_NEXT): the socket hooks' business, and other programs' too"
        );
        assert_eq!(out.packet, node_port, "untouched");
    });
}

#[test]
fn no_endpoints_answers_port_unreachable() {
    with_node(|node| {
        program_services(node);
        let cases = [
            (L4::TcpSyn, 30083, 43_000),
            (L4::Sctp, 30869, 43_100),
            (L4::SctpData, 30869, 43_200),
        ];
        for (l4, node_port, client_port) in cases {
            for (client, frontend, icmp_proto, type_code) in [
                (
                    sa(CLIENT, client_port),
                    sa(NODE_IP, node_port),
                    PROTO_ICMP,
                    [3u8, 3],
                ),
                (
                    sa(CLIENT6, client_port + 1),
                    sa(NODE_IP6, node_port),
                    PROTO_ICMPV6,
                    [1u8, 4],
                ),
            ] {
                let what = format!("{l4:?} {client} → {frontend}");
                let frame = build(client, frontend, l4, b"");
                let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT, "{what}: sent back out of ext0");
                assert_eq!(out.proto, icmp_proto, "{what}");
                assert_eq!(out.src, frontend.ip(), "{what}: from the address wanted");
                assert_eq!(out.dst, client.ip(), "{what}");
                assert_eq!(out.l4[..2], type_code, "{what}: port unreachable");
                // Ethernet addresses swapped: back to the sender.
                assert_eq!(out.eth_dst[..], frame[6..12]);
                assert_eq!(out.eth_src[..], frame[0..6]);
                // The quote: the original IP header and the first 8 bytes of L4 (for SCTP the
                // ports and the verification tag, what the sender matches the error by).
                let ip_len = if client.is_ipv4() { 20 } else { 40 };
                let quote = &frame[14..14 + ip_len + 8];
                assert_eq!(&out.l4[8..], quote, "{what}: quoted original");
                eprintln!(
                    "{what}: ICMP type/code {type_code:?}, {} bytes",
                    out.l4.len()
                );
            }
        }
    });
}

/// Hygiene: REJECT replies are rate-limited per client like the kernel's
/// `icmp_ratelimit` (a bucket of 6, then one per interval). With an interval of an hour nothing
/// refills during the test: of 20 SYNs from one client to a NodePort without endpoints exactly
/// 6 get a port unreachable, 14 are dropped (and counted); another client has its own bucket.
#[test]
fn reject_replies_are_rate_limited_per_client() {
    let hour = Some(std::time::Duration::from_secs(3600));
    with_node_path(LbOptions::default(), false, hour, SNAT_PORTS, |node| {
        program_services(node);
        let frontend = sa(NODE_IP, 30083);
        let mut replies = 0;
        for port in 0..20 {
            let frame = build(sa(CLIENT, 44_000 + port), frontend, L4::TcpSyn, b"");
            let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
            if action == TC_ACT_REDIRECT {
                assert_eq!(out.proto, PROTO_ICMP, "a reply is the port unreachable");
                replies += 1;
            } else {
                assert_eq!(
                    action, TC_ACT_SHOT,
                    "beyond the bucket the packet is dropped"
                );
            }
        }
        assert_eq!(replies, 6, "the bucket holds 6 replies");
        let other = build(sa("203.0.113.7", 44_100), frontend, L4::TcpSyn, b"");
        let (action, _) = run(node, program_names::TC_EXTERNAL, &other, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT, "another client has its own bucket");
        let limited = node
            .dataplane
            .stats()
            .into_iter()
            .find(|(index, _)| *index == StatIndex::TcRejectRateLimited)
            .map(|(_, value)| value);
        assert_eq!(limited, Some(14));
    });
}

/// Offset of the L4 header in frames from `build` (no IP options or extension headers).
fn l4_offset(client: SocketAddr) -> usize {
    14 + if client.is_ipv4() { 20 } else { 40 }
}

/// The CRC32c as stored in an SCTP segment and as recomputed from scratch over it.
fn sctp_crcs(l4: &[u8]) -> (u32, u32) {
    let stored = u32::from_le_bytes([l4[8], l4[9], l4[10], l4[11]]);
    let mut zeroed = l4.to_vec();
    zeroed[8..12].fill(0);
    (stored, crc32c(&zeroed))
}

/// SCTP through a NodePort whose targetPort differs from the port, so the destination port,
/// the SNAT source port and with them the CRC32c change: INIT and DATA (payloads of several
/// lengths, so different bits of the length-dependent CRC shift are used), both families, both
/// directions, and the eTP Local variant (only the destination port changes).
#[test]
fn sctp_node_port_translation_keeps_the_crc32c_valid() {
    with_node(|node| {
        program_services(node);
        let mut port = 44_000;
        for (client_ip, node_ip, backend_ip) in
            [(CLIENT, NODE_IP, BACKEND), (CLIENT6, NODE_IP6, BACKEND6)]
        {
            for l4 in [L4::Sctp, L4::SctpData] {
                port += 1;
                let (client, frontend) = (sa(client_ip, port), sa(node_ip, 30868));
                round_trip(node, client, frontend, sa(backend_ip, 3869), l4, false);
                // Another packet of the flow (from conntrack) with a longer payload.
                let payload = vec![0xa5u8; 1000 + port as usize % 7];
                let frame = build(client, frontend, l4, &payload);
                let (before, _) = sctp_crcs(&frame[l4_offset(client)..]);
                let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT);
                let (after, recomputed) = sctp_crcs(&out.l4);
                assert_eq!(after, recomputed, "{l4:?} {client}: CRC32c after NAT");
                assert_ne!(
                    before, after,
                    "{l4:?} {client}: the port change must change the CRC"
                );
                assert_eq!(out.destination(), sa(backend_ip, 3869));
                assert_eq!(
                    out.l4[4..8],
                    frame[l4_offset(client) + 4..][..4],
                    "verification tag kept"
                );
                eprintln!(
                    "SCTP {l4:?} {client} → {frontend} ⇒ {} → {}: {} bytes, CRC32c {before:#010x} → {after:#010x} (recomputed {recomputed:#010x})",
                    out.source(),
                    out.destination(),
                    out.l4.len()
                );
            }
        }
        round_trip(
            node,
            sa(CLIENT, 44_100),
            sa(NODE_IP, 30870),
            sa(BACKEND, 3869),
            L4::SctpData,
            true,
        );
    });
}

/// A packet whose CRC32c is wrong on arrival is still translated (checking it would mean a
/// pass over the payload), and the delta update keeps it wrong by exactly the same error, so
/// the backend's SCTP stack drops it as it would have dropped the untranslated packet.
#[test]
fn sctp_bad_crc_stays_bad_by_the_same_error() {
    with_node(|node| {
        program_services(node);
        for (client, frontend) in [
            (sa(CLIENT, 45_000), sa(NODE_IP, 30868)),
            (sa(CLIENT6, 45_001), sa(NODE_IP6, 30868)),
        ] {
            let mut frame = build(client, frontend, L4::SctpData, b"corrupted in flight");
            let l4_offset = l4_offset(client);
            let error = 0x0040_0001u32;
            for (i, b) in error.to_le_bytes().iter().enumerate() {
                frame[l4_offset + 8 + i] ^= b;
            }
            let out = node
                .dataplane
                .test_run_tc(program_names::TC_EXTERNAL, &frame, node.ext0)
                .expect("test_run");
            assert_eq!(out.action, TC_ACT_REDIRECT, "{client}: translated anyway");
            assert!(
                parse_checked(&out.packet).is_err(),
                "{client}: still invalid"
            );
            let seg = &out.packet[l4_offset..];
            assert_eq!(u16::from_be_bytes([seg[2], seg[3]]), 3869, "{client}: DNAT");
            let (stored, recomputed) = sctp_crcs(seg);
            assert_eq!(
                stored ^ recomputed,
                error,
                "{client}: same CRC error after NAT"
            );
            eprintln!(
                "{client}: CRC error {error:#010x} in, {:#010x} out",
                stored ^ recomputed
            );
        }
    });
}

/// A short SCTP packet (SHUTDOWN COMPLETE, 16 bytes) in a frame padded to Ethernet's 60-byte
/// minimum: at tc ingress the padding is still in the skb, so the CRC length must come from the
/// IP header, not from the skb length.
#[test]
fn sctp_short_padded_frame_uses_the_ip_length() {
    with_node(|node| {
        program_services(node);
        let (client, frontend) = (sa(CLIENT, 46_000), sa(NODE_IP, 30868));
        let mut frame = build(client, frontend, L4::SctpData, b"");
        // Common header + one 4-byte chunk (type 14, flag T: tag reflected).
        frame.truncate(14 + 20 + 12);
        frame.extend_from_slice(&[14, 1, 0, 4]);
        let total = (20 + 16u16).to_be_bytes();
        frame[16..18].copy_from_slice(&total);
        frame[24..26].fill(0);
        let ip_csum = inet_checksum(&frame[14..34]);
        frame[24..26].copy_from_slice(&ip_csum.to_be_bytes());
        frame[34 + 8..34 + 12].fill(0);
        let crc = crc32c(&frame[34..]);
        frame[34 + 8..34 + 12].copy_from_slice(&crc.to_le_bytes());
        frame.resize(60, 0);
        parse_checked(&frame).expect("crafted frame valid");
        let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(out.destination(), sa(BACKEND, 3869));
        assert_eq!(out.l4.len(), 16);
        eprintln!(
            "padded SHUTDOWN COMPLETE: 60-byte frame, 16-byte SCTP packet, CRC32c {crc:#010x} → {:#010x} (valid)",
            sctp_crcs(&out.l4).0
        );
    });
}

/// IPv4 options move the SCTP header: the rewrite and the CRC length follow the IHL.
#[test]
fn sctp_behind_ipv4_options_is_translated_with_a_valid_crc32c() {
    with_node(|node| {
        program_services(node);
        let (client, frontend) = (sa(CLIENT, 48_000), sa(NODE_IP, 30868));
        let plain = build(client, frontend, L4::SctpData, b"options ahead");
        // Four bytes of options (NOP, NOP, NOP, end of list): IHL 6, total length + 4.
        let mut frame = plain[..34].to_vec();
        frame.extend_from_slice(&[1, 1, 1, 0]);
        frame.extend_from_slice(&plain[34..]);
        frame[14] = 0x46;
        let total = u16::from_be_bytes([frame[16], frame[17]]) + 4;
        frame[16..18].copy_from_slice(&total.to_be_bytes());
        frame[24..26].fill(0);
        let ip_csum = inet_checksum(&frame[14..38]);
        frame[24..26].copy_from_slice(&ip_csum.to_be_bytes());
        let out = node
            .dataplane
            .test_run_tc(program_names::TC_EXTERNAL, &frame, node.ext0)
            .expect("test_run");
        assert_eq!(out.action, TC_ACT_REDIRECT);
        let packet = &out.packet;
        assert_eq!(inet_checksum(&packet[14..38]), 0, "IPv4 header checksum");
        let backend: std::net::Ipv4Addr = BACKEND.parse().expect("ip");
        assert_eq!(packet[30..34], backend.octets(), "DNAT address");
        let seg = &packet[38..];
        assert_eq!(u16::from_be_bytes([seg[2], seg[3]]), 3869, "DNAT port");
        assert_eq!(
            &seg[seg.len() - 16..],
            &plain[plain.len() - 16..],
            "chunk kept"
        );
        let (stored, recomputed) = sctp_crcs(seg);
        assert_eq!(stored, recomputed, "CRC32c behind options");
        eprintln!("IHL 6: SCTP at offset 38, CRC32c {stored:#010x} valid after NAT");
    });
}

/// `bpf_ktime_get_ns`'s clock.
fn monotonic_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("clock");
    u64::try_from(now.tv_sec()).expect("sec") * 1_000_000_000
        + u64::try_from(now.tv_nsec()).expect("nsec")
}

/// Rewrites the forward entry `key` as last seen `age` ago and pointing at `marker_port`, a
/// port no backend has: a packet translated to it was taken from the (still fresh) entry, one
/// translated to the real backend port started a new flow (the entry had expired).
fn age_forward_entry(node: &Node, key: &CtKey, age_s: u64, marker_port: u16) {
    let mut ct = pinned_ct(node);
    let mut value = ct.get(key).expect("forward entry");
    value.last_seen_ns = ago(age_s);
    value.dport = marker_port.to_be();
    ct.insert(key, &value, 0).expect("update entry");
}

/// The tc conntrack through its pins, as another process (the agent's GC, bpftool) would open
/// it.
fn pinned_ct(node: &Node) -> ConntrackMaps<MapData> {
    ConntrackMaps::open_pinned(&node.parts.bpf.path().join(PIN_DIR_NAME)).expect("pinned conntrack")
}

/// `bpf_ktime_get_ns` `age_s` seconds ago.
fn ago(age_s: u64) -> u64 {
    monotonic_ns()
        .checked_sub(age_s * 1_000_000_000)
        .expect("uptime longer than the age")
}

/// Rewrites entry `key` as last seen (a reply entry: created) `age_s` ago, nothing else.
fn age_entry(ct: &mut ConntrackMaps<MapData>, key: &CtKey, age_s: u64) {
    let mut value = ct.get(key).expect("entry to age");
    value.last_seen_ns = ago(age_s);
    ct.insert(key, &value, 0).expect("update entry");
}

/// SCTP entries idle out after 210 s (the kernel's `nf_conntrack_sctp_timeout_established`),
/// UDP ones after 120 s: at 150 s idle an SCTP packet is still translated from its entry and a
/// UDP one starts a new flow; at 220 s the SCTP one does too.
#[test]
fn sctp_conntrack_outlives_udp_and_expires_after_210_s() {
    with_node(|node| {
        program_services(node);
        const MARKER: u16 = 9;
        let cases = [
            (L4::SctpData, 30868, 3869, 150, MARKER),
            (L4::Udp, 30053, 5353, 150, 5353),
            (L4::SctpData, 30868, 3869, 220, 3869),
        ];
        for (i, (l4, node_port, backend_port, age_s, expected)) in cases.into_iter().enumerate() {
            let client = sa(CLIENT, 47_000 + i as u16);
            let frontend = sa(NODE_IP, node_port);
            let frame = build(client, frontend, l4, b"ping");
            let (action, first) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            assert_eq!(first.dport(), backend_port);
            age_forward_entry(node, &ct_key(client, frontend, l4.proto()), age_s, MARKER);
            let (action, again) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            eprintln!(
                "{l4:?} idle {age_s} s: translated to port {} ({})",
                again.dport(),
                if again.dport() == MARKER {
                    "entry kept"
                } else {
                    "new flow"
                }
            );
            assert_eq!(again.dport(), expected, "{l4:?} after {age_s} s idle");
        }
    });
}

/// The `spread` Service: NodePort TCP 30090, eTP Cluster, with one endpoint per address.
fn program_spread(node: &mut Node, backends: &[&str]) {
    program_spread_with(node, backends, "None");
}

/// [`program_spread`] with the given `sessionAffinity`.
fn program_spread_with(node: &mut Node, backends: &[&str], affinity: &str) {
    let yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: spread, namespace: default}}\n\
         spec: {{type: NodePort, clusterIP: 10.96.0.30, sessionAffinity: {affinity}, ports: [\
         {{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30090}}]}}\n"
    );
    let snapshot = single_slice_snapshot("spread", &yaml, backends);
    let (summary, errors) = node.dataplane.apply(&snapshot, None);
    assert!(errors.is_empty(), "apply errors: {errors:?}");
    assert!(summary.frontends_written > 0, "{summary:?}");
}

const FLOWS: u16 = 2000;
const SPREAD_BACKENDS: [&str; 5] = [
    "10.244.1.2",
    "10.244.1.3",
    "10.244.1.4",
    "10.244.1.5",
    "10.244.1.6",
];
/// The backend that leaves between the two rounds.
const LEAVING: &str = "10.244.1.4";

/// Sends one SYN per flow (distinct client ports) to the `spread` NodePort after clearing the
/// tc conntrack, so every flow is new and takes a fresh backend decision; returns each flow's
/// backend address as the program translated it.
fn send_flows(node: &mut Node) -> Vec<IpAddr> {
    let cleared = node.dataplane.clear_conntrack().expect("clear conntrack");
    eprintln!("cleared {cleared} conntrack entries");
    let frontend = sa(NODE_IP, 30090);
    (0..FLOWS)
        .map(|i| {
            let client = sa(CLIENT, 20_000 + i);
            let frame = build(client, frontend, L4::TcpSyn, b"");
            let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "flow {client}: action");
            assert_eq!(out.dport(), 8080, "flow {client}: DNAT port");
            out.dst
        })
        .collect()
}

/// What a change of backends did to the same flows.
struct Disruption {
    /// Share of the flows whose backend stayed in the Service that changed backend anyway.
    survivors_moved: f64,
    /// How the leaving backend's flows spread over the remaining backends.
    leaving_spread: BTreeMap<IpAddr, usize>,
    /// Flows per backend in the first round.
    first: BTreeMap<IpAddr, usize>,
}

/// Sends [`FLOWS`] new flows to 5 backends, removes one backend through the real apply, and
/// sends the same flows (same 5-tuples, conntrack cleared) again.
fn measure_disruption(lb: LbOptions) -> Disruption {
    with_node_lb(lb, |node| {
        program_spread(node, &SPREAD_BACKENDS);
        let before = send_flows(node);
        let remaining: Vec<&str> = SPREAD_BACKENDS
            .into_iter()
            .filter(|b| *b != LEAVING)
            .collect();
        program_spread(node, &remaining);
        let after = send_flows(node);

        let leaving: IpAddr = LEAVING.parse().expect("ip");
        let mut first = BTreeMap::new();
        let mut leaving_spread = BTreeMap::new();
        let (mut survivors, mut moved) = (0usize, 0usize);
        for (old, new) in before.iter().zip(&after) {
            *first.entry(*old).or_insert(0) += 1;
            assert_ne!(*new, leaving, "a flow went to the removed backend");
            if *old == leaving {
                *leaving_spread.entry(*new).or_insert(0) += 1;
            } else {
                survivors += 1;
                moved += usize::from(old != new);
            }
        }
        Disruption {
            survivors_moved: moved as f64 / survivors.max(1) as f64,
            leaving_spread,
            first,
        }
    })
}

/// `--lb-algorithm maglev`: removing one of five backends moves only the flows that were on it
/// (and a few more, from the table refill), where random choice moves most flows; new flows are
/// spread evenly over the backends either way.
#[test]
fn maglev_keeps_most_flows_on_their_backend_when_one_leaves() {
    let maglev = measure_disruption(LbOptions {
        maglev: true,
        ..LbOptions::default()
    });
    let random = measure_disruption(LbOptions::default());
    for (name, d) in [("maglev", &maglev), ("random", &random)] {
        eprintln!(
            "{name}: {:.1}% of the flows of surviving backends moved; first round per backend \
             {:?}; the removed backend's flows went to {:?}",
            d.survivors_moved * 100.0,
            d.first.values().collect::<Vec<_>>(),
            d.leaving_spread.values().collect::<Vec<_>>(),
        );
        assert_eq!(
            d.first.len(),
            SPREAD_BACKENDS.len(),
            "{name}: {:?}",
            d.first
        );
        let even = f64::from(FLOWS) / SPREAD_BACKENDS.len() as f64;
        for (backend, &n) in &d.first {
            let ratio = n as f64 / even;
            assert!(
                (0.75..=1.25).contains(&ratio),
                "{name}: backend {backend} got {n} of {FLOWS} flows"
            );
        }
    }
    assert!(
        maglev.survivors_moved < 0.10,
        "maglev moved {:.1}% of surviving flows",
        maglev.survivors_moved * 100.0
    );
    assert!(
        random.survivors_moved > 0.5,
        "random moved only {:.1}% of surviving flows",
        random.survivors_moved * 100.0
    );
    // The removed backend's flows (about 400) are shared by all four others, none left out.
    let leaving_flows: usize = maglev.leaving_spread.values().sum();
    assert_eq!(maglev.leaving_spread.len(), SPREAD_BACKENDS.len() - 1);
    for (backend, &n) in &maglev.leaving_spread {
        assert!(
            n * 10 >= leaving_flows,
            "maglev: {backend} took only {n} of the removed backend's {leaving_flows} flows"
        );
    }
}

/// Session affinity goes before Maglev: flows of one client with different source ports (which
/// Maglev alone spreads over the backends) all go to the backend of its first flow.
#[test]
fn session_affinity_keeps_priority_over_maglev() {
    let lb = LbOptions {
        maglev: true,
        ..LbOptions::default()
    };
    let backends = with_node_lb(lb, |node| {
        program_spread_with(node, &SPREAD_BACKENDS, "ClientIP");
        let frontend = sa(NODE_IP, 30090);
        (0..50u16)
            .map(|i| {
                let frame = build(sa(CLIENT, 30_000 + i), frontend, L4::TcpSyn, b"");
                let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT);
                out.dst
            })
            .collect::<std::collections::BTreeSet<IpAddr>>()
    });
    eprintln!("50 flows of one client with affinity and maglev went to {backends:?}");
    assert_eq!(backends.len(), 1, "{backends:?}");
}

/// Maglev over IPv6: a dual-stack NodePort's IPv6 flows spread over the backends, and the same
/// tuples get the same backends again after conntrack is cleared (random would not).
#[test]
fn maglev_ipv6_flows_keep_their_backend_for_the_same_tuple() {
    let lb = LbOptions {
        maglev: true,
        ..LbOptions::default()
    };
    let (first, second) = with_node_lb(lb, |node| {
        let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: spread6, namespace: default}\n\
                    spec: {type: NodePort, clusterIP: 'fd00:96::30', clusterIPs: ['fd00:96::30'], \
                    ipFamilies: [IPv6], ipFamilyPolicy: SingleStack, ports: [\
                    {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30091}]}\n";
        let service: Service = serde_yaml::from_str(yaml).expect("service yaml");
        let yaml = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                    metadata: {name: spread6-1, namespace: default, labels: {kubernetes.io/service-name: spread6}}\n\
                    addressType: IPv6\nports: [{name: http, port: 8080, protocol: TCP}]\n\
                    endpoints: [{addresses: ['fd00:244:1::2']}, {addresses: ['fd00:244:1::3']}, \
                    {addresses: ['fd00:244:1::4']}]\n";
        let slice: EndpointSlice = serde_yaml::from_str(yaml).expect("slice yaml");
        let objects = Objects::new(
            BTreeMap::from([(key("spread6"), service.into())]),
            BTreeMap::from([(key("spread6-1"), slice.into())]),
            None,
        );
        let (_, errors) = node
            .dataplane
            .apply(&Snapshot::compute(&objects, NODE), None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        let frontend = sa(NODE_IP6, 30091);
        let round = |node: &mut Node| -> Vec<IpAddr> {
            node.dataplane.clear_conntrack().expect("clear conntrack");
            (0..200u16)
                .map(|i| {
                    let frame = build(sa(CLIENT6, 30_000 + i), frontend, L4::TcpSyn, b"");
                    let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                    assert_eq!(action, TC_ACT_REDIRECT);
                    out.dst
                })
                .collect()
        };
        let first = round(node);
        let second = round(node);
        (first, second)
    });
    let mut counts = BTreeMap::new();
    for backend in &first {
        *counts.entry(*backend).or_insert(0usize) += 1;
    }
    let same = first.iter().zip(&second).filter(|(a, b)| a == b).count();
    eprintln!("IPv6 maglev: flows per backend {counts:?}; {same} of 200 on the same backend again");
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert_eq!(same, first.len());
}

/// How a test flow ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Close {
    /// Not at all (an established, idle connection).
    Open,
    ClientFin,
    ClientRst,
    /// The backend's FIN on the external interface (a remote backend's reply to the SNAT
    /// address goes through `kpr_tc_external`).
    BackendFinExternal,
    /// The backend's RST on the pod interface (`kpr_tc_reply`).
    BackendRstReply,
}

/// Opens a TCP flow client → `NODE_IP`:30080 (eTP Cluster: SNAT) and closes it as `close`
/// says; returns the SNAT address and port the backend sees.
fn open_and_close(node: &mut Node, client: SocketAddr, close: Close) -> SocketAddr {
    let frontend = sa(NODE_IP, 30080);
    let backend = sa(BACKEND, 8080);
    let syn = build(client, frontend, L4::TcpSyn, b"");
    let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
    assert_eq!(action, TC_ACT_REDIRECT, "{client}: SYN");
    assert_eq!(out.destination(), backend, "{client}: DNAT");
    let snat = out.source();
    let (program, frame, ifindex, to) = match close {
        Close::Open => return snat,
        Close::ClientFin => (
            program_names::TC_EXTERNAL,
            build(client, frontend, L4::TcpFin, b""),
            node.ext0,
            backend,
        ),
        Close::ClientRst => (
            program_names::TC_EXTERNAL,
            build(client, frontend, L4::TcpRst, b""),
            node.ext0,
            backend,
        ),
        Close::BackendFinExternal => (
            program_names::TC_EXTERNAL,
            build(backend, snat, L4::TcpFin, b""),
            node.ext0,
            client,
        ),
        Close::BackendRstReply => (
            program_names::TC_REPLY,
            build(backend, snat, L4::TcpRst, b""),
            node.pod0,
            client,
        ),
    };
    let (action, closed) = run(node, program, &frame, ifindex);
    assert_eq!(action, TC_ACT_REDIRECT, "{client}: {close:?}");
    assert_eq!(closed.destination(), to, "{client}: {close:?} translated");
    snat
}

/// A FIN or RST in either direction marks the forward entry closing: it still carries the
/// flow's last packets within the 10 s close timeout, and after it a SYN from the same client
/// tuple picks a backend again, while an established flow idle as long keeps its entry. A SYN
/// on a closing entry (the client reusing its port) starts a new flow at once.
#[test]
fn tcp_fin_or_rst_closes_the_flow_and_a_new_syn_chooses_again() {
    with_node(|node| {
        program_services(node);
        const MARKER: u16 = 9;
        let frontend = sa(NODE_IP, 30080);
        let cases = [
            Close::Open,
            Close::ClientFin,
            Close::ClientRst,
            Close::BackendFinExternal,
            Close::BackendRstReply,
        ];
        for (i, close) in cases.into_iter().enumerate() {
            let client = sa(CLIENT, 41_000 + i as u16);
            open_and_close(node, client, close);
            let key = ct_key(client, frontend, PROTO_TCP);
            let flags = ct_entry(node, &key).expect("forward entry").flags;
            assert_eq!(
                flags & ct_flags::CLOSING != 0,
                close != Close::Open,
                "{close:?}: CLOSING flag in {flags:#x}"
            );
            // 5 s later the last ACK still takes the entry (marked by a fake backend port).
            age_forward_entry(node, &key, 5, MARKER);
            let ack = build(client, frontend, L4::TcpAck, b"");
            let (action, late) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            assert_eq!(
                late.dport(),
                MARKER,
                "{close:?}: ACK 5 s later uses the entry"
            );
            // 11 s idle: past the close timeout, far within the established one.
            age_forward_entry(node, &key, 11, MARKER);
            let syn = build(client, frontend, L4::TcpSyn, b"");
            let (action, again) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            eprintln!(
                "{close:?}: flags {flags:#x}; SYN after 11 s idle → port {} ({})",
                again.dport(),
                if again.dport() == MARKER {
                    "entry kept"
                } else {
                    "new flow"
                }
            );
            let expected = if close == Close::Open { MARKER } else { 8080 };
            assert_eq!(again.dport(), expected, "{close:?}: SYN after 11 s idle");
            let after = ct_entry(node, &key).expect("forward entry");
            assert_eq!(after.flags & ct_flags::CLOSING, 0, "{close:?}: open again");
        }

        // The client reuses its port 2 s after an RST: its SYN starts a new flow at once.
        let client = sa(CLIENT, 41_100);
        let key = ct_key(client, frontend, PROTO_TCP);
        open_and_close(node, client, Close::ClientRst);
        age_forward_entry(node, &key, 2, MARKER);
        let syn = build(client, frontend, L4::TcpSyn, b"");
        let (action, reused) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        eprintln!("SYN 2 s after RST → port {}", reused.dport());
        assert_eq!(reused.dport(), 8080, "SYN on a closing entry: new flow");
    });
}

/// Runs `count` sequential SNATed TCP flows from distinct client ports; with `close`, each is
/// reset by the client and aged past the close timeout before the next one. Returns (flows
/// translated, flows dropped, `tc_snat_port_exhausted` count).
fn sequential_snat_flows(node: &mut Node, count: u16, close: bool) -> (u32, u32, u64) {
    let frontend = sa(NODE_IP, 30080);
    let mut ct = pinned_ct(node);
    let (mut translated, mut dropped) = (0, 0);
    for i in 0..count {
        let client = sa(CLIENT, 10_000 + i);
        let syn = build(client, frontend, L4::TcpSyn, b"");
        let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        if action == TC_ACT_SHOT {
            dropped += 1;
            continue;
        }
        assert_eq!(action, TC_ACT_REDIRECT, "flow {i}");
        assert!(
            (61_000..=65_535).contains(&out.sport()),
            "flow {i}: SNAT port {}",
            out.sport()
        );
        translated += 1;
        if close {
            let rst = build(client, frontend, L4::TcpRst, b"");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &rst, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "flow {i}: RST");
            age_entry(&mut ct, &ct_key(client, frontend, PROTO_TCP), 11);
        } else {
            // The client answers: an open connection, whose port is never taken (an
            // unanswered flow's is, by a new flow that finds no free one).
            let ack = build(client, frontend, L4::TcpAck, b"");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "flow {i}: ACK");
        }
    }
    let exhausted = node
        .dataplane
        .stats()
        .into_iter()
        .find(|(index, _)| *index == StatIndex::TcSnatPortExhausted)
        .map_or(0, |(_, value)| value);
    (translated, dropped, exhausted)
}

/// 6000 short connections from one client to one backend through SNAT with 4536 ports
/// (61000–65535): closed flows give their ports back, so all are translated; connections left
/// open (handshake done) hold theirs, and the ports run out.
#[test]
fn snat_ports_of_closed_flows_are_reused() {
    const FLOWS: u16 = 6_000;
    let ports = 61_000..=65_535;
    let (translated, dropped, exhausted) =
        with_node_path(LbOptions::default(), true, None, ports.clone(), |node| {
            program_services(node);
            sequential_snat_flows(node, FLOWS, true)
        });
    eprintln!(
        "{FLOWS} flows closed by RST: {translated} translated, {dropped} dropped, \
         tc_snat_port_exhausted {exhausted}"
    );
    assert_eq!((translated, dropped, exhausted), (u32::from(FLOWS), 0, 0));

    let (translated, dropped, exhausted) =
        with_node_path(LbOptions::default(), true, None, ports, |node| {
            program_services(node);
            sequential_snat_flows(node, FLOWS, false)
        });
    eprintln!(
        "{FLOWS} flows left open: {translated} translated, {dropped} dropped, \
         tc_snat_port_exhausted {exhausted}"
    );
    assert!(
        translated <= 4_536,
        "more flows than SNAT ports: {translated}"
    );
    assert!(dropped >= u32::from(FLOWS) - 4_536, "dropped {dropped}");
    assert_eq!(u64::from(dropped), exhausted);
}

/// The agent's conntrack GC through the pinned map: a closed flow past the close timeout, a
/// UDP flow past 120 s and a reply entry without its forward entry are deleted; a fresh flow
/// and an established TCP flow idle 11 s stay; the run is counted in the metrics.
#[test]
fn conntrack_gc_deletes_dead_flows_and_keeps_live_ones() {
    with_node(|node| {
        program_services(node);
        let frontend = sa(NODE_IP, 30080);
        let mut ct = pinned_ct(node);
        let mut flow = |node: &mut Node, port: u16, close: Close, age_s: u64| {
            let client = sa(CLIENT, port);
            let snat = open_and_close(node, client, close);
            let forward = ct_key(client, frontend, PROTO_TCP);
            let reply = ct_key(sa(BACKEND, 8080), snat, PROTO_TCP);
            // Both entries as if the flow began `age_s` ago and went quiet.
            age_entry(&mut ct, &forward, age_s);
            age_entry(&mut ct, &reply, age_s);
            (forward, reply)
        };
        let live = flow(node, 42_000, Close::Open, 0);
        let idle = flow(node, 42_001, Close::Open, 11);
        let closed = flow(node, 42_002, Close::ClientRst, 11);
        let closing = flow(node, 42_003, Close::ClientFin, 5);
        let orphan = flow(node, 42_004, Close::BackendRstReply, 11);
        ct.remove(&orphan.0)
            .expect("delete the orphan's forward entry");

        // UDP: 120 s idle timeout.
        let client = sa(CLIENT, 42_005);
        let dns = sa(NODE_IP, 30053);
        let (action, out) = run(
            node,
            program_names::TC_EXTERNAL,
            &build(client, dns, L4::Udp, b"q"),
            node.ext0,
        );
        assert_eq!(action, TC_ACT_REDIRECT);
        let udp = (
            ct_key(client, dns, PROTO_UDP),
            ct_key(sa(BACKEND, 5353), out.source(), PROTO_UDP),
        );
        age_entry(&mut ct, &udp.0, 130);
        age_entry(&mut ct, &udp.1, 130);

        let report = node.dataplane.conntrack_gc().expect("conntrack gc");
        eprintln!("GC: {report:?}");
        let left: Vec<CtKey> = node
            .dataplane
            .conntrack_entries()
            .expect("conntrack")
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        for (what, keys, kept) in [
            ("fresh", live, true),
            ("established, idle 11 s", idle, true),
            ("closing, idle 5 s", closing, true),
            ("closed, idle 11 s", closed, false),
            ("UDP idle 130 s", udp, false),
        ] {
            for key in [keys.0, keys.1] {
                assert_eq!(left.contains(&key), kept, "{what}: {key:?}");
            }
        }
        assert!(!left.contains(&orphan.1), "orphan reply entry");
        assert_eq!(report.deleted_forward, 2, "{report:?}");
        assert_eq!(report.deleted_reply, 3, "{report:?}");
        assert_eq!(report.remaining, left.len(), "{report:?}");
        assert_eq!(left.len(), 6);

        // A second run finds nothing.
        let again = node.dataplane.conntrack_gc().expect("conntrack gc");
        assert_eq!((again.deleted_forward, again.deleted_reply), (0, 0));
        assert_eq!(again.remaining, 6, "{again:?}");
    });
}

/// Hygiene: the conntrack walk resumes where it stopped. 3000 entries are walked in
/// batches of 64; after the first batch, 500 entries it has not reached yet and 20 it has seen
/// are deleted (as GC, a purge, the datapath or LRU eviction would). A key-based walk
/// (`get_next_key` from a deleted key) restarts at the first bucket and visits entries again;
/// this one visits every entry that stayed exactly once and none of the deleted unseen ones.
#[test]
fn conntrack_walk_resumes_after_deletions_and_visits_each_entry_once() {
    use std::collections::{BTreeMap as Counts, BTreeSet};
    use std::os::fd::AsFd as _;

    use proxy_agent::dataplane::ebpf::CtWalk;
    with_node(|node| {
        let mut ct = pinned_ct(node);
        let key_of = |i: u32| CtKey {
            src: [i, 0, 0, 0],
            dst: [0x0a0a_0001, 0, 0, 0],
            sport: 1,
            dport: 2,
            proto: PROTO_UDP,
            family: family::V4,
            _pad: 0,
        };
        let all: Vec<CtKey> = (1..=3000).map(key_of).collect();
        for key in &all {
            ct.insert(key, &CtValue::default(), 0).expect("insert");
        }
        let data = MapData::from_pin(
            node.parts
                .bpf
                .path()
                .join(PIN_DIR_NAME)
                .join(map_names::CT4),
        )
        .expect("conntrack pin");
        let mut walk = CtWalk::new();
        let mut visits: Counts<CtKey, u32> = Counts::new();
        let first: Vec<(CtKey, CtValue)> = walk
            .next_batch::<CtKey4, CtValue4>(data.fd().as_fd(), 64)
            .expect("first batch")
            .into_iter()
            .map(|(k, v)| (k.widen(), v.widen()))
            .collect();
        assert!(!first.is_empty() && !walk.finished());
        for (key, _) in &first {
            *visits.entry(*key).or_default() += 1;
        }
        let seen: BTreeSet<CtKey> = first.iter().map(|(k, _)| *k).collect();
        let deleted_unseen: Vec<CtKey> = all
            .iter()
            .filter(|k| !seen.contains(k))
            .step_by(5)
            .take(500)
            .copied()
            .collect();
        let deleted_seen: Vec<CtKey> = seen.iter().take(20).copied().collect();
        for key in deleted_unseen.iter().chain(&deleted_seen) {
            ct.remove(key).expect("delete");
        }
        let mut batches = 1;
        while !walk.finished() {
            assert!(batches < 10_000, "the walk must end");
            let batch = walk.next_batch::<CtKey4, CtValue4>(data.fd().as_fd(), 64);
            for (key, _) in batch.expect("batch") {
                *visits.entry(key.widen()).or_default() += 1;
            }
            batches += 1;
        }
        let twice: Vec<_> = visits.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "visited more than once: {}", twice.len());
        for key in &deleted_unseen {
            assert!(
                !visits.contains_key(key),
                "a deleted entry was visited: {key:?}"
            );
        }
        let stayed = all
            .iter()
            .filter(|k| !deleted_unseen.contains(k) && !deleted_seen.contains(k));
        let mut stayed_count = 0;
        for key in stayed {
            assert_eq!(visits.get(key), Some(&1), "{key:?}");
            stayed_count += 1;
        }
        eprintln!(
            "{batches} batches, {} entries visited, {stayed_count} stayed",
            visits.len()
        );
        assert_eq!(stayed_count, 3000 - 520);
    });
}

/// Hygiene: purging the conntrack entries of removed backends is handed to the
/// conntrack worker's thread, not done in the apply (a full-table purge took ~0.5 s of the
/// sync loop): the apply only queues it, and the worker deletes the flow's entries after.
#[test]
fn conntrack_purge_runs_off_the_apply() {
    with_node(|node| {
        program_services(node);
        let client = sa(CLIENT, 42_100);
        let dns = sa(NODE_IP, 30053);
        let (action, _) = run(
            node,
            program_names::TC_EXTERNAL,
            &build(client, dns, L4::Udp, b"q"),
            node.ext0,
        );
        assert_eq!(action, TC_ACT_REDIRECT);
        let forward = ct_key(client, dns, PROTO_UDP);
        assert!(ct_entry(node, &forward).is_some(), "the flow's entry");
        // Every Service gone: the UDP NodePort's backend is removed.
        let empty = Snapshot::compute(&Objects::new(BTreeMap::new(), BTreeMap::new(), None), NODE);
        let (summary, errors) = node.dataplane.apply(&empty, None);
        assert!(errors.is_empty(), "{errors:?}");
        assert!(summary.conntrack_purge_queued, "{summary:?}");
        assert_eq!(summary.conntrack_purged, 0, "nothing purged in the apply");
        proxy_tests::wait::wait_until(
            "the worker purged the flow",
            std::time::Duration::from_secs(10),
            std::time::Duration::from_millis(10),
            || {
                node.dataplane
                    .conntrack_worker_reports()
                    .is_some_and(|r| r.purged >= 2)
            },
        )
        .expect("purge");
        assert!(ct_entry(node, &forward).is_none(), "purged");
    });
}

/// A datapath counter's total.
fn stat(node: &Node, index: StatIndex) -> u64 {
    node.dataplane
        .stats()
        .into_iter()
        .find(|(i, _)| *i == index)
        .map_or(0, |(_, value)| value)
}

/// SNAT under load: the client's own source port is kept when it lies in the SNAT
/// range and is free (netfilter's choice, and one SNAT port fewer taken at random); another
/// client with the same port gets another port of the range; a client port outside the range
/// is replaced. Both families.
#[test]
fn snat_keeps_the_client_port_when_free() {
    with_node(|node| {
        program_services(node);
        for (client, other, node_ip, backend) in [
            (CLIENT, "203.0.113.7", NODE_IP, BACKEND),
            (CLIENT6, "fd00:10::3", NODE_IP6, BACKEND6),
        ] {
            let frontend = sa(node_ip, 30080);
            let mut snat = |from: SocketAddr| {
                let syn = build(from, frontend, L4::TcpSyn, b"");
                let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT, "{from}: SYN");
                assert_eq!(out.destination(), sa(backend, 8080), "{from}: DNAT");
                assert_eq!(out.src, node_ip.parse::<IpAddr>().expect("ip"), "{from}");
                out.sport()
            };
            let kept = snat(sa(client, 50_000));
            let second = snat(sa(other, 50_000));
            let outside = snat(sa(client, 40_000));
            eprintln!(
                "{node_ip}: client port 50000 → {kept}; another client's 50000 → {second}; \
                 40000 (outside the range) → {outside}"
            );
            assert_eq!(kept, 50_000, "{node_ip}: the client's port is kept");
            assert_ne!(second, 50_000, "{node_ip}: taken: another port");
            assert!(SNAT_PORTS.contains(&second), "{node_ip}: {second}");
            assert!(SNAT_PORTS.contains(&outside), "{node_ip}: {outside}");
        }
    });
}

/// With a 2-port range (`--bpf-snat-port-range 61000-61001`), a
/// half-open flow (no segment after the client's SYN) and an established one: a third new flow
/// finds no free port and takes the half-open flow's (`tc_snat_port_reclaimed`), never the
/// established one's; with both ports held by established flows the next new flow is dropped
/// and counted (`tc_snat_port_exhausted`, the metric's reason), also after 61 s idle (an
/// established flow keeps its port for 24 h). A half-open flow expires after 60 s, not 24 h:
/// at 61 s idle its port goes to the next new flow as a dead flow's (not counted as
/// reclaimed), and the GC deletes it. Both families.
#[test]
fn half_open_flows_expire_after_60_s_and_exhaustion_is_counted() {
    with_node_path(LbOptions::default(), true, None, 61_000..=61_001, |node| {
        program_services(node);
        let mut ct = pinned_ct(node);
        let (mut exhausted, mut reclaimed) = (0, 0);
        for (client, node_ip, backend) in
            [(CLIENT, NODE_IP, BACKEND), (CLIENT6, NODE_IP6, BACKEND6)]
        {
            let frontend = sa(node_ip, 30080);
            let syn = |node: &mut Node, port: u16| {
                let from = sa(client, port);
                let frame = build(from, frontend, L4::TcpSyn, b"");
                let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                (action, out.sport(), ct_key(from, frontend, PROTO_TCP))
            };
            let segment = |node: &mut Node, port: u16, l4: L4| {
                let frame = build(sa(client, port), frontend, l4, b"");
                run(node, program_names::TC_EXTERNAL, &frame, node.ext0)
            };
            let reply_key = |port: u16| ct_key(sa(backend, 8080), sa(node_ip, port), PROTO_TCP);
            let (action, half_open_port, half_open) = syn(node, 20_000);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: first flow");
            let (action, established_port, established) = syn(node, 20_001);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: second flow");
            assert_ne!(half_open_port, established_port);
            let (action, _) = segment(node, 20_001, L4::TcpAck);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: the second flow's ACK");
            let flags = ct_entry(node, &established).expect("entry").flags;
            assert_ne!(flags & ct_flags::ESTABLISHED, 0, "{node_ip}: {flags:#x}");

            // No free port: the half-open flow's is taken, its entry goes with it.
            let (action, port, _) = syn(node, 20_002);
            assert_eq!(
                action, TC_ACT_REDIRECT,
                "{node_ip}: the half-open flow's port"
            );
            assert_eq!(port, half_open_port, "{node_ip}");
            reclaimed += 1;
            assert_eq!(stat(node, StatIndex::TcSnatPortReclaimed), reclaimed);
            assert!(
                ct_entry(node, &half_open).is_none(),
                "{node_ip}: taken over"
            );
            let (action, _) = segment(node, 20_002, L4::TcpAck);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: the third flow's ACK");

            // Both ports held by established flows, also idle 61 s.
            let (action, _, _) = syn(node, 20_003);
            assert_eq!(action, TC_ACT_SHOT, "{node_ip}: both ports in use");
            exhausted += 1;
            assert_eq!(stat(node, StatIndex::TcSnatPortExhausted), exhausted);
            age_entry(&mut ct, &established, 61);
            let (action, _, _) = syn(node, 20_004);
            assert_eq!(action, TC_ACT_SHOT, "{node_ip}: still in use after 61 s");
            exhausted += 1;
            let (action, again) = segment(node, 20_001, L4::TcpAck);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: established flow kept");
            assert_eq!(again.sport(), established_port, "{node_ip}");

            // The third flow closes: its port is free for a new half-open flow, which at 61 s
            // idle is dead, its port taken as such.
            let (action, _) = segment(node, 20_002, L4::TcpRst);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: the third flow's RST");
            let (action, port, expiring) = syn(node, 20_005);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: a closed flow's port");
            assert_eq!(port, half_open_port, "{node_ip}");
            age_entry(&mut ct, &expiring, 61);
            let (action, port, _) = syn(node, 20_006);
            eprintln!(
                "{node_ip}: after 61 s idle a new flow takes port {port} (half-open flow's \
                 {half_open_port}, established flow's {established_port})"
            );
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: expired port reused");
            assert_eq!(port, half_open_port, "{node_ip}");
            assert_eq!(
                stat(node, StatIndex::TcSnatPortReclaimed),
                reclaimed,
                "{node_ip}: an expired flow's port is not a live one's taken"
            );

            // The GC: the new half-open flow, idle 61 s with its reply entry, goes; the
            // established flow stays.
            let newest = ct_key(sa(client, 20_006), frontend, PROTO_TCP);
            age_entry(&mut ct, &newest, 61);
            let reply = reply_key(port);
            age_entry(&mut ct, &reply, 61);
            let report = node.dataplane.conntrack_gc().expect("gc");
            eprintln!("{node_ip}: GC {report:?}");
            let left: Vec<CtKey> = node
                .dataplane
                .conntrack_entries()
                .expect("conntrack")
                .into_iter()
                .map(|(key, _)| key)
                .collect();
            assert!(
                !left.contains(&newest),
                "{node_ip}: half-open entry deleted"
            );
            assert!(!left.contains(&reply), "{node_ip}: its reply entry deleted");
            assert!(left.contains(&established), "{node_ip}: established kept");
        }
        assert_eq!(stat(node, StatIndex::TcSnatPortExhausted), exhausted);
    });
}

/// Conntrack under pressure: the LRU evicts the forward entry
/// of a live SNATed TCP flow (deleted here, as eviction would). With a 1-port range: the
/// client's next segment recovers the flow from its reply entry — same backend, same SNAT
/// port, counted as `tc_ct_midstream_recovered` — and is translated; a new flow does not get
/// the flow's SNAT port while its reply entry is live (dropped, counted as exhaustion); evicted
/// again, the backend's next segment is translated back to the client and rebuilds the forward
/// entry (a reply checks its forward entry at most once a second, so that is within a second
/// of the eviction, given traffic from the backend). With both entries gone the flow is
/// written again from its own choice (same backend, same port); with its port taken by a new
/// flow meanwhile, the segment goes to the stack untranslated. Both families.
#[test]
fn evicted_forward_entry_keeps_its_snat_port_and_is_rebuilt() {
    with_node_path(LbOptions::default(), true, None, 61_000..=61_000, |node| {
        program_services(node);
        // What the agent does after its first sync: from then on a segment without any entry
        // is one of the datapath's own flows.
        node.dataplane.adopt_kernel_nat_flows();
        let mut ct = pinned_ct(node);
        for (i, (client, other, node_ip, backend)) in [
            (CLIENT, "203.0.113.7", NODE_IP, BACKEND),
            (CLIENT6, "fd00:10::3", NODE_IP6, BACKEND6),
        ]
        .into_iter()
        .enumerate()
        {
            let n = i as u64 + 1;
            let client = sa(client, 20_000);
            let frontend = sa(node_ip, 30080);
            let backend = sa(backend, 8080);
            let syn = build(client, frontend, L4::TcpSyn, b"");
            let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            let snat = out.source();
            assert_eq!(snat.port(), 61_000);
            let ack = build(client, frontend, L4::TcpAck, b"data");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);

            let forward = ct_key(client, frontend, PROTO_TCP);
            ct.remove(&forward).expect("evict the forward entry");
            let (action, recovered) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(
                action, TC_ACT_REDIRECT,
                "{node_ip}: mid-stream without entry"
            );
            assert_eq!(
                (recovered.source(), recovered.destination()),
                (snat, backend),
                "{node_ip}: recovered to its own backend and port"
            );
            assert_eq!(stat(node, StatIndex::TcMidstreamRecovered), n, "{node_ip}");
            let entry = ct_entry(node, &forward).expect("forward entry recovered");
            assert_ne!(entry.flags & ct_flags::ESTABLISHED, 0, "{node_ip}");

            let newcomer = build(sa(other, 20_001), frontend, L4::TcpSyn, b"");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &newcomer, node.ext0);
            assert_eq!(
                action, TC_ACT_SHOT,
                "{node_ip}: the live flow's port is not free"
            );
            assert_eq!(stat(node, StatIndex::TcSnatPortExhausted), n, "{node_ip}");

            // A reply checks its forward entry at most once a second (with its refresh): the
            // backend answers 2 s after the flow's last reply.
            ct.remove(&forward).expect("evict the forward entry again");
            age_entry(&mut ct, &ct_key(backend, snat, PROTO_TCP), 2);
            let answer = build(backend, snat, L4::TcpAck, b"pong");
            let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: reply");
            assert_eq!((back.source(), back.destination()), (frontend, client));
            assert_eq!(stat(node, StatIndex::TcForwardRebuilt), n, "{node_ip}");
            let rebuilt = ct_entry(node, &forward).expect("forward entry rebuilt");
            assert_eq!(rebuilt.dst, words(backend.ip()), "{node_ip}");
            assert_eq!(rebuilt.sport, 61_000u16.to_be(), "{node_ip}");
            let (action, again) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: translated again");
            assert_eq!((again.source(), again.destination()), (snat, backend));

            // Both directions evicted: written again from the flow's own choice — the same
            // backend (the Service has not changed) and the only port of the range.
            ct.remove(&forward).expect("evict the forward entry");
            let reply = ct_key(backend, snat, PROTO_TCP);
            ct.remove(&reply).expect("evict the reply entry");
            let (action, recreated) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: both entries gone");
            assert_eq!(
                (recreated.source(), recreated.destination()),
                (snat, backend),
                "{node_ip}: recreated with its own backend and port"
            );
            assert_eq!(stat(node, StatIndex::TcMidstreamRecreated), n, "{node_ip}");

            // Both evicted and the port taken by a new flow meanwhile: the segment is not
            // sent from a port another flow holds, nor to a backend chosen anew.
            ct.remove(&forward).expect("evict the forward entry");
            ct.remove(&reply).expect("evict the reply entry");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &newcomer, node.ext0);
            assert_eq!(
                action, TC_ACT_REDIRECT,
                "{node_ip}: the newcomer gets the port"
            );
            let passed_before = stat(node, StatIndex::TcMidstreamPassed);
            let (action, passed) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(
                action, TC_ACT_UNSPEC,
                "{node_ip}: port held by another flow"
            );
            assert_eq!(passed.destination(), frontend, "{node_ip}: not re-balanced");
            assert_eq!(
                stat(node, StatIndex::TcMidstreamPassed),
                passed_before + 1,
                "{node_ip}"
            );
            assert!(
                ct_entry(node, &forward).is_none(),
                "{node_ip}: no entry made"
            );
            eprintln!("{node_ip}: evicted forward entry recovered: {snat} → {backend} kept");
        }
        // Without SNAT (eTP Local): the reply entry is keyed by the client's own tuple.
        let client = sa(CLIENT, 40_000);
        let local = sa(NODE_IP, 30081);
        let syn = build(client, local, L4::TcpSyn, b"");
        let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT, "eTP Local");
        ct.remove(&ct_key(client, local, PROTO_TCP))
            .expect("evict the forward entry");
        let ack = build(client, local, L4::TcpAck, b"data");
        let (action, recovered) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT, "eTP Local: recovered");
        assert_eq!(
            (recovered.source(), recovered.destination()),
            (client, out.destination()),
            "eTP Local: the client's address kept, the same backend"
        );
        assert_eq!(stat(node, StatIndex::TcMidstreamRecovered), 3);
    });
}

/// Takeover: until the agent has adopted the flows the kernel's conntrack
/// NATs (`node_flags::KERNEL_FLOWS`, from its start to the adoption after its first sync), a
/// TCP segment without any entry may be one of those and goes to the stack, where the
/// kernel's NAT carries it; afterwards it is taken for an evicted flow of the datapath's own
/// and written again from the flow's choice.
#[test]
fn segments_without_entries_are_left_to_the_kernel_until_its_flows_are_adopted() {
    with_node_path(LbOptions::default(), true, None, 61_000..=61_000, |node| {
        program_services(node);
        let client = sa(CLIENT, 20_000);
        let frontend = sa(NODE_IP, 30080);
        let ack = build(client, frontend, L4::TcpAck, b"data");
        let (action, passed) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
        assert_eq!(
            action, TC_ACT_UNSPEC,
            "before the adoption: the kernel's, maybe"
        );
        assert_eq!(passed.destination(), frontend);
        assert_eq!(stat(node, StatIndex::TcMidstreamRecreated), 0);
        node.dataplane.adopt_kernel_nat_flows();
        let (action, out) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
        assert_eq!(
            action, TC_ACT_REDIRECT,
            "after the adoption: the datapath's own"
        );
        assert_eq!(out.destination(), sa(BACKEND, 8080));
        assert_eq!(out.source(), sa(NODE_IP, 61_000));
        assert_eq!(stat(node, StatIndex::TcMidstreamRecreated), 1);
    });
}

/// A backend's segment to a SNAT port whose flow's entries were both evicted
/// (no SYN, no socket of the node on that port) is dropped and counted — the stack
/// would answer it with a reset and end the flow at the backend before the client's next
/// segment writes its entries again. A socket bound to that port keeps its segments, and a
/// port outside the SNAT range is left to the stack. Both families.
#[test]
fn backend_segments_of_evicted_flows_are_dropped_not_reset() {
    with_node_path(LbOptions::default(), true, None, 61_000..=61_000, |node| {
        program_services(node);
        for (n, (node_ip, backend)) in [(NODE_IP, BACKEND), (NODE_IP6, BACKEND6)]
            .into_iter()
            .enumerate()
        {
            let n = n as u64 + 1;
            let backend = sa(backend, 8080);
            let snat = sa(node_ip, 61_000);
            let segment = build(backend, snat, L4::TcpAck, b"pong");
            let (action, _) = run(node, program_names::TC_REPLY, &segment, node.pod0);
            assert_eq!(action, TC_ACT_SHOT, "{node_ip}: orphan segment");
            assert_eq!(
                stat(node, StatIndex::TcOrphanSegmentDropped),
                n,
                "{node_ip}"
            );

            let syn = build(backend, snat, L4::TcpSyn, b"");
            let (action, _) = run(node, program_names::TC_REPLY, &syn, node.pod0);
            assert_eq!(action, TC_ACT_UNSPEC, "{node_ip}: a SYN is the stack's");
            let outside = build(backend, sa(node_ip, 40_000), L4::TcpAck, b"pong");
            let (action, _) = run(node, program_names::TC_REPLY, &outside, node.pod0);
            assert_eq!(action, TC_ACT_UNSPEC, "{node_ip}: not a SNAT port");

            let listener = std::net::TcpListener::bind(snat).expect("bind the SNAT port");
            let (action, _) = run(node, program_names::TC_REPLY, &segment, node.pod0);
            assert_eq!(action, TC_ACT_UNSPEC, "{node_ip}: a socket holds the port");
            drop(listener);
            assert_eq!(
                stat(node, StatIndex::TcOrphanSegmentDropped),
                n,
                "{node_ip}"
            );
        }
    });
}

/// A mid-stream packet whose forward entry was evicted is never sent to
/// another backend. 5 backends, 60 SNATed flows (client ports in and outside the SNAT range,
/// so both the kept client port and the hashed probe sequence are recovered): every forward
/// entry is deleted, as the LRU would, and each client's next segment reaches the backend and
/// comes from the SNAT port its flow had. (A flow without SNAT: the test above.)
#[test]
fn evicted_flows_are_recovered_to_their_own_backends() {
    with_node_path(LbOptions::default(), true, None, 49_152..=65_535, |node| {
        program_services(node);
        program_spread(node, &SPREAD_BACKENDS);
        let frontend = sa(NODE_IP, 30090);
        let clients: Vec<SocketAddr> = (0..30u16)
            .map(|i| sa(CLIENT, 30_000 + i))
            .chain((0..30u16).map(|i| sa(CLIENT, 50_000 + i)))
            .collect();
        let mut flows = Vec::new();
        for client in &clients {
            let syn = build(*client, frontend, L4::TcpSyn, b"");
            let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{client}");
            flows.push((*client, frontend, out.source(), out.destination()));
        }
        let backends: std::collections::BTreeSet<IpAddr> = flows.iter().map(|f| f.3.ip()).collect();
        assert!(backends.len() >= 4, "flows spread over {backends:?}");

        let mut ct = pinned_ct(node);
        let forward: Vec<CtKey> = ct
            .entries()
            .into_iter()
            .filter(|(_, v)| v.flags & ct_flags::REPLY == 0)
            .map(|(k, _)| k)
            .collect();
        assert_eq!(forward.len(), flows.len(), "one forward entry per flow");
        for key in &forward {
            ct.remove(key).expect("evict");
        }
        let recovered_before = stat(node, StatIndex::TcMidstreamRecovered);
        for (client, frontend, source, backend) in &flows {
            let ack = build(*client, *frontend, L4::TcpAck, b"data");
            let (action, out) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{client}: recovered");
            assert_eq!(
                (out.source(), out.destination()),
                (*source, *backend),
                "{client}: same backend and source port as before the eviction"
            );
        }
        assert_eq!(
            stat(node, StatIndex::TcMidstreamRecovered) - recovered_before,
            flows.len() as u64
        );
        eprintln!(
            "{} evicted flows over {} backends recovered to their own backends and ports",
            flows.len(),
            backends.len()
        );
    });
}

/// A flow without SNAT never overwrites another live flow's reply entry. The same
/// client tuple reaches the eTP Local NodePort 30081 on two node addresses: both flows go to
/// the same backend port, so their reply entries would share a key. The second is dropped and
/// counted (`tc_ct_reply_clash`), and the first flow's replies still come from its own
/// frontend. Once the first flow is closed (FIN or RST), the second gets in.
#[test]
fn reply_entry_of_another_live_flow_is_never_overwritten() {
    with_node(|node| {
        program_services(node);
        let client = sa(CLIENT, 20_000);
        let first = sa(NODE_IP, 30081);
        let second = sa("10.244.1.1", 30081);
        let backend = sa(BACKEND, 8080);
        let (action, out) = run(
            node,
            program_names::TC_EXTERNAL,
            &build(client, first, L4::TcpSyn, b""),
            node.ext0,
        );
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!((out.source(), out.destination()), (client, backend));
        let (action, _) = run(
            node,
            program_names::TC_EXTERNAL,
            &build(client, second, L4::TcpSyn, b""),
            node.ext0,
        );
        assert_eq!(
            action, TC_ACT_SHOT,
            "the second flow would take the reply entry"
        );
        assert_eq!(stat(node, StatIndex::TcReplyClash), 1);
        let answer = build(backend, client, L4::TcpAck, b"pong");
        let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(
            back.source(),
            first,
            "the first flow's replies keep its frontend"
        );

        // Closed (RST): the first flow no longer holds the tuple (as netfilter lets a new
        // connection take a TIME_WAIT/CLOSE tuple), and the second flow takes it at once.
        let rst = build(client, first, L4::TcpRst, b"");
        let (action, _) = run(node, program_names::TC_EXTERNAL, &rst, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        let (action, _) = run(
            node,
            program_names::TC_EXTERNAL,
            &build(client, second, L4::TcpSyn, b""),
            node.ext0,
        );
        assert_eq!(
            action, TC_ACT_REDIRECT,
            "a closed flow's reply entry is replaced"
        );
        let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(back.source(), second);
    });
}

/// The SNAT range is reserved from the ephemeral ports of the agent's network
/// namespace (`ip_local_reserved_ports` is per namespace: the host's is never touched here)
/// and released again (`--cleanup`, a switch to iptables mode), keeping ports reserved by
/// others.
#[test]
fn snat_range_is_reserved_from_local_ports() {
    let host_before = std::fs::read_to_string(reserved_ports::SYSCTL).expect("host sysctl");
    let (started, released, none) =
        with_node_path(LbOptions::default(), true, None, 50_000..=50_999, |_node| {
            let started = std::fs::read_to_string(reserved_ports::SYSCTL).expect("sysctl");
            std::fs::write(reserved_ports::SYSCTL, "8080,50000-50999").expect("add a port");
            reserved_ports::release(&(50_000..=50_999));
            let released = std::fs::read_to_string(reserved_ports::SYSCTL).expect("sysctl");
            reserved_ports::release(&(8080..=8080));
            let none = std::fs::read_to_string(reserved_ports::SYSCTL).expect("sysctl");
            (started, released, none)
        });
    eprintln!("after start: {started:?}; after release: {released:?}, then {none:?}");
    assert_eq!(started.trim(), "50000-50999");
    assert_eq!(released.trim(), "8080");
    assert_eq!(none.trim(), "", "the last reserved port released");
    let host_after = std::fs::read_to_string(reserved_ports::SYSCTL).expect("host sysctl");
    assert_eq!(host_before, host_after, "the host's sysctl is untouched");
}

/// The `race` ClusterIP Service 10.96.0.40:80 → 8080 with one endpoint per address.
fn race_snapshot(backends: &[&str]) -> Snapshot {
    let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: race, namespace: default}\n\
                spec: {clusterIP: 10.96.0.40, ports: [{name: http, port: 80, protocol: TCP, \
                targetPort: 8080}]}\n";
    single_slice_snapshot("race", yaml, backends)
}

/// Service `name` (from `service_yaml`) with one ready IPv4 endpoint on this node per address
/// in `backends`, port `http` 8080, in the slice `<name>-4`.
fn single_slice_snapshot(name: &str, service_yaml: &str, backends: &[&str]) -> Snapshot {
    let service: Service = serde_yaml::from_str(service_yaml).expect("service yaml");
    let endpoints: Vec<String> = backends
        .iter()
        .map(|addr| {
            format!("{{addresses: ['{addr}'], nodeName: {NODE}, conditions: {{ready: true}}}}")
        })
        .collect();
    let yaml = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: {name}-4, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\n\
         addressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\n\
         endpoints: [{}]\n",
        endpoints.join(", ")
    );
    let slice: EndpointSlice = serde_yaml::from_str(&yaml).expect("slice yaml");
    let objects = Objects::new(
        BTreeMap::from([(key(name), service.into())]),
        BTreeMap::from([(key(&format!("{name}-4")), slice.into())]),
        None,
    );
    Snapshot::compute(&objects, NODE)
}

/// No spurious refusals (a stress guard, not a proof of the re-read): a process in
/// the hooks' cgroup connects to a ClusterIP 3000 times (each a new socket, served by echo
/// servers on the node's own addresses) while full applies ask the agent's map writer to flip
/// the frontend back and forth as fast as they can (endpoints {.2, .3} and {.2, .3, .4}; each
/// switch writes the new generation, switches, and retires the old one, whose slots and,
/// every other time, backend go a grace later; a flip asked within the grace is deferred).
/// Every connect must reach a backend: the Service always has some. This catches an update
/// order that exposes a generation before its slots exist. `generation_race.rs` races millions
/// of connects against the map writer to catch a slot deleted under a hook's feet.
/// Bounded: 3000 attempts, applies until the client is done.
#[test]
fn connects_racing_generation_switches_are_never_refused() {
    const ATTEMPTS: u32 = 3_000;
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    with_node(|node| {
        let backends = ["10.244.1.2", "10.244.1.3", "10.244.1.4"];
        let mut echoes = Vec::new();
        for (i, addr) in backends.iter().enumerate() {
            let status = std::process::Command::new("ip")
                .args(["addr", "add", &format!("{addr}/32"), "dev", "lo"])
                .status()
                .expect("ip addr");
            assert!(status.success(), "ip addr add {addr}");
            echoes.push(
                proxy_tests::echo::EchoServer::start(
                    &node.netns,
                    &format!("pod{}", i + 1),
                    sa(addr, 8080),
                )
                .expect("echo server"),
            );
        }
        let small = race_snapshot(&backends[..2]);
        let large = race_snapshot(&backends);
        let (_, errors) = node.dataplane.apply(&large, None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        let client = proxy_tests::client::Client::new(node.netns.clone())
            .in_cgroup(node.parts.cgroup.path())
            .timeout(std::time::Duration::from_secs(2));
        let first = client.once(sa("10.96.0.40", 80)).expect("client");
        assert!(
            first.backend().is_some(),
            "translated before the race: {first:?}"
        );
        let racer = std::thread::spawn(move || client.run(sa("10.96.0.40", 80), ATTEMPTS));
        let mut switches = 0u64;
        while !racer.is_finished() {
            let snapshot = if switches.is_multiple_of(2) {
                &small
            } else {
                &large
            };
            let (_, errors) = node.dataplane.apply(snapshot, None);
            assert!(errors.is_empty(), "apply errors: {errors:?}");
            switches += 1;
        }
        let attempts = racer.join().expect("client thread").expect("client run");
        let counts = proxy_tests::client::tally(&attempts);
        eprintln!("{ATTEMPTS} connects during {switches} applies: {counts:?}");
        assert!(switches >= 100, "too few applies to race: {switches}");
        assert!(
            attempts.iter().all(|a| a.backend().is_some()),
            "every connect reaches a backend: {counts:?}"
        );
        drop(echoes);
    });
}

// ---- XDP (`kpr_xdp_external`, `--bpf-xdp`) ----
//
// The oracle is the tc fast path on the same node: XDP must leave a packet of an established
// flow exactly as tc would (addresses, ports, every checksum recomputed here from scratch),
// with the next hop's MACs, and hand everything it cannot finish to tc untouched.

/// A backend on the external network (another node's pod, reached through `ext0`) and the
/// neighbour entries XDP needs (it redirects only to resolved neighbours).
const REMOTE: &str = "10.10.0.9";
const REMOTE6: &str = "fd00:10::9";
const REMOTE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x09];
/// The client's MAC (`packet::build`'s source MAC), as the node's neighbour table knows it.
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

/// `remote`: dual-stack NodePort TCP 30095 → 8080 and UDP 30096 → 5353 on [`REMOTE`] /
/// [`REMOTE6`]; `podside`: NodePort TCP 30097 → 8080 on the local pod [`BACKEND`] (behind
/// `pod0`, not an XDP target); `guarded`: LB IP 198.51.100.20:80 for 203.0.113.0/24 only;
/// `remotelocal`: LB IP 198.51.100.21:80 and NodePort 30099, eTP Local, its one endpoint on
/// another node; `empty`: NodePort TCP 30094 without endpoints. Also writes the neighbour
/// entries of the remote backend and the client on `ext0`.
fn program_remote(node: &mut Node) {
    for (addr, mac) in [
        (REMOTE, REMOTE_MAC),
        (REMOTE6, REMOTE_MAC),
        (CLIENT, CLIENT_MAC),
        (CLIENT6, CLIENT_MAC),
    ] {
        let mac = mac.map(|b| format!("{b:02x}")).join(":");
        // This thread is in the node namespace; the child inherits it.
        let status = std::process::Command::new("ip")
            .args(["neigh", "replace", addr, "lladdr", &mac, "dev", "ext0"])
            .args(["nud", "permanent"])
            .status()
            .expect("ip neigh");
        assert!(status.success(), "ip neigh {addr}");
    }
    let services = [
        "{name: remote, namespace: default}\nspec: {type: NodePort, clusterIP: 10.96.0.60, \
         clusterIPs: [10.96.0.60, 'fd00:96::60'], ipFamilies: [IPv4, IPv6], \
         ipFamilyPolicy: RequireDualStack, ports: [\
         {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30095}, \
         {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30096}, \
         {name: diameter, port: 3868, protocol: SCTP, targetPort: 3869, nodePort: 30098}]}",
        "{name: podside, namespace: default}\nspec: {type: NodePort, clusterIP: 10.96.0.61, \
         ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30097}]}",
        "{name: guarded, namespace: default}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.62, \
         loadBalancerSourceRanges: [203.0.113.0/24], ports: [\
         {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30093}]}\n\
         status: {loadBalancer: {ingress: [{ip: 198.51.100.20}]}}",
        "{name: remotelocal, namespace: default}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.63, \
         externalTrafficPolicy: Local, ports: [\
         {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30099}]}\n\
         status: {loadBalancer: {ingress: [{ip: 198.51.100.21}]}}",
        "{name: empty, namespace: default}\nspec: {type: NodePort, clusterIP: 10.96.0.64, \
         ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30094}]}",
    ];
    let services = services_of(&services);
    let slice = |name: &str, service: &str, family: &str, addr: &str| {
        slice_of(name, service, family, addr, "other")
    };
    let slices = BTreeMap::from([
        slice("remote-4", "remote", "IPv4", REMOTE),
        slice("remote-6", "remote", "IPv6", REMOTE6),
        slice("podside-4", "podside", "IPv4", BACKEND),
        slice("guarded-4", "guarded", "IPv4", REMOTE),
        slice("remotelocal-4", "remotelocal", "IPv4", REMOTE),
    ]);
    let snapshot = Snapshot::compute(&Objects::new(services, slices, None), NODE);
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    assert!(errors.is_empty(), "snapshot errors: {errors:?}");
    let (_, errors) = node.dataplane.apply(&snapshot, None);
    assert!(errors.is_empty(), "apply errors: {errors:?}");
}

/// `ext0`'s MAC, as the fib lookup reports it for packets leaving there.
fn ext0_mac() -> [u8; 6] {
    let addrs = nix::ifaddrs::getifaddrs().expect("getifaddrs");
    for ifaddr in addrs {
        if ifaddr.interface_name != "ext0" {
            continue;
        }
        if let Some(link) = ifaddr.address.as_ref().and_then(|a| a.as_link_addr())
            && let Some(mac) = link.addr()
        {
            return mac;
        }
    }
    panic!("no MAC on ext0");
}

/// The `remote` NodePort flows of the XDP tests: (client, node address, NodePort, backend,
/// backend port, first packet, later packet), TCP and UDP in both families.
const REMOTE_CASES: [(&str, &str, u16, &str, u16, L4, L4); 4] = [
    (CLIENT, NODE_IP, 30095, REMOTE, 8080, L4::TcpSyn, L4::TcpAck),
    (CLIENT, NODE_IP, 30096, REMOTE, 5353, L4::Udp, L4::Udp),
    (
        CLIENT6,
        NODE_IP6,
        30095,
        REMOTE6,
        8080,
        L4::TcpSyn,
        L4::TcpAck,
    ),
    (CLIENT6, NODE_IP6, 30096, REMOTE6, 5353, L4::Udp, L4::Udp),
];

/// Runs the XDP program on `frame` arriving on `ext0`: the action and the output frame.
fn run_xdp(node: &mut Node, frame: &[u8]) -> (u32, Vec<u8>) {
    let out = node
        .dataplane
        .test_run_xdp(frame, node.ext0)
        .expect("xdp test_run");
    (out.action, out.packet)
}

/// `frame` with its L4 checksum replaced by the pseudo-header sum alone, as a local stack
/// leaves it for the device to finish (`CHECKSUM_PARTIAL` over veth).
fn partial_checksum(frame: &[u8]) -> Vec<u8> {
    let parsed = parse_checked(frame).expect("frame");
    let offset = frame.len() - parsed.l4.len();
    let field = offset + if parsed.proto == PROTO_TCP { 16 } else { 6 };
    let pseudo = !l4_checksum(
        parsed.src,
        parsed.dst,
        parsed.proto,
        &vec![0; parsed.l4.len()],
    );
    let mut out = frame.to_vec();
    out[field..field + 2].copy_from_slice(&pseudo.to_be_bytes());
    out
}

/// A flow whose first packet went through tc (as on an interface without XDP,
/// or before XDP was attached): every later packet of the flow, and the backend's replies, are
/// translated by XDP exactly as tc translated the first (SNAT to the node address and port tc
/// chose, DNAT to the backend; replies back to frontend → client), every checksum valid, with
/// the next hop's MACs and `XDP_REDIRECT` to `ext0` (an XDP target: the agent attached the
/// program there). TCP and UDP, IPv4 and IPv6.
#[test]
fn xdp_translates_later_packets_of_tc_flows_and_their_replies() {
    with_node(|node| {
        assert_eq!(
            node.dataplane.xdp_interfaces(),
            vec![("ext0".to_owned(), node.ext0)],
            "XDP on the external interface only"
        );
        program_remote(node);
        let own_mac = ext0_mac();
        for (i, (client, node_ip, port, backend, backend_port, first, later)) in
            REMOTE_CASES.into_iter().enumerate()
        {
            let client = sa(client, 45_000 + i as u16);
            let frontend = sa(node_ip, port);
            let backend = sa(backend, backend_port);
            let what = format!("{first:?} {client} → {frontend}");
            let before = (
                stat(node, StatIndex::XdpEstablished),
                stat(node, StatIndex::XdpReplyTranslated),
            );

            // The first packet: tc starts the flow.
            let syn = build(client, frontend, first, b"hello");
            let (action, by_tc) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{what}: tc");
            assert_eq!(by_tc.destination(), backend, "{what}: tc DNAT");

            // Later packets: XDP, the same translation as tc's.
            let data = build(client, frontend, later, b"data");
            let (action, frame) = run_xdp(node, &data);
            assert_eq!(
                action, XDP_REDIRECT,
                "{what}: XDP takes the established flow"
            );
            let out = parse_checked(&frame)
                .unwrap_or_else(|e| panic!("{what}: XDP output {frame:02x?}: {e}"));
            assert_eq!(out.destination(), backend, "{what}: DNAT");
            assert_eq!(
                out.source(),
                by_tc.source(),
                "{what}: tc's SNAT address and port"
            );
            assert!(out.l4.ends_with(b"data"), "{what}: payload");
            assert_eq!(out.eth_dst, REMOTE_MAC, "{what}: next hop's MAC");
            assert_eq!(out.eth_src, own_mac, "{what}: ext0's MAC");

            // The backend's reply arrives on ext0 too: back to the client from the frontend.
            let reply = build(backend, out.source(), later, b"pong");
            let (action, frame) = run_xdp(node, &reply);
            assert_eq!(action, XDP_REDIRECT, "{what}: XDP takes the reply");
            let back = parse_checked(&frame)
                .unwrap_or_else(|e| panic!("{what}: XDP reply {frame:02x?}: {e}"));
            assert_eq!(back.source(), frontend, "{what}: reply source");
            assert_eq!(back.destination(), client, "{what}: reply destination");
            assert!(back.l4.ends_with(b"pong"), "{what}: reply payload");
            assert_eq!(back.eth_dst, CLIENT_MAC, "{what}: client's MAC");
            assert_eq!(back.eth_src, own_mac, "{what}: reply leaves ext0");

            assert_eq!(
                (
                    stat(node, StatIndex::XdpEstablished),
                    stat(node, StatIndex::XdpReplyTranslated),
                ),
                (before.0 + 1, before.1 + 1),
                "{what}: counted"
            );
        }
    });
}

/// XDP starts a new flow itself, as tc does. The oracle is tc on a flow of
/// another client port started the same way: the same backend (DNAT), the same SNAT address
/// (the node's), a port of the SNAT range. XDP's first packet leaves with every checksum valid,
/// the next hop's MACs and `XDP_REDIRECT`; its conntrack entries are tc's: tc translates the
/// flow's next packet (the first again included) to the same tuple, and the backend's reply
/// comes back to the client from the frontend through XDP and through tc alike. TCP and UDP,
/// IPv4 and IPv6.
#[test]
fn xdp_starts_new_flows_as_tc_does() {
    with_node(|node| {
        program_remote(node);
        let own_mac = ext0_mac();
        for (i, (client_ip, node_ip, port, backend, backend_port, first, later)) in
            REMOTE_CASES.into_iter().enumerate()
        {
            let frontend = sa(node_ip, port);
            let backend = sa(backend, backend_port);
            let oracle = build(sa(client_ip, 45_100 + i as u16), frontend, first, b"hello");
            let (action, by_tc) = run(node, program_names::TC_EXTERNAL, &oracle, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "tc starts {oracle:02x?}");

            let client = sa(client_ip, 45_200 + i as u16);
            let what = format!("{first:?} {client} → {frontend}");
            let translated = stat(node, StatIndex::XdpTranslated);
            let syn = build(client, frontend, first, b"hello");
            let (action, frame) = run_xdp(node, &syn);
            assert_eq!(action, XDP_REDIRECT, "{what}: XDP starts the flow");
            assert_eq!(
                stat(node, StatIndex::XdpTranslated),
                translated + 1,
                "{what}: counted"
            );
            let out = parse_checked(&frame)
                .unwrap_or_else(|e| panic!("{what}: XDP output {frame:02x?}: {e}"));
            assert_eq!(out.destination(), backend, "{what}: tc's backend");
            assert_eq!(out.src, by_tc.src, "{what}: tc's SNAT address");
            let snat_port = out.source().port();
            assert!(
                SNAT_PORTS.contains(&snat_port) || snat_port == client.port(),
                "{what}: SNAT port {snat_port}"
            );
            assert!(out.l4.ends_with(b"hello"), "{what}: payload");
            assert_eq!(out.eth_dst, REMOTE_MAC, "{what}: next hop's MAC");
            assert_eq!(out.eth_src, own_mac, "{what}: ext0's MAC");

            // tc follows XDP's entries: the same packet again, and the next one.
            for (frame, payload) in [
                (&syn, &b"hello"[..]),
                (&build(client, frontend, later, b"data"), b"data"),
            ] {
                let (action, by_tc) = run(node, program_names::TC_EXTERNAL, frame, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT, "{what}: tc");
                assert_eq!(
                    (by_tc.source(), by_tc.destination()),
                    (out.source(), backend),
                    "{what}: tc translates XDP's flow as XDP did"
                );
                assert!(by_tc.l4.ends_with(payload), "{what}: payload through tc");
            }

            // The backend's reply, through XDP and through tc.
            let reply = build(backend, out.source(), later, b"pong");
            let (action, frame) = run_xdp(node, &reply);
            assert_eq!(action, XDP_REDIRECT, "{what}: XDP takes the reply");
            let back = parse_checked(&frame)
                .unwrap_or_else(|e| panic!("{what}: XDP reply {frame:02x?}: {e}"));
            assert_eq!(
                (back.source(), back.destination()),
                (frontend, client),
                "{what}: reply through XDP"
            );
            assert_eq!(back.eth_dst, CLIENT_MAC, "{what}: client's MAC");
            let (action, back) = run(node, program_names::TC_EXTERNAL, &reply, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{what}: tc takes the reply");
            assert_eq!(
                (back.source(), back.destination()),
                (frontend, client),
                "{what}: reply through tc"
            );
        }

        // No endpoints: REJECT is tc's, which answers port unreachable.
        let syn = build(sa(CLIENT, 45_300), sa(NODE_IP, 30094), L4::TcpSyn, b"");
        let (action, out) = run_xdp(node, &syn);
        assert_eq!(
            (action, out == syn),
            (XDP_PASS, true),
            "no endpoints: tc's REJECT"
        );
        let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_eq!(
            (action, out.proto),
            (TC_ACT_REDIRECT, PROTO_ICMP),
            "tc answers port unreachable"
        );

        // A client routed back by another interface (here: none, no route) is tc's, which
        // records the interface the stack delivers its packets to.
        let passed = stat(node, StatIndex::XdpPassedReturnRoute);
        let syn = build(
            sa("192.0.2.77", 45_301),
            sa(NODE_IP, 30095),
            L4::TcpSyn,
            b"",
        );
        let (action, out) = run_xdp(node, &syn);
        assert_eq!(
            (action, out == syn),
            (XDP_PASS, true),
            "no route back by ext0: tc's"
        );
        assert_eq!(stat(node, StatIndex::XdpPassedReturnRoute), passed + 1);
    });
}

/// What XDP cannot finish goes on to tc exactly as it came (and tc then
/// translates it, so nothing is lost): a flow whose next hop is a local pod's veth (not an XDP
/// target), a packet whose L4 checksum is only the pseudo-header sum (`CHECKSUM_PARTIAL`), an
/// ICMP error about a flow, IP fragments, SCTP. A UDP datagram without checksum (IPv4 checksum
/// 0) keeps it 0.
#[test]
fn xdp_passes_to_tc_what_it_cannot_finish() {
    with_node(|node| {
        program_remote(node);

        // A local pod's backend: XDP starts the flow but leaves its packets to tc, which
        // redirects them.
        let client = sa(CLIENT, 46_000);
        let frontend = sa(NODE_IP, 30097);
        let syn = build(client, frontend, L4::TcpSyn, b"");
        let passed = stat(node, StatIndex::XdpPassedToTc);
        let (action, out) = run_xdp(node, &syn);
        assert_eq!(
            (action, out == syn),
            (XDP_PASS, true),
            "next hop pod0 is tc's, from the first packet"
        );
        assert_eq!(stat(node, StatIndex::XdpPassedToTc), passed + 1);
        let (action, by_tc) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(
            by_tc.destination(),
            sa(BACKEND, 8080),
            "the flow XDP started"
        );
        let passed = stat(node, StatIndex::XdpPassedToTc);
        let ack = build(client, frontend, L4::TcpAck, b"data");
        let (action, out) = run_xdp(node, &ack);
        assert_eq!(action, XDP_PASS, "next hop pod0 is tc's");
        assert_eq!(out, ack, "passed untouched");
        assert_eq!(stat(node, StatIndex::XdpPassedToTc), passed + 1);
        let (action, by_tc) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT, "tc translates what XDP passed");
        assert_eq!(by_tc.destination(), sa(BACKEND, 8080));

        // A partial checksum on an established flow XDP would otherwise take.
        let client = sa(CLIENT, 46_001);
        let frontend = sa(NODE_IP, 30095);
        let syn = build(client, frontend, L4::TcpSyn, b"");
        let (action, _) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        let ack = build(client, frontend, L4::TcpAck, b"data");
        let partial = partial_checksum(&ack);
        let counted = stat(node, StatIndex::XdpPassedChecksumPartial);
        let (action, out) = run_xdp(node, &partial);
        assert_eq!(action, XDP_PASS, "partial checksum is tc's");
        assert_eq!(out, partial, "passed untouched");
        assert_eq!(stat(node, StatIndex::XdpPassedChecksumPartial), counted + 1);
        let (action, _) = run_xdp(node, &ack);
        assert_eq!(
            action, XDP_REDIRECT,
            "the same flow with a complete checksum is XDP's"
        );

        // UDP over IPv4 without a checksum keeps none.
        let client = sa(CLIENT, 46_002);
        let frontend = sa(NODE_IP, 30096);
        let first = build(client, frontend, L4::Udp, b"q");
        let (action, _) = run(node, program_names::TC_EXTERNAL, &first, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        let mut bare = build(client, frontend, L4::Udp, b"q2");
        let field = bare.len() - b"q2".len() - 2;
        bare[field..field + 2].fill(0);
        let (action, frame) = run_xdp(node, &bare);
        assert_eq!(action, XDP_REDIRECT);
        let out = parse_checked(&frame).expect("valid output");
        assert_eq!(out.destination(), sa(REMOTE, 5353));
        assert_eq!(&out.l4[6..8], &[0, 0], "no checksum stays no checksum");

        // An ICMP error about the flow (the backend's port unreachable, quoting what XDP sent
        // it) is tc's, which translates outer and quoted headers.
        let error = icmp_error(sa(REMOTE, 5353).ip(), out.src, 3, 3, 0, &frame);
        let (action, passed) = run_xdp(node, &error);
        assert_eq!(
            (action, passed == error),
            (XDP_PASS, true),
            "ICMP errors are tc's"
        );

        // Fragments and SCTP stay with tc, whatever their flow.
        let big = build(client, frontend, L4::Udp, &[7u8; 3000]);
        for piece in fragment(&big, 1400, 0x77) {
            let (action, out) = run_xdp(node, &piece);
            assert_eq!(action, XDP_PASS, "fragments are tc's");
            assert_eq!(out, piece);
        }
        let client = sa(CLIENT, 46_003);
        let sctp = build(client, sa(NODE_IP, 30098), L4::Sctp, b"");
        let (action, _) = run(node, program_names::TC_EXTERNAL, &sctp, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        let data = build(client, sa(NODE_IP, 30098), L4::SctpData, b"chunk");
        let (action, out) = run_xdp(node, &data);
        assert_eq!(action, XDP_PASS, "SCTP is tc's");
        assert_eq!(out, data);
    });
}

/// On the netfilter path (the default) `--bpf-xdp auto` attaches nothing, and the program
/// itself takes no flow there: the translation must be split around FORWARD/POSTROUTING.
#[test]
fn xdp_takes_nothing_on_the_netfilter_path() {
    with_netfilter_node(|node| {
        assert!(node.dataplane.xdp_interfaces().is_empty(), "auto: no XDP");
        program_remote(node);
        let client = sa(CLIENT, 47_000);
        let frontend = sa(NODE_IP, 30095);
        let syn = build(client, frontend, L4::TcpSyn, b"");
        let (action, _) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_eq!(
            action, TC_ACT_UNSPEC,
            "netfilter path: DNAT, then the stack"
        );
        let ack = build(client, frontend, L4::TcpAck, b"data");
        let (action, out) = run_xdp(node, &ack);
        assert_eq!(action, XDP_PASS);
        assert_eq!(out, ack);
        let syn = build(sa(CLIENT, 47_001), frontend, L4::TcpSyn, b"");
        let (action, out) = run_xdp(node, &syn);
        assert_eq!(
            (action, out == syn),
            (XDP_PASS, true),
            "a new flow is tc's there"
        );
    });
}

/// The drops tc makes before any NAT at an LB IP, XDP makes in the driver — a
/// client outside `loadBalancerSourceRanges`, `externalTrafficPolicy: Local` without a local
/// endpoint (kube-proxy's KUBE-FW / KUBE-XLB DROP), at the LB IP and at the NodePort — and tc,
/// the oracle, drops the same packets; a stray mid-stream segment from a refused client goes
/// on to tc, and an allowed client's flow starts.
#[test]
fn xdp_drops_what_tc_drops_before_nat() {
    with_node(|node| {
        program_remote(node);
        let lb = sa("198.51.100.20", 80);
        let refused = sa(CLIENT, 48_000);
        let dropped = stat(node, StatIndex::XdpDroppedSourceRange);
        let syn = build(refused, lb, L4::TcpSyn, b"");
        let (action, _) = run_xdp(node, &syn);
        assert_eq!(action, XDP_DROP, "outside the source ranges");
        assert_eq!(stat(node, StatIndex::XdpDroppedSourceRange), dropped + 1);
        let (action, _) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_eq!(action, TC_ACT_SHOT, "tc drops it too");
        let ack = build(refused, lb, L4::TcpAck, b"");
        let (action, out) = run_xdp(node, &ack);
        assert_eq!(
            (action, out == ack),
            (XDP_PASS, true),
            "a stray segment is tc's"
        );

        let allowed = build(sa("203.0.113.7", 48_001), lb, L4::TcpSyn, b"");
        let (action, out) = run_xdp(node, &allowed);
        assert_eq!(action, XDP_REDIRECT, "an allowed client's flow starts");
        let out = parse_checked(&out).expect("valid output");
        assert_eq!(out.destination(), sa(REMOTE, 8080));

        let no_local = build(sa(CLIENT, 48_002), sa("198.51.100.21", 80), L4::TcpSyn, b"");
        let dropped = stat(node, StatIndex::XdpDroppedNoLocal);
        let (action, _) = run_xdp(node, &no_local);
        assert_eq!(action, XDP_DROP, "eTP Local without local endpoints");
        assert_eq!(stat(node, StatIndex::XdpDroppedNoLocal), dropped + 1);
        let (action, _) = run(node, program_names::TC_EXTERNAL, &no_local, node.ext0);
        assert_eq!(action, TC_ACT_SHOT, "tc drops it too");
        let node_port = build(sa(CLIENT, 48_003), sa(NODE_IP, 30099), L4::TcpSyn, b"");
        let dropped = stat(node, StatIndex::XdpDroppedNoLocal);
        let (action, _) = run_xdp(node, &node_port);
        assert_eq!(
            action, XDP_DROP,
            "eTP Local NodePort without local endpoints"
        );
        assert_eq!(stat(node, StatIndex::XdpDroppedNoLocal), dropped + 1);
        let (action, _) = run(node, program_names::TC_EXTERNAL, &node_port, node.ext0);
        assert_eq!(action, TC_ACT_SHOT, "tc drops it");
    });
}

/// ICMP errors on the fast path: the redirect bypasses the router (the stack) that would
/// answer a packet too big for the link to its next hop, so the program answers it: a
/// datagram to the `remote` NodePort, whose backend is reached by `ext0` at MTU 1280 here, gets
/// fragmentation needed (IPv4, DF) / packet too big (IPv6) naming 1280, from the NodePort's
/// address to the client, quoting the datagram as the client sent it, every checksum valid,
/// back out of `ext0`. One that fits is redirected to the backend; an IPv4 one without DF goes
/// to the stack (which may fragment it), counted. XDP leaves the big ones to tc.
#[test]
fn fast_path_answers_packets_too_big_for_the_next_hop() {
    with_node(|node| {
        program_remote(node);
        // This thread is in the node namespace; the child inherits it.
        let status = std::process::Command::new("ip")
            .args(["link", "set", "ext0", "mtu", "1280"])
            .status()
            .expect("ip link");
        assert!(status.success(), "ip link set ext0 mtu 1280");
        for (client, frontend, backend, icmp_proto, type_code) in [
            (
                sa(CLIENT, 41_000),
                sa(NODE_IP, 30096),
                sa(REMOTE, 5353),
                PROTO_ICMP,
                [3u8, 4],
            ),
            (
                sa(CLIENT6, 41_001),
                sa(NODE_IP6, 30096),
                sa(REMOTE6, 5353),
                PROTO_ICMPV6,
                [2u8, 0],
            ),
        ] {
            let what = format!("{client} → {frontend}");
            let fits = build(client, frontend, L4::Udp, &[1u8; 100]);
            let (action, out) = run(node, program_names::TC_EXTERNAL, &fits, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{what}: fits");
            assert_eq!(out.destination(), backend, "{what}: fits");

            // XDP takes a later datagram that fits and leaves a big one, untouched, to tc
            // (its fib lookup checks the MTU with the frame's length).
            let (action, _) = run_xdp(node, &fits);
            assert_eq!(action, XDP_REDIRECT, "{what}: XDP takes one that fits");
            let big = build(client, frontend, L4::Udp, &[2u8; 1400]);
            let (action, passed) = run_xdp(node, &big);
            assert_eq!(
                (action, passed == big),
                (XDP_PASS, true),
                "{what}: XDP leaves one too big to tc"
            );

            let sent = stat(node, StatIndex::TcTooBigSent);
            let (action, out) = run(node, program_names::TC_EXTERNAL, &big, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{what}: answered out of ext0");
            assert_eq!(out.proto, icmp_proto, "{what}");
            assert_eq!(out.l4[..2], type_code, "{what}: too big");
            let mtu = if client.is_ipv4() {
                u32::from(u16::from_be_bytes([out.l4[6], out.l4[7]]))
            } else {
                u32::from_be_bytes([out.l4[4], out.l4[5], out.l4[6], out.l4[7]])
            };
            assert_eq!(mtu, 1280, "{what}: the next hop's MTU");
            assert_eq!(out.src, frontend.ip(), "{what}: from the address sent to");
            assert_eq!(out.dst, client.ip(), "{what}");
            assert_eq!(out.eth_dst[..], big[6..12], "{what}: back to the sender");
            assert_eq!(out.eth_src[..], big[0..6], "{what}");
            let ip_len = if client.is_ipv4() { 20 } else { 40 };
            assert_eq!(
                &out.l4[8..],
                &big[14..14 + ip_len + 8],
                "{what}: the datagram quoted as sent"
            );
            assert_eq!(stat(node, StatIndex::TcTooBigSent), sent + 1, "{what}");
        }

        // IPv4 without DF: the stack's to fragment.
        let mut big = build(
            sa(CLIENT, 41_002),
            sa(NODE_IP, 30096),
            L4::Udp,
            &[3u8; 1400],
        );
        big[14 + 6] = 0;
        big[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
        let csum = inet_checksum(&big[14..34]);
        big[14 + 10..14 + 12].copy_from_slice(&csum.to_be_bytes());
        let to_stack = stat(node, StatIndex::TcTooBigToStack);
        let sent = stat(node, StatIndex::TcTooBigSent);
        let (action, out) = run(node, program_names::TC_EXTERNAL, &big, node.ext0);
        assert_eq!(action, TC_ACT_OK, "no DF: up the stack");
        assert_eq!(out.destination(), sa(REMOTE, 5353), "translated");
        assert_eq!(stat(node, StatIndex::TcTooBigToStack), to_stack + 1);
        assert_eq!(stat(node, StatIndex::TcTooBigSent), sent);
    });
}

/// A packet sent to a pod's own address with the tuple a translated flow reached that pod by
/// (the client reused its port for a direct connection; here the NodePort connection is
/// closed, and it need not be) is no flow of ours. On the netfilter path the egress entries
/// are keyed by exactly that tuple: taken at ingress for a forward entry, they marked the
/// direct connection translated and the pod's answer left as if from the NodePort, so the
/// client never got its SYN-ACK (the benchmark's routed path timed out). Both programs leave
/// the packets untouched and unmarked.
#[test]
fn direct_connections_reusing_a_translated_flows_tuple_are_left_alone() {
    with_netfilter_node(|node| {
        program_services(node);
        for (client, node_ip, backend) in [
            (sa(CLIENT, 41_500), NODE_IP, sa(BACKEND, 8080)),
            (sa(CLIENT6, 41_501), NODE_IP6, sa(BACKEND6, 8080)),
        ] {
            let what = format!("{client} → {backend}");
            let frontend = sa(node_ip, 30080);
            let syn = build(client, frontend, L4::TcpSyn, b"");
            let (action, out_frame, _, mark) =
                run_marked(node, program_names::TC_EXTERNAL, &syn, node.ext0, 0);
            assert_eq!((action, mark), (TC_ACT_UNSPEC, TRANSLATED_MARK), "{what}");
            let (_, _, snat, _) = run_marked(
                node,
                program_names::TC_EGRESS,
                &out_frame,
                node.pod0,
                TRANSLATED_MARK,
            );
            assert_ne!(snat.src, client.ip(), "{what}: the NodePort flow is SNATed");
            let fin = build(client, frontend, L4::TcpFin, b"");
            run_marked(node, program_names::TC_EXTERNAL, &fin, node.ext0, 0);

            for l4 in [L4::TcpSyn, L4::TcpAck] {
                let direct = build(client, backend, l4, b"");
                let (action, frame, _, mark) =
                    run_marked(node, program_names::TC_EXTERNAL, &direct, node.ext0, 0);
                assert_eq!(
                    (action, mark),
                    (TC_ACT_UNSPEC, 0),
                    "{what} {l4:?}: not ours"
                );
                assert_eq!(frame, direct, "{what} {l4:?}: untouched");
            }
            let answer = build(backend, client, L4::TcpAck, b"");
            let (action, frame, _, mark) =
                run_marked(node, program_names::TC_REPLY, &answer, node.pod0, 0);
            assert_eq!(
                (action, mark),
                (TC_ACT_UNSPEC, 0),
                "{what}: the pod's answer is not ours"
            );
            assert_eq!(frame, answer, "{what}: answer untouched");
        }
    });
}

/// A spoofed SYN flood against a NodePort never costs an established flow its conntrack
/// entries (netfilter's early drop: unassured entries go first). With a small conntrack map,
/// flows of both families complete their handshake (SYN, the backend's answer, the client's
/// ACK); then SYNs from random sources, many times the map's size, go through the ingress
/// program. Every established flow's entries are still there, and its next segment takes the
/// same backend and SNAT port from them (not rebuilt: nothing is counted as recovered or
/// recreated); a new client's SYN still gets a backend.
#[test]
fn syn_flood_never_evicts_established_flows() {
    const CAPACITY: u32 = 1024;
    const ESTABLISHED: u16 = 20;
    with_node_sized(
        LbOptions::default(),
        true,
        None,
        SNAT_PORTS,
        BTreeSet::new(),
        |_| {},
        CAPACITY,
        |node| {
            program_services(node);
            let cases = [
                (CLIENT, sa(NODE_IP, 30080), "100.64"),
                (CLIENT6, sa(NODE_IP6, 30080), "fd00:64::"),
            ];
            let mut established = Vec::new();
            for (client, frontend, _) in cases {
                for i in 0..ESTABLISHED {
                    let from = sa(client, 40_000 + i);
                    let syn = build(from, frontend, L4::TcpSyn, b"");
                    let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
                    assert_eq!(action, TC_ACT_REDIRECT, "{from}: SYN");
                    let answer = build(out.destination(), out.source(), L4::TcpAck, b"");
                    let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
                    assert_eq!(action, TC_ACT_REDIRECT, "{from}: backend's answer");
                    assert_eq!(back.destination(), from, "{from}: answer un-NATed");
                    let ack = build(from, frontend, L4::TcpAck, b"hello");
                    let (action, again) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
                    assert_eq!(action, TC_ACT_REDIRECT, "{from}: ACK");
                    assert_eq!(
                        (again.source(), again.destination()),
                        (out.source(), out.destination()),
                        "{from}: ACK translated as the SYN"
                    );
                    let reply_key = ct_key(out.destination(), out.source(), PROTO_TCP);
                    established.push((from, frontend, out, reply_key));
                }
            }

            // The flood: SYNs from random spoofed sources and ports, 16 times the map's size a
            // family.
            let mut seed = 0x2545_f491_4f6c_dd1d_u64;
            let mut next = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            let mut flooded = 0u32;
            for (_, frontend, prefix) in cases {
                for _ in 0..16 * CAPACITY {
                    let r = next();
                    let ip = if frontend.is_ipv4() {
                        format!("{prefix}.{}.{}", (r >> 8) & 0xff, r & 0xff)
                    } else {
                        format!("{prefix}{:x}:{:x}", (r >> 16) & 0xffff, r & 0xffff)
                    };
                    let from = sa(&ip, 1024 + (r >> 32) as u16 % 60_000);
                    let syn = build(from, frontend, L4::TcpSyn, b"");
                    let (action, _) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
                    if action == TC_ACT_REDIRECT {
                        flooded += 1;
                    }
                }
            }
            eprintln!("{flooded} flood SYNs translated");

            let entries: BTreeMap<CtKey, CtValue> = node
                .dataplane
                .conntrack_entries()
                .expect("conntrack")
                .into_iter()
                .collect();
            let lost: Vec<String> = established
                .iter()
                .filter(|(from, frontend, _, reply_key)| {
                    !entries.contains_key(&ct_key(*from, *frontend, PROTO_TCP))
                        || !entries.contains_key(reply_key)
                })
                .map(|(from, frontend, _, _)| format!("{from} → {frontend}"))
                .collect();
            assert!(
                lost.is_empty(),
                "{} of {} established flows lost entries to the flood: {lost:?}",
                lost.len(),
                established.len()
            );
            for (from, frontend, out, _) in &established {
                let ack = build(*from, *frontend, L4::TcpAck, b"later");
                let (action, again) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT, "{from}: ACK after the flood");
                assert_eq!(
                    (again.source(), again.destination()),
                    (out.source(), out.destination()),
                    "{from}: same backend and SNAT port after the flood"
                );
            }
            assert_eq!(stat(node, StatIndex::TcMidstreamRecovered), 0);
            assert_eq!(stat(node, StatIndex::TcMidstreamRecreated), 0);

            for (client, frontend, _) in cases {
                let from = sa(client, 50_000);
                let syn = build(from, frontend, L4::TcpSyn, b"");
                let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
                assert_eq!(
                    action, TC_ACT_REDIRECT,
                    "{from}: a new client after the flood"
                );
                assert_eq!(out.dport(), 8080, "{from}: DNAT port");
            }
        },
    );
}

/// A spoofed SYN flood cannot hold the SNAT port range: with 32 ports per backend, 8 flows
/// established and an unanswered flows' map with room for 128 flows, SYNs from random sources
/// (three times the range, per family) fill the free ports and then take the ports of the
/// oldest unanswered flows among their probes (`tc_snat_port_reclaimed`), never an
/// established flow's: every SYN is translated, none dropped for want of a port, and no two
/// forward entries share a port. A client that sends its SYN amid the flood keeps its port
/// through ten more flood SYNs (younger flows are taken last), and its ACK goes out as its SYN
/// did; the established flows keep their ports. Both families.
#[test]
fn unanswered_flows_give_up_their_snat_ports_first() {
    const CAPACITY: u32 = 1024;
    const PORTS: RangeInclusive<u16> = 61_000..=61_031;
    const ESTABLISHED: u16 = 8;
    const FLOOD: u16 = 96;
    with_node_sized(
        LbOptions::default(),
        true,
        None,
        PORTS,
        BTreeSet::new(),
        |_| {},
        CAPACITY,
        |node| {
            program_services(node);
            let cases = [
                (CLIENT, sa(NODE_IP, 30080), "198.18"),
                (CLIENT6, sa(NODE_IP6, 30080), "fd00:64::"),
            ];
            // Opens a flow (SYN, the backend's answer, the client's ACK); the SYN's output.
            let handshake = |node: &mut Node, from: SocketAddr, frontend: SocketAddr| {
                let syn = build(from, frontend, L4::TcpSyn, b"");
                let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT, "{from}: SYN");
                let answer = build(out.destination(), out.source(), L4::TcpAck, b"");
                let (action, _) = run(node, program_names::TC_REPLY, &answer, node.pod0);
                assert_eq!(action, TC_ACT_REDIRECT, "{from}: backend's answer");
                out
            };
            let ack_again =
                |node: &mut Node, from: SocketAddr, frontend: SocketAddr, out: &Parsed| {
                    let ack = build(from, frontend, L4::TcpAck, b"data");
                    let (action, again) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
                    assert_eq!(action, TC_ACT_REDIRECT, "{from}: ACK");
                    assert_eq!(
                        (again.source(), again.destination()),
                        (out.source(), out.destination()),
                        "{from}: the ACK translated as the SYN (same backend and SNAT port)"
                    );
                };
            let mut established = Vec::new();
            for (client, frontend, _) in cases {
                for i in 0..ESTABLISHED {
                    let from = sa(client, 40_000 + i);
                    let out = handshake(node, from, frontend);
                    ack_again(node, from, frontend, &out);
                    established.push((from, frontend, out));
                }
            }
            let mut seed = 0x2545_f491_4f6c_dd1d_u64;
            let mut spoofed = |prefix: &str, v4: bool| {
                seed = proxy_tests::flood::xorshift(seed);
                let ip = if v4 {
                    format!("{prefix}.{}.{}", (seed >> 8) & 0xff, seed & 0xff)
                } else {
                    format!("{prefix}{:x}:{:x}", (seed >> 16) & 0xffff, seed & 0xffff)
                };
                // Client ports outside the SNAT range: every flow probes the range.
                sa(&ip, 1024 + (seed >> 32) as u16 % 50_000)
            };
            let mut flood = |node: &mut Node, count: u16| {
                for (_, frontend, prefix) in cases {
                    for _ in 0..count {
                        let from = spoofed(prefix, frontend.is_ipv4());
                        let syn = build(from, frontend, L4::TcpSyn, b"");
                        let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
                        assert_eq!(action, TC_ACT_REDIRECT, "{from}: a flood SYN translated");
                        assert!(PORTS.contains(&out.sport()), "{from}: SNAT port {out:?}");
                    }
                }
            };
            flood(node, FLOOD);
            let free = (PORTS.len() as u64 - u64::from(ESTABLISHED)) * cases.len() as u64;
            let flooded = u64::from(FLOOD) * cases.len() as u64;
            let reclaimed = stat(node, StatIndex::TcSnatPortReclaimed);
            eprintln!("{flooded} flood SYNs, {free} free ports: {reclaimed} ports reclaimed");
            assert_eq!(stat(node, StatIndex::TcSnatPortExhausted), 0);
            assert!(
                reclaimed >= flooded - free,
                "every SYN past the free ports took an unanswered flow's: {reclaimed}"
            );

            // A client amid the flood, then ten more flood SYNs a family.
            let amid: Vec<_> = cases
                .iter()
                .map(|(client, frontend, _)| {
                    let from = sa(client, 45_000);
                    (from, *frontend, handshake(node, from, *frontend))
                })
                .collect();
            flood(node, 10);
            for (from, frontend, out) in amid.iter().chain(&established) {
                ack_again(node, *from, *frontend, out);
            }
            assert_eq!(stat(node, StatIndex::TcMidstreamRecovered), 0);
            assert_eq!(stat(node, StatIndex::TcMidstreamRecreated), 0);

            // One forward entry per SNAT port: a flow whose port was taken left no entry behind
            // that would still send its packets from that port.
            let mut ports = BTreeMap::new();
            for (_, value) in node.dataplane.conntrack_entries().expect("conntrack") {
                if value.flags & (ct_flags::REPLY | ct_flags::EGRESS) == 0
                    && value.flags & ct_flags::SNAT != 0
                {
                    *ports
                        .entry((value.src, value.sport, value.dst, value.dport))
                        .or_insert(0u32) += 1;
                }
            }
            let shared: Vec<_> = ports.iter().filter(|(_, n)| **n > 1).collect();
            assert!(
                shared.is_empty(),
                "forward entries sharing a SNAT port: {shared:?}"
            );
        },
    );
}
