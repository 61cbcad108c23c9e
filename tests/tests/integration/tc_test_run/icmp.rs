//! ICMP errors about translated flows, and the fast path's packet-too-big answers.

use super::*;

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
