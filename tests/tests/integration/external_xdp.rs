//! XDP with real packets: the agent runs with `--tc-fast-path` (so
//! `--bpf-xdp auto` attaches `kpr_xdp_external` in native mode to the external interfaces
//! `vext` and `vnode2`), an external client reaches a dual-stack NodePort whose only endpoint
//! is a pod on a second node, over TCP and UDP. Every packet of a flow, its first included, and
//! every reply goes through XDP (driver → translated → redirected to the other veth), none
//! through tc, which the datapath counters show; the echo server reports which pod answered and
//! the client sees the NodePort as its peer.
//!
//! The client's and node2's veth ends first keep their default offloads: their packets arrive
//! with only the pseudo-header sum in the L4 checksum (`CHECKSUM_PARTIAL`), which XDP must
//! leave to tc (counted). Then they send complete checksums, as a NIC receiving from a wire
//! delivers them (`ethtool -K eth0 tx off`), and have NAPI on (`gro on`), which a veth needs to
//! take redirected XDP frames.
//!
//! Jumbo frames: every link at MTU 9000, where only a multi-buffer XDP program attaches, with
//! full-size TCP segments and 8000-byte UDP datagrams carried by XDP
//! ([`jumbo_frames_run_through_xdp`]); and an upgrade from a build whose single-buffer program
//! is in the pinned links. Needs root.

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proxy_common::StatIndex;
use proxy_tests::client::{Attempt, Client, Proto, tally};
use proxy_tests::manifests::{Endpoint, Protocol, SlicePort, endpoint_slice_yaml};
use proxy_tests::netns::on_thread_in;
use proxy_tests::scenario::{BACKEND_PORT, Scenario, http_and_dns_slice_ports};
use proxy_tests::topology::{Place, Topology};

const NAMESPACE: &str = "default";
const SERVICE: &str = "web";
const TCP_NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
/// Attempts per protocol and family in each phase.
const ATTEMPTS: u32 = 10;

fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::with_families(1, true)?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    s.topo.start_remote_pod_echoes6(BACKEND_PORT)?;
    s.manifests.write(
        "svc.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {SERVICE}\n  namespace: {NAMESPACE}\n\
             spec:\n  type: NodePort\n  clusterIP: \"10.96.0.20\"\n\
             \x20 clusterIPs: [\"10.96.0.20\", \"fd00:96::20\"]\n  ipFamilies: [IPv4, IPv6]\n\
             \x20 ipFamilyPolicy: RequireDualStack\n  externalTrafficPolicy: Cluster\n\
             \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
             \x20   nodePort: {TCP_NODE_PORT}\n  - name: dns\n    port: 53\n    protocol: UDP\n\
             \x20   targetPort: 8080\n    nodePort: {UDP_NODE_PORT}\n"
        ),
    )?;
    for (slice, ipv6) in [("web-4", false), ("web-6", true)] {
        let remote = Endpoint {
            node_name: Some("other-node".into()),
            ..Endpoint::ready(Topology::remote_pod_addr(1, ipv6))
        };
        s.manifests.write(
            &format!("{slice}.yaml"),
            &endpoint_slice_yaml(
                NAMESPACE,
                slice,
                SERVICE,
                &http_and_dns_slice_ports(),
                &[remote],
            ),
        )?;
    }
    Ok(s)
}

fn node_port(proto: Proto, ipv6: bool) -> SocketAddr {
    let ip: IpAddr = if ipv6 {
        Topology::node_ext_ip6().into()
    } else {
        Topology::node_ext_ip().into()
    };
    let port = match proto {
        Proto::Udp => UDP_NODE_PORT,
        _ => TCP_NODE_PORT,
    };
    SocketAddr::new(ip, port)
}

fn is_remote(attempt: &Attempt) -> bool {
    attempt.backend() == Some("rpod1")
}

