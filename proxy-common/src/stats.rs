//! Per-CPU datapath counters (`KPR_STATS`), indexed by [`StatIndex`].

/// Why the datapath did what it did; each variant is one slot of the per-CPU counter array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatIndex {
    /// A `connect()` to a frontend was translated to a backend.
    Translated = 0,
    /// A `connect()` to a frontend without backends was refused (kube-proxy's REJECT).
    RejectedNoBackends = 1,
    /// The chosen slot or backend was missing (should not happen with the update protocol).
    BackendMissing = 2,
    /// `getpeername()` was rewritten back to the service address.
    PeerNameRewritten = 3,
    /// An unconnected UDP `sendmsg()` to a frontend was translated to a backend.
    SendmsgTranslated = 4,
    /// An unconnected UDP `sendmsg()` to a frontend without backends was refused.
    SendmsgRejectedNoBackends = 5,
    /// A UDP reply's source was rewritten to the service address in `recvmsg()`.
    RecvmsgRewritten = 6,
    /// A live session-affinity entry chose the backend.
    AffinityHit = 7,
    /// An affinity entry was found but had expired or its backend left the service.
    AffinityStale = 8,
    /// The reverse-NAT map refused an entry (full and not evictable): getpeername/recvmsg of
    /// that socket will show the backend address.
    RevNatUpdateFailed = 9,
    /// A new external flow was DNATed to a backend (tc).
    TcTranslated = 10,
    /// A packet of a known external flow was translated (tc conntrack hit).
    TcEstablished = 11,
    /// A backend's reply was translated back to the service address (tc).
    TcReplyTranslated = 12,
    /// A new external flow was source-NATed to the node address.
    TcSnat = 13,
    /// A packet to a frontend without endpoints got ICMP port unreachable (REJECT).
    TcRejected = 14,
    /// A packet to a frontend whose endpoints are all elsewhere was dropped (eTP Local, DROP).
    TcDroppedNoLocal = 15,
    /// A client outside loadBalancerSourceRanges was dropped.
    TcDroppedSourceRange = 16,
    /// No free SNAT port was found; the packet was dropped.
    TcSnatPortExhausted = 17,
    /// A conntrack entry could not be written; the packet was dropped.
    TcCtFailed = 18,
    /// Rewriting a packet failed (helper error); the packet was dropped.
    TcRewriteFailed = 19,
    /// A translated packet had no forwarding route (fib lookup) and went up the stack.
    TcPassedToStack = 20,
    /// Building the ICMP reply failed (an IPv4 header with options, which the reply does not
    /// quote, or a helper error); the packet was dropped instead.
    TcRejectFailed = 21,
    /// A local socket dialled a frontend whose endpoints are all on other nodes
    /// (`internalTrafficPolicy: Local`): kube-proxy DROPs it; the hook fails the syscall at once
    /// with `EHOSTUNREACH` (a socket hook has no packet to drop).
    SockDroppedNoLocal = 22,
    /// A process of the node's own network namespace dialled an LB IP whose
    /// `loadBalancerSourceRanges` do not admit the node address: failed with `EHOSTUNREACH`.
    SockDroppedSourceRange = 23,
    /// A local socket dialled a NodePort on a node address (or localhost) and was translated.
    SockNodePort = 24,
    /// A TCP segment other than a SYN to a frontend, without a conntrack entry: not a new
    /// connection, handed to the stack unchanged (a backend chosen for it would reset it).
    TcMidstreamPassed = 25,
    /// Netfilter path: the egress program rewrote a packet's source after the host routed it
    /// (SNAT of a forward packet, or the frontend address on a reply).
    TcEgressTranslated = 26,
    /// A REJECT's ICMP port unreachable was not sent: the client's token bucket was empty
    /// (`icmp_ratelimit`); the packet was dropped.
    TcRejectRateLimited = 27,
    /// A packet with a hardware-stripped VLAN tag (`vlan_tci`, VLAN id not 0) left to the stack
    /// untranslated: it belongs to the VLAN device stacked on the interface.
    TcVlanLeftToStack = 28,
    /// A pod's `connect()`/`sendmsg()` to a frontend was left untranslated for the tc program
    /// on its interface (`--bpf-socket-lb-host-namespace-only`).
    SockLeftToTc = 29,
    /// A new flow without SNAT would have replaced the reply entry of another live flow (the
    /// same backend and client tuple, reached through another frontend): dropped, so that
    /// flow's replies keep going back through its own frontend.
    TcReplyClash = 30,
    /// A backend's reply found its flow's forward entry gone (LRU eviction) and rebuilt it
    /// from the reply entry: the flow keeps its backend and SNAT port.
    TcForwardRebuilt = 31,
    /// A UDP/SCTP packet of a flow the kernel's conntrack NATs (adopted at the agent's start,
    /// `ct_flags::KERNEL_NAT`) went to the stack untranslated, keeping its backend.
    TcKernelNatPassed = 32,
    /// A TCP segment other than a SYN found its flow's forward entry gone (LRU eviction) and
    /// its reply entry there: the forward entry was rebuilt from the flow's own choice of
    /// backend and SNAT port, and the segment translated as before.
    TcMidstreamRecovered = 33,
    /// A TCP segment other than a SYN found both entries of its flow gone (LRU eviction):
    /// they were written again from the flow's own (tuple-hashed) choice of backend and SNAT
    /// port.
    TcMidstreamRecreated = 34,
    /// A TCP segment other than a SYN to a port of the SNAT range without a conntrack entry
    /// and without a socket of the node (a backend's segment of a flow whose entries the LRU
    /// evicted): dropped rather than answered with the stack's reset.
    TcOrphanSegmentDropped = 35,
    /// A new flow whose tuple between client and backend (what the netfilter path shows the
    /// kernel, and keys its egress entries by) another live flow holds — the same client port
    /// to the same backend through another frontend, or a connection of the previous rules in
    /// the kernel's conntrack: it takes the fast path (`ct_flags::BYPASS`).
    TcTupleBypassed = 36,
    /// A reply left by the interface its flow's client came in on, where its route would have
    /// taken another (`CtValue::out_ifindex`: a node with several uplinks).
    TcReplyViaIngress = 37,
    /// A tc entry program found no program of the packet's family to hand it to, or a family
    /// program none for a later IP fragment (the agent fills `KPR_TC_FRAGMENT` and
    /// `KPR_TC_FAMILY` before attaching): the packet went to the stack untranslated. Also the
    /// XDP program without the new-flow program of the packet's family
    /// (`KPR_XDP_NEW_FLOW_FRAGS`): the packet went on to tc.
    TcFamilyProgramMissing = 38,
    /// An ICMP or ICMPv6 error (destination unreachable, fragmentation needed / packet too
    /// big, time exceeded, parameter problem) about a packet of a translated flow had its
    /// quoted packet and its addresses translated as the flow's own packets are (one count
    /// per program that rewrote it), so the client or the backend matches it to its socket.
    TcIcmpErrorTranslated = 39,
    /// A later IP fragment whose datagram's first fragment these programs did not remember
    /// (reordered in front of it, lost, sent before the programs were attached, or not a
    /// flow's: only the first fragments of flows are remembered) went to the stack as it is:
    /// it cannot be matched to a flow, and a Service flow's datagram is lost with it (the
    /// stack cannot reassemble it with the translated rest).
    TcFragmentUntracked = 40,
    /// XDP: a packet of a known external flow (forward entry) was translated and redirected
    /// from the driver, before an skb existed (`--bpf-xdp`, fast path).
    XdpEstablished = 41,
    /// XDP: a backend's reply was translated back and redirected from the driver.
    XdpReplyTranslated = 42,
    /// XDP: a packet of a known flow was left to the tc program because its L4 checksum field
    /// holds only the pseudo-header sum (`CHECKSUM_PARTIAL`, from a local stack over veth),
    /// which an incremental update would corrupt.
    XdpPassedChecksumPartial = 43,
    /// XDP: a packet of a known flow was left to the tc program because its next hop is not an
    /// interface XDP redirects to (a local pod's veth, the node itself, an unresolved
    /// neighbour, or a flow on the netfilter path).
    XdpPassedToTc = 44,
    /// XDP: rewriting or redirecting a packet failed after it was rewritten; it was dropped
    /// (a half-translated packet must not go on).
    XdpRewriteFailed = 45,
    /// XDP: a new flow's packet from a client outside `loadBalancerSourceRanges` was dropped in
    /// the driver (as tc would drop it, before any NAT).
    XdpDroppedSourceRange = 46,
    /// XDP: a new flow's packet to a frontend whose endpoints are all elsewhere
    /// (`externalTrafficPolicy: Local`; kube-proxy DROPs) was dropped in the driver.
    XdpDroppedNoLocal = 47,
    /// Fast path: a translated packet too big for the link to its next hop (IPv4 with DF,
    /// IPv6) was answered with fragmentation needed / packet too big quoting it as its sender
    /// sent it, as a router would (the redirect bypasses the stack that would send it).
    TcTooBigSent = 48,
    /// Fast path: a translated IPv4 packet without DF too big for the link to its next hop
    /// went to the stack, which fragments it only if its translated source is not one of the
    /// node's addresses (a masqueraded flow's is, and the stack drops it as a martian).
    TcTooBigToStack = 49,
    /// XDP: a new flow's first packet (`kpr_xdp_new_flow4/6`) got its backend, its conntrack
    /// entries (as tc's `new_flow` writes them) and was translated and redirected from the
    /// driver.
    XdpTranslated = 50,
    /// XDP: a new flow's first packet was left to tc because the route back to its client
    /// leaves by another interface than the one it came in on (several uplinks, or a VLAN
    /// device on top whose tag the NIC stripped, which XDP cannot see): tc starts the flow on
    /// the interface the stack delivers it to.
    XdpPassedReturnRoute = 51,
    /// A packet to a loopback address (127.0.0.0/8, `::1`) arrived on an interface with the tc
    /// programs and was dropped before any lookup: localhost NodePorts
    /// (`nodePortAddresses` with 127.0.0.0/8) are the node's own processes' (CVE-2020-8558;
    /// kube-proxy's KUBE-FIREWALL rule drops such packets that are not from a loopback
    /// source).
    TcDroppedLoopback = 52,
    /// XDP: a packet to a loopback address was dropped in the driver (as tc would drop it).
    XdpDroppedLoopback = 53,
    /// A new flow found no free SNAT port among its probes and took the port of a TCP flow
    /// whose client never answered its SYN-ACK (an entry of `KPR_CT4_NEW`/`KPR_CT6_NEW`, e.g.
    /// a spoofed SYN): that flow's entries were removed. Established flows' ports are never
    /// taken.
    TcSnatPortReclaimed = 54,
    /// The per-CPU scratch slot (slot 0 of an array map, which always exists) could not be
    /// read where a new flow is written or translated: the packet was dropped. Not expected
    /// with a loaded object; a count means a kernel or build fault worth reporting.
    TcScratchUnavailable = 55,
    /// A TCP, UDP or SCTP packet (or first fragment) whose L4 header ends before its ports
    /// (and, for TCP, its flags): it cannot be matched to a flow or a frontend and went to the
    /// stack untranslated, which drops it as malformed. Counted for any destination: a
    /// truncated header is never regular traffic.
    TcTruncatedHeader = 56,
    /// The fast path looked up the route of a translated packet whose conntrack entry kept no
    /// valid next hop (the flow's first packets, the first after a route, neighbour or link
    /// change, and about once a second); the others use the entry's ([`crate::NextHop`]).
    TcNextHopLookedUp = 57,
}

