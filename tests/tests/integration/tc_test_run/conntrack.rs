//! The tc conntrack: entry sizes, closing flows, the agent's GC, walk and purge, evicted entries
//! and their recovery, and a SYN flood.

use super::*;

/// IPv4 flows are kept in `KPR_CT4`, in entries sized for IPv4 (a 16-byte key
/// and a 40-byte value, against 40 and 64 bytes in `KPR_CT6`), IPv6 flows in `KPR_CT6`; each
/// flow's entry is in its family's map and not in the other, and carries the service id of the
/// frontend it was started to (whose packet counters its packets add to). Until the client's ACK a TCP
/// flow is in its family's unanswered flows' map (`KPR_CT4_NEW`, sized as `KPR_CT4`).
#[test]
fn ipv4_flows_are_kept_in_entries_sized_for_ipv4() {
    with_node(|node| {
        program_services(node);
        let four = (sa(CLIENT, 40_100), sa(NODE_IP, 30080));
        let six = (sa(CLIENT6, 40_101), sa(NODE_IP6, 30080));
        round_trip(node, four.0, four.1, sa(BACKEND, 8080), L4::TcpSyn, false);
        round_trip(node, six.0, six.1, sa(BACKEND6, 8080), L4::TcpSyn, false);
        let pins = node.parts.bpf.path().join(PIN_DIR_NAME);
        let open = |name: &str| MapData::from_pin(pins.join(name)).expect("conntrack pin");
        let unanswered = open(map_names::CT4_NEW);
        let info = unanswered.info().expect("map info");
        assert_eq!((info.key_size(), info.value_size()), (16, 64));
        let unanswered = AyaHashMap::<MapData, CtKey4, CtValue4>::try_from(
            Map::from_map_data(unanswered).expect("map"),
        )
        .expect("KPR_CT4_NEW");
        let key4 = CtKey4::narrow(&ct_key(four.0, four.1, proto::TCP));
        assert!(
            unanswered.get(&key4, 0).is_ok(),
            "the IPv4 flow in KPR_CT4_NEW before the client's ACK"
        );
        for (client, frontend) in [four, six] {
            let ack = build(client, frontend, L4::TcpAck, b"");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{client}: ACK");
        }
        assert!(
            unanswered.get(&key4, 0).is_err(),
            "the IPv4 flow moved out of KPR_CT4_NEW by the client's ACK"
        );
        let (v4, v6) = (open(map_names::CT4), open(map_names::CT6));
        let sizes = |map: &MapData| {
            let info = map.info().expect("map info");
            (info.key_size(), info.value_size())
        };
        assert_eq!(sizes(&v4), (16, 64));
        assert_eq!(sizes(&v6), (40, 88));
        let narrow =
            AyaHashMap::<MapData, CtKey4, CtValue4>::try_from(Map::from_map_data(v4).expect("map"))
                .expect("KPR_CT4");
        let wide =
            AyaHashMap::<MapData, CtKey, CtValue>::try_from(Map::from_map_data(v6).expect("map"))
                .expect("KPR_CT6");
        let key4 = ct_key(four.0, four.1, proto::TCP);
        let key6 = ct_key(six.0, six.1, proto::TCP);
        let forward4 = narrow
            .get(&CtKey4::narrow(&key4), 0)
            .expect("the IPv4 flow in KPR_CT4");
        assert_eq!(forward4.widen().dst, words(sa(BACKEND, 8080).ip()));
        let forward6 = wide.get(&key6, 0).expect("the IPv6 flow in KPR_CT6");
        assert!(
            forward4.service_id != 0 && forward6.service_id != 0,
            "both flows carry their NodePort frontend's service id: {} and {}",
            forward4.service_id,
            forward6.service_id
        );
        assert!(
            wide.get(&key4, 0).is_err(),
            "the IPv4 flow is not in KPR_CT6"
        );
        assert_eq!(
            wide.get(&key6, 0).expect("the IPv6 flow in KPR_CT6").dst,
            words(sa(BACKEND6, 8080).ip())
        );
        assert!(
            wide.keys().flatten().all(|k| k.family == family::V6),
            "KPR_CT6 holds IPv6 flows only"
        );
    });
}

