//! What the tc programs refuse before any NAT: source ranges, loopback destinations, Services
//! without endpoints (and the rate of their REJECTs).

use super::*;

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

/// The drop, reject and untranslated-pass reasons (`StatAction::is_drop`) whose counters moved
/// since `before` (a reading of [`EbpfDataplane::stats`]), by name, with how much.
fn drops_since(node: &Node, before: &[(StatIndex, u64)]) -> Vec<(&'static str, u64)> {
    node.dataplane
        .stats()
        .into_iter()
        .filter(|(index, _)| index.action().is_drop())
        .filter_map(|(index, value)| {
            let was = before
                .iter()
                .find(|(i, _)| *i == index)
                .map_or(0, |(_, v)| *v);
            (value != was).then(|| (index.name(), value - was))
        })
        .collect()
}

/// Runs `frame` through `program` on `ifindex` and checks the action and that exactly one
/// drop, reject or untranslated-pass reason counted it, once: `reason`.
fn assert_counted_once(
    node: &mut Node,
    program: &'static str,
    frame: &[u8],
    ifindex: u32,
    action: i32,
    reason: StatIndex,
    what: &str,
) {
    assert!(reason.action().is_drop(), "{what}: {}", reason.name());
    let before = node.dataplane.stats();
    let out = node
        .dataplane
        .test_run_tc(program, frame, ifindex)
        .expect("test_run");
    assert_eq!(out.action, action, "{what}");
    if action != TC_ACT_REDIRECT {
        assert_eq!(out.packet, frame, "{what}: the packet is not rewritten");
    }
    assert_eq!(
        drops_since(node, &before),
        [(reason.name(), 1)],
        "{what}: counted once, by its reason"
    );
}

