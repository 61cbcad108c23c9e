//! The XDP program beside tc: later packets of tc's flows, new flows, what it leaves to tc, its
//! drops.

use proxy_model::traffic::FrontendKind;

use super::*;

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

/// Jumbo frames (`ext0` at MTU 9000): a later packet of 8000 payload bytes, larger than a page,
/// reaches the multi-buffer program in several buffers (`BPF_PROG_TEST_RUN` puts what does not
/// fit the first page in fragments, as a driver does), of which direct packet access sees the
/// first. XDP translates it and the backend's reply of the same size as it translates small
/// ones: the headers in the first buffer rewritten, every checksum right over the whole
/// packet (recomputed from scratch here), the payload intact, the length unchanged; and the
/// Service's byte counts take the whole frame (`bpf_xdp_get_buff_len`), not its first buffer.
/// TCP and UDP, IPv4 and IPv6.
#[test]
fn xdp_translates_jumbo_frames_in_several_buffers() {
    with_node(|node| {
        program_remote(node);
        // This thread is in the node namespace; the child inherits it.
        let status = std::process::Command::new("ip")
            .args(["link", "set", "ext0", "mtu", "9000"])
            .status()
            .expect("ip link");
        assert!(status.success(), "ext0 at MTU 9000");
        let mut counters = super::traffic::reader(node);
        let payload: Vec<u8> = (0..8000u32).map(|i| (i % 251) as u8).collect();
        for (i, (client, node_ip, port, backend, backend_port, first, later)) in
            REMOTE_CASES.into_iter().enumerate()
        {
            let client = sa(client, 45_300 + i as u16);
            let frontend = sa(node_ip, port);
            let backend = sa(backend, backend_port);
            let what = format!("{later:?} {client} → {frontend}");
            let syn = build(client, frontend, first, b"hello");
            let (action, by_tc) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{what}: tc starts the flow");

            let before = (
                stat(node, StatIndex::XdpEstablished),
                stat(node, StatIndex::XdpReplyTranslated),
            );
            let bytes_before = super::traffic::packets(
                &counters.read().expect("read"),
                "remote",
                FrontendKind::NodePort,
            );
            let data = build(client, frontend, later, &payload);
            assert!(data.len() > 4096, "{what}: larger than a page");
            let (action, frame) = run_xdp(node, &data);
            assert_eq!(action, XDP_REDIRECT, "{what}: XDP takes the jumbo frame");
            assert_eq!(frame.len(), data.len(), "{what}: length unchanged");
            let out = parse_checked(&frame)
                .unwrap_or_else(|e| panic!("{what}: XDP output of {} bytes: {e}", frame.len()));
            assert_eq!(out.destination(), backend, "{what}: DNAT");
            assert_eq!(out.source(), by_tc.source(), "{what}: tc's SNAT");
            assert!(out.l4.ends_with(&payload), "{what}: payload intact");
            assert_eq!(out.eth_dst, REMOTE_MAC, "{what}: next hop's MAC");

            let reply = build(backend, out.source(), later, &payload);
            let (action, frame) = run_xdp(node, &reply);
            assert_eq!(action, XDP_REDIRECT, "{what}: XDP takes the jumbo reply");
            let back = parse_checked(&frame)
                .unwrap_or_else(|e| panic!("{what}: XDP reply of {} bytes: {e}", frame.len()));
            assert_eq!(
                (back.source(), back.destination()),
                (frontend, client),
                "{what}: reply translated"
            );
            assert!(back.l4.ends_with(&payload), "{what}: reply payload intact");

            assert_eq!(
                (
                    stat(node, StatIndex::XdpEstablished),
                    stat(node, StatIndex::XdpReplyTranslated),
                ),
                (before.0 + 1, before.1 + 1),
                "{what}: counted"
            );
            let bytes_after = super::traffic::packets(
                &counters.read().expect("read"),
                "remote",
                FrontendKind::NodePort,
            );
            let ip_bytes = (data.len() - 14) as u64;
            assert_eq!(
                [
                    bytes_after[1] - bytes_before[1],
                    bytes_after[3] - bytes_before[3],
                ],
                [ip_bytes, ip_bytes],
                "{what}: the whole frames' IP bytes counted, forward and reply"
            );
        }
    });
}

/// A frame in one buffer is counted by its own length, as tc counts `skb->len`: later packets
/// without payload, padded to Ethernet's 60-byte minimum as a wire delivers them (IPv4) or
/// longer than it (IPv6), each sent once through tc and once through XDP in the same flow.
/// Both add the frame's bytes past the Ethernet header, padding included, to the forward
/// count; XDP reads that length from the frame it sees rather than asking the kernel for the
/// length across buffers (the jumbo test above covers frames in several buffers).
#[test]
fn xdp_counts_a_frame_in_one_buffer_as_tc_does_padding_included() {
    with_node(|node| {
        program_remote(node);
        let mut counters = super::traffic::reader(node);
        let mut forward_bytes = || {
            super::traffic::packets(
                &counters.read().expect("read"),
                "remote",
                FrontendKind::NodePort,
            )[1]
        };
        for (i, (client, node_ip, port, _, _, first, later)) in REMOTE_CASES.into_iter().enumerate()
        {
            let client = sa(client, 45_400 + i as u16);
            let frontend = sa(node_ip, port);
            let what = format!("{later:?} {client} → {frontend}");
            let syn = build(client, frontend, first, b"");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{what}: tc starts the flow");

            let mut data = build(client, frontend, later, b"");
            let unpadded = data.len();
            data.resize(unpadded.max(60), 0);
            let frame_bytes = (data.len() - 14) as u64;

            let before = forward_bytes();
            let (action, _) = run(node, program_names::TC_EXTERNAL, &data, node.ext0);
            assert_eq!(
                action, TC_ACT_REDIRECT,
                "{what}: tc translates a later packet"
            );
            let by_tc = forward_bytes() - before;

            let established = stat(node, StatIndex::XdpEstablished);
            let before = forward_bytes();
            let (action, _) = run_xdp(node, &data);
            assert_eq!(action, XDP_REDIRECT, "{what}: XDP takes the padded frame");
            assert_eq!(
                stat(node, StatIndex::XdpEstablished),
                established + 1,
                "{what}: counted as established"
            );
            let by_xdp = forward_bytes() - before;
            assert_eq!(
                (by_tc, by_xdp),
                (frame_bytes, frame_bytes),
                "{what}: a {}-byte frame ({unpadded} before padding) counted by tc and by XDP",
                data.len()
            );
        }
    });
}