/// A FIN or RST in either direction marks the forward entry closing: it still carries the
/// flow's last packets within the 10 s close timeout, and after it a SYN from the same client
/// tuple picks a backend again, while an established flow idle as long keeps its entry. A SYN
/// on a closing entry (the client reusing its port) starts a new flow at once.
#[test]
fn tcp_fin_or_rst_closes_the_flow_and_a_new_syn_chooses_again() {
    with_node(|node| {
        program_services(node);
        const MARKER: u16 = 9;
        let frontend = sa(NODE_IP, 30080);
        let cases = [
            Close::Open,
            Close::ClientFin,
            Close::ClientRst,
            Close::BackendFinExternal,
            Close::BackendRstReply,
        ];
        for (i, close) in cases.into_iter().enumerate() {
            let client = sa(CLIENT, 41_000 + i as u16);
            open_and_close(node, client, close);
            let key = ct_key(client, frontend, PROTO_TCP);
            let flags = ct_entry(node, &key).expect("forward entry").flags;
            assert_eq!(
                flags & ct_flags::CLOSING != 0,
                close != Close::Open,
                "{close:?}: CLOSING flag in {flags:#x}"
            );
            // 5 s later the last ACK still takes the entry (marked by a fake backend port).
            age_forward_entry(node, &key, 5, MARKER);
            let ack = build(client, frontend, L4::TcpAck, b"");
            let (action, late) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            assert_eq!(
                late.dport(),
                MARKER,
                "{close:?}: ACK 5 s later uses the entry"
            );
            // 11 s idle: past the close timeout, far within the established one.
            age_forward_entry(node, &key, 11, MARKER);
            let syn = build(client, frontend, L4::TcpSyn, b"");
            let (action, again) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            eprintln!(
                "{close:?}: flags {flags:#x}; SYN after 11 s idle → port {} ({})",
                again.dport(),
                if again.dport() == MARKER {
                    "entry kept"
                } else {
                    "new flow"
                }
            );
            let expected = if close == Close::Open { MARKER } else { 8080 };
            assert_eq!(again.dport(), expected, "{close:?}: SYN after 11 s idle");
            let after = ct_entry(node, &key).expect("forward entry");
            assert_eq!(after.flags & ct_flags::CLOSING, 0, "{close:?}: open again");
        }

        // The client reuses its port 2 s after an RST: its SYN starts a new flow at once.
        let client = sa(CLIENT, 41_100);
        let key = ct_key(client, frontend, PROTO_TCP);
        open_and_close(node, client, Close::ClientRst);
        age_forward_entry(node, &key, 2, MARKER);
        let syn = build(client, frontend, L4::TcpSyn, b"");
        let (action, reused) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        eprintln!("SYN 2 s after RST → port {}", reused.dport());
        assert_eq!(reused.dport(), 8080, "SYN on a closing entry: new flow");
    });
}

/// The programs stamp conntrack entries with `CLOCK_MONOTONIC` read as of the last tick
/// (`coarse-clock`, the default where the kernel has `bpf_ktime_get_coarse_ns`) or read from
/// the clock source (the feature turned off): a new flow's entry carries a time between the
/// matching clock's readings before and after its packet. Either way an entry the agent
/// stamped ahead of the programs' clock (the agent reads the precise clock, up to a tick ahead
/// of the coarse one; 50 ms here) is fresh, not read as idle for centuries, and one idle past
/// the UDP timeout (120 s) is not.
#[test]
fn flows_are_stamped_by_the_clock_the_programs_read_and_a_time_ahead_is_fresh() {
    const MARKER: u16 = 9;
    for disabled in [BTreeSet::new(), BTreeSet::from([Feature::CoarseClock])] {
        let coarse = disabled.is_empty();
        with_node_features(
            LbOptions::default(),
            true,
            None,
            SNAT_PORTS,
            disabled,
            move |node| {
                program_services(node);
                let clock = if coarse {
                    nix::time::ClockId::CLOCK_MONOTONIC_COARSE
                } else {
                    nix::time::ClockId::CLOCK_MONOTONIC
                };
                let read = || clock_ns(clock);
                let frontend = sa(NODE_IP, 30053);
                let client = sa(CLIENT, 43_000);
                let key = ct_key(client, frontend, PROTO_UDP);
                let datagram = build(client, frontend, L4::Udp, b"ping");
                let before = read();
                let (action, out) = run(node, program_names::TC_EXTERNAL, &datagram, node.ext0);
                let after = read();
                assert_eq!(action, TC_ACT_REDIRECT, "coarse {coarse}: first datagram");
                assert_eq!(out.dport(), 5353, "coarse {coarse}: to the backend");
                let stamped = ct_entry(node, &key).expect("forward entry").last_seen_ns;
                assert!(
                    (before..=after).contains(&stamped),
                    "coarse {coarse}: stamped {stamped} outside {before}..={after}"
                );

                let mut ct = pinned_ct(node);
                let mut value = ct.get(&key).expect("forward entry");
                value.last_seen_ns = monotonic_ns() + 50_000_000;
                value.dport = MARKER.to_be();
                ct.insert(&key, &value, 0).expect("update entry");
                let (action, again) = run(node, program_names::TC_EXTERNAL, &datagram, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT, "coarse {coarse}: second datagram");
                assert_eq!(
                    again.dport(),
                    MARKER,
                    "coarse {coarse}: an entry stamped ahead of the programs' clock carries the flow"
                );

                age_forward_entry(node, &key, 121, MARKER);
                let (action, late) = run(node, program_names::TC_EXTERNAL, &datagram, node.ext0);
                assert_eq!(
                    action, TC_ACT_REDIRECT,
                    "coarse {coarse}: datagram after 121 s"
                );
                assert_eq!(
                    late.dport(),
                    5353,
                    "coarse {coarse}: an entry idle past the UDP timeout starts the flow again"
                );
            },
        );
    }
}