/// `ATTEMPTS` TCP connections and UDP exchanges per family from the external client: every one
/// answered by the remote pod, the NodePort as the peer. Returns how many.
fn serve_all(s: &mut Scenario) -> anyhow::Result<u64> {
    let mut failures = Vec::new();
    let mut answered = 0;
    for ipv6 in [false, true] {
        for proto in [Proto::Tcp, Proto::Udp] {
            let target = node_port(proto, ipv6);
            let client = Client::new(s.topo.ext().path())
                .proto(proto)
                .timeout(Duration::from_secs(2));
            s.wait_for_datapath_with(&client, target, "remote pod answered", is_remote)?;
            let attempts = client.run(target, ATTEMPTS)?;
            eprintln!("{target} {proto:?}: {:?}", tally(&attempts));
            let good = attempts
                .iter()
                .all(|a| is_remote(a) && matches!(a, Attempt::Ok { peer, .. } if *peer == target));
            if !good {
                failures.push(format!("{target} {proto:?}: {attempts:?}"));
            }
            answered += attempts.len() as u64;
        }
    }
    s.ensure(failures.is_empty(), || {
        format!("every attempt answered by rpod1 from the NodePort: {failures:#?}")
    })?;
    Ok(answered)
}

fn counter(s: &mut Scenario, index: StatIndex) -> anyhow::Result<u64> {
    Ok(s.agent()?.datapath_counter(index)?)
}

/// Wire-like traffic on the client's and node2's links: complete checksums, NAPI on.
fn complete_checksums(s: &Scenario) -> anyhow::Result<()> {
    for place in [Place::Ext, Place::RemoteNode] {
        s.topo
            .netns(place)?
            .exec("ethtool", &["-K", "eth0", "tx", "off", "gro", "on"])?;
    }
    Ok(())
}

/// `proxy-agent inspect interfaces --json` in the node's namespace: (interface, hook,
/// program) rows.
fn inspect_interfaces(s: &mut Scenario) -> anyhow::Result<Vec<(String, String, String)>> {
    let rows = s.inspect_json(&["interfaces", "--json"])?;
    let rows = rows
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("inspect interfaces: not a list: {rows}"))?;
    Ok(rows
        .iter()
        .map(|row| {
            let field = |name: &str| row[name].as_str().unwrap_or_default().to_owned();
            (field("interface"), field("hook"), field("program"))
        })
        .collect())
}