/// What the datapath did with the packet (or syscall) an event counts: the `action` label of
/// `kubeproxy_ebpf_datapath_events_total` and the column of `inspect counters`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum StatAction {
    /// The packet was dropped (or the syscall failed where kube-proxy's rules drop).
    Dropped,
    /// The client was refused: ICMP port unreachable, `ECONNREFUSED`, or an ICMP error sent in
    /// the packet's place.
    Rejected,
    /// A packet to a frontend or of a tracked flow went on to the stack untranslated.
    PassedUntranslated,
    /// A packet, error or syscall address was translated (each packet counted once).
    Translated,
    /// Anything else: a detail of a translation counted above (SNAT, affinity, recovered
    /// entries), a hand-over between programs, or a best-effort map write that failed.
    Other,
}

impl StatAction {
    pub const ALL: [StatAction; 5] = [
        StatAction::Dropped,
        StatAction::Rejected,
        StatAction::PassedUntranslated,
        StatAction::Translated,
        StatAction::Other,
    ];

    /// Label value in metrics and `inspect`.
    pub const fn name(self) -> &'static str {
        match self {
            StatAction::Dropped => "dropped",
            StatAction::Rejected => "rejected",
            StatAction::PassedUntranslated => "passed_untranslated",
            StatAction::Translated => "translated",
            StatAction::Other => "other",
        }
    }

    /// Whether the user lost traffic to it: dropped, rejected or passed untranslated
    /// (`inspect counters --drops`).
    pub const fn is_drop(self) -> bool {
        matches!(
            self,
            StatAction::Dropped | StatAction::Rejected | StatAction::PassedUntranslated
        )
    }
}

