//! Packets and bytes per Service in the eBPF mode (`kubeproxy_rs_service_packets_total`,
//! `kubeproxy_rs_service_bytes_total`): a client outside the node sends a known number of UDP
//! datagrams of a known size through `web`'s NodePort on one connected socket, each answered by
//! the pod; the agent's counters must grow by exactly those packets and IP bytes in each
//! direction (and by one new connection: one UDP flow), on the netfilter path, the fast path
//! and with XDP in front. Needs root.

use std::{
    net::{SocketAddr, UdpSocket},
    time::Duration,
};

use anyhow::{Context as _, ensure};
use proxy_tests::{client::Proto, http::metric_sum, scenario::Scenario, takeover, wait};

const DATAGRAMS: u64 = 25;
const PAYLOAD: usize = 300;
/// IPv4 and UDP headers: what an IP byte count adds to each datagram's payload.
const HEADERS: u64 = 20 + 8;

/// The counters of `web`'s UDP NodePort: new connections, then packets and bytes forward and
/// back.
fn counters(exposition: &str) -> [f64; 5] {
    let service = ["name=\"web\"", "frontend=\"node_port\"", "protocol=\"UDP\""];
    let with = |direction: &'static str| {
        let mut labels = service.to_vec();
        labels.push(direction);
        labels
    };
    let forward = with("direction=\"forward\"");
    let reply = with("direction=\"reply\"");
    [
        metric_sum(
            exposition,
            "kubeproxy_rs_service_new_connections_total",
            &service,
        ),
        metric_sum(exposition, "kubeproxy_rs_service_packets_total", &forward),
        metric_sum(exposition, "kubeproxy_rs_service_bytes_total", &forward),
        metric_sum(exposition, "kubeproxy_rs_service_packets_total", &reply),
        metric_sum(exposition, "kubeproxy_rs_service_bytes_total", &reply),
    ]
}

/// [`DATAGRAMS`] datagrams of [`PAYLOAD`] bytes to `target` on one connected socket, each
/// waiting for its answer (never sent again: a resend would be a packet more); returns the
/// answers' payload bytes.
fn exchange(target: SocketAddr) -> anyhow::Result<u64> {
    let sock = UdpSocket::bind("0.0.0.0:0")?;
    sock.connect(target)?;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    let data = vec![b'x'; PAYLOAD];
    let mut buf = [0u8; 2048];
    let mut answered = 0u64;
    for i in 0..DATAGRAMS {
        sock.send(&data)?;
        let n = sock
            .recv(&mut buf)
            .with_context(|| format!("the answer to datagram {i} of {DATAGRAMS}"))?;
        let text = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
        ensure!(text.starts_with("pod1 "), "datagram {i}: answered {text:?}");
        answered += u64::try_from(n)?;
    }
    Ok(answered)
}

fn counted_exactly(args: &[&str]) -> anyhow::Result<()> {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s: Scenario = takeover::served_by_pod1_on("ebpf", args)?;
    // The agent reads its counters every 3 s: what the readiness traffic counted is in.
    std::thread::sleep(Duration::from_secs(4));
    let before = counters(&s.agent()?.metrics()?);
    let target = takeover::web_node_port(Proto::Udp, false);
    let answered =
        proxy_tests::netns::on_thread_in(&s.topo.ext().path(), move || exchange(target))??;
    let want = [
        1.0,
        DATAGRAMS as f64,
        (DATAGRAMS * (HEADERS + PAYLOAD as u64)) as f64,
        DATAGRAMS as f64,
        (DATAGRAMS * HEADERS + answered) as f64,
    ];
    let agent = s.agent()?;
    let mut grown = [0.0; 5];
    let exact = wait::try_wait_until(
        "web's NodePort counters grown by the datagrams sent and answered",
        Duration::from_secs(20),
        Duration::from_millis(500),
        || {
            let now = counters(&agent.metrics()?);
            for ((grew, now), then) in grown.iter_mut().zip(now).zip(before) {
                *grew = now - then;
            }
            Ok(grown == want)
        },
    );
    ensure!(
        exact.is_ok(),
        "{args:?}: [new connections, forward packets, forward bytes, reply packets, reply \
         bytes] grew by {grown:?}, want {want:?}"
    );
    Ok(())
}

#[test]
fn node_port_packets_and_bytes_are_counted_exactly_on_the_netfilter_path() -> anyhow::Result<()> {
    counted_exactly(takeover::EBPF_NETFILTER_PATH)
}

#[test]
fn node_port_packets_and_bytes_are_counted_exactly_on_the_fast_path() -> anyhow::Result<()> {
    counted_exactly(takeover::EBPF_FAST_PATH)
}

#[test]
fn node_port_packets_and_bytes_are_counted_exactly_with_xdp_in_front() -> anyhow::Result<()> {
    counted_exactly(takeover::EBPF_XDP)
}