#[test]
fn node_port_flows_to_a_remote_pod_run_through_xdp() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext,vnode2", "--tc-fast-path"])?;
    // Local-stack checksums: XDP leaves those packets to tc, and everything is served.
    serve_all(&mut s)?;
    // XDP on both external interfaces, each before its tc programs; none on the pod's veth.
    let rows = inspect_interfaces(&mut s)?;
    eprintln!("inspect interfaces: {rows:?}");
    for interface in ["vext", "vnode2"] {
        let hooks: Vec<(&str, &str)> = rows
            .iter()
            .filter(|(name, _, _)| name == interface)
            .map(|(_, hook, program)| (hook.as_str(), program.as_str()))
            .collect();
        s.ensure(
            hooks
                == [
                    ("xdp", "kpr_xdp_external"),
                    ("tc ingress", "kpr_tc_external"),
                    ("tc egress", "kpr_tc_egress"),
                ],
            || format!("{interface}: {hooks:?}"),
        )?;
    }
    s.ensure(
        rows.iter()
            .any(|(name, hook, _)| name == "vpod1" && hook == "tc ingress")
            && !rows
                .iter()
                .any(|(name, hook, _)| name == "vpod1" && hook == "xdp"),
        || format!("vpod1 has tc, not XDP: {rows:?}"),
    )?;

    let partial = counter(&mut s, StatIndex::XdpPassedChecksumPartial)?;
    s.ensure(partial > 0, || {
        "veth packets with partial checksums were left to tc (xdp_passed_checksum_partial 0)"
            .to_owned()
    })?;

    complete_checksums(&s)?;
    let counters = |s: &mut Scenario| -> anyhow::Result<[u64; 5]> {
        Ok([
            counter(s, StatIndex::XdpEstablished)?,
            counter(s, StatIndex::XdpReplyTranslated)?,
            counter(s, StatIndex::XdpTranslated)?,
            counter(s, StatIndex::TcTranslated)?,
            counter(s, StatIndex::TcEstablished)? + counter(s, StatIndex::TcReplyTranslated)?,
        ])
    };
    let before = counters(&mut s)?;
    let answered = serve_all(&mut s)?;
    let after = counters(&mut s)?;
    eprintln!(
        "answered {answered}: xdp_established +{}, xdp_reply_translated +{}, xdp_translated +{}, \
         tc_translated +{}, tc_established and tc_reply_translated +{}",
        after[0] - before[0],
        after[1] - before[1],
        after[2] - before[2],
        after[3] - before[3],
        after[4] - before[4],
    );
    // Every exchange's reply (a UDP answer, a TCP SYN-ACK and more) came back through XDP,
    // every TCP connection's later segments (ACK, data, FIN) went out through it, and every
    // flow's first packet: tc translated nothing.
    let tcp = u64::from(ATTEMPTS) * 2;
    s.ensure(after[1] - before[1] >= answered, || {
        format!(
            "replies through XDP: {} for {answered} answers",
            after[1] - before[1]
        )
    })?;
    s.ensure(after[0] - before[0] >= tcp, || {
        format!(
            "later client packets through XDP: {} for {tcp} TCP connections",
            after[0] - before[0]
        )
    })?;
    s.ensure(after[2] - before[2] >= answered, || {
        format!(
            "first packets through XDP: {} for {answered} answers",
            after[2] - before[2]
        )
    })?;
    s.ensure(after[3] == before[3] && after[4] == before[4], || {
        format!("tc translated nothing: {before:?} → {after:?}")
    })?;

    // A restart swaps the new agent's program into the pinned links: XDP stays and serves.
    s.agent()?.stop()?;
    let established = counter(&mut s, StatIndex::XdpEstablished)?;
    s.agent()?.restart()?;
    wait_synced(&mut s)?;
    serve_all(&mut s)?;
    let rows = inspect_interfaces(&mut s)?;
    s.ensure(has_xdp(&rows, "vext") && has_xdp(&rows, "vnode2"), || {
        format!("XDP kept across the restart: {rows:?}")
    })?;
    let now = counter(&mut s, StatIndex::XdpEstablished)?;
    s.ensure(now >= established + tcp, || {
        format!("XDP after the restart: xdp_established {established} → {now}")
    })?;

    // `--bpf-xdp off`: the links go, tc serves alone.
    s.agent()?.stop()?;
    s.agent()?.restart_with_args(&[
        "--interfaces",
        "vext,vnode2",
        "--tc-fast-path",
        "--bpf-xdp",
        "off",
    ])?;
    wait_synced(&mut s)?;
    let rows = inspect_interfaces(&mut s)?;
    s.ensure(!has_xdp(&rows, "vext") && !has_xdp(&rows, "vnode2"), || {
        format!("no XDP with --bpf-xdp off: {rows:?}")
    })?;
    let xdp_before = (
        counter(&mut s, StatIndex::XdpEstablished)?,
        counter(&mut s, StatIndex::XdpReplyTranslated)?,
        counter(&mut s, StatIndex::XdpTranslated)?,
    );
    serve_all(&mut s)?;
    let xdp_after = (
        counter(&mut s, StatIndex::XdpEstablished)?,
        counter(&mut s, StatIndex::XdpReplyTranslated)?,
        counter(&mut s, StatIndex::XdpTranslated)?,
    );
    s.ensure(xdp_before == xdp_after, || {
        format!("nothing through XDP once off: {xdp_before:?} → {xdp_after:?}")
    })?;
    Ok(())
}

/// Waits (bounded) until the restarted agent has synced once: its programs are attached by
/// then (the previous agent's pinned ones serve meanwhile, so traffic alone does not tell).
fn wait_synced(s: &mut Scenario) -> anyhow::Result<()> {
    let agent = s.agent()?;
    proxy_tests::wait::wait_until(
        "the restarted agent's first sync",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || agent.syncs() >= 1,
    )?;
    Ok(())
}

fn has_xdp(rows: &[(String, String, String)], interface: &str) -> bool {
    rows.iter()
        .any(|(name, hook, _)| name == interface && hook == "xdp")
}

/// NodePorts of the `bulk` Service (TCP and UDP), whose endpoint is [`BulkEcho`] in `rpod1`.
const BULK_TCP_NODE_PORT: u16 = 30090;
const BULK_UDP_NODE_PORT: u16 = 30091;
const BULK_PORT: u16 = 9090;
/// The jumbo links' MTU, and what the test sends: a TCP stream of 1 MiB each way (full-size
/// segments of 8960 bytes over IPv4) and UDP datagrams of 8000 bytes (one frame each; at MTU
/// 1500 they would be IP fragments, which XDP leaves to tc).
const JUMBO_MTU: &str = "9000";
const TCP_BYTES: usize = 1 << 20;
const UDP_BYTES: usize = 8000;