/// The agent's conntrack GC through the pinned map: a closed flow past the close timeout, a
/// UDP flow past 120 s and a reply entry without its forward entry are deleted; a fresh flow
/// and an established TCP flow idle 11 s stay; the run is counted in the metrics.
#[test]
fn conntrack_gc_deletes_dead_flows_and_keeps_live_ones() {
    with_node(|node| {
        program_services(node);
        let frontend = sa(NODE_IP, 30080);
        let mut ct = pinned_ct(node);
        let mut flow = |node: &mut Node, port: u16, close: Close, age_s: u64| {
            let client = sa(CLIENT, port);
            let snat = open_and_close(node, client, close);
            let forward = ct_key(client, frontend, PROTO_TCP);
            let reply = ct_key(sa(BACKEND, 8080), snat, PROTO_TCP);
            // Both entries as if the flow began `age_s` ago and went quiet.
            age_entry(&mut ct, &forward, age_s);
            age_entry(&mut ct, &reply, age_s);
            (forward, reply)
        };
        let live = flow(node, 42_000, Close::Open, 0);
        let idle = flow(node, 42_001, Close::Open, 11);
        let closed = flow(node, 42_002, Close::ClientRst, 11);
        let closing = flow(node, 42_003, Close::ClientFin, 5);
        let orphan = flow(node, 42_004, Close::BackendRstReply, 11);
        ct.remove(&orphan.0)
            .expect("delete the orphan's forward entry");

        // UDP: 120 s idle timeout.
        let client = sa(CLIENT, 42_005);
        let dns = sa(NODE_IP, 30053);
        let (action, out) = run(
            node,
            program_names::TC_EXTERNAL,
            &build(client, dns, L4::Udp, b"q"),
            node.ext0,
        );
        assert_eq!(action, TC_ACT_REDIRECT);
        let udp = (
            ct_key(client, dns, PROTO_UDP),
            ct_key(sa(BACKEND, 5353), out.source(), PROTO_UDP),
        );
        age_entry(&mut ct, &udp.0, 130);
        age_entry(&mut ct, &udp.1, 130);

        let report = node.dataplane.conntrack_gc().expect("conntrack gc");
        eprintln!("GC: {report:?}");
        let left: Vec<CtKey> = node
            .dataplane
            .conntrack_entries()
            .expect("conntrack")
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        for (what, keys, kept) in [
            ("fresh", live, true),
            ("established, idle 11 s", idle, true),
            ("closing, idle 5 s", closing, true),
            ("closed, idle 11 s", closed, false),
            ("UDP idle 130 s", udp, false),
        ] {
            for key in [keys.0, keys.1] {
                assert_eq!(left.contains(&key), kept, "{what}: {key:?}");
            }
        }
        assert!(!left.contains(&orphan.1), "orphan reply entry");
        assert_eq!(report.deleted_forward, 2, "{report:?}");
        assert_eq!(report.deleted_reply, 3, "{report:?}");
        assert_eq!(report.remaining, left.len(), "{report:?}");
        assert_eq!(left.len(), 6);

        // A second run finds nothing.
        let again = node.dataplane.conntrack_gc().expect("conntrack gc");
        assert_eq!((again.deleted_forward, again.deleted_reply), (0, 0));
        assert_eq!(again.remaining, 6, "{again:?}");
    });
}