/// Every drop, reject and untranslated pass tc makes of a packet to a frontend counts exactly
/// one reason, once: a client outside `loadBalancerSourceRanges`; `externalTrafficPolicy:
/// Local` without a local endpoint at the LB IP and at the NodePort; a Service without
/// endpoints (REJECT, and a drop where the REJECT cannot be built); a TCP segment other than a SYN without a flow; TCP and UDP headers cut
/// short before their ports (IPv4, IPv6); a frontend whose backend vanished from the backend
/// map; an entry program whose family program is missing. A packet to no frontend moves no
/// drop counter.
#[test]
fn every_drop_is_counted_once_by_its_reason() {
    with_node(|node| {
        program_remote(node);
        let truncated_tcp = {
            let mut frame = build(sa(CLIENT, 48_105), sa(NODE_IP, 30095), L4::TcpSyn, b"");
            // Ethernet, IPv4, 10 of the TCP header's 14 bytes up to its flags.
            frame.truncate(14 + 20 + 10);
            frame
        };
        let truncated_udp6 = {
            let mut frame = build(sa(CLIENT6, 48_106), sa(NODE_IP6, 30096), L4::Udp, b"");
            // Ethernet, IPv6, the source port only.
            frame.truncate(14 + 40 + 2);
            frame
        };
        let with_options = {
            let mut frame = build(sa(CLIENT, 48_109), sa(NODE_IP, 30094), L4::TcpSyn, b"");
            // Four NOP options: a 24-byte IPv4 header, which the REJECT does not quote.
            frame.splice(14 + 20..14 + 20, [1u8; 4]);
            frame[14] = 0x46;
            let total = u16::from_be_bytes([frame[16], frame[17]]) + 4;
            frame[16..18].copy_from_slice(&total.to_be_bytes());
            frame[24..26].fill(0);
            let sum = inet_checksum(&frame[14..38]);
            frame[24..26].copy_from_slice(&sum.to_be_bytes());
            frame
        };
        let cases = [
            (
                "a client outside the source ranges",
                build(sa(CLIENT, 48_100), sa("198.51.100.20", 80), L4::TcpSyn, b""),
                TC_ACT_SHOT,
                StatIndex::TcDroppedSourceRange,
            ),
            (
                "eTP Local without a local endpoint, LB IP",
                build(sa(CLIENT, 48_101), sa("198.51.100.21", 80), L4::TcpSyn, b""),
                TC_ACT_SHOT,
                StatIndex::TcDroppedNoLocal,
            ),
            (
                "eTP Local without a local endpoint, NodePort",
                build(sa(CLIENT, 48_102), sa(NODE_IP, 30099), L4::TcpSyn, b""),
                TC_ACT_SHOT,
                StatIndex::TcDroppedNoLocal,
            ),
            (
                "a Service without endpoints",
                build(sa(CLIENT, 48_103), sa(NODE_IP, 30094), L4::TcpSyn, b""),
                TC_ACT_REDIRECT,
                StatIndex::TcRejected,
            ),
            (
                "a Service without endpoints, IPv4 options (no REJECT built)",
                with_options,
                TC_ACT_SHOT,
                StatIndex::TcRejectFailed,
            ),
            (
                "an ACK without a flow",
                build(sa(CLIENT, 48_104), sa(NODE_IP, 30095), L4::TcpAck, b""),
                TC_ACT_UNSPEC,
                StatIndex::TcMidstreamPassed,
            ),
            (
                "a TCP header cut before its flags",
                truncated_tcp,
                TC_ACT_UNSPEC,
                StatIndex::TcTruncatedHeader,
            ),
            (
                "a UDP header cut before its destination port (IPv6)",
                truncated_udp6,
                TC_ACT_UNSPEC,
                StatIndex::TcTruncatedHeader,
            ),
        ];
        for (what, frame, action, reason) in cases {
            let ext0 = node.ext0;
            assert_counted_once(
                node,
                program_names::TC_EXTERNAL,
                &frame,
                ext0,
                action,
                reason,
                what,
            );
        }

        // Not the datapath's: no counter on its path.
        let before = node.dataplane.stats();
        let stranger = build(sa(CLIENT, 48_107), sa(NODE_IP, 31_999), L4::TcpSyn, b"");
        let (action, _) = run(node, program_names::TC_EXTERNAL, &stranger, node.ext0);
        assert_eq!(action, TC_ACT_UNSPEC, "to no frontend: the stack's");
        assert_eq!(drops_since(node, &before), [], "to no frontend: no drop");

        // The frontend's backend vanished (the agent's update protocol never lets it): the
        // packet is dropped, not sent anywhere.
        let pins = node.parts.bpf.path().join(PIN_DIR_NAME);
        // An array indexed by backend id: a backend is removed by writing the zero value,
        // which the programs must take for "no backend", as a hash miss was.
        let mut backends = aya::maps::Array::<MapData, proxy_common::Backend4>::try_from(
            Map::from_map_data(
                MapData::from_pin(pins.join(map_names::BACKENDS4)).expect("backends pin"),
            )
            .expect("map"),
        )
        .expect("backends map");
        let ids: Vec<u32> = (0..backends.len())
            .filter(|&id| backends.get(&id, 0).is_ok_and(|b| b.proto != 0))
            .collect();
        assert!(!ids.is_empty(), "the Services' backends");
        for id in ids {
            backends
                .set(id, proxy_common::Backend4::default(), 0)
                .expect("remove backend");
        }
        let frame = build(sa(CLIENT, 48_108), sa(NODE_IP, 30095), L4::TcpSyn, b"");
        let ext0 = node.ext0;
        assert_counted_once(
            node,
            program_names::TC_EXTERNAL,
            &frame,
            ext0,
            TC_ACT_SHOT,
            StatIndex::BackendMissing,
            "a frontend whose backend vanished",
        );

        // No IPv4 program behind the entry program (the agent fills the slots before it
        // attaches): to the stack untranslated.
        let mut family = aya::maps::ProgramArray::try_from(Map::ProgramArray(
            MapData::from_pin(pins.join(map_names::TC_FAMILY)).expect("family pin"),
        ))
        .expect("program array");
        family
            .clear_index(&(proxy_common::TcFamilyProgram::External4 as u32))
            .expect("clear slot");
        assert_counted_once(
            node,
            program_names::TC_EXTERNAL,
            &frame,
            ext0,
            TC_ACT_UNSPEC,
            StatIndex::TcFamilyProgramMissing,
            "no IPv4 program",
        );
    });
}

