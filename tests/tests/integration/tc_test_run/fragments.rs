//! IP fragments of translated flows, and which first fragments are remembered.

use super::*;

/// IP fragments of a translated UDP flow, on the netfilter path, both
/// families: the first, middle and last fragment of a 3000-byte datagram each get the flow's
/// translation — at ingress the backend as destination, at egress the SNAT address as source,
/// the later fragments by the ports their first fragment carried — and at each step they make
/// up the translated datagram with a valid UDP checksum. A later fragment whose first fragment
/// was lost passes untouched and is counted.
#[test]
fn fragments_of_a_flow_get_its_translation() {
    with_netfilter_node(|node| {
        program_services(node);
        for (client, node_ip, backend, id) in [
            (CLIENT, NODE_IP, BACKEND, 0x1234),
            (CLIENT6, NODE_IP6, BACKEND6, 0x5678_9abc),
        ] {
            let client = sa(client, 43_053);
            let frontend = sa(node_ip, 30053);
            let backend = sa(backend, 5353);
            let Fragmented {
                what,
                payload,
                datagram,
                pieces,
            } = three_fragments(client, frontend, id);

            let mut ingress = Vec::new();
            let mut ingress_frames = Vec::new();
            for (i, piece) in pieces.iter().enumerate() {
                let (action, out, mark) =
                    run_fragment(node, program_names::TC_EXTERNAL, piece, node.ext0, 0, &what);
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: fragment {i} to the stack");
                assert_eq!(mark, TRANSLATED_MARK, "{what}: fragment {i} marked");
                let f = parse_fragment(&out).unwrap_or_else(|e| panic!("{what}: {i}: {e}"));
                assert_eq!(
                    (f.src, f.dst),
                    (client.ip(), backend.ip()),
                    "{what}: fragment {i} DNATed"
                );
                ingress.push(f);
                ingress_frames.push(out);
            }
            let whole = reassemble(&ingress).unwrap_or_else(|e| panic!("{what}: ingress: {e}"));
            assert_eq!(
                (whole.source(), whole.destination()),
                (client, backend),
                "{what}: the datagram DNATed"
            );
            assert!(whole.l4.ends_with(&payload), "{what}: payload");

            let mut egress = Vec::new();
            for (i, frame) in ingress_frames.iter().enumerate() {
                let (action, out, _) = run_fragment(
                    node,
                    program_names::TC_EGRESS,
                    frame,
                    node.pod0,
                    TRANSLATED_MARK,
                    &what,
                );
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: fragment {i} on");
                let f = parse_fragment(&out).unwrap_or_else(|e| panic!("{what}: {i}: {e}"));
                assert_eq!(
                    (f.src, f.dst),
                    (frontend.ip(), backend.ip()),
                    "{what}: fragment {i} SNATed"
                );
                egress.push(f);
            }
            let whole = reassemble(&egress).unwrap_or_else(|e| panic!("{what}: egress: {e}"));
            assert_eq!(whole.destination(), backend, "{what}: to the backend");
            assert!(
                SNAT_PORTS.contains(&whole.sport()),
                "{what}: SNAT port {}",
                whole.sport()
            );

            // The first fragment of another datagram of the flow is lost: its middle one
            // cannot be matched to the flow.
            let before = stat(node, StatIndex::TcFragmentUntracked);
            let orphan = fragment(&datagram, 1232, id + 1).swap_remove(1);
            let (action, out, mark) = run_fragment(
                node,
                program_names::TC_EXTERNAL,
                &orphan,
                node.ext0,
                0,
                &what,
            );
            assert_eq!(action, TC_ACT_UNSPEC, "{what}: orphan to the stack");
            assert_eq!((out, mark), (orphan, 0), "{what}: orphan untouched");
            assert_eq!(
                stat(node, StatIndex::TcFragmentUntracked),
                before + 1,
                "{what}: orphan counted"
            );
        }
    });
}