/// Echo servers on `BULK_PORT` of remote pod 1 (both families), on threads of the test whose
/// sockets were made in the pod's namespace: TCP sends a connection back everything it sent
/// once the client has shut down its side; UDP sends each datagram back whole (the rig's echo
/// server answers with its name only). Stopped and joined on drop; every wait bounded.
struct BulkEcho {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BulkEcho {
    fn start(pod: &std::path::Path) -> anyhow::Result<Self> {
        let addrs = [
            SocketAddr::new(Topology::remote_pod_ip(1).into(), BULK_PORT),
            SocketAddr::new(Topology::remote_pod_ip6(1).into(), BULK_PORT),
        ];
        // Sockets stay in the namespace they were made in, whichever thread serves them.
        let sockets = on_thread_in(
            pod,
            move || -> std::io::Result<Vec<(TcpListener, UdpSocket)>> {
                addrs
                    .iter()
                    .map(|addr| Ok((TcpListener::bind(addr)?, UdpSocket::bind(addr)?)))
                    .collect()
            },
        )??;
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for (tcp, udp) in sockets {
            tcp.set_nonblocking(true)?;
            udp.set_read_timeout(Some(Duration::from_millis(100)))?;
            let stopped = Arc::clone(&stop);
            threads.push(std::thread::spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    match tcp.accept() {
                        Ok((conn, _)) => {
                            let _ = echo_stream(conn);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            }));
            let stopped = Arc::clone(&stop);
            threads.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 65_536];
                while !stopped.load(Ordering::Relaxed) {
                    if let Ok((n, peer)) = udp.recv_from(&mut buf)
                        && let Some(datagram) = buf.get(..n)
                    {
                        let _ = udp.send_to(datagram, peer);
                    }
                }
            }));
        }
        Ok(Self { stop, threads })
    }
}

impl Drop for BulkEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Reads a connection to its end (bounded by a read timeout), then writes it all back.
fn echo_stream(mut conn: TcpStream) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(20)))?;
    conn.set_write_timeout(Some(Duration::from_secs(20)))?;
    let mut data = Vec::new();
    conn.read_to_end(&mut data)?;
    conn.write_all(&data)
}

/// A payload no two offsets of which a misplaced buffer would leave equal for long.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ seed.wrapping_mul((i / 251) as u8))
        .collect()
}

/// From the external client: `TCP_BYTES` to the bulk TCP NodePort and back, the peer the
/// NodePort. Retried (bounded) while the first connections may still miss the datapath.
fn tcp_round_trip(s: &Scenario, ipv6: bool) -> anyhow::Result<()> {
    let target = SocketAddr::new(node_port(Proto::Tcp, ipv6).ip(), BULK_TCP_NODE_PORT);
    let sent = pattern(TCP_BYTES, 7);
    let expected = sent.clone();
    let echoed = on_thread_in(&s.topo.ext().path(), move || -> anyhow::Result<Vec<u8>> {
        let mut conn = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
        anyhow::ensure!(conn.peer_addr()? == target, "peer {}", conn.peer_addr()?);
        conn.set_read_timeout(Some(Duration::from_secs(20)))?;
        conn.set_write_timeout(Some(Duration::from_secs(20)))?;
        conn.write_all(&sent)?;
        conn.shutdown(Shutdown::Write)?;
        let mut back = Vec::new();
        conn.read_to_end(&mut back)?;
        Ok(back)
    })??;
    anyhow::ensure!(
        echoed == expected,
        "{target}: {} bytes came back of {TCP_BYTES}, first difference at {:?}",
        echoed.len(),
        echoed.iter().zip(&expected).position(|(a, b)| a != b)
    );
    Ok(())
}