impl StatIndex {
    pub const COUNT: u32 = 58;
    pub const ALL: [StatIndex; Self::COUNT as usize] = [
        StatIndex::Translated,
        StatIndex::RejectedNoBackends,
        StatIndex::BackendMissing,
        StatIndex::PeerNameRewritten,
        StatIndex::SendmsgTranslated,
        StatIndex::SendmsgRejectedNoBackends,
        StatIndex::RecvmsgRewritten,
        StatIndex::AffinityHit,
        StatIndex::AffinityStale,
        StatIndex::RevNatUpdateFailed,
        StatIndex::TcTranslated,
        StatIndex::TcEstablished,
        StatIndex::TcReplyTranslated,
        StatIndex::TcSnat,
        StatIndex::TcRejected,
        StatIndex::TcDroppedNoLocal,
        StatIndex::TcDroppedSourceRange,
        StatIndex::TcSnatPortExhausted,
        StatIndex::TcCtFailed,
        StatIndex::TcRewriteFailed,
        StatIndex::TcPassedToStack,
        StatIndex::TcRejectFailed,
        StatIndex::SockDroppedNoLocal,
        StatIndex::SockDroppedSourceRange,
        StatIndex::SockNodePort,
        StatIndex::TcMidstreamPassed,
        StatIndex::TcEgressTranslated,
        StatIndex::TcRejectRateLimited,
        StatIndex::TcVlanLeftToStack,
        StatIndex::SockLeftToTc,
        StatIndex::TcReplyClash,
        StatIndex::TcForwardRebuilt,
        StatIndex::TcKernelNatPassed,
        StatIndex::TcMidstreamRecovered,
        StatIndex::TcMidstreamRecreated,
        StatIndex::TcOrphanSegmentDropped,
        StatIndex::TcTupleBypassed,
        StatIndex::TcReplyViaIngress,
        StatIndex::TcFamilyProgramMissing,
        StatIndex::TcIcmpErrorTranslated,
        StatIndex::TcFragmentUntracked,
        StatIndex::XdpEstablished,
        StatIndex::XdpReplyTranslated,
        StatIndex::XdpPassedChecksumPartial,
        StatIndex::XdpPassedToTc,
        StatIndex::XdpRewriteFailed,
        StatIndex::XdpDroppedSourceRange,
        StatIndex::XdpDroppedNoLocal,
        StatIndex::TcTooBigSent,
        StatIndex::TcTooBigToStack,
        StatIndex::XdpTranslated,
        StatIndex::XdpPassedReturnRoute,
        StatIndex::TcDroppedLoopback,
        StatIndex::XdpDroppedLoopback,
        StatIndex::TcSnatPortReclaimed,
        StatIndex::TcScratchUnavailable,
        StatIndex::TcTruncatedHeader,
        StatIndex::TcNextHopLookedUp,
    ];

