//! Translation on every tc path: the netfilter path (DNAT at ingress, SNAT at egress), the fast
//! path, host-network backends, eTP Local, guarded LB IPs, and frontends switching generations.

use super::*;

/// The netfilter path (default): a NodePort flow's translation is split so that the host's
/// FORWARD/POSTROUTING see the client and the backend — ingress only rewrites destinations
/// and returns `TC_ACT_UNSPEC` (next program, then the stack), `kpr_tc_egress` rewrites
/// sources. With SNAT (eTP
/// Cluster) and without (eTP Local), TCP and UDP, IPv4 and IPv6.
#[test]
fn netfilter_path_splits_translation_between_ingress_and_egress() {
    with_netfilter_node(|node| {
        program_services(node);
        let cases = [
            (CLIENT, NODE_IP, 30080, BACKEND, 8080, L4::TcpSyn, false),
            (CLIENT, NODE_IP, 30053, BACKEND, 5353, L4::Udp, false),
            (CLIENT6, NODE_IP6, 30080, BACKEND6, 8080, L4::TcpSyn, false),
            (CLIENT, NODE_IP, 30081, BACKEND, 8080, L4::TcpSyn, true),
        ];
        for (i, (client, node_ip, node_port, backend, backend_port, l4, preserve)) in
            cases.into_iter().enumerate()
        {
            let client = sa(client, 41_000 + i as u16);
            let frontend = sa(node_ip, node_port);
            let backend = sa(backend, backend_port);
            let what = format!("{l4:?} {client} → {frontend}");
            // Ingress: DNAT only; the client stays the source for FORWARD.
            let frame = build(client, frontend, l4, b"ping");
            let (action, out_frame, out, mark) =
                run_marked(node, program_names::TC_EXTERNAL, &frame, node.ext0, 0);
            assert_eq!(
                action, TC_ACT_UNSPEC,
                "{what}: to the next program, then the stack"
            );
            assert_eq!(
                mark, TRANSLATED_MARK,
                "{what}: ingress marks what it translated"
            );
            assert_eq!(out.destination(), backend, "{what}: DNAT");
            assert_eq!(out.source(), client, "{what}: source untouched at ingress");

            // Egress of the pod side (after FORWARD/POSTROUTING): SNAT, or nothing.
            let (action, _, snat, mark) = run_marked(
                node,
                program_names::TC_EGRESS,
                &out_frame,
                node.pod0,
                TRANSLATED_MARK,
            );
            assert_eq!(mark, 0, "{what}: egress takes its mark bit off");
            assert_eq!(
                snat.destination(),
                backend,
                "{what}: egress keeps the backend"
            );
            let to_backend = if preserve {
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: not ours at egress");
                assert_eq!(snat.source(), client, "{what}: client kept (eTP Local)");
                client
            } else {
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: egress SNAT action");
                assert_eq!(snat.src, frontend.ip(), "{what}: SNAT address");
                assert!(
                    SNAT_PORTS.contains(&snat.sport()),
                    "{what}: SNAT port {}",
                    snat.sport()
                );
                let entry = ct_entry(node, &ct_key(client, backend, l4.proto()))
                    .expect("egress forward entry");
                assert_eq!(entry.flags & ct_flags::EGRESS, ct_flags::EGRESS);
                snat.source()
            };
            assert!(snat.l4.ends_with(b"ping"), "{what}: payload");

            // The backend answers on the pod side: ingress un-SNATs (destination only)...
            let answer = build(backend, to_backend, l4, b"pong");
            let (action, back_frame, back, mark) =
                run_marked(node, program_names::TC_REPLY, &answer, node.pod0, 0);
            assert_eq!(action, TC_ACT_UNSPEC, "{what}: reply to the stack");
            assert_eq!(mark, TRANSLATED_MARK, "{what}: the reply is marked too");
            assert_eq!(back.destination(), client, "{what}: reply destination");
            assert_eq!(
                back.source(),
                backend,
                "{what}: reply source still the backend"
            );
            // ...and egress of the external side puts the frontend back as its source.
            let (action, _, out, _) =
                run_marked(node, program_names::TC_EGRESS, &back_frame, node.ext0, mark);
            assert_eq!(action, TC_ACT_UNSPEC, "{what}: egress reply action");
            assert_eq!(out.source(), frontend, "{what}: reply source");
            assert_eq!(out.destination(), client, "{what}: reply destination");
            assert!(out.l4.ends_with(b"pong"));
        }

        // A flow without SNAT (eTP Local, 30081) from the first case's client tuple to its
        // backend while that SNATed flow lives: on the netfilter path both would show the
        // kernel the same tuple, and the egress entries keyed by it are the first flow's (they
        // would SNAT this one). The new flow takes the fast path (`ct_flags::BYPASS`): whole
        // at ingress and redirected, never marked for egress, the client's address kept; and
        // the first flow, whose egress reply entry held the tuple, moves to the fast path too.
        let client = sa(CLIENT, 41_000);
        let frame = build(client, sa(NODE_IP, 30081), L4::TcpSyn, b"again");
        let (action, _, out) = run_raw(node, program_names::TC_EXTERNAL, &frame, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT, "a held tuple takes the fast path");
        assert_eq!(out.destination(), sa(BACKEND, 8080));
        assert_eq!(out.source(), client, "client kept");
        for key in [
            ct_key(client, sa(NODE_IP, 30081), proto::TCP),
            ct_key(client, sa(NODE_IP, 30080), proto::TCP),
        ] {
            let entry = ct_entry(node, &key).expect("both flows' forward entries");
            assert_ne!(entry.flags & ct_flags::BYPASS, 0, "{key:?} bypasses");
        }

        // The client reaches the backend's pod address directly, from the port of the second
        // (SNATed, UDP) case's flow, whose egress entries are still there: nothing translated
        // this packet at ingress, so egress must not SNAT it.
        let client = sa(CLIENT, 41_001);
        let direct = build(client, sa(BACKEND, 5353), L4::Udp, b"direct");
        ct_entry(node, &ct_key(client, sa(BACKEND, 5353), proto::UDP))
            .expect("the SNATed UDP flow's egress entry is still tracked");
        let (action, out) = run(node, program_names::TC_EGRESS, &direct, node.pod0);
        assert_eq!(action, TC_ACT_UNSPEC);
        assert_eq!(
            (out.source(), out.destination()),
            (client, sa(BACKEND, 5353)),
            "a packet ingress did not translate keeps its addresses"
        );

        // Traffic egress has no entry for passes on, unchanged, to the next program.
        let unrelated = build(sa(CLIENT, 9), sa(BACKEND, 10), L4::Udp, b"x");
        let (action, out) = run(node, program_names::TC_EGRESS, &unrelated, node.pod0);
        assert_eq!(action, TC_ACT_UNSPEC);
        assert_eq!(
            (out.source(), out.destination()),
            (sa(CLIENT, 9), sa(BACKEND, 10))
        );
    });
}