/// From the external client: `count` datagrams of `UDP_BYTES` to the bulk UDP NodePort, each
/// answered whole from the NodePort (a lost one is sent again, up to 3 times).
fn udp_round_trips(s: &Scenario, ipv6: bool, count: u8) -> anyhow::Result<()> {
    let target = SocketAddr::new(node_port(Proto::Udp, ipv6).ip(), BULK_UDP_NODE_PORT);
    on_thread_in(&s.topo.ext().path(), move || -> anyhow::Result<()> {
        let local: SocketAddr = if ipv6 { "[::]:0" } else { "0.0.0.0:0" }.parse()?;
        let sock = UdpSocket::bind(local)?;
        sock.connect(target)?;
        sock.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut buf = vec![0u8; 65_536];
        for i in 0..count {
            let sent = pattern(UDP_BYTES, i);
            let answered = (0..3).any(|_| {
                sock.send(&sent).is_ok()
                    && sock
                        .recv(&mut buf)
                        .is_ok_and(|n| buf.get(..n) == Some(&sent[..]))
            });
            anyhow::ensure!(
                answered,
                "{target}: datagram {i} of {UDP_BYTES} bytes not echoed whole"
            );
        }
        Ok(())
    })?
}

/// Jumbo frames: every link of the path at MTU 9000 (client ↔ node, node ↔ node2, node2 ↔
/// the remote pod) before the agent starts. The multi-buffer XDP program attaches to both
/// external veths (a single-buffer one is refused at this MTU, and the agent would log "no
/// XDP on this interface"); a TCP stream of 1 MiB each way in full-size segments and UDP
/// datagrams of 8000 bytes reach the remote pod and come back intact, both families, carried
/// by XDP in both directions with tc translating nothing. The client and node2 send
/// MTU-sized frames (segmentation offloads off, as the existing test's complete checksums):
/// an aggregate larger than the MTU would be tc's (the fib lookup's MTU check).
#[test]
fn jumbo_frames_run_through_xdp() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.manifests.write(
        "bulk.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: bulk\n  namespace: {NAMESPACE}\n\
             spec:\n  type: NodePort\n  clusterIP: \"10.96.0.21\"\n\
             \x20 clusterIPs: [\"10.96.0.21\", \"fd00:96::21\"]\n  ipFamilies: [IPv4, IPv6]\n\
             \x20 ipFamilyPolicy: RequireDualStack\n  externalTrafficPolicy: Cluster\n\
             \x20 ports:\n  - name: stream\n    port: 90\n    protocol: TCP\n\
             \x20   targetPort: {BULK_PORT}\n    nodePort: {BULK_TCP_NODE_PORT}\n\
             \x20 - name: datagram\n    port: 91\n    protocol: UDP\n\
             \x20   targetPort: {BULK_PORT}\n    nodePort: {BULK_UDP_NODE_PORT}\n"
        ),
    )?;
    let ports = [
        SlicePort {
            name: "stream".into(),
            port: BULK_PORT,
            protocol: Protocol::Tcp,
        },
        SlicePort {
            name: "datagram".into(),
            port: BULK_PORT,
            protocol: Protocol::Udp,
        },
    ];
    for (slice, ipv6) in [("bulk-4", false), ("bulk-6", true)] {
        let remote = Endpoint {
            node_name: Some("other-node".into()),
            ..Endpoint::ready(Topology::remote_pod_addr(1, ipv6))
        };
        s.manifests.write(
            &format!("{slice}.yaml"),
            &endpoint_slice_yaml(NAMESPACE, slice, "bulk", &ports, &[remote]),
        )?;
    }
    for (place, interfaces) in [
        (Place::Ext, &["eth0"][..]),
        (Place::Node, &["vext", "vnode2"][..]),
        (Place::RemoteNode, &["eth0", "vrpod1"][..]),
        (Place::RemotePod(1), &["eth0"][..]),
    ] {
        for interface in interfaces {
            s.topo
                .netns(place)?
                .ip(&["link", "set", "dev", interface, "mtu", JUMBO_MTU])?;
        }
    }
    // Before XDP is attached: it takes software segmentation off its veth's peer's settable
    // features.
    for place in [Place::Ext, Place::RemoteNode] {
        s.topo.netns(place)?.exec(
            "ethtool",
            &[
                "-K", "eth0", "tso", "off", "gso", "off", "tx", "off", "gro", "on",
            ],
        )?;
    }
    let _echo = BulkEcho::start(&s.topo.netns(Place::RemotePod(1))?.path())?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext,vnode2", "--tc-fast-path"])?;
    // The small exchanges first: the datapath is in place, and XDP too.
    serve_all(&mut s)?;
    let rows = inspect_interfaces(&mut s)?;
    s.ensure(has_xdp(&rows, "vext") && has_xdp(&rows, "vnode2"), || {
        format!("XDP attached at MTU {JUMBO_MTU}: {rows:?}")
    })?;
    let log = s.agent()?.log_contents();
    s.ensure(!log.contains("no XDP on this interface"), || {
        "no interface refused the XDP program".to_owned()
    })?;

    let counters = |s: &mut Scenario| -> anyhow::Result<[u64; 4]> {
        Ok([
            counter(s, StatIndex::XdpEstablished)?,
            counter(s, StatIndex::XdpReplyTranslated)?,
            counter(s, StatIndex::XdpTranslated)?,
            counter(s, StatIndex::TcTranslated)?
                + counter(s, StatIndex::TcEstablished)?
                + counter(s, StatIndex::TcReplyTranslated)?,
        ])
    };
    for ipv6 in [false, true] {
        let before = counters(&mut s)?;
        tcp_round_trip(&s, ipv6)?;
        let after = counters(&mut s)?;
        let [client, replies, first, tc] = std::array::from_fn(|i| after[i] - before[i]);
        eprintln!(
            "TCP ipv6={ipv6}: xdp_established +{client}, xdp_reply_translated +{replies}, \
             xdp_translated +{first}, tc +{tc}"
        );
        // 1 MiB in segments of at most 8960 bytes (8940 over IPv6) is at least 118 each
        // way; in 1500-byte frames the data alone would be 725 (1448 bytes of each).
        let full_size = (TCP_BYTES / 8940 + 1) as u64;
        let small = (TCP_BYTES / 1448) as u64;
        s.ensure(
            first == 1 && replies >= full_size && client >= full_size && tc == 0,
            || format!("TCP ipv6={ipv6} carried by XDP, none by tc: {before:?} → {after:?}"),
        )?;
        s.ensure(client < small, || {
            format!("TCP ipv6={ipv6}: {client} client packets for 1 MiB: not full-size frames")
        })?;

        let before = counters(&mut s)?;
        udp_round_trips(&s, ipv6, 5)?;
        let after = counters(&mut s)?;
        let [later, replies, first, tc] = std::array::from_fn(|i| after[i] - before[i]);
        eprintln!(
            "UDP ipv6={ipv6}: xdp_established +{later}, xdp_reply_translated +{replies}, \
             xdp_translated +{first}, tc +{tc}"
        );
        // One flow: its first datagram starts it in XDP, the other four follow it there.
        s.ensure(first == 1 && later >= 4 && replies >= 5 && tc == 0, || {
            format!("UDP ipv6={ipv6} carried by XDP, none by tc: {before:?} → {after:?}")
        })?;
    }
    Ok(())
}