    /// Label used in logs and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            StatIndex::Translated => "translated",
            StatIndex::RejectedNoBackends => "rejected_no_backends",
            StatIndex::BackendMissing => "backend_missing",
            StatIndex::PeerNameRewritten => "peername_rewritten",
            StatIndex::SendmsgTranslated => "sendmsg_translated",
            StatIndex::SendmsgRejectedNoBackends => "sendmsg_rejected_no_backends",
            StatIndex::RecvmsgRewritten => "recvmsg_rewritten",
            StatIndex::AffinityHit => "affinity_hit",
            StatIndex::AffinityStale => "affinity_stale",
            StatIndex::RevNatUpdateFailed => "revnat_update_failed",
            StatIndex::TcTranslated => "tc_translated",
            StatIndex::TcEstablished => "tc_established",
            StatIndex::TcReplyTranslated => "tc_reply_translated",
            StatIndex::TcSnat => "tc_snat",
            StatIndex::TcRejected => "tc_rejected",
            StatIndex::TcDroppedNoLocal => "tc_dropped_no_local_endpoints",
            StatIndex::TcDroppedSourceRange => "tc_dropped_source_range",
            StatIndex::TcSnatPortExhausted => "tc_snat_port_exhausted",
            StatIndex::TcCtFailed => "tc_ct_update_failed",
            StatIndex::TcRewriteFailed => "tc_rewrite_failed",
            StatIndex::TcPassedToStack => "tc_passed_to_stack",
            StatIndex::TcRejectFailed => "tc_reject_failed",
            StatIndex::SockDroppedNoLocal => "sock_dropped_no_local_endpoints",
            StatIndex::SockDroppedSourceRange => "sock_dropped_source_range",
            StatIndex::SockNodePort => "sock_node_port",
            StatIndex::TcMidstreamPassed => "tc_midstream_passed",
            StatIndex::TcEgressTranslated => "tc_egress_translated",
            StatIndex::TcRejectRateLimited => "tc_reject_rate_limited",
            StatIndex::TcVlanLeftToStack => "tc_vlan_left_to_stack",
            StatIndex::SockLeftToTc => "sock_left_to_tc",
            StatIndex::TcReplyClash => "tc_ct_reply_clash",
            StatIndex::TcForwardRebuilt => "tc_ct_forward_rebuilt",
            StatIndex::TcKernelNatPassed => "tc_kernel_nat_passed",
            StatIndex::TcMidstreamRecovered => "tc_ct_midstream_recovered",
            StatIndex::TcMidstreamRecreated => "tc_ct_midstream_recreated",
            StatIndex::TcOrphanSegmentDropped => "tc_ct_orphan_segment_dropped",
            StatIndex::TcTupleBypassed => "tc_tuple_bypassed",
            StatIndex::TcReplyViaIngress => "tc_reply_via_ingress_interface",
            StatIndex::TcFamilyProgramMissing => "tc_family_program_missing",
            StatIndex::TcIcmpErrorTranslated => "tc_icmp_error_translated",
            StatIndex::TcFragmentUntracked => "tc_fragment_untracked",
            StatIndex::XdpEstablished => "xdp_established",
            StatIndex::XdpReplyTranslated => "xdp_reply_translated",
            StatIndex::XdpPassedChecksumPartial => "xdp_passed_checksum_partial",
            StatIndex::XdpPassedToTc => "xdp_passed_to_tc",
            StatIndex::XdpRewriteFailed => "xdp_rewrite_failed",
            StatIndex::XdpDroppedSourceRange => "xdp_dropped_source_range",
            StatIndex::XdpDroppedNoLocal => "xdp_dropped_no_local_endpoints",
            StatIndex::XdpTranslated => "xdp_translated",
            StatIndex::XdpPassedReturnRoute => "xdp_passed_return_route",
            StatIndex::TcTooBigSent => "tc_too_big_sent",
            StatIndex::TcTooBigToStack => "tc_too_big_to_stack",
            StatIndex::TcDroppedLoopback => "tc_dropped_loopback_destination",
            StatIndex::XdpDroppedLoopback => "xdp_dropped_loopback_destination",
            StatIndex::TcSnatPortReclaimed => "tc_snat_port_reclaimed",
            StatIndex::TcScratchUnavailable => "tc_scratch_unavailable",
            StatIndex::TcTruncatedHeader => "tc_truncated_header",
            StatIndex::TcNextHopLookedUp => "tc_next_hop_looked_up",
        }
    }

    /// What the datapath did with what this reason counts (see [`StatAction`]).
    pub const fn action(self) -> StatAction {
        use StatAction::{Dropped, Other, PassedUntranslated, Rejected, Translated};
        match self {
            StatIndex::Translated
            | StatIndex::PeerNameRewritten
            | StatIndex::SendmsgTranslated
            | StatIndex::RecvmsgRewritten
            | StatIndex::TcTranslated
            | StatIndex::TcEstablished
            | StatIndex::TcReplyTranslated
            | StatIndex::TcIcmpErrorTranslated
            | StatIndex::XdpEstablished
            | StatIndex::XdpReplyTranslated
            | StatIndex::XdpTranslated => Translated,
            StatIndex::RejectedNoBackends
            | StatIndex::SendmsgRejectedNoBackends
            | StatIndex::TcRejected
            | StatIndex::TcTooBigSent => Rejected,
            StatIndex::BackendMissing
            | StatIndex::TcDroppedNoLocal
            | StatIndex::TcDroppedSourceRange
            | StatIndex::TcSnatPortExhausted
            | StatIndex::TcCtFailed
            | StatIndex::TcRewriteFailed
            | StatIndex::TcRejectFailed
            | StatIndex::SockDroppedNoLocal
            | StatIndex::SockDroppedSourceRange
            | StatIndex::TcRejectRateLimited
            | StatIndex::TcReplyClash
            | StatIndex::TcOrphanSegmentDropped
            | StatIndex::XdpRewriteFailed
            | StatIndex::XdpDroppedSourceRange
            | StatIndex::XdpDroppedNoLocal
            | StatIndex::TcDroppedLoopback
            | StatIndex::XdpDroppedLoopback
            | StatIndex::TcScratchUnavailable => Dropped,
            StatIndex::TcMidstreamPassed
            | StatIndex::TcKernelNatPassed
            | StatIndex::TcFamilyProgramMissing
            | StatIndex::TcFragmentUntracked
            | StatIndex::TcTruncatedHeader => PassedUntranslated,
            StatIndex::AffinityHit
            | StatIndex::TcNextHopLookedUp
            | StatIndex::AffinityStale
            | StatIndex::RevNatUpdateFailed
            | StatIndex::TcSnat
            | StatIndex::TcPassedToStack
            | StatIndex::SockNodePort
            | StatIndex::TcEgressTranslated
            | StatIndex::TcVlanLeftToStack
            | StatIndex::SockLeftToTc
            | StatIndex::TcForwardRebuilt
            | StatIndex::TcMidstreamRecovered
            | StatIndex::TcMidstreamRecreated
            | StatIndex::TcTupleBypassed
            | StatIndex::TcReplyViaIngress
            | StatIndex::XdpPassedChecksumPartial
            | StatIndex::XdpPassedToTc
            | StatIndex::TcTooBigToStack
            | StatIndex::XdpPassedReturnRoute
            | StatIndex::TcSnatPortReclaimed => Other,
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{collections::BTreeSet, vec::Vec};

    use super::*;

    #[test]
    fn all_lists_every_index_in_order_and_fits_the_map() {
        for (i, index) in StatIndex::ALL.iter().enumerate() {
            assert_eq!(*index as usize, i, "{}", index.name());
        }
        const { assert!(StatIndex::COUNT <= crate::default_sizes::STATS) };
    }

    /// Every reason has a stable snake_case name of its own, an action (the match is
    /// exhaustive: a new variant without one does not compile) and a row in the documented
    /// table of datapath events that names the same action; the table has no row for a reason
    /// that does not exist.
    #[test]
    fn every_reason_is_named_classified_and_documented() {
        const CHAPTER: &str = include_str!("../../docs/monitoring.md");
        let rows: Vec<(&str, &str)> = CHAPTER
            .lines()
            .filter_map(|line| {
                let mut cells = line.strip_prefix("| `")?.split('|');
                let reason = cells.next()?.trim().strip_suffix('`')?;
                let action = cells.next()?.trim();
                Some((reason, action))
            })
            .filter(|(_, action)| StatAction::ALL.iter().any(|a| a.name() == *action))
            .collect();
        let mut names = BTreeSet::new();
        for index in StatIndex::ALL {
            let name = index.name();
            assert!(
                !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{name}: not snake_case"
            );
            assert!(names.insert(name), "{name}: named twice");
            let documented: Vec<&str> = rows
                .iter()
                .filter(|(reason, _)| *reason == name)
                .map(|(_, action)| *action)
                .collect();
            assert_eq!(
                documented,
                [index.action().name()],
                "{name}: one row in docs/monitoring.md's table of datapath events, with its action"
            );
        }
        for (reason, _) in &rows {
            assert!(
                names.contains(reason),
                "{reason}: documented, but no such reason"
            );
        }
        assert_eq!(rows.len(), StatIndex::ALL.len());
    }
}
