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
use proxy_common::{
    CtKey, CtKey4, CtValue, CtValue4, NodeAddrKey, StatIndex, TRANSLATED_MARK, ct_flags, family,
    map_names, program_names, proto,
};
use proxy_dataplane_ebpf::{
    ConntrackMaps, EbpfDataplane, EbpfOptions, Feature, LbOptions, PIN_DIR_NAME, TcOptions,
    TcTestInput, conntrack::reserved_ports,
};
use proxy_model::{
    desired::Snapshot,
    objects::{ObjectKey, Objects, ServiceInfo},
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

mod conntrack;
mod drops;
mod fragments;
mod icmp;
mod maglev;
mod next_hop;
mod port_filter;
mod sctp;
mod snat;
mod traffic;
mod translation;
mod xdp;

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
            max_frontends_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_FRONTENDS_PER_SERVICE,
            max_endpoints_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_ENDPOINTS_PER_SERVICE,
            backends_capacity: 1024,
            conntrack_capacity: Some(conntrack_capacity),
            lru_budget: proxy_dataplane_ebpf::maps::map_sizes::LruBudget::MemoryShare(
                proxy_dataplane_ebpf::maps::map_sizes::DEFAULT_DYNAMIC_SIZE_RATIO,
            ),
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
) -> (ObjectKey, proxy_model::objects::EndpointSliceInfo) {
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
    let snapshot = services_snapshot();
    let (summary, errors) = node.dataplane.apply(&snapshot, None);
    assert!(errors.is_empty(), "apply errors: {errors:?}");
    assert!(summary.frontends_written > 0, "{summary:?}");
}

/// The Services of [`program_services`].
fn services_snapshot() -> Snapshot {
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
    snapshot
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

/// A flow's first packet from `client` to `frontend` through `kpr_tc_external` on `ext0`,
/// which must redirect it (the fast path: [`with_node`]); what left.
fn first_packet(
    node: &mut Node,
    client: SocketAddr,
    frontend: SocketAddr,
    l4: L4,
    payload: &[u8],
) -> Parsed {
    let (action, out) = run(
        node,
        program_names::TC_EXTERNAL,
        &build(client, frontend, l4, payload),
        node.ext0,
    );
    assert_eq!(
        action, TC_ACT_REDIRECT,
        "{client} → {frontend}: first packet"
    );
    out
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

/// The datagrams `KPR_FRAGMENTS` remembers, as (source, destination, protocol).
fn remembered_datagrams(node: &Node) -> BTreeSet<(IpAddr, IpAddr, u8)> {
    let ip = |words: [u32; 4], family: u8| match family {
        family::V4 => IpAddr::from(words[0].to_ne_bytes()),
        _ => IpAddr::V6(proxy_dataplane_ebpf::ip6_from_map(words)),
    };
    node.dataplane
        .fragment_datagrams()
        .expect("fragment map")
        .into_iter()
        .map(|key| (ip(key.src, key.family), ip(key.dst, key.family), key.proto))
        .collect()
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
                _ => IpAddr::V6(proxy_dataplane_ebpf::ip6_from_map(key.addr)),
            }
        })
        .collect()
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

/// `bpf_ktime_get_ns`'s clock (the agent's).
fn monotonic_ns() -> u64 {
    clock_ns(nix::time::ClockId::CLOCK_MONOTONIC)
}

/// `clock` now, in ns.
fn clock_ns(clock: nix::time::ClockId) -> u64 {
    let now = nix::time::clock_gettime(clock).expect("clock");
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

/// A datapath counter's total.
fn stat(node: &Node, index: StatIndex) -> u64 {
    node.dataplane
        .stats()
        .into_iter()
        .find(|(i, _)| *i == index)
        .map_or(0, |(_, value)| value)
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
        set_neighbour(addr, mac);
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

/// A permanent neighbour entry on `ext0`, `addr` at `mac`.
fn set_neighbour(addr: &str, mac: [u8; 6]) {
    let mac = mac.map(|b| format!("{b:02x}")).join(":");
    // This thread is in the node namespace; the child inherits it.
    let status = std::process::Command::new("ip")
        .args(["neigh", "replace", addr, "lladdr", &mac, "dev", "ext0"])
        .args(["nud", "permanent"])
        .status()
        .expect("ip neigh");
    assert!(status.success(), "ip neigh {addr}");
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
