//! State that survives floods, with real packets: the agent in eBPF mode on the rig's node, a
//! spoofed flood written into the external namespace's link (`proxy_tests::flood`) at the
//! highest rate the rig reaches, and real clients beside it. The rates reached are printed,
//! never asserted (they are the machine's); `cargo xtask bench`'s SYN flood section measures
//! them against the iptables mode. Needs root.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proxy_common::StatIndex;
use proxy_tests::flood::{
    Flood, FrameWriter, SynFloodOutcome, SynFloodPlan, junk_fragment, link_macs, served_share,
    syn_flood, syn_flood_node, with_macs,
};
use proxy_tests::manifests::{Protocol, SlicePort, endpoint_slice_yaml};
use proxy_tests::netns::spawn_in;
use proxy_tests::packet::{L4, build, fragment};
use proxy_tests::scenario::{BACKEND_PORT, Scenario, pod_endpoint};
use proxy_tests::topology::Topology;
use proxy_tests::udp_probe::exchange;

/// Idle connections opened before a flood.
const IDLE: usize = 20;

fn plan() -> SynFloodPlan {
    SynFloodPlan {
        idle: IDLE,
        duration: Duration::from_secs(4),
        max_frames: 5_000_000,
        after: 100,
        client_interval: Duration::from_millis(10),
        // Past the first SYN retransmission (1 s): a client whose SYN was dropped once is
        // still served, as a real one is.
        client_timeout: Duration::from_millis(2500),
    }
}

/// Runs the plan on an eBPF node with `args` and checks what every flood must leave: each
/// idle connection answered by the backend that greeted it, without its flow rebuilt (its
/// entries were never evicted), and at least 95 % of the new connections served during the
/// flood and after it.
fn flood_the_node_port(args: &[&str]) -> anyhow::Result<(Scenario, SynFloodOutcome)> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = syn_flood_node("ebpf", args)?;
    let outcome = syn_flood(&mut s, plan(), true)?;
    eprintln!("{outcome}");
    let lost: Vec<_> = outcome.idle.iter().filter(|(_, r)| r.is_err()).collect();
    s.ensure(lost.is_empty(), || {
        format!("every idle connection answers after the flood: lost {lost:?}")
    })?;
    let backends: std::collections::BTreeSet<_> =
        outcome.idle.iter().map(|(b, _)| b.as_str()).collect();
    s.ensure(backends.iter().all(|b| b.starts_with("pod")), || {
        format!("idle connections greeted by the pods: {backends:?}")
    })?;
    s.ensure(outcome.idle_rebuilt == Some(0), || {
        format!(
            "the idle connections' entries survived the flood (none rebuilt from the client's \
             tuple when they spoke again): {:?}",
            outcome.idle_rebuilt
        )
    })?;
    for (what, served) in [("during", &outcome.during), ("after", &outcome.after)] {
        let share = served_share(served);
        s.ensure(!served.is_empty() && share >= 0.95, || {
            let failed: Vec<_> = served.iter().filter(|r| r.is_err()).take(5).collect();
            format!(
                "new connections served {what} the flood: {:.1} % of {} (first failures \
                 {failed:?})",
                share * 100.0,
                served.len()
            )
        })?;
    }
    Ok((s, outcome))
}

/// A conntrack map of 4096 entries (1024 for unanswered flows): the flood overflows the
/// unanswered flows' map hundreds of times over, and the established flows live apart.
#[test]
fn spoofed_syn_flood_spares_established_connections_and_new_clients() -> anyhow::Result<()> {
    let (s, outcome) = flood_the_node_port(&["--bpf-map-conntrack", "4096"])?;
    let taken = outcome.flood.accepted;
    s.ensure(taken > 4 * 1024, || {
        format!("the flood overflowed the unanswered flows' map: {taken} SYNs taken")
    })?;
    Ok(())
}