/// What an agent of a build before multi-buffer XDP leaves on an interface, made by hand: a
/// single-buffer XDP program (`old_xdp`, `XDP_PASS` alone) attached through an XDP link in
/// native mode and pinned where the agent pins its link, and the single-buffer programs'
/// program array `KPR_XDP_NEW_FLOW` (owned by such a program). Raw `bpf(2)`: aya loads
/// programs only from objects. Each returns an fd the kernel just made.
mod single_buffer {
    use std::ffi::CString;
    use std::io;
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    use std::path::Path;

    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_OBJ_PIN: libc::c_long = 6;
    const BPF_LINK_CREATE: libc::c_long = 28;
    const BPF_MAP_TYPE_PROG_ARRAY: u32 = 3;
    const BPF_PROG_TYPE_XDP: u32 = 6;
    /// `enum bpf_attach_type`'s `BPF_XDP`, what aya loads interface XDP programs with (a
    /// link update requires the same).
    const BPF_XDP: u32 = 37;
    const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
    /// `r0 = XDP_PASS; exit`.
    const PASS: [u64; 2] = [0x0000_0002_0000_00b7, 0x95];

    fn put(attr: &mut [u8], offset: usize, value: &[u8]) {
        attr[offset..offset + value.len()].copy_from_slice(value);
    }