/// First fragments are remembered (`KPR_FRAGMENTS`, an LRU of 8192 datagrams) only for the
/// datagrams of flows, so that junk cannot evict them. Between the first fragment of a UDP
/// datagram to a NodePort (remembered: a new flow) and its later fragments, 20 000 first
/// fragments of other datagrams arrive — to a port no Service has on the node's address, to
/// a NodePort's port at an address that is not the node's, from ever other clients — and
/// leave no entry; the later fragments still get the flow's translation (the flood evicted
/// nothing; with every first fragment recorded it would have evicted the flow's). The
/// backend's fragmented reply is remembered too (a flow in the conntrack) and translated
/// back. Both families, netfilter path.
#[test]
fn only_first_fragments_of_flows_are_remembered() {
    const JUNK: u32 = 20_000;
    with_netfilter_node(|node| {
        program_services(node);
        let mut expected = BTreeSet::new();
        for (client, node_ip, backend, elsewhere, id) in [
            (CLIENT, NODE_IP, BACKEND, "10.10.0.99", 0x4321),
            (CLIENT6, NODE_IP6, BACKEND6, "fd00:10::99", 0x1357_9bdf),
        ] {
            let client = sa(client, 43_100);
            let frontend = sa(node_ip, 30053);
            let backend = sa(backend, 5353);
            let Fragmented {
                what,
                payload,
                datagram: _,
                pieces,
            } = three_fragments(client, frontend, id);
            let mut ingress = Vec::new();
            let (action, out, _) = run_fragment(
                node,
                program_names::TC_EXTERNAL,
                &pieces[0],
                node.ext0,
                0,
                &what,
            );
            assert_eq!(action, TC_ACT_UNSPEC, "{what}: first fragment");
            ingress.push(parse_fragment(&out).expect("first fragment"));
            expected.insert((client.ip(), frontend.ip(), PROTO_UDP));
            assert_eq!(
                remembered_datagrams(node),
                expected,
                "{what}: the first fragment of a new flow is remembered"
            );

            // The flood: first fragments of small datagrams to no frontend.
            let v4 = client.is_ipv4();
            for i in 0..JUNK {
                let port = 40_000 + (i % 20_000) as u16;
                let host = i % 200 + 2;
                let (src, dst) = if i % 2 == 0 {
                    let src = if v4 {
                        format!("203.0.113.{host}")
                    } else {
                        format!("fd00:10::{host:x}")
                    };
                    (sa(&src, port), sa(node_ip, port))
                } else {
                    let src = if v4 {
                        format!("10.10.0.{host}")
                    } else {
                        format!("fd00:10::1:{host:x}")
                    };
                    (sa(&src, port), sa(elsewhere, 30053))
                };
                let junk = build(src, dst, L4::Udp, &[0x5a; 64]);
                let first = fragment(&junk, 40, i).swap_remove(0);
                let out = node
                    .dataplane
                    .test_run_tc(program_names::TC_EXTERNAL, &first, node.ext0)
                    .expect("test_run");
                assert_eq!(
                    (out.action, out.packet == first),
                    (TC_ACT_UNSPEC, true),
                    "junk {src} → {dst}: to the stack untouched"
                );
            }
            assert_eq!(
                remembered_datagrams(node),
                expected,
                "{what}: no junk first fragment is remembered"
            );

            // The datagram's later fragments, after the flood.
            let untracked = stat(node, StatIndex::TcFragmentUntracked);
            for (i, piece) in pieces.iter().enumerate().skip(1) {
                let (action, out, mark) =
                    run_fragment(node, program_names::TC_EXTERNAL, piece, node.ext0, 0, &what);
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: fragment {i} to the stack");
                assert_eq!(mark, TRANSLATED_MARK, "{what}: fragment {i} translated");
                ingress.push(parse_fragment(&out).unwrap_or_else(|e| panic!("{what}: {i}: {e}")));
            }
            assert_eq!(stat(node, StatIndex::TcFragmentUntracked), untracked);
            let whole = reassemble(&ingress).unwrap_or_else(|e| panic!("{what}: ingress: {e}"));
            assert_eq!(
                (whole.source(), whole.destination()),
                (client, backend),
                "{what}: the datagram DNATed"
            );
            assert!(whole.l4.ends_with(&payload), "{what}: payload");

            // The backend's fragmented answer, to the flow's SNAT address and port.
            let forward = ct_entry(node, &ct_key(client, frontend, PROTO_UDP)).expect("flow");
            let snat = sa(node_ip, u16::from_be(forward.sport));
            let answer = build(backend, snat, L4::Udp, &payload);
            let what = format!("UDP {backend} → {snat}, fragmented");
            let mut back = Vec::new();
            for (i, piece) in fragment(&answer, 1232, id + 1).iter().enumerate() {
                let (action, out, mark) =
                    run_fragment(node, program_names::TC_REPLY, piece, node.pod0, 0, &what);
                assert_eq!(action, TC_ACT_UNSPEC, "{what}: fragment {i} to the stack");
                assert_eq!(mark, TRANSLATED_MARK, "{what}: fragment {i} translated");
                let f = parse_fragment(&out).unwrap_or_else(|e| panic!("{what}: {i}: {e}"));
                assert_eq!(f.dst, client.ip(), "{what}: fragment {i} to the client");
                back.push(f);
            }
            expected.insert((backend.ip(), snat.ip(), PROTO_UDP));
            assert_eq!(
                remembered_datagrams(node),
                expected,
                "{what}: a reply's first fragment is remembered"
            );
            let whole = reassemble(&back).unwrap_or_else(|e| panic!("{what}: reply: {e}"));
            assert_eq!(whole.destination(), client, "{what}: back to the client");
        }
    });
}
