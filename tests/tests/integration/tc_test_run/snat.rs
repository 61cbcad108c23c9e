//! SNAT ports: reuse, the client's own port, half-open flows and their reclaim, the reserved range.

use super::*;

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