/// The SNAT port range narrowed to 2048 ports (6144 per node across the three backends) and an
/// unanswered flows' map with room for 8192 flows: left to the SYN timeout, the flood's flows
/// would hold every port for a minute and no new client would get one. The flood's ports are
/// taken over instead, the oldest unanswered flow's first, and new clients are served.
#[test]
fn spoofed_syn_flood_cannot_hold_the_snat_ports() -> anyhow::Result<()> {
    let (s, outcome) = flood_the_node_port(&[
        "--bpf-map-conntrack",
        "131072",
        "--bpf-snat-port-range",
        "61000-63047",
    ])?;
    let reclaimed = outcome.counter(StatIndex::TcSnatPortReclaimed);
    s.ensure(reclaimed.is_some_and(|n| n > 0), || {
        format!(
            "the flood filled the port range and new flows took its ports: \
             tc_snat_port_reclaimed {reclaimed:?}"
        )
    })?;
    Ok(())
}

/// NodePort of `default/dns` (UDP 53 → 8080 on pod 1).
const UDP_NODE_PORT: u16 = 30053;
/// More than two MTUs of 1500: three fragments.
const DATAGRAM: usize = 4000;

/// Fragmented UDP datagrams to a UDP NodePort are answered by the pod while the external
/// namespace floods junk first fragments of datagrams that never complete, from spoofed
/// sources with random IP IDs, to ports of the node without a frontend: they are never
/// remembered (only first fragments of flows are), so they cannot evict the legitimate
/// datagrams' from the fragment map (8192 datagrams), and no later fragment of those goes
/// untranslated. Two clients: the stack's (4000 bytes, three fragments sent back to back) and
/// a slow one that writes its datagram's first fragment, waits 100 ms — the flood writes
/// thousands of junk first fragments meanwhile — and then its other two: had the junk been
/// remembered, the LRU would have evicted its first fragment's ports by then.
#[test]
fn junk_first_fragments_leave_fragmented_datagrams_working() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(1)?;
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
    s.topo.node().ip(&[
        "route",
        "add",
        proxy_tests::flood::SPOOFED_NET,
        "via",
        &Topology::ext_ip().to_string(),
    ])?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    let target = SocketAddr::from((Topology::node_ext_ip(), UDP_NODE_PORT));
    let ext = s.topo.ext().path();
    let first = exchange(&ext, target, DATAGRAM, false)?;
    let mut ready = first.starts_with("reply pod1");
    for _ in 0..40 {
        if ready {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
        ready = exchange(&ext, target, DATAGRAM, false)?.starts_with("reply pod1");
    }
    s.ensure(ready, || {
        format!("the UDP NodePort answers a {DATAGRAM}-byte datagram: {first}")
    })?;
    let untracked_before = s
        .agent()?
        .datapath_counter(StatIndex::TcFragmentUntracked)?;

    // Junk to the node's address on ports no frontend has. (Not through the node to a pod: the
    // pod's own reassembly memory would fill with it, in either mode, whatever the proxy does.)
    let junk_targets: Vec<SocketAddr> = vec![
        SocketAddr::from((Topology::node_ext_ip(), 9)),
        SocketAddr::from((Topology::node_ext_ip(), 31_999)),
    ];
    let macs = link_macs(s.topo.ext(), "eth0", s.topo.node(), "vext")?;
    let stop = Arc::new(AtomicBool::new(false));
    let exchanges = {
        let (stop, ext) = (Arc::clone(&stop), ext.clone());
        std::thread::spawn(move || -> anyhow::Result<Vec<Result<String, String>>> {
            let mut answers = Vec::new();
            while !stop.load(Ordering::Relaxed) && answers.len() < 2_000 {
                answers.push(exchange(&ext, target, DATAGRAM, false).map_err(|e| e.to_string()));
                // Pacing of the exchanges beside the junk.
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(answers)
        })
    };
    let slow = {
        let stop = Arc::clone(&stop);
        spawn_in(&ext, move || slow_fragmented_datagrams(&stop, macs, target))?
    };
    let flood = Flood::start(
        s.topo.ext(),
        "eth0",
        Duration::from_secs(4),
        5_000_000,
        junk_fragment(0x9e37_79b9_7f4a_7c15, macs, junk_targets),
    )?
    .join();
    stop.store(true, Ordering::Relaxed);
    let answers = exchanges
        .join()
        .map_err(|_| anyhow::anyhow!("the exchanging thread panicked"))??;
    let slow = slow
        .join()
        .map_err(|_| anyhow::anyhow!("the slow client panicked"))???;
    let flood = flood?;
    let answered = answers
        .iter()
        .filter(|a| a.as_ref().is_ok_and(|t| t.starts_with("reply pod1")))
        .count();
    let untracked = s
        .agent()?
        .datapath_counter(StatIndex::TcFragmentUntracked)?
        .saturating_sub(untracked_before);
    let slow_answered = slow.iter().filter(|a| **a).count();
    eprintln!(
        "junk first fragments: {flood}; {DATAGRAM}-byte datagrams answered during it {answered}/{} \
         ({:.1} %), with 100 ms between first and later fragments {slow_answered}/{}; later \
         fragments untracked {untracked}",
        answers.len(),
        answered as f64 * 100.0 / answers.len().max(1) as f64,
        slow.len()
    );
    s.ensure(
        !slow.is_empty() && slow_answered as f64 >= 0.95 * slow.len() as f64,
        || {
            format!(
                "datagrams whose later fragments came 100 ms after the first answered during \
                 the junk flood: {slow_answered} of {}",
                slow.len()
            )
        },
    )?;
    s.ensure(
        !answers.is_empty() && answered as f64 >= 0.95 * answers.len() as f64,
        || {
            let failed: Vec<_> = answers
                .iter()
                .filter(|a| !a.as_ref().is_ok_and(|t| t.starts_with("reply pod1")))
                .take(5)
                .collect();
            format!(
                "fragmented datagrams answered during the junk flood: {answered} of {} (first \
                 failures {failed:?})",
                answers.len()
            )
        },
    )?;
    s.ensure(flood.accepted > 8192, || {
        format!("the flood outnumbered the fragment map's 8192 datagrams: {flood}")
    })?;
    Ok(())
}

/// The slow client of `junk_first_fragments_leave_fragmented_datagrams_working`, on a thread
/// in the external namespace: until `stop`, a 4000-byte datagram from a fresh socket's port
/// written as three fragments of its own, the first one 100 ms before the others; whether the
/// pod answered each.
fn slow_fragmented_datagrams(
    stop: &AtomicBool,
    macs: [[u8; 6]; 2],
    target: SocketAddr,
) -> anyhow::Result<Vec<bool>> {
    let writer = FrameWriter::open("eth0")?;
    let mut answers = Vec::new();
    while !stop.load(Ordering::Relaxed) && answers.len() < 200 {
        let socket = UdpSocket::bind((Topology::ext_ip(), 0))?;
        socket.set_read_timeout(Some(Duration::from_secs(1)))?;
        let datagram = with_macs(
            build(socket.local_addr()?, target, L4::Udp, &[b'x'; DATAGRAM]),
            macs,
        );
        let id = 0x1000 + u32::try_from(answers.len())?;
        let fragments = fragment(&datagram, 1480, id);
        let (first, rest) = fragments.split_at(1.min(fragments.len()));
        writer.send(first)?;
        // The gap between the fragments is the behaviour under test: the first one waits
        // for the rest in reassembly.
        std::thread::sleep(Duration::from_millis(100));
        writer.send(rest)?;
        let mut buf = [0u8; 2048];
        answers.push(
            socket
                .recv(&mut buf)
                .is_ok_and(|n| buf.get(..n).is_some_and(|b| b.starts_with(b"pod1"))),
        );
    }
    Ok(answers)
}