    /// `bpf(cmd, attr)`; the attribute is a zero-filled prefix of `union bpf_attr`.
    fn bpf(cmd: libc::c_long, attr: &mut [u8]) -> io::Result<libc::c_long> {
        // SAFETY: `attr` is a zero-filled `union bpf_attr` prefix of its length whose pointers
        // (set by the callers) point to memory alive across the call.
        let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
        if ret < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(ret)
        }
    }

    fn fd(ret: libc::c_long) -> io::Result<OwnedFd> {
        let raw = i32::try_from(ret).map_err(|_| io::Error::other(format!("fd {ret}")))?;
        // SAFETY: the kernel just returned this fd and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    }

    fn pin(object: &OwnedFd, path: &Path) -> io::Result<()> {
        let path = CString::new(path.as_os_str().as_encoded_bytes())?;
        let mut attr = [0u8; 16];
        put(&mut attr, 0, &(path.as_ptr() as u64).to_ne_bytes());
        put(&mut attr, 8, &object.as_raw_fd().to_ne_bytes());
        bpf(BPF_OBJ_PIN, &mut attr).map(drop)
    }

    /// The single-buffer program (no `BPF_F_XDP_HAS_FRAGS`).
    pub fn program() -> io::Result<OwnedFd> {
        let license = c"GPL";
        let mut attr = [0u8; 72];
        put(&mut attr, 0, &BPF_PROG_TYPE_XDP.to_ne_bytes());
        put(&mut attr, 4, &(PASS.len() as u32).to_ne_bytes());
        put(&mut attr, 8, &(PASS.as_ptr() as u64).to_ne_bytes());
        put(&mut attr, 16, &(license.as_ptr() as u64).to_ne_bytes());
        put(&mut attr, 48, b"old_xdp");
        put(&mut attr, 68, &BPF_XDP.to_ne_bytes());
        fd(bpf(BPF_PROG_LOAD, &mut attr)?)
    }

    /// Attaches `program` to interface `ifindex` of the calling thread's namespace (native
    /// mode, an XDP link) and pins the link at `path`.
    pub fn attach(program: &OwnedFd, ifindex: u32, path: &Path) -> io::Result<()> {
        let mut attr = [0u8; 16];
        put(&mut attr, 0, &program.as_raw_fd().to_ne_bytes());
        put(&mut attr, 4, &ifindex.to_ne_bytes());
        put(&mut attr, 8, &BPF_XDP.to_ne_bytes());
        put(&mut attr, 12, &XDP_FLAGS_DRV_MODE.to_ne_bytes());
        let link = fd(bpf(BPF_LINK_CREATE, &mut attr)?)?;
        pin(&link, path)
    }

    /// A program array of two slots holding `program` in slot 0 (which makes a single-buffer
    /// XDP program its owner), pinned at `path`.
    pub fn program_array(program: &OwnedFd, path: &Path) -> io::Result<()> {
        let mut attr = [0u8; 20];
        put(&mut attr, 0, &BPF_MAP_TYPE_PROG_ARRAY.to_ne_bytes());
        put(&mut attr, 4, &4u32.to_ne_bytes());
        put(&mut attr, 8, &4u32.to_ne_bytes());
        put(&mut attr, 12, &2u32.to_ne_bytes());
        let map = fd(bpf(BPF_MAP_CREATE, &mut attr)?)?;
        let key = 0u32;
        let value = program.as_raw_fd();
        let mut attr = [0u8; 32];
        put(&mut attr, 0, &map.as_raw_fd().to_ne_bytes());
        put(&mut attr, 8, &(&raw const key as u64).to_ne_bytes());
        put(&mut attr, 16, &(&raw const value as u64).to_ne_bytes());
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr)?;
        pin(&map, path)
    }
}

/// The id of the link pinned at `pin` and of the program it runs.
fn pinned_link(pin: &std::path::Path) -> anyhow::Result<(u32, u32)> {
    let link = aya::programs::links::FdLink::from(aya::programs::links::PinnedLink::from_pin(pin)?);
    let info = link.info()?;
    Ok((info.id(), info.program_id()))
}