/// Hygiene: the conntrack walk resumes where it stopped. 3000 entries are walked in
/// batches of 64; after the first batch, 500 entries it has not reached yet and 20 it has seen
/// are deleted (as GC, a purge, the datapath or LRU eviction would). A key-based walk
/// (`get_next_key` from a deleted key) restarts at the first bucket and visits entries again;
/// this one visits every entry that stayed exactly once and none of the deleted unseen ones.
#[test]
fn conntrack_walk_resumes_after_deletions_and_visits_each_entry_once() {
    use std::collections::{BTreeMap as Counts, BTreeSet};
    use std::os::fd::AsFd as _;

    use proxy_dataplane_ebpf::CtWalk;
    with_node(|node| {
        let mut ct = pinned_ct(node);
        let key_of = |i: u32| CtKey {
            src: [i, 0, 0, 0],
            dst: [0x0a0a_0001, 0, 0, 0],
            sport: 1,
            dport: 2,
            proto: PROTO_UDP,
            family: family::V4,
            _pad: 0,
        };
        let all: Vec<CtKey> = (1..=3000).map(key_of).collect();
        for key in &all {
            ct.insert(key, &CtValue::default(), 0).expect("insert");
        }
        let data = MapData::from_pin(
            node.parts
                .bpf
                .path()
                .join(PIN_DIR_NAME)
                .join(map_names::CT4),
        )
        .expect("conntrack pin");
        let mut walk = CtWalk::new();
        let mut visits: Counts<CtKey, u32> = Counts::new();
        let first: Vec<(CtKey, CtValue)> = walk
            .next_batch::<CtKey4, CtValue4>(data.fd().as_fd(), 64)
            .expect("first batch")
            .into_iter()
            .map(|(k, v)| (k.widen(), v.widen()))
            .collect();
        assert!(!first.is_empty() && !walk.finished());
        for (key, _) in &first {
            *visits.entry(*key).or_default() += 1;
        }
        let seen: BTreeSet<CtKey> = first.iter().map(|(k, _)| *k).collect();
        let deleted_unseen: Vec<CtKey> = all
            .iter()
            .filter(|k| !seen.contains(k))
            .step_by(5)
            .take(500)
            .copied()
            .collect();
        let deleted_seen: Vec<CtKey> = seen.iter().take(20).copied().collect();
        for key in deleted_unseen.iter().chain(&deleted_seen) {
            ct.remove(key).expect("delete");
        }
        let mut batches = 1;
        while !walk.finished() {
            assert!(batches < 10_000, "the walk must end");
            let batch = walk.next_batch::<CtKey4, CtValue4>(data.fd().as_fd(), 64);
            for (key, _) in batch.expect("batch") {
                *visits.entry(key.widen()).or_default() += 1;
            }
            batches += 1;
        }
        let twice: Vec<_> = visits.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "visited more than once: {}", twice.len());
        for key in &deleted_unseen {
            assert!(
                !visits.contains_key(key),
                "a deleted entry was visited: {key:?}"
            );
        }
        let stayed = all
            .iter()
            .filter(|k| !deleted_unseen.contains(k) && !deleted_seen.contains(k));
        let mut stayed_count = 0;
        for key in stayed {
            assert_eq!(visits.get(key), Some(&1), "{key:?}");
            stayed_count += 1;
        }
        eprintln!(
            "{batches} batches, {} entries visited, {stayed_count} stayed",
            visits.len()
        );
        assert_eq!(stayed_count, 3000 - 520);
    });
}

/// Hygiene: purging the conntrack entries of removed backends is handed to the
/// conntrack worker's thread, not done in the apply (a full-table purge took ~0.5 s of the
/// sync loop): the apply only queues it, and the worker deletes the flow's entries after.
#[test]
fn conntrack_purge_runs_off_the_apply() {
    with_node(|node| {
        program_services(node);
        let client = sa(CLIENT, 42_100);
        let dns = sa(NODE_IP, 30053);
        first_packet(node, client, dns, L4::Udp, b"q");
        let forward = ct_key(client, dns, PROTO_UDP);
        assert!(ct_entry(node, &forward).is_some(), "the flow's entry");
        // Every Service gone: the UDP NodePort's backend is removed.
        let empty = Snapshot::compute(&Objects::new(BTreeMap::new(), BTreeMap::new(), None), NODE);
        let (summary, errors) = node.dataplane.apply(&empty, None);
        assert!(errors.is_empty(), "{errors:?}");
        assert!(summary.conntrack_purge_queued, "{summary:?}");
        assert_eq!(summary.conntrack_purged, 0, "nothing purged in the apply");
        proxy_tests::wait::wait_until(
            "the worker purged the flow",
            std::time::Duration::from_secs(10),
            std::time::Duration::from_millis(10),
            || {
                node.dataplane
                    .conntrack_worker_reports()
                    .is_some_and(|r| r.purged >= 2)
            },
        )
        .expect("purge");
        assert!(ct_entry(node, &forward).is_none(), "purged");
    });
}

