//! The fast path's next hop kept in the conntrack entry (`proxy_common::NextHop`): a flow's
//! first packet (and a reply's) looks its route up, the next ones take the MACs from the entry
//! without a lookup (`tc_next_hop_looked_up` stays put), and a neighbour change, which the
//! agent's route watch turns into a new route generation, makes the next packet look it up
//! again and leave with the new MAC. The oracle for the MACs is the node's neighbour table, as
//! the kernel's own forwarding would use it.

use std::time::{Duration, Instant};

use aya::maps::{Array, Map, MapData};

use super::*;

/// The route generation the datapath compares kept next hops against.
fn route_generation(node: &Node) -> u32 {
    let pin = node
        .parts
        .bpf_root()
        .join(PIN_DIR_NAME)
        .join(map_names::ROUTE_GENERATION);
    let map = MapData::from_pin(pin).expect("route generation pin");
    let array = Array::<MapData, u32>::try_from(Map::Array(map)).expect("array");
    array.get(&0, 0).expect("generation")
}

#[test]
fn kept_next_hops_spare_the_lookup_until_the_neighbour_changes() {
    with_node(|node| {
        program_remote(node);
        let lookups = |node: &Node| stat(node, StatIndex::TcNextHopLookedUp);
        for (client, node_ip, remote) in [(CLIENT, NODE_IP, REMOTE), (CLIENT6, NODE_IP6, REMOTE6)] {
            let client = sa(client, 41_000);
            let frontend = sa(node_ip, 30095);
            let what = format!("{client} → {frontend}");
            set_neighbour(remote, REMOTE_MAC);
            let send = |node: &mut Node, l4: L4| {
                let (action, frame, out) = run_raw(
                    node,
                    program_names::TC_EXTERNAL,
                    &build(client, frontend, l4, b"x"),
                    node.ext0,
                );
                assert_eq!(action, TC_ACT_REDIRECT, "{what}: {l4:?}");
                assert_eq!(out.destination(), sa(remote, 8080), "{what}: DNAT");
                let dmac: [u8; 6] = frame[0..6].try_into().expect("dmac");
                let smac: [u8; 6] = frame[6..12].try_into().expect("smac");
                (dmac, smac, out)
            };

            let before = lookups(node);
            let (dmac, smac, first) = send(node, L4::TcpSyn);
            assert_eq!(
                (dmac, smac),
                (REMOTE_MAC, ext0_mac()),
                "{what}: first packet"
            );
            assert_eq!(
                lookups(node),
                before + 1,
                "{what}: the first packet looks it up"
            );
            for l4 in [L4::TcpAck, L4::TcpAck, L4::TcpAck] {
                let (dmac, smac, _) = send(node, l4);
                assert_eq!((dmac, smac), (REMOTE_MAC, ext0_mac()), "{what}: kept");
            }
            assert_eq!(
                lookups(node),
                before + 1,
                "{what}: the next packets take the entry's next hop"
            );

            // The backend's reply (to the SNAT address) looks the client's route up once too.
            let reply = build(sa(remote, 8080), first.source(), L4::TcpAck, b"y");
            for round in 0..3 {
                let (action, frame, back) =
                    run_raw(node, program_names::TC_EXTERNAL, &reply, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT, "{what}: reply {round}");
                assert_eq!(back.destination(), client, "{what}: reverse NAT");
                assert_eq!(
                    frame[0..6],
                    CLIENT_MAC,
                    "{what}: reply {round} to the client"
                );
            }
            assert_eq!(
                lookups(node),
                before + 2,
                "{what}: one lookup for the replies"
            );

            // The remote backend's MAC changes: the route watch bumps the generation, and the
            // flow's next packet looks the neighbour up again.
            let generation = route_generation(node);
            let moved = [0x02, 0, 0, 0, 0, 0x19];
            set_neighbour(remote, moved);
            let bound = Instant::now() + Duration::from_secs(2);
            while route_generation(node) == generation && Instant::now() < bound {
                std::thread::sleep(Duration::from_millis(2));
            }
            assert_ne!(
                route_generation(node),
                generation,
                "{what}: the neighbour change bumped the route generation"
            );
            let looked_up = lookups(node);
            let (dmac, _, _) = send(node, L4::TcpAck);
            assert_eq!(dmac, moved, "{what}: the new MAC right after the change");
            assert_eq!(lookups(node), looked_up + 1, "{what}: looked up again");
            let (dmac, _, _) = send(node, L4::TcpAck);
            assert_eq!(dmac, moved, "{what}: and kept");
            assert_eq!(lookups(node), looked_up + 1, "{what}: kept again");
        }
        set_neighbour(REMOTE, REMOTE_MAC);
    });
}

/// A packet longer than the kept next hop's MTU is looked up again, so the lookup's check
/// answers it as too big (ICMP fragmentation needed), as without the kept next hop
/// (`icmp::fast_path_answers_packets_too_big_for_the_next_hop` checks the answer itself).
#[test]
fn a_packet_over_the_kept_mtu_is_looked_up_and_answered_too_big() {
    with_node(|node| {
        program_remote(node);
        let client = sa(CLIENT, 41_100);
        let frontend = sa(NODE_IP, 30095);
        let (action, _, _) = run_raw(
            node,
            program_names::TC_EXTERNAL,
            &build(client, frontend, L4::TcpSyn, b""),
            node.ext0,
        );
        assert_eq!(action, TC_ACT_REDIRECT);
        let (action, _, _) = run_raw(
            node,
            program_names::TC_EXTERNAL,
            &build(client, frontend, L4::TcpAck, b"small"),
            node.ext0,
        );
        assert_eq!(action, TC_ACT_REDIRECT, "kept next hop");
        let looked_up = stat(node, StatIndex::TcNextHopLookedUp);
        // ext0's MTU is 1500: 1600 bytes of payload do not fit.
        let (action, _, out) = run_raw(
            node,
            program_names::TC_EXTERNAL,
            &build(client, frontend, L4::TcpAck, &[0u8; 1600]),
            node.ext0,
        );
        assert_eq!(
            stat(node, StatIndex::TcNextHopLookedUp),
            looked_up + 1,
            "too long for the kept next hop: looked up"
        );
        assert_eq!(action, TC_ACT_REDIRECT, "answered out of ext0");
        assert_eq!(out.proto, PROTO_ICMP, "answered: fragmentation needed");
        assert_eq!(out.l4[..2], [3u8, 4], "fragmentation needed");
        assert_eq!(out.dst, client.ip(), "to the client");
    });
}