/// Every rewrite keeps a `CHECKSUM_COMPLETE` skb's `csum` true to the packet: IPv4 (address
/// changes move the header checksum too) and IPv6 (address and L4 checksum changes cancel
/// out, so `csum` must not move: `BPF_F_IPV6`, or on kernels without it the helper's IPv4-style
/// adjustment taken back), TCP and UDP, both directions, on the netfilter path (each half in
/// its own program) and the fast path, with the `l4-csum-ipv6` feature used and turned off.
#[test]
fn checksum_complete_skbs_keep_a_true_csum_through_every_rewrite() {
    for (fast_path, disabled) in [
        (false, BTreeSet::new()),
        (true, BTreeSet::new()),
        (false, BTreeSet::from([Feature::L4CsumIpv6])),
        (true, BTreeSet::from([Feature::L4CsumIpv6])),
    ] {
        with_node_features(
            LbOptions::default(),
            fast_path,
            None,
            SNAT_PORTS,
            disabled.clone(),
            move |node| {
                program_services(node);
                let cases = [
                    (CLIENT, NODE_IP, 30080, L4::TcpSyn),
                    (CLIENT, NODE_IP, 30053, L4::Udp),
                    (CLIENT6, NODE_IP6, 30080, L4::TcpSyn),
                    (CLIENT6, NODE_IP6, 30053, L4::Udp),
                ];
                for (i, (client, node_ip, node_port, l4)) in cases.into_iter().enumerate() {
                    let client = sa(client, 42_000 + i as u16);
                    let frontend = sa(node_ip, node_port);
                    let what = format!(
                        "{l4:?} {client} → {frontend} (fast path {fast_path}, disabled {disabled:?})"
                    );
                    let frame = build(client, frontend, l4, b"ping");
                    let (_, mut to_backend, mark) = run_complete(
                        node,
                        program_names::TC_EXTERNAL,
                        &frame,
                        node.ext0,
                        0,
                        &what,
                    );
                    if !fast_path {
                        (_, to_backend, _) = run_complete(
                            node,
                            program_names::TC_EGRESS,
                            &to_backend,
                            node.pod0,
                            mark,
                            &what,
                        );
                    }
                    let sent = parse_checked(&to_backend).expect("checked above");
                    assert_ne!(sent.destination(), frontend, "{what}: DNAT");
                    let answer = build(sent.destination(), sent.source(), l4, b"pong");
                    let (_, mut to_client, mark) =
                        run_complete(node, program_names::TC_REPLY, &answer, node.pod0, 0, &what);
                    if !fast_path {
                        (_, to_client, _) = run_complete(
                            node,
                            program_names::TC_EGRESS,
                            &to_client,
                            node.ext0,
                            mark,
                            &what,
                        );
                    }
                    let back = parse_checked(&to_client).expect("checked above");
                    assert_eq!(
                        (back.source(), back.destination()),
                        (frontend, client),
                        "{what}: reverse translation"
                    );
                }
            },
        );
    }
}

