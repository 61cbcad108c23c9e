//! SCTP through a NodePort: CRC32c kept valid (or equally invalid), odd frames, conntrack lifetime.

use super::*;

/// SCTP through a NodePort whose targetPort differs from the port, so the destination port,
/// the SNAT source port and with them the CRC32c change: INIT and DATA (payloads of several
/// lengths, so different bits of the length-dependent CRC shift are used), both families, both
/// directions, and the eTP Local variant (only the destination port changes).
#[test]
fn sctp_node_port_translation_keeps_the_crc32c_valid() {
    with_node(|node| {
        program_services(node);
        let mut port = 44_000;
        for (client_ip, node_ip, backend_ip) in
            [(CLIENT, NODE_IP, BACKEND), (CLIENT6, NODE_IP6, BACKEND6)]
        {
            for l4 in [L4::Sctp, L4::SctpData] {
                port += 1;
                let (client, frontend) = (sa(client_ip, port), sa(node_ip, 30868));
                round_trip(node, client, frontend, sa(backend_ip, 3869), l4, false);
                // Another packet of the flow (from conntrack) with a longer payload.
                let payload = vec![0xa5u8; 1000 + port as usize % 7];
                let frame = build(client, frontend, l4, &payload);
                let (before, _) = sctp_crcs(&frame[l4_offset(client)..]);
                let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT);
                let (after, recomputed) = sctp_crcs(&out.l4);
                assert_eq!(after, recomputed, "{l4:?} {client}: CRC32c after NAT");
                assert_ne!(
                    before, after,
                    "{l4:?} {client}: the port change must change the CRC"
                );
                assert_eq!(out.destination(), sa(backend_ip, 3869));
                assert_eq!(
                    out.l4[4..8],
                    frame[l4_offset(client) + 4..][..4],
                    "verification tag kept"
                );
                eprintln!(
                    "SCTP {l4:?} {client} → {frontend} ⇒ {} → {}: {} bytes, CRC32c {before:#010x} → {after:#010x} (recomputed {recomputed:#010x})",
                    out.source(),
                    out.destination(),
                    out.l4.len()
                );
            }
        }
        round_trip(
            node,
            sa(CLIENT, 44_100),
            sa(NODE_IP, 30870),
            sa(BACKEND, 3869),
            L4::SctpData,
            true,
        );
    });
}

/// A packet whose CRC32c is wrong on arrival is still translated (checking it would mean a
/// pass over the payload), and the delta update keeps it wrong by exactly the same error, so
/// the backend's SCTP stack drops it as it would have dropped the untranslated packet.
#[test]
fn sctp_bad_crc_stays_bad_by_the_same_error() {
    with_node(|node| {
        program_services(node);
        for (client, frontend) in [
            (sa(CLIENT, 45_000), sa(NODE_IP, 30868)),
            (sa(CLIENT6, 45_001), sa(NODE_IP6, 30868)),
        ] {
            let mut frame = build(client, frontend, L4::SctpData, b"corrupted in flight");
            let l4_offset = l4_offset(client);
            let error = 0x0040_0001u32;
            for (i, b) in error.to_le_bytes().iter().enumerate() {
                frame[l4_offset + 8 + i] ^= b;
            }
            let out = node
                .dataplane
                .test_run_tc(program_names::TC_EXTERNAL, &frame, node.ext0)
                .expect("test_run");
            assert_eq!(out.action, TC_ACT_REDIRECT, "{client}: translated anyway");
            assert!(
                parse_checked(&out.packet).is_err(),
                "{client}: still invalid"
            );
            let seg = &out.packet[l4_offset..];
            assert_eq!(u16::from_be_bytes([seg[2], seg[3]]), 3869, "{client}: DNAT");
            let (stored, recomputed) = sctp_crcs(seg);
            assert_eq!(
                stored ^ recomputed,
                error,
                "{client}: same CRC error after NAT"
            );
            eprintln!(
                "{client}: CRC error {error:#010x} in, {:#010x} out",
                stored ^ recomputed
            );
        }
    });
}

