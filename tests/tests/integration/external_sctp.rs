//! SCTP through the tc programs with real packets between namespaces and the real agent. The
//! kernels here have no SCTP stack, so both ends are raw `IPPROTO_SCTP` sockets (they work
//! without it: the IP layer hands raw sockets every packet of their protocol): the external
//! client sends a crafted INIT to the NodePort, the pod's raw socket receives what the node
//! forwarded, answers, and the client receives the reverse-translated answer. Every packet's
//! addresses, ports and CRC32c (recomputed from scratch) are checked. IPv4 only: an IPv6 raw
//! socket does not return the IP header (the destination address), and `tc_test_run/sctp.rs`
//! covers IPv6 byte for byte. `inspect explain` for the INIT's tuple must name the pod it
//! reached and the SNAT source the pod saw (SCTP's share of the explain agreement, which the
//! connection-based `explain_agreement.rs` cannot make without an SCTP stack). Needs root.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn, recvfrom, sendto,
    setsockopt, socket, sockopt::ReceiveTimeout,
};
use nix::sys::time::TimeVal;
use proxy_tests::manifests::{Protocol, SlicePort, endpoint_slice_yaml};
use proxy_tests::netns::Netns;
use proxy_tests::packet::{L4, Parsed, build, crc32c, parse_checked};
use proxy_tests::scenario::{DATAPATH_TIMEOUT, Scenario, pod_endpoint};
use proxy_tests::topology::Topology;

const NODE_PORT: u16 = 30868;
const PORT: u16 = 3868;
const TARGET_PORT: u16 = 3869;
const CLIENT_PORT: u16 = 40_868;
const IPV4_HLEN: usize = 20;
/// Poll interval of the raw receivers (and of the INIT retries until the agent has programmed
/// the frontend).
const POLL: Duration = Duration::from_millis(200);

fn diameter_service() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: diameter, namespace: default}}\n\
         spec:\n  type: NodePort\n  clusterIP: 10.96.0.30\n  externalTrafficPolicy: Cluster\n\
         \x20 ports:\n  - {{name: diameter, port: {PORT}, protocol: SCTP, targetPort: \
         {TARGET_PORT}, nodePort: {NODE_PORT}}}\n"
    )
}

