//! Conntrack under pressure: live TCP streams through a NodePort while the tc
//! conntrack map is filled far past its capacity with other flows. The LRU evicts the streams'
//! entries (both directions, idle between exchanges); the next segment of each stream finds
//! its flow again from the client's tuple — the same backend, the same SNAT port — instead of
//! being handed to the stack, which answers a NodePort segment without a socket with a reset,
//! or to a backend chosen anew. Needs root.

use std::net::{SocketAddr, SocketAddrV4, UdpSocket};
use std::path::PathBuf;
use std::time::Duration;

use proxy_common::StatIndex;

use proxy_tests::RigError;
use proxy_tests::client::{Attempt, Mode, tally};
use proxy_tests::manifests::{Protocol, SlicePort, endpoint_slice_yaml};
use proxy_tests::netns::on_thread_in;
use proxy_tests::scenario::{BACKEND_PORT, Scenario, is_pod, pod_endpoint};
use proxy_tests::service_scenarios::ServiceSpec;
use proxy_tests::topology::Topology;
use proxy_tests::wait::try_wait_until;

const NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
/// Entries of the tc conntrack map: the flood writes ten times as many.
const CONNTRACK: &str = "1024";
const FLOOD_FLOWS: u16 = 5_000;
const STREAMS: usize = 10;

fn node_port_addr() -> SocketAddr {
    SocketAddrV4::new(Topology::node_ext_ip(), NODE_PORT).into()
}

fn udp_node_port_addr() -> SocketAddr {
    SocketAddrV4::new(Topology::node_ext_ip(), UDP_NODE_PORT).into()
}

/// `default/web` (TCP, NodePort, eTP Cluster: masqueraded) on pods 1–3 and `default/dns` (UDP
/// NodePort) on pod 1, for the flood.
fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let s = Scenario::new(3)?;
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1), pod_endpoint(2), pod_endpoint(3)])?;
    let port = SlicePort {
        name: "dns".into(),
        port: BACKEND_PORT,
        protocol: Protocol::Udp,
    };
    s.manifests.write(
        "dns-slice.yaml",
        &endpoint_slice_yaml("default", "dns-1", "dns", &[port], &[pod_endpoint(1)]),
    )?;
    s.manifests.write(
        "dns-svc.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: default}}\nspec:\n  \
             type: NodePort\n  clusterIP: 10.96.0.53\n  ports:\n  - {{name: dns, port: 53, \
             targetPort: {BACKEND_PORT}, protocol: UDP, nodePort: {UDP_NODE_PORT}}}\n"
        ),
    )?;
    Ok(s)
}

/// One datagram from each of `FLOOD_FLOWS` source ports in the `ext` namespace to the UDP
/// NodePort: two conntrack entries per flow.
fn flood(netns: PathBuf) -> anyhow::Result<u16> {
    on_thread_in(&netns, move || -> anyhow::Result<u16> {
        let mut sent = 0;
        for port in 20_000..20_000 + FLOOD_FLOWS {
            let socket = UdpSocket::bind(("0.0.0.0", port))?;
            if socket.send_to(b"flood", udp_node_port_addr()).is_ok() {
                sent += 1;
            }
        }
        Ok(sent)
    })?
}

#[test]
fn streams_keep_their_backends_while_the_conntrack_map_overflows() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.start_agent_with_args(
        "ebpf",
        &["--interfaces", "vext", "--bpf-map-conntrack", CONNTRACK],
    )?;
    let outside = s.external_client();
    s.wait_for_datapath_with(&outside, node_port_addr(), "NodePort answered", is_pod)?;
    // 120 exchanges 100 ms apart: about 12 s per stream, the flood in the middle.
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| {
            let client = outside
                .clone()
                .mode(Mode::TcpStream)
                .interval(Duration::from_millis(100))
                .timeout(Duration::from_millis(1000));
            std::thread::spawn(move || client.run(node_port_addr(), 120))
        })
        .collect();
    // Every stream connected before the flood starts.
    s.wait_for_tcp_streams(STREAMS)?;
    let sent = flood(s.topo.ext().path())?;
    let running = streams.iter().filter(|t| !t.is_finished()).count();
    s.ensure(running == STREAMS, || {
        format!("the flood must end while the streams run: {running} of {STREAMS} ran")
    })?;

    let mut broken = Vec::new();
    let mut backends = std::collections::BTreeSet::new();
    for (i, stream) in streams.into_iter().enumerate() {
        let attempts: Vec<Attempt> = stream
            .join()
            .map_err(|_| RigError::Other(format!("stream {i}: client thread panicked")))??;
        let counts = tally(&attempts);
        eprintln!("stream {i}: {counts:?}");
        let answered = attempts.iter().all(|a| matches!(a, Attempt::Ok { .. }));
        if counts.len() != 1 || !answered {
            broken.push((i, counts));
        } else if let Some(backend) = attempts.first().and_then(Attempt::backend) {
            backends.insert(backend.split('#').next().unwrap_or_default().to_owned());
        }
    }
    // The flood evicted the streams' entries: their next segments found their flows again.
    let recovered = s
        .agent()?
        .datapath_counter(StatIndex::TcMidstreamRecovered)?;
    let recreated = s
        .agent()?
        .datapath_counter(StatIndex::TcMidstreamRecreated)?;
    let passed = s.agent()?.datapath_counter(StatIndex::TcMidstreamPassed)?;
    let orphans = s
        .agent()?
        .datapath_counter(StatIndex::TcOrphanSegmentDropped)?;
    eprintln!(
        "{sent} flood flows into {CONNTRACK} entries: {} of {STREAMS} streams broken, \
         backends {backends:?}; mid-stream segments recovered {recovered}, recreated \
         {recreated}, passed to the stack {passed}; backends' segments without entry dropped \
         {orphans}",
        broken.len()
    );
    s.ensure(broken.is_empty(), || {
        format!("every stream answered by its one backend throughout: broken {broken:?}")
    })?;
    s.ensure(recovered + recreated > 0, || {
        "the flood evicted no stream entry: the test did not test anything".to_owned()
    })?;
    // New connections still reach the pods.
    try_wait_until(
        "a new connection answered after the flood",
        Duration::from_secs(5),
        Duration::from_millis(100),
        || Ok(is_pod(&outside.once(node_port_addr())?)),
    )
    .map_err(|e| s.agent_error(e.to_string()))?;
    Ok(())
}