/// A later fragment of a flow's datagram whose first fragment was remembered, but whose
/// flow's entries are gone since (expired, evicted), goes to the stack untouched and counts
/// `tc_fragment_untracked`; one of a flow the kernel's conntrack NATs (adopted at the agent's
/// start) counts `tc_kernel_nat_passed`, as the flow's whole datagrams do.
#[test]
fn later_fragments_left_to_the_stack_are_counted() {
    with_netfilter_node(|node| {
        program_services(node);
        let frontend = sa(NODE_IP, 30053);
        for (port, id, reason) in [
            (43_110, 0x4321, StatIndex::TcFragmentUntracked),
            (43_111, 0x4322, StatIndex::TcKernelNatPassed),
        ] {
            let client = sa(CLIENT, port);
            let Fragmented { what, pieces, .. } = three_fragments(client, frontend, id);
            let what = format!("{what}, {}", reason.name());
            let (action, _, mark) = run_fragment(
                node,
                program_names::TC_EXTERNAL,
                &pieces[0],
                node.ext0,
                0,
                &what,
            );
            assert_eq!(
                (action, mark),
                (TC_ACT_UNSPEC, TRANSLATED_MARK),
                "{what}: the first fragment starts the flow"
            );
            let key = ct_key(client, frontend, PROTO_UDP);
            let mut ct = pinned_ct(node);
            if reason == StatIndex::TcFragmentUntracked {
                ct.remove(&key).expect("remove the flow's entry");
            } else {
                let mut value = ct.get(&key).expect("the flow's entry");
                value.flags |= ct_flags::KERNEL_NAT;
                ct.insert(&key, &value, 0)
                    .expect("mark the flow the kernel's");
            }
            drop(ct);
            let before = node.dataplane.stats();
            let (action, out, mark) = run_fragment(
                node,
                program_names::TC_EXTERNAL,
                &pieces[1],
                node.ext0,
                0,
                &what,
            );
            assert_eq!(action, TC_ACT_UNSPEC, "{what}: to the stack");
            assert_eq!((out, mark), (pieces[1].clone(), 0), "{what}: untouched");
            assert_eq!(
                drops_since(node, &before),
                [(reason.name(), 1)],
                "{what}: counted once"
            );
            if reason == StatIndex::TcKernelNatPassed {
                // A whole datagram of the flow: left to the kernel's NAT as well.
                let datagram = build(client, frontend, L4::Udp, b"ping");
                let before = node.dataplane.stats();
                let (action, out, mark) = run_fragment(
                    node,
                    program_names::TC_EXTERNAL,
                    &datagram,
                    node.ext0,
                    0,
                    &what,
                );
                assert_eq!(
                    (action, out, mark),
                    (TC_ACT_UNSPEC, datagram, 0),
                    "{what}: a whole datagram untouched"
                );
                assert_eq!(
                    drops_since(node, &before),
                    [(reason.name(), 1)],
                    "{what}: a whole datagram counted once"
                );
            }
        }
    });
}

/// A program missing behind a tail call (the agent fills the program arrays before it
/// attaches): XDP hands a new flow's first packet on to tc, and a family program a later IP
/// fragment to the stack, each untouched and counted `tc_family_program_missing` once.
#[test]
fn missing_tail_call_programs_are_counted() {
    with_node(|node| {
        program_remote(node);
        let pins = node.parts.bpf.path().join(PIN_DIR_NAME);
        let clear = |name: &str, slot: u32| {
            let mut programs = aya::maps::ProgramArray::try_from(Map::ProgramArray(
                MapData::from_pin(pins.join(name)).expect("program array pin"),
            ))
            .expect("program array");
            programs.clear_index(&slot).expect("clear slot");
        };
        clear(map_names::XDP_NEW_FLOW, 0);
        let syn = build(sa(CLIENT, 48_120), sa(NODE_IP, 30095), L4::TcpSyn, b"");
        let before = node.dataplane.stats();
        let (action, out) = run_xdp(node, &syn);
        assert_eq!((action, &out), (XDP_PASS, &syn), "XDP: on to tc, untouched");
        assert_eq!(
            drops_since(node, &before),
            [(StatIndex::TcFamilyProgramMissing.name(), 1)],
            "XDP without its new-flow program: counted once"
        );

        clear(
            map_names::TC_FRAGMENT,
            proxy_common::TcFragmentProgram::Ingress4 as u32,
        );
        let Fragmented { pieces, .. } =
            three_fragments(sa(CLIENT, 48_121), sa(NODE_IP, 30096), 0x7777);
        let ext0 = node.ext0;
        assert_counted_once(
            node,
            program_names::TC_EXTERNAL,
            &pieces[1],
            ext0,
            TC_ACT_UNSPEC,
            StatIndex::TcFamilyProgramMissing,
            "a later fragment without the fragment program",
        );
    });
}