/// Conntrack under pressure: the LRU evicts the forward entry
/// of a live SNATed TCP flow (deleted here, as eviction would). With a 1-port range: the
/// client's next segment recovers the flow from its reply entry — same backend, same SNAT
/// port, counted as `tc_ct_midstream_recovered` — and is translated; a new flow does not get
/// the flow's SNAT port while its reply entry is live (dropped, counted as exhaustion); evicted
/// again, the backend's next segment is translated back to the client and rebuilds the forward
/// entry (a reply checks its forward entry at most once a second, so that is within a second
/// of the eviction, given traffic from the backend). With both entries gone the flow is
/// written again from its own choice (same backend, same port); with its port taken by a new
/// flow meanwhile, the segment goes to the stack untranslated. Both families.
#[test]
fn evicted_forward_entry_keeps_its_snat_port_and_is_rebuilt() {
    with_node_path(LbOptions::default(), true, None, 61_000..=61_000, |node| {
        program_services(node);
        // What the agent does after its first sync: from then on a segment without any entry
        // is one of the datapath's own flows.
        node.dataplane
            .adopt_kernel_nat_flows(&proxy_dataplane_ebpf::read_kernel_nat_flows());
        let mut ct = pinned_ct(node);
        for (i, (client, other, node_ip, backend)) in [
            (CLIENT, "203.0.113.7", NODE_IP, BACKEND),
            (CLIENT6, "fd00:10::3", NODE_IP6, BACKEND6),
        ]
        .into_iter()
        .enumerate()
        {
            let n = i as u64 + 1;
            let client = sa(client, 20_000);
            let frontend = sa(node_ip, 30080);
            let backend = sa(backend, 8080);
            let syn = build(client, frontend, L4::TcpSyn, b"");
            let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            let snat = out.source();
            assert_eq!(snat.port(), 61_000);
            let ack = build(client, frontend, L4::TcpAck, b"data");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);

            let forward = ct_key(client, frontend, PROTO_TCP);
            ct.remove(&forward).expect("evict the forward entry");
            let (action, recovered) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(
                action, TC_ACT_REDIRECT,
                "{node_ip}: mid-stream without entry"
            );
            assert_eq!(
                (recovered.source(), recovered.destination()),
                (snat, backend),
                "{node_ip}: recovered to its own backend and port"
            );
            assert_eq!(stat(node, StatIndex::TcMidstreamRecovered), n, "{node_ip}");
            let entry = ct_entry(node, &forward).expect("forward entry recovered");
            assert_ne!(entry.flags & ct_flags::ESTABLISHED, 0, "{node_ip}");

            let newcomer = build(sa(other, 20_001), frontend, L4::TcpSyn, b"");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &newcomer, node.ext0);
            assert_eq!(
                action, TC_ACT_SHOT,
                "{node_ip}: the live flow's port is not free"
            );
            assert_eq!(stat(node, StatIndex::TcSnatPortExhausted), n, "{node_ip}");

            // A reply checks its forward entry at most once a second (with its refresh): the
            // backend answers 2 s after the flow's last reply.
            ct.remove(&forward).expect("evict the forward entry again");
            age_entry(&mut ct, &ct_key(backend, snat, PROTO_TCP), 2);
            let answer = build(backend, snat, L4::TcpAck, b"pong");
            let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: reply");
            assert_eq!((back.source(), back.destination()), (frontend, client));
            assert_eq!(stat(node, StatIndex::TcForwardRebuilt), n, "{node_ip}");
            let rebuilt = ct_entry(node, &forward).expect("forward entry rebuilt");
            assert_eq!(rebuilt.dst, words(backend.ip()), "{node_ip}");
            assert_eq!(rebuilt.sport, 61_000u16.to_be(), "{node_ip}");
            let (action, again) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: translated again");
            assert_eq!((again.source(), again.destination()), (snat, backend));

            // Both directions evicted: written again from the flow's own choice — the same
            // backend (the Service has not changed) and the only port of the range.
            ct.remove(&forward).expect("evict the forward entry");
            let reply = ct_key(backend, snat, PROTO_TCP);
            ct.remove(&reply).expect("evict the reply entry");
            let (action, recreated) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{node_ip}: both entries gone");
            assert_eq!(
                (recreated.source(), recreated.destination()),
                (snat, backend),
                "{node_ip}: recreated with its own backend and port"
            );
            assert_eq!(stat(node, StatIndex::TcMidstreamRecreated), n, "{node_ip}");

            // Both evicted and the port taken by a new flow meanwhile: the segment is not
            // sent from a port another flow holds, nor to a backend chosen anew.
            ct.remove(&forward).expect("evict the forward entry");
            ct.remove(&reply).expect("evict the reply entry");
            let (action, _) = run(node, program_names::TC_EXTERNAL, &newcomer, node.ext0);
            assert_eq!(
                action, TC_ACT_REDIRECT,
                "{node_ip}: the newcomer gets the port"
            );
            let passed_before = stat(node, StatIndex::TcMidstreamPassed);
            let (action, passed) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(
                action, TC_ACT_UNSPEC,
                "{node_ip}: port held by another flow"
            );
            assert_eq!(passed.destination(), frontend, "{node_ip}: not re-balanced");
            assert_eq!(
                stat(node, StatIndex::TcMidstreamPassed),
                passed_before + 1,
                "{node_ip}"
            );
            assert!(
                ct_entry(node, &forward).is_none(),
                "{node_ip}: no entry made"
            );
            eprintln!("{node_ip}: evicted forward entry recovered: {snat} → {backend} kept");
        }
        // Without SNAT (eTP Local): the reply entry is keyed by the client's own tuple.
        let client = sa(CLIENT, 40_000);
        let local = sa(NODE_IP, 30081);
        let syn = build(client, local, L4::TcpSyn, b"");
        let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT, "eTP Local");
        ct.remove(&ct_key(client, local, PROTO_TCP))
            .expect("evict the forward entry");
        let ack = build(client, local, L4::TcpAck, b"data");
        let (action, recovered) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT, "eTP Local: recovered");
        assert_eq!(
            (recovered.source(), recovered.destination()),
            (client, out.destination()),
            "eTP Local: the client's address kept, the same backend"
        );
        assert_eq!(stat(node, StatIndex::TcMidstreamRecovered), 3);
    });
}