/// An upgrade from a build whose XDP programs were single-buffer: its links on `vext` and
/// `vnode2` (made by hand, see [`single_buffer`]) get the multi-buffer program swapped in
/// place (`bpf_link_update`: the same link, veth takes the change of frags-ness), the old
/// build's program array is unpinned, and XDP carries the flows again. A start without XDP
/// and one with it then lift veth's single-buffer MTU cap: the client's link goes to MTU 9000
/// and XDP still carries its flows.
#[test]
fn an_upgrade_swaps_the_multi_buffer_program_into_a_single_buffer_programs_link()
-> anyhow::Result<()> {
    let mut s = setup()?;
    complete_checksums(&s)?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext,vnode2", "--tc-fast-path"])?;
    serve_all(&mut s)?;
    s.agent()?.stop()?;
    let pin_dir = s.agent()?.bpf_root().join("kubeproxy-rs");
    let old_array = pin_dir.join("KPR_XDP_NEW_FLOW");
    let links = {
        let pin_dir = pin_dir.clone();
        let old_array = old_array.clone();
        on_thread_in(
            &s.topo.node().path(),
            move || -> anyhow::Result<Vec<(std::path::PathBuf, u32, u32)>> {
                let program = single_buffer::program()?;
                let mut links = Vec::new();
                for interface in ["vext", "vnode2"] {
                    let ifindex = nix::net::if_::if_nametoindex(interface)?;
                    let pin = pin_dir.join(format!("kpr_xdp_external_if{ifindex}_link"));
                    // The new build's link goes (its program detached at once), the old
                    // build's comes.
                    proxy_kernel::bpf::bpf_syscall::detach_pinned_link(&pin)?;
                    std::fs::remove_file(&pin)?;
                    single_buffer::attach(&program, ifindex, &pin)?;
                    let (link, program) = pinned_link(&pin)?;
                    links.push((pin, link, program));
                }
                single_buffer::program_array(&program, &old_array)?;
                Ok(links)
            },
        )??
    };
    // As after another build: the programs are loaded, not reused.
    std::fs::remove_file(pin_dir.join("KPR_LOAD_STAMP"))?;
    let program_pin = pin_dir.join("kpr_xdp_external_prog");
    let previous = aya::programs::ProgramInfo::from_pin(&program_pin)?.id();
    s.ensure(
        links.iter().all(|(_, _, program)| *program != previous),
        || format!("the single-buffer program in both links: {links:?}"),
    )?;

    let established = counter(&mut s, StatIndex::XdpEstablished)?;
    s.agent()?.restart()?;
    wait_synced(&mut s)?;
    serve_all(&mut s)?;
    // The agent's program, loaded again (multi-buffer), in each old link.
    let loaded = aya::programs::ProgramInfo::from_pin(&program_pin)?.id();
    for (pin, old_link, _) in &links {
        let (link, program) = pinned_link(pin)?;
        s.ensure(link == *old_link && program == loaded, || {
            format!(
                "{}: link {old_link} updated in place to program {loaded}: link {link}, \
                 program {program}",
                pin.display()
            )
        })?;
    }
    s.ensure(!old_array.exists(), || {
        "the single-buffer programs' array unpinned".to_owned()
    })?;
    let now = counter(&mut s, StatIndex::XdpEstablished)?;
    let tcp = u64::from(ATTEMPTS) * 2;
    s.ensure(now >= established + tcp, || {
        format!("XDP after the upgrade: xdp_established {established} → {now}")
    })?;

    // veth caps the peer's MTU when the first XDP program attaches, to what that program takes
    // (a single-buffer one: about 3.5 kB), and an in-place update leaves the cap: the way to
    // jumbo frames after such an upgrade is one start without XDP and one with it again,
    // which attaches the multi-buffer program anew (docs/xdp.md).
    for xdp in ["off", "auto"] {
        s.agent()?.stop()?;
        s.agent()?.restart_with_args(&[
            "--interfaces",
            "vext,vnode2",
            "--tc-fast-path",
            "--bpf-xdp",
            xdp,
        ])?;
        wait_synced(&mut s)?;
    }
    s.topo
        .ext()
        .ip(&["link", "set", "dev", "eth0", "mtu", JUMBO_MTU])?;
    s.topo
        .node()
        .ip(&["link", "set", "dev", "vext", "mtu", JUMBO_MTU])?;
    let before = counter(&mut s, StatIndex::XdpEstablished)?;
    serve_all(&mut s)?;
    let rows = inspect_interfaces(&mut s)?;
    let now = counter(&mut s, StatIndex::XdpEstablished)?;
    s.ensure(has_xdp(&rows, "vext") && now >= before + tcp, || {
        format!("XDP at MTU {JUMBO_MTU} after attaching anew: {rows:?}, {before} → {now}")
    })?;
    Ok(())
}