/// On the fast path the egress program passes everything it did not send itself (see
/// `host_network_backends_are_delivered_locally_and_answered_at_egress`): ingress did the
/// whole translation.
#[test]
fn fast_path_egress_passes_everything() {
    with_node(|node| {
        program_services(node);
        let client = sa(CLIENT, 42_000);
        let frame = build(client, sa(NODE_IP, 30053), L4::Udp, b"ping");
        let (action, out_frame, out) = run_raw(node, program_names::TC_EXTERNAL, &frame, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        let (action, again) = run(node, program_names::TC_EGRESS, &out_frame, node.pod0);
        assert_eq!(action, TC_ACT_UNSPEC);
        assert_eq!(
            (again.source(), again.destination()),
            (out.source(), out.destination())
        );
        // No egress entries were written.
        let entries = node.dataplane.conntrack_entries().expect("conntrack");
        assert!(
            entries.iter().all(|(_, v)| v.flags & ct_flags::EGRESS == 0),
            "{entries:?}"
        );
    });
}

/// Host-network backends, on both paths: a NodePort whose backend is an address of
/// the node itself is DNATed and handed to the stack for local delivery, never SNATed (the
/// node's own address as the source would be a martian, and kube-proxy's MASQUERADE never sees
/// a locally delivered packet), with a `HOST_BACKEND` reply entry; the backend's answer, which
/// leaves the node's own stack unmarked, gets the frontend as its source at egress. Egress
/// leaves alone the same packet received on an interface, and a locally sent packet whose
/// entry is a pod backend's.
#[test]
fn host_network_backends_are_delivered_locally_and_answered_at_egress() {
    for fast_path in [false, true] {
        with_node_path(
            LbOptions::default(),
            fast_path,
            None,
            SNAT_PORTS,
            move |node| {
                let (summary, errors) = node.dataplane.apply(&host_network_snapshot(), None);
                assert!(errors.is_empty(), "apply errors: {errors:?}");
                assert!(summary.frontends_written > 0, "{summary:?}");
                let path = if fast_path {
                    "fast path"
                } else {
                    "netfilter path"
                };
                let cases = [
                    (CLIENT, NODE_IP, 30090, 8080, L4::TcpSyn),
                    (CLIENT, NODE_IP, 30091, 5353, L4::Udp),
                    (CLIENT6, NODE_IP6, 30090, 8080, L4::TcpSyn),
                    (CLIENT6, NODE_IP6, 30091, 5353, L4::Udp),
                ];
                for (i, (client, node_ip, node_port, backend_port, l4)) in
                    cases.into_iter().enumerate()
                {
                    let client = sa(client, 43_000 + i as u16);
                    let frontend = sa(node_ip, node_port);
                    let backend = sa(node_ip, backend_port);
                    let what = format!("{path}: {l4:?} {client} → {frontend}");
                    let frame = build(client, frontend, l4, b"ping");
                    let (action, _, out, mark) =
                        run_marked(node, program_names::TC_EXTERNAL, &frame, node.ext0, 0);
                    let (expected_action, expected_mark) = if fast_path {
                        // No forwarding route: up the stack, to the local socket.
                        (TC_ACT_OK, 0)
                    } else {
                        (TC_ACT_UNSPEC, TRANSLATED_MARK)
                    };
                    assert_eq!(action, expected_action, "{what}: action");
                    assert_eq!(mark, expected_mark, "{what}: mark");
                    assert_eq!(out.destination(), backend, "{what}: DNAT to the node");
                    assert_eq!(out.source(), client, "{what}: never SNATed");
                    assert!(out.l4.ends_with(b"ping"), "{what}: payload");
                    let forward = ct_entry(node, &ct_key(client, frontend, l4.proto()))
                        .expect("forward entry");
                    assert_eq!(forward.flags & ct_flags::SNAT, 0, "{what}: forward entry");
                    let reply = ct_entry(node, &ct_key(backend, client, l4.proto()))
                        .expect("reply entry under the backend's own packet");
                    assert_eq!(
                        reply.flags & (ct_flags::REPLY | ct_flags::HOST_BACKEND | ct_flags::EGRESS),
                        ct_flags::REPLY | ct_flags::HOST_BACKEND,
                        "{what}: reply entry flags"
                    );

                    // The backend's answer leaves the node's own stack: egress of `ext0`.
                    let answer = build(backend, client, l4, b"pong");
                    let local = |local| TcTestInput {
                        ifindex: node.ext0,
                        local,
                        ..TcTestInput::default()
                    };
                    let sent = local(true);
                    let run = node
                        .dataplane
                        .test_run_tc_with(program_names::TC_EGRESS, &answer, sent)
                        .expect("test_run");
                    let back = parse_checked(&run.packet).expect("egress output");
                    assert_eq!(run.action, TC_ACT_UNSPEC, "{what}: egress action");
                    assert_eq!(back.source(), frontend, "{what}: reply from the frontend");
                    assert_eq!(back.destination(), client, "{what}: reply destination");
                    assert!(back.l4.ends_with(b"pong"), "{what}: reply payload");

                    // The same tuple received on an interface is not the local socket's.
                    let received = local(false);
                    let run = node
                        .dataplane
                        .test_run_tc_with(program_names::TC_EGRESS, &answer, received)
                        .expect("test_run");
                    let untouched = parse_checked(&run.packet).expect("egress output");
                    assert_eq!(run.action, TC_ACT_UNSPEC);
                    assert_eq!(
                        (untouched.source(), untouched.destination()),
                        (backend, client),
                        "{what}: a received packet is not a host backend's reply"
                    );
                }

                // A pod backend's flow (eTP Local, no SNAT): its reply entry is keyed by the pod's
                // packet, but only a packet from the pod, translated at ingress, is its reply.
                let client = sa(CLIENT, 43_100);
                let frame = build(client, sa(NODE_IP, 30092), L4::TcpSyn, b"ping");
                let (_, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                assert_eq!(out.destination(), sa(BACKEND, 8080), "{path}: pod flow");
                let answer = build(sa(BACKEND, 8080), client, L4::TcpSyn, b"pong");
                let input = TcTestInput {
                    ifindex: node.ext0,
                    local: true,
                    ..TcTestInput::default()
                };
                let run = node
                    .dataplane
                    .test_run_tc_with(program_names::TC_EGRESS, &answer, input)
                    .expect("test_run");
                let untouched = parse_checked(&run.packet).expect("egress output");
                assert_eq!(run.action, TC_ACT_UNSPEC);
                assert_eq!(
                    untouched.source(),
                    sa(BACKEND, 8080),
                    "{path}: an unmarked packet of a pod backend's flow is not egress's"
                );
            },
        );
    }
}

#[test]
fn node_port_translation_both_families_and_protocols() {
    with_node(|node| {
        program_services(node);
        round_trip(
            node,
            sa(CLIENT, 40_000),
            sa(NODE_IP, 30080),
            sa(BACKEND, 8080),
            L4::TcpSyn,
            false,
        );
        round_trip(
            node,
            sa(CLIENT, 40_001),
            sa(NODE_IP, 30053),
            sa(BACKEND, 5353),
            L4::Udp,
            false,
        );
        round_trip(
            node,
            sa(CLIENT6, 40_002),
            sa(NODE_IP6, 30080),
            sa(BACKEND6, 8080),
            L4::TcpSyn,
            false,
        );
        round_trip(
            node,
            sa(CLIENT6, 40_003),
            sa(NODE_IP6, 30053),
            sa(BACKEND6, 5353),
            L4::Udp,
            false,
        );
    });
}

#[test]
fn local_policy_keeps_the_client_address() {
    with_node(|node| {
        program_services(node);
        round_trip(
            node,
            sa(CLIENT, 41_000),
            sa(NODE_IP, 30081),
            sa(BACKEND, 8080),
            L4::TcpSyn,
            true,
        );
    });
}

/// A pod's packets to an LB IP guarded by source ranges (the socket hooks leave them alone):
/// `kpr_tc_reply` on the pod's veth judges the pod's address like kube-proxy's KUBE-FW chain,
/// then DNATs and masquerades (KUBE-EXT, eTP Cluster); outside the ranges they are dropped.
/// Other frontends are not its business: a pod's packet to a NodePort passes untouched.
#[test]
fn pods_reach_guarded_lb_ips_through_the_reply_program() {
    with_node(|node| {
        program_services(node);
        let lb = sa(LB_IP, 80);
        let outside = sa("10.244.1.7", 43_000);
        let frame = build(outside, lb, L4::TcpSyn, b"");
        let out = node
            .dataplane
            .test_run_tc(program_names::TC_REPLY, &frame, node.pod0)
            .expect("test_run");
        assert_eq!(out.action, TC_ACT_SHOT, "a pod outside the ranges");
        assert!(ct_entry(node, &ct_key(outside, lb, 6)).is_none());

        let inside = sa("10.244.1.200", 43_001);
        let frame = build(inside, lb, L4::TcpSyn, b"ping");
        let (action, out) = run(node, program_names::TC_REPLY, &frame, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT, "a pod inside the ranges");
        assert_eq!(out.destination(), sa(BACKEND, 8080), "DNAT");
        assert_eq!(
            out.src,
            NODE_IP.parse::<IpAddr>().expect("ip"),
            "masqueraded"
        );
        let (action, again) = run(node, program_names::TC_REPLY, &frame, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(
            (again.source(), again.destination()),
            (out.source(), out.destination()),
            "the flow's next packet takes its conntrack entry"
        );
        let answer = build(sa(BACKEND, 8080), out.source(), L4::TcpSyn, b"pong");
        let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT, "the backend's reply");
        assert_eq!((back.source(), back.destination()), (lb, inside));

        let node_port = build(inside, sa(NODE_IP, 30080), L4::TcpSyn, b"");
        let out = node
            .dataplane
            .test_run_tc(program_names::TC_REPLY, &node_port, node.pod0)
            .expect("test_run");
        assert_eq!(
            out.action, TC_ACT_UNSPEC,
            "TC_ACT_UNSPEC (TCX_NEXT): the socket hooks' business, and other programs' too"
        );
        assert_eq!(out.packet, node_port, "untouched");
    });
}

/// No spurious refusals (a stress guard, not a proof of the re-read): a process in
/// the hooks' cgroup connects to a ClusterIP 3000 times (each a new socket, served by echo
/// servers on the node's own addresses) while full applies ask the agent's map writer to flip
/// the frontend back and forth as fast as they can (endpoints {.2, .3} and {.2, .3, .4}; each
/// switch writes the new generation, switches, and retires the old one, whose slots and,
/// every other time, backend go a grace later; a flip asked within the grace is deferred).
/// Every connect must reach a backend: the Service always has some. This catches an update
/// order that exposes a generation before its slots exist. `generation_race.rs` races millions
/// of connects against the map writer to catch a slot deleted under a hook's feet.
/// Bounded: 3000 attempts, applies until the client is done.
#[test]
fn connects_racing_generation_switches_are_never_refused() {
    const ATTEMPTS: u32 = 3_000;
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    with_node(|node| {
        let backends = ["10.244.1.2", "10.244.1.3", "10.244.1.4"];
        let mut echoes = Vec::new();
        for (i, addr) in backends.iter().enumerate() {
            let status = std::process::Command::new("ip")
                .args(["addr", "add", &format!("{addr}/32"), "dev", "lo"])
                .status()
                .expect("ip addr");
            assert!(status.success(), "ip addr add {addr}");
            echoes.push(
                proxy_tests::echo::EchoServer::start(
                    &node.netns,
                    &format!("pod{}", i + 1),
                    sa(addr, 8080),
                )
                .expect("echo server"),
            );
        }
        let small = race_snapshot(&backends[..2]);
        let large = race_snapshot(&backends);
        let (_, errors) = node.dataplane.apply(&large, None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        let client = proxy_tests::client::Client::new(node.netns.clone())
            .in_cgroup(node.parts.cgroup.path())
            .timeout(std::time::Duration::from_secs(2));
        let first = client.once(sa("10.96.0.40", 80)).expect("client");
        assert!(
            first.backend().is_some(),
            "translated before the race: {first:?}"
        );
        let racer = std::thread::spawn(move || client.run(sa("10.96.0.40", 80), ATTEMPTS));
        let mut switches = 0u64;
        while !racer.is_finished() {
            let snapshot = if switches.is_multiple_of(2) {
                &small
            } else {
                &large
            };
            let (_, errors) = node.dataplane.apply(snapshot, None);
            assert!(errors.is_empty(), "apply errors: {errors:?}");
            switches += 1;
        }
        let attempts = racer.join().expect("client thread").expect("client run");
        let counts = proxy_tests::client::tally(&attempts);
        eprintln!("{ATTEMPTS} connects during {switches} applies: {counts:?}");
        assert!(switches >= 100, "too few applies to race: {switches}");
        assert!(
            attempts.iter().all(|a| a.backend().is_some()),
            "every connect reaches a backend: {counts:?}"
        );
        drop(echoes);
    });
}

/// A packet sent to a pod's own address with the tuple a translated flow reached that pod by
/// (the client reused its port for a direct connection; here the NodePort connection is
/// closed, and it need not be) is no flow of ours. On the netfilter path the egress entries
/// are keyed by exactly that tuple: taken at ingress for a forward entry, they marked the
/// direct connection translated and the pod's answer left as if from the NodePort, so the
/// client never got its SYN-ACK (the benchmark's routed path timed out). Both programs leave
/// the packets untouched and unmarked.
#[test]
fn direct_connections_reusing_a_translated_flows_tuple_are_left_alone() {
    with_netfilter_node(|node| {
        program_services(node);
        for (client, node_ip, backend) in [
            (sa(CLIENT, 41_500), NODE_IP, sa(BACKEND, 8080)),
            (sa(CLIENT6, 41_501), NODE_IP6, sa(BACKEND6, 8080)),
        ] {
            let what = format!("{client} → {backend}");
            let frontend = sa(node_ip, 30080);
            let syn = build(client, frontend, L4::TcpSyn, b"");
            let (action, out_frame, _, mark) =
                run_marked(node, program_names::TC_EXTERNAL, &syn, node.ext0, 0);
            assert_eq!((action, mark), (TC_ACT_UNSPEC, TRANSLATED_MARK), "{what}");
            let (_, _, snat, _) = run_marked(
                node,
                program_names::TC_EGRESS,
                &out_frame,
                node.pod0,
                TRANSLATED_MARK,
            );
            assert_ne!(snat.src, client.ip(), "{what}: the NodePort flow is SNATed");
            let fin = build(client, frontend, L4::TcpFin, b"");
            run_marked(node, program_names::TC_EXTERNAL, &fin, node.ext0, 0);

            for l4 in [L4::TcpSyn, L4::TcpAck] {
                let direct = build(client, backend, l4, b"");
                let (action, frame, _, mark) =
                    run_marked(node, program_names::TC_EXTERNAL, &direct, node.ext0, 0);
                assert_eq!(
                    (action, mark),
                    (TC_ACT_UNSPEC, 0),
                    "{what} {l4:?}: not ours"
                );
                assert_eq!(frame, direct, "{what} {l4:?}: untouched");
            }
            let answer = build(backend, client, L4::TcpAck, b"");
            let (action, frame, _, mark) =
                run_marked(node, program_names::TC_REPLY, &answer, node.pod0, 0);
            assert_eq!(
                (action, mark),
                (TC_ACT_UNSPEC, 0),
                "{what}: the pod's answer is not ours"
            );
            assert_eq!(frame, answer, "{what}: answer untouched");
        }
    });
}