/// Takeover: until the agent has adopted the flows the kernel's conntrack
/// NATs (`node_flags::KERNEL_FLOWS`, from its start to the adoption after its first sync), a
/// TCP segment without any entry may be one of those and goes to the stack, where the
/// kernel's NAT carries it; afterwards it is taken for an evicted flow of the datapath's own
/// and written again from the flow's choice.
#[test]
fn segments_without_entries_are_left_to_the_kernel_until_its_flows_are_adopted() {
    with_node_path(LbOptions::default(), true, None, 61_000..=61_000, |node| {
        program_services(node);
        let client = sa(CLIENT, 20_000);
        let frontend = sa(NODE_IP, 30080);
        let ack = build(client, frontend, L4::TcpAck, b"data");
        let (action, passed) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
        assert_eq!(
            action, TC_ACT_UNSPEC,
            "before the adoption: the kernel's, maybe"
        );
        assert_eq!(passed.destination(), frontend);
        assert_eq!(stat(node, StatIndex::TcMidstreamRecreated), 0);
        node.dataplane
            .adopt_kernel_nat_flows(&proxy_dataplane_ebpf::read_kernel_nat_flows());
        let (action, out) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
        assert_eq!(
            action, TC_ACT_REDIRECT,
            "after the adoption: the datapath's own"
        );
        assert_eq!(out.destination(), sa(BACKEND, 8080));
        assert_eq!(out.source(), sa(NODE_IP, 61_000));
        assert_eq!(stat(node, StatIndex::TcMidstreamRecreated), 1);
    });
}

/// A backend's segment to a SNAT port whose flow's entries were both evicted
/// (no SYN, no socket of the node on that port) is dropped and counted — the stack
/// would answer it with a reset and end the flow at the backend before the client's next
/// segment writes its entries again. A socket bound to that port keeps its segments, and a
/// port outside the SNAT range is left to the stack. Both families.
#[test]
fn backend_segments_of_evicted_flows_are_dropped_not_reset() {
    with_node_path(LbOptions::default(), true, None, 61_000..=61_000, |node| {
        program_services(node);
        for (n, (node_ip, backend)) in [(NODE_IP, BACKEND), (NODE_IP6, BACKEND6)]
            .into_iter()
            .enumerate()
        {
            let n = n as u64 + 1;
            let backend = sa(backend, 8080);
            let snat = sa(node_ip, 61_000);
            let segment = build(backend, snat, L4::TcpAck, b"pong");
            let (action, _) = run(node, program_names::TC_REPLY, &segment, node.pod0);
            assert_eq!(action, TC_ACT_SHOT, "{node_ip}: orphan segment");
            assert_eq!(
                stat(node, StatIndex::TcOrphanSegmentDropped),
                n,
                "{node_ip}"
            );

            let syn = build(backend, snat, L4::TcpSyn, b"");
            let (action, _) = run(node, program_names::TC_REPLY, &syn, node.pod0);
            assert_eq!(action, TC_ACT_UNSPEC, "{node_ip}: a SYN is the stack's");
            let outside = build(backend, sa(node_ip, 40_000), L4::TcpAck, b"pong");
            let (action, _) = run(node, program_names::TC_REPLY, &outside, node.pod0);
            assert_eq!(action, TC_ACT_UNSPEC, "{node_ip}: not a SNAT port");

            let listener = std::net::TcpListener::bind(snat).expect("bind the SNAT port");
            let (action, _) = run(node, program_names::TC_REPLY, &segment, node.pod0);
            assert_eq!(action, TC_ACT_UNSPEC, "{node_ip}: a socket holds the port");
            drop(listener);
            assert_eq!(
                stat(node, StatIndex::TcOrphanSegmentDropped),
                n,
                "{node_ip}"
            );
        }
    });
}