/// A raw IPv4 SCTP socket in `ns` (a socket stays in the namespace it was created in, so a
/// short-lived thread creates it there).
fn raw_sctp_socket(ns: &Netns) -> anyhow::Result<OwnedFd> {
    let path = ns.path();
    std::thread::spawn(move || -> anyhow::Result<OwnedFd> {
        proxy_tests::netns::enter_netns(&path)?;
        let fd = socket(
            AddressFamily::Inet,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::Sctp,
        )
        .context("socket(AF_INET, SOCK_RAW, IPPROTO_SCTP)")?;
        setsockopt(
            &fd,
            ReceiveTimeout,
            &TimeVal::new(0, POLL.as_micros() as i64),
        )
        .context("SO_RCVTIMEO")?;
        Ok(fd)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("socket thread panicked"))?
}

/// Sends `segment` (an SCTP packet) to `to`; the kernel adds the IPv4 header.
fn send(fd: &OwnedFd, segment: &[u8], to: Ipv4Addr) -> anyhow::Result<()> {
    let addr = SockaddrIn::from(SocketAddrV4::new(to, 0));
    sendto(
        std::os::fd::AsRawFd::as_raw_fd(fd),
        segment,
        &addr,
        MsgFlags::empty(),
    )
    .with_context(|| format!("sendto {to}"))?;
    Ok(())
}

/// The SCTP packet of a frame from `build` (IPv4, no options).
fn segment(frame: &[u8]) -> &[u8] {
    &frame[14 + IPV4_HLEN..]
}

/// The next packet to `dport` that arrives within one poll interval, parsed with every
/// checksum verified (an IPv4 raw socket returns the IP header; an Ethernet header is put in
/// front for the frame parser).
fn receive(fd: &OwnedFd, dport: u16) -> anyhow::Result<Option<Parsed>> {
    let mut buf = [0u8; 2048];
    let deadline = Instant::now() + POLL;
    while Instant::now() < deadline {
        let len = match recvfrom::<SockaddrIn>(std::os::fd::AsRawFd::as_raw_fd(fd), &mut buf) {
            Ok((len, _)) => len,
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => return Ok(None),
            Err(e) => bail!("recvfrom: {e}"),
        };
        let mut frame = vec![0u8; 12];
        frame.extend_from_slice(&0x0800u16.to_be_bytes());
        frame.extend_from_slice(&buf[..len]);
        let parsed = parse_checked(&frame)
            .map_err(|e| anyhow::anyhow!("received {:02x?}: {e}", &buf[..len]))?;
        if parsed.dport() == dport {
            return Ok(Some(parsed));
        }
    }
    Ok(None)
}

fn stored_crc(l4: &[u8]) -> u32 {
    u32::from_le_bytes([l4[8], l4[9], l4[10], l4[11]])
}

#[test]
fn sctp_init_reaches_the_pod_translated_and_the_answer_comes_back() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(1)?;
    s.manifests.write("svc.yaml", &diameter_service())?;
    s.manifests.write(
        "slice.yaml",
        &endpoint_slice_yaml(
            "default",
            "diameter-1",
            "diameter",
            &[SlicePort {
                name: "diameter".into(),
                port: TARGET_PORT,
                protocol: Protocol::Sctp,
            }],
            &[pod_endpoint(1)],
        ),
    )?;
    let client_sock = raw_sctp_socket(s.topo.ext())?;
    let pod_sock = raw_sctp_socket(s.topo.pod(1)?)?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;

    let node_ip = Topology::node_ext_ip();
    let client = SocketAddr::new(Topology::ext_ip().into(), CLIENT_PORT);
    let frontend = SocketAddr::new(node_ip.into(), NODE_PORT);
    let pod = SocketAddr::new(Topology::pod_ip(1).into(), TARGET_PORT);
    let init = build(client, frontend, L4::Sctp, b"");

    // Until the agent has programmed the NodePort the node's own stack gets the INIT (and,
    // without SCTP, drops it): resend until the pod sees one, bounded in time.
    let start = Instant::now();
    let mut sent = 0;
    let arrived = loop {
        send(&client_sock, segment(&init), node_ip)?;
        sent += 1;
        if let Some(p) = receive(&pod_sock, TARGET_PORT)? {
            break p;
        }
        if start.elapsed() > DATAPATH_TIMEOUT {
            return Err(s
                .agent_error(format!("no INIT reached the pod in {DATAPATH_TIMEOUT:?}"))
                .into());
        }
    };
    eprintln!(
        "INIT {client} → {frontend} arrived as {} → {} after {sent} send(s), {:?}; CRC32c \
         {:#010x} → {:#010x} (valid)",
        arrived.source(),
        arrived.destination(),
        start.elapsed(),
        stored_crc(segment(&init)),
        stored_crc(&arrived.l4),
    );
    ensure!(arrived.destination() == pod, "DNAT: {arrived:?}");
    ensure!(
        arrived.src == IpAddr::V4(node_ip) && arrived.sport() >= 49_152,
        "SNAT to the node (eTP Cluster): {arrived:?}"
    );
    ensure!(
        arrived.l4[4..][..4] == segment(&init)[4..8] && arrived.l4[12..] == segment(&init)[12..],
        "verification tag and INIT chunk unchanged"
    );
    ensure!(
        stored_crc(&arrived.l4) != stored_crc(segment(&init)),
        "the ports changed, so must the CRC32c"
    );

    // `inspect explain` for this exact tuple agrees with the packet: the flow's conntrack
    // entry carries it to the pod, SNATed to exactly the source the pod saw.
    let explained = std::process::Command::new("nsenter")
        .arg(format!("--net={}", s.topo.node().path().display()))
        .arg(proxy_tests::agent::agent_binary()?)
        .arg("--bpf-root")
        .arg(s.agent()?.bpf_root())
        .args(["inspect", "explain", "--json", "--from", "external"])
        .args(["--client", &client.ip().to_string()])
        .args(["--to", &format!("{frontend}/sctp")])
        .args(["--sport", &CLIENT_PORT.to_string()])
        .output()?;
    ensure!(
        explained.status.success(),
        "inspect explain: {}",
        String::from_utf8_lossy(&explained.stderr)
    );
    let e: serde_json::Value = serde_json::from_slice(&explained.stdout)?;
    eprintln!("explain: {e}");
    ensure!(
        e["verdict"] == "translate" && e["chosen"] == pod.to_string(),
        "explain must name the pod the INIT reached: {e}"
    );
    ensure!(
        e["source"] == format!("{} (SNAT)", arrived.source()),
        "explain must name the SNAT source the pod saw ({}): {e}",
        arrived.source()
    );

    // The pod answers with DATA to the address it saw.
    let answer = build(pod, arrived.source(), L4::SctpData, b"answer!!");
    send(&pod_sock, segment(&answer), node_ip)?;
    let back = (0..DATAPATH_TIMEOUT.as_millis() / POLL.as_millis())
        .find_map(|_| receive(&client_sock, CLIENT_PORT).transpose())
        .context("no answer reached the client")??;
    eprintln!(
        "answer {pod} → {} arrived as {} → {}; CRC32c {:#010x} → {:#010x} (valid)",
        arrived.source(),
        back.source(),
        back.destination(),
        stored_crc(segment(&answer)),
        stored_crc(&back.l4),
    );
    ensure!(back.source() == frontend, "reverse NAT source: {back:?}");
    ensure!(
        back.destination() == client,
        "reverse NAT destination: {back:?}"
    );
    ensure!(back.l4.ends_with(b"answer!!"), "payload: {back:?}");
    // From scratch once more, independent of the parser.
    let mut zeroed = back.l4.clone();
    zeroed[8..12].fill(0);
    ensure!(
        crc32c(&zeroed) == stored_crc(&back.l4),
        "CRC32c of the answer"
    );
    Ok(())
}