/// A short SCTP packet (SHUTDOWN COMPLETE, 16 bytes) in a frame padded to Ethernet's 60-byte
/// minimum: at tc ingress the padding is still in the skb, so the CRC length must come from the
/// IP header, not from the skb length.
#[test]
fn sctp_short_padded_frame_uses_the_ip_length() {
    with_node(|node| {
        program_services(node);
        let (client, frontend) = (sa(CLIENT, 46_000), sa(NODE_IP, 30868));
        let mut frame = build(client, frontend, L4::SctpData, b"");
        // Common header + one 4-byte chunk (type 14, flag T: tag reflected).
        frame.truncate(14 + 20 + 12);
        frame.extend_from_slice(&[14, 1, 0, 4]);
        let total = (20 + 16u16).to_be_bytes();
        frame[16..18].copy_from_slice(&total);
        frame[24..26].fill(0);
        let ip_csum = inet_checksum(&frame[14..34]);
        frame[24..26].copy_from_slice(&ip_csum.to_be_bytes());
        frame[34 + 8..34 + 12].fill(0);
        let crc = crc32c(&frame[34..]);
        frame[34 + 8..34 + 12].copy_from_slice(&crc.to_le_bytes());
        frame.resize(60, 0);
        parse_checked(&frame).expect("crafted frame valid");
        let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(out.destination(), sa(BACKEND, 3869));
        assert_eq!(out.l4.len(), 16);
        eprintln!(
            "padded SHUTDOWN COMPLETE: 60-byte frame, 16-byte SCTP packet, CRC32c {crc:#010x} → {:#010x} (valid)",
            sctp_crcs(&out.l4).0
        );
    });
}

/// IPv4 options move the SCTP header: the rewrite and the CRC length follow the IHL.
#[test]
fn sctp_behind_ipv4_options_is_translated_with_a_valid_crc32c() {
    with_node(|node| {
        program_services(node);
        let (client, frontend) = (sa(CLIENT, 48_000), sa(NODE_IP, 30868));
        let plain = build(client, frontend, L4::SctpData, b"options ahead");
        // Four bytes of options (NOP, NOP, NOP, end of list): IHL 6, total length + 4.
        let mut frame = plain[..34].to_vec();
        frame.extend_from_slice(&[1, 1, 1, 0]);
        frame.extend_from_slice(&plain[34..]);
        frame[14] = 0x46;
        let total = u16::from_be_bytes([frame[16], frame[17]]) + 4;
        frame[16..18].copy_from_slice(&total.to_be_bytes());
        frame[24..26].fill(0);
        let ip_csum = inet_checksum(&frame[14..38]);
        frame[24..26].copy_from_slice(&ip_csum.to_be_bytes());
        let out = node
            .dataplane
            .test_run_tc(program_names::TC_EXTERNAL, &frame, node.ext0)
            .expect("test_run");
        assert_eq!(out.action, TC_ACT_REDIRECT);
        let packet = &out.packet;
        assert_eq!(inet_checksum(&packet[14..38]), 0, "IPv4 header checksum");
        let backend: std::net::Ipv4Addr = BACKEND.parse().expect("ip");
        assert_eq!(packet[30..34], backend.octets(), "DNAT address");
        let seg = &packet[38..];
        assert_eq!(u16::from_be_bytes([seg[2], seg[3]]), 3869, "DNAT port");
        assert_eq!(
            &seg[seg.len() - 16..],
            &plain[plain.len() - 16..],
            "chunk kept"
        );
        let (stored, recomputed) = sctp_crcs(seg);
        assert_eq!(stored, recomputed, "CRC32c behind options");
        eprintln!("IHL 6: SCTP at offset 38, CRC32c {stored:#010x} valid after NAT");
    });
}

/// SCTP entries idle out after 210 s (the kernel's `nf_conntrack_sctp_timeout_established`),
/// UDP ones after 120 s: at 150 s idle an SCTP packet is still translated from its entry and a
/// UDP one starts a new flow; at 220 s the SCTP one does too.
#[test]
fn sctp_conntrack_outlives_udp_and_expires_after_210_s() {
    with_node(|node| {
        program_services(node);
        const MARKER: u16 = 9;
        let cases = [
            (L4::SctpData, 30868, 3869, 150, MARKER),
            (L4::Udp, 30053, 5353, 150, 5353),
            (L4::SctpData, 30868, 3869, 220, 3869),
        ];
        for (i, (l4, node_port, backend_port, age_s, expected)) in cases.into_iter().enumerate() {
            let client = sa(CLIENT, 47_000 + i as u16);
            let frontend = sa(NODE_IP, node_port);
            let frame = build(client, frontend, l4, b"ping");
            let (action, first) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            assert_eq!(first.dport(), backend_port);
            age_forward_entry(node, &ct_key(client, frontend, l4.proto()), age_s, MARKER);
            let (action, again) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT);
            eprintln!(
                "{l4:?} idle {age_s} s: translated to port {} ({})",
                again.dport(),
                if again.dport() == MARKER {
                    "entry kept"
                } else {
                    "new flow"
                }
            );
            assert_eq!(again.dport(), expected, "{l4:?} after {age_s} s idle");
        }
    });
}