/// A mid-stream packet whose forward entry was evicted is never sent to
/// another backend. 5 backends, 60 SNATed flows (client ports in and outside the SNAT range,
/// so both the kept client port and the hashed probe sequence are recovered): every forward
/// entry is deleted, as the LRU would, and each client's next segment reaches the backend and
/// comes from the SNAT port its flow had. (A flow without SNAT: the test above.)
#[test]
fn evicted_flows_are_recovered_to_their_own_backends() {
    with_node_path(LbOptions::default(), true, None, 49_152..=65_535, |node| {
        program_services(node);
        program_spread(node, &SPREAD_BACKENDS);
        let frontend = sa(NODE_IP, 30090);
        let clients: Vec<SocketAddr> = (0..30u16)
            .map(|i| sa(CLIENT, 30_000 + i))
            .chain((0..30u16).map(|i| sa(CLIENT, 50_000 + i)))
            .collect();
        let mut flows = Vec::new();
        for client in &clients {
            let syn = build(*client, frontend, L4::TcpSyn, b"");
            let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{client}");
            flows.push((*client, frontend, out.source(), out.destination()));
        }
        let backends: std::collections::BTreeSet<IpAddr> = flows.iter().map(|f| f.3.ip()).collect();
        assert!(backends.len() >= 4, "flows spread over {backends:?}");

        let mut ct = pinned_ct(node);
        let forward: Vec<CtKey> = ct
            .entries()
            .into_iter()
            .filter(|(_, v)| v.flags & ct_flags::REPLY == 0)
            .map(|(k, _)| k)
            .collect();
        assert_eq!(forward.len(), flows.len(), "one forward entry per flow");
        for key in &forward {
            ct.remove(key).expect("evict");
        }
        let recovered_before = stat(node, StatIndex::TcMidstreamRecovered);
        for (client, frontend, source, backend) in &flows {
            let ack = build(*client, *frontend, L4::TcpAck, b"data");
            let (action, out) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "{client}: recovered");
            assert_eq!(
                (out.source(), out.destination()),
                (*source, *backend),
                "{client}: same backend and source port as before the eviction"
            );
        }
        assert_eq!(
            stat(node, StatIndex::TcMidstreamRecovered) - recovered_before,
            flows.len() as u64
        );
        eprintln!(
            "{} evicted flows over {} backends recovered to their own backends and ports",
            flows.len(),
            backends.len()
        );
    });
}

/// A flow without SNAT never overwrites another live flow's reply entry. The same
/// client tuple reaches the eTP Local NodePort 30081 on two node addresses: both flows go to
/// the same backend port, so their reply entries would share a key. The second is dropped and
/// counted (`tc_ct_reply_clash`), and the first flow's replies still come from its own
/// frontend. Once the first flow is closed (FIN or RST), the second gets in.
#[test]
fn reply_entry_of_another_live_flow_is_never_overwritten() {
    with_node(|node| {
        program_services(node);
        let client = sa(CLIENT, 20_000);
        let first = sa(NODE_IP, 30081);
        let second = sa("10.244.1.1", 30081);
        let backend = sa(BACKEND, 8080);
        let (action, out) = run(
            node,
            program_names::TC_EXTERNAL,
            &build(client, first, L4::TcpSyn, b""),
            node.ext0,
        );
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!((out.source(), out.destination()), (client, backend));
        let (action, _) = run(
            node,
            program_names::TC_EXTERNAL,
            &build(client, second, L4::TcpSyn, b""),
            node.ext0,
        );
        assert_eq!(
            action, TC_ACT_SHOT,
            "the second flow would take the reply entry"
        );
        assert_eq!(stat(node, StatIndex::TcReplyClash), 1);
        let answer = build(backend, client, L4::TcpAck, b"pong");
        let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(
            back.source(),
            first,
            "the first flow's replies keep its frontend"
        );

        // Closed (RST): the first flow no longer holds the tuple (as netfilter lets a new
        // connection take a TIME_WAIT/CLOSE tuple), and the second flow takes it at once.
        let rst = build(client, first, L4::TcpRst, b"");
        let (action, _) = run(node, program_names::TC_EXTERNAL, &rst, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        let (action, _) = run(
            node,
            program_names::TC_EXTERNAL,
            &build(client, second, L4::TcpSyn, b""),
            node.ext0,
        );
        assert_eq!(
            action, TC_ACT_REDIRECT,
            "a closed flow's reply entry is replaced"
        );
        let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(back.source(), second);
    });
}

/// A spoofed SYN flood against a NodePort never costs an established flow its conntrack
/// entries (netfilter's early drop: unassured entries go first). With a small conntrack map,
/// flows of both families complete their handshake (SYN, the backend's answer, the client's
/// ACK); then SYNs from random sources, many times the map's size, go through the ingress
/// program. Every established flow's entries are still there, and its next segment takes the
/// same backend and SNAT port from them (not rebuilt: nothing is counted as recovered or
/// recreated); a new client's SYN still gets a backend.
#[test]
fn syn_flood_never_evicts_established_flows() {
    const CAPACITY: u32 = 1024;
    const ESTABLISHED: u16 = 20;
    with_node_sized(
        LbOptions::default(),
        true,
        None,
        SNAT_PORTS,
        BTreeSet::new(),
        |_| {},
        CAPACITY,
        |node| {
            program_services(node);
            let cases = [
                (CLIENT, sa(NODE_IP, 30080), "100.64"),
                (CLIENT6, sa(NODE_IP6, 30080), "fd00:64::"),
            ];
            let mut established = Vec::new();
            for (client, frontend, _) in cases {
                for i in 0..ESTABLISHED {
                    let from = sa(client, 40_000 + i);
                    let syn = build(from, frontend, L4::TcpSyn, b"");
                    let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
                    assert_eq!(action, TC_ACT_REDIRECT, "{from}: SYN");
                    let answer = build(out.destination(), out.source(), L4::TcpAck, b"");
                    let (action, back) = run(node, program_names::TC_REPLY, &answer, node.pod0);
                    assert_eq!(action, TC_ACT_REDIRECT, "{from}: backend's answer");
                    assert_eq!(back.destination(), from, "{from}: answer un-NATed");
                    let ack = build(from, frontend, L4::TcpAck, b"hello");
                    let (action, again) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
                    assert_eq!(action, TC_ACT_REDIRECT, "{from}: ACK");
                    assert_eq!(
                        (again.source(), again.destination()),
                        (out.source(), out.destination()),
                        "{from}: ACK translated as the SYN"
                    );
                    let reply_key = ct_key(out.destination(), out.source(), PROTO_TCP);
                    established.push((from, frontend, out, reply_key));
                }
            }

            // The flood: SYNs from random spoofed sources and ports, 16 times the map's size a
            // family.
            let mut seed = 0x2545_f491_4f6c_dd1d_u64;
            let mut next = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            let mut flooded = 0u32;
            for (_, frontend, prefix) in cases {
                for _ in 0..16 * CAPACITY {
                    let r = next();
                    let ip = if frontend.is_ipv4() {
                        format!("{prefix}.{}.{}", (r >> 8) & 0xff, r & 0xff)
                    } else {
                        format!("{prefix}{:x}:{:x}", (r >> 16) & 0xffff, r & 0xffff)
                    };
                    let from = sa(&ip, 1024 + (r >> 32) as u16 % 60_000);
                    let syn = build(from, frontend, L4::TcpSyn, b"");
                    let (action, _) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
                    if action == TC_ACT_REDIRECT {
                        flooded += 1;
                    }
                }
            }
            eprintln!("{flooded} flood SYNs translated");

            let entries: BTreeMap<CtKey, CtValue> = node
                .dataplane
                .conntrack_entries()
                .expect("conntrack")
                .into_iter()
                .collect();
            let lost: Vec<String> = established
                .iter()
                .filter(|(from, frontend, _, reply_key)| {
                    !entries.contains_key(&ct_key(*from, *frontend, PROTO_TCP))
                        || !entries.contains_key(reply_key)
                })
                .map(|(from, frontend, _, _)| format!("{from} → {frontend}"))
                .collect();
            assert!(
                lost.is_empty(),
                "{} of {} established flows lost entries to the flood: {lost:?}",
                lost.len(),
                established.len()
            );
            for (from, frontend, out, _) in &established {
                let ack = build(*from, *frontend, L4::TcpAck, b"later");
                let (action, again) = run(node, program_names::TC_EXTERNAL, &ack, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT, "{from}: ACK after the flood");
                assert_eq!(
                    (again.source(), again.destination()),
                    (out.source(), out.destination()),
                    "{from}: same backend and SNAT port after the flood"
                );
            }
            assert_eq!(stat(node, StatIndex::TcMidstreamRecovered), 0);
            assert_eq!(stat(node, StatIndex::TcMidstreamRecreated), 0);

            for (client, frontend, _) in cases {
                let from = sa(client, 50_000);
                let syn = build(from, frontend, L4::TcpSyn, b"");
                let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
                assert_eq!(
                    action, TC_ACT_REDIRECT,
                    "{from}: a new client after the flood"
                );
                assert_eq!(out.dport(), 8080, "{from}: DNAT port");
            }
        },
    );
}
