//! The tc programs' logic: external service traffic (NodePort, externalIPs, LoadBalancer IPs,
//! ClusterIPs reached from outside) and the reply path.
//!
//! `external` (ingress of the node's external interfaces): a packet of a known flow is
//! translated from its conntrack entry (this also covers replies of remote backends, which
//! arrive here addressed to the SNAT address). Otherwise its destination is looked up as an
//! external frontend (exact address, then the NodePort wildcard if the destination is a node
//! address); source ranges are enforced before any NAT; a backend is chosen; DNAT, SNAT to the
//! node address unless the client must be preserved; both conntrack entries are written.
//!
//! `reply` (ingress of every other interface, i.e. pod veths): the same logic, except that a
//! new flow starts only for an LB IP guarded by source ranges (pods reach every other frontend
//! through the socket hooks) — and, with `node_flags::HOST_NAMESPACE_ONLY`, for every internal
//! frontend (the socket hooks' own: ClusterIP, NodePort at a node address, externalIPs, LB
//! IPs), which the socket hooks then leave to this program for pods. So replies of local
//! backends are translated back from their reply entry, flows of pods from their forward
//! entry, and everything else passes untouched.

use core::mem;

use aya_ebpf::{
    bindings::bpf_fib_lookup as FibLookup,
    bindings::{
        BPF_F_CURRENT_NETNS, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_NOT_FWDED,
        BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_SHOT, TC_ACT_UNSPEC, bpf_sock_tuple,
    },
    helpers::{bpf_fib_lookup, bpf_sk_release, bpf_skc_lookup_tcp},
    maps::{ProgramArray, lpm_trie::Key},
    programs::TcContext,
};
use proxy_common::{
    FrontendValue, NextHop, NodeConfig, StatIndex, TRANSLATED_MARK, TcFamilyProgram,
    TcFragmentProgram, TrafficDirection, TrafficEvent, ct_flags, frontend_flags, ip_family,
    lookup::{self, TcSide},
    maglev::flow_hash,
    node_flags, proto,
    select::{Chosen, address_client},
};

use crate::{
    clock,
    conntrack::{self, ReplyKey, SnatPort, Tuple, View},
    fragments, icmp, icmp_error,
    lb::{Decision, select_backend},
    maps::{
        Destination, FamilyMaps, KPR_NODE_CONFIG, KPR_SNAT_IFACES, KPR_SOURCE_RANGES,
        KPR_TC_FAMILY, KPR_TC_FRAGMENT, scratch,
    },
    nat::{draining, fast_path, fib_query, translate_source, translate_view},
    parse::{ETH_P_IP, ETH_P_IPV6, Frame, Packet, is_later_fragment, parse, parse_later_fragment},
    port_filter,
    stats::bump,
    traffic,
};

pub const DROP: i32 = TC_ACT_SHOT;
/// Not ours: the next program in the chain (`TCX_NEXT`; under legacy cls_bpf the next
/// filter), or the stack if there is none. `TC_ACT_OK` would be `TCX_PASS`, which ends the
/// chain: a program attached after ours would never see the interface's traffic (cilium
/// #36775). Translated packets too, on the netfilter path (see `nat::translate`); only the
/// fast path's redirect and our drops end the chain.
pub const NEXT: i32 = TC_ACT_UNSPEC;

/// The VLAN id bits of a tag (the rest is priority and DEI).
const VLAN_VID_MASK: u32 = 0x0fff;

/// Hands the packet to the program of its family in `KPR_TC_FAMILY`: `first` (the entry
/// program's IPv4 slot) or the slot after it; unless `port_filter` shows at once that it
/// cannot be a Service flow's, which passes on without the tail call. One program per family, because the verifier
/// checks each program as a whole: with both families' conntrack code in one (a map each, with
/// entries sized for their addresses) it went past its million instructions; the other family's
/// code is compiled out of each.
// Inlined: the tail call must be in the entry program itself (the kernel refuses tail calls
// from BPF-to-BPF subprograms of an object without BTF).
#[inline(always)]
pub fn family(ctx: &TcContext, first: TcFamilyProgram) -> i32 {
    // The skb's protocol rather than the frame's ethertype: a field read, no packet access.
    // They agree on every frame the family programs parse (a tag the NIC stripped is in
    // neither; an in-band one is in both, and `parse` leaves such frames alone).
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the field holds a __be16 in a u32"
    )]
    let protocol = ctx.skb.protocol() as u16;
    let (slot, v6) = match u16::from_be(protocol) {
        ETH_P_IP => (first as u32, false),
        ETH_P_IPV6 => (first as u32 + 1, true),
        _ => return NEXT,
    };
    let passes = if first == TcFamilyProgram::Egress4 {
        port_filter::egress_passes(ctx, v6)
    } else {
        port_filter::ingress_passes(ctx, v6)
    };
    if passes {
        return NEXT;
    }
    hand_over(ctx, &KPR_TC_FAMILY, slot)
}

/// Tail-calls the program in `slot` of `programs` (`KPR_TC_FAMILY`, `KPR_TC_FRAGMENT`); to the
/// stack untouched, counted as a missing program, if the slot is empty.
#[inline(always)]
fn hand_over(ctx: &TcContext, programs: &ProgramArray, slot: u32) -> i32 {
    // SAFETY: the slots hold tc programs of this object's build; on success this never
    // returns.
    unsafe { programs.tail_call(ctx, slot) };
    bump(StatIndex::TcFamilyProgramMissing);
    NEXT
}

pub fn external<const V6: bool>(ctx: &TcContext) -> i32 {
    service::<V6>(ctx, TcSide::External)
}

/// Replies of local backends (and of flows pods started to guarded LB IPs), then new flows of
/// pods to LB IPs guarded by source ranges.
pub fn reply<const V6: bool>(ctx: &TcContext) -> i32 {
    service::<V6>(ctx, TcSide::Pod)
}

/// Egress of every interface with an ingress program (netfilter path): the source half of
/// translations whose destination half ingress did, now that the host has routed the packet
/// through FORWARD and POSTROUTING. An entry applies when the packet already carries the
/// translation's destination (so ingress did its half): the egress entries of SNATed flows
/// (`ct_flags::EGRESS`) and the reply entries of flows without SNAT, which are keyed by
/// the backend's own packet.
pub fn egress<const V6: bool>(ctx: &TcContext) -> i32 {
    // Errors about the flows' packets, the node's own among them: no mark, on either path.
    if let Some(action) = icmp_error::egress::<V6>(ctx) {
        return action;
    }
    // Only packets an ingress program translated (`TRANSLATED_MARK`): another packet with the
    // tuple of a tracked flow is someone else's. The bit is ours; it goes with the translation.
    // SAFETY: the context pointer is the program's own __sk_buff.
    let mark = unsafe { (*ctx.skb.skb).mark };
    if fast_path() || mark & TRANSLATED_MARK == 0 {
        return host_backend_reply::<V6>(ctx);
    }
    ctx.set_mark(mark & !TRANSLATED_MARK);
    let Some(pkt) = parse::<V6>(ctx) else {
        if is_later_fragment::<V6>(ctx) {
            return hand_over(
                ctx,
                &KPR_TC_FRAGMENT,
                TcFragmentProgram::of(true, V6) as u32,
            );
        }
        return NEXT;
    };
    // An ingress program translated it: a flow's packet.
    fragments::remember::<V6>(pkt);
    egress_source::<V6>(ctx, pkt)
}

/// The source half of `pkt`'s translation, if egress owes it one (see [`egress`]).
#[inline(always)]
fn egress_source<const V6: bool>(ctx: &TcContext, pkt: &Packet) -> i32 {
    let Some(value) = conntrack::lookup::<V6>(&pkt.ct_key(), View::A) else {
        return NEXT;
    };
    if value.flags & (ct_flags::EGRESS | ct_flags::REPLY) == 0
        || value.dst != pkt.dst
        || value.dport != pkt.dport
        || (value.src == pkt.src && value.sport == pkt.sport)
    {
        return NEXT;
    }
    translate_source(ctx, pkt, value)
}

/// Ingress of a later fragment of a datagram (`kpr_tc_fragment_ingress4/6`, tail-called by
/// the family programs): the translation of the flow its first fragment is in (by the ports
/// that one carried, `fragments`), addresses only; to the stack untouched if the flow has no
/// entry or its first fragment was not seen (counted). A later fragment never starts a flow:
/// it carries no L4 header to choose by.
pub fn fragment_ingress<const V6: bool>(ctx: &TcContext) -> i32 {
    let Some(pkt) = parse_later_fragment::<V6>(ctx) else {
        return NEXT;
    };
    let Some(value) = conntrack::lookup::<V6>(&pkt.ct_key(), View::A) else {
        // Its first fragment was a flow's, whose entries are gone since (expired, evicted).
        bump(StatIndex::TcFragmentUntracked);
        return NEXT;
    };
    // One `translate_view` for both directions (see there).
    let stat = if value.flags & ct_flags::REPLY != 0 {
        traffic::count_tc_packet(ctx, value.service_id, TrafficDirection::Reply);
        StatIndex::TcReplyTranslated
    } else {
        // The kernel's conntrack NATs an adopted flow's packets: it reassembles them first.
        if value.flags & ct_flags::KERNEL_NAT != 0 {
            bump(StatIndex::TcKernelNatPassed);
            return NEXT;
        }
        traffic::count_tc_packet(ctx, value.service_id, TrafficDirection::Forward);
        StatIndex::TcEstablished
    };
    translate_view(ctx, pkt, stat)
}

/// Egress of a later fragment (`kpr_tc_fragment_egress4/6`): the source half its first
/// fragment got (see [`egress`]).
pub fn fragment_egress<const V6: bool>(ctx: &TcContext) -> i32 {
    match parse_later_fragment::<V6>(ctx) {
        Some(pkt) => egress_source::<V6>(ctx, pkt),
        None => NEXT,
    }
}

/// Egress, on either path: a reply of a host-network backend on this node (its flow's reply
/// entry has `ct_flags::HOST_BACKEND`). Ingress translated the client's packet to the node's
/// own address and the host delivered it to the backend's socket; the answer leaves the
/// node's own stack, so no ingress program saw it and it carries no mark: it gets the
/// frontend as its source here, as netfilter's conntrack un-DNATs it on the output path for
/// kube-proxy. Only packets the node itself sent (`ingress_ifindex` 0: never received on an
/// interface) are looked up, so forwarded traffic pays nothing.
#[inline(always)]
fn host_backend_reply<const V6: bool>(ctx: &TcContext) -> i32 {
    // SAFETY: the context pointer is the program's own __sk_buff.
    if unsafe { (*ctx.skb.skb).ingress_ifindex } != 0 {
        return NEXT;
    }
    let Some(pkt) = parse::<V6>(ctx) else {
        return NEXT;
    };
    let key = pkt.ct_key();
    let Some(value) = conntrack::lookup::<V6>(&key, View::A) else {
        return NEXT;
    };
    if value.flags & ct_flags::HOST_BACKEND == 0 || value.dst != pkt.dst || value.dport != pkt.dport
    {
        return NEXT;
    }
    let now = clock::now_ns();
    // Refreshed (and a FIN or RST passed on, an evicted forward entry rebuilt) as ingress does
    // for the replies of other backends.
    if conntrack::reply_seen::<V6>(&key, value, pkt, now) {
        bump(StatIndex::TcForwardRebuilt);
    }
    // No ingress program saw this reply (it leaves the node's own stack): counted here.
    traffic::count_tc_packet(ctx, value.service_id, TrafficDirection::Reply);
    translate_source(ctx, pkt, value)
}

#[inline(always)]
fn service<const V6: bool>(ctx: &TcContext, side: TcSide) -> i32 {
    // A VLAN tag the NIC stripped (hardware VLAN offload) is in `vlan_tci`, not in the
    // frame: the packet belongs to the VLAN device stacked on this interface, whose own
    // program (an external interface like any other) sees it untagged once the stack has
    // handed it over. Translated here it would be redirected with the stale tag. Priority
    // tags (VLAN 0) stay on this interface in the stack too, so they are served here.
    // SAFETY: the context pointer is the program's own __sk_buff.
    let (vlan_present, vlan_tci) =
        unsafe { ((*ctx.skb.skb).vlan_present, (*ctx.skb.skb).vlan_tci) };
    if vlan_present != 0 && vlan_tci & VLAN_VID_MASK != 0 {
        bump(StatIndex::TcVlanLeftToStack);
        return NEXT;
    }
    let Some(pkt) = parse::<V6>(ctx) else {
        // A later fragment of a flow's datagram (to its own program), or an error about a
        // flow, or none of ours.
        if is_later_fragment::<V6>(ctx) {
            return hand_over(
                ctx,
                &KPR_TC_FRAGMENT,
                TcFragmentProgram::of(false, V6) as u32,
            );
        }
        return icmp_error::ingress::<V6>(ctx);
    };
    // A loopback destination from an interface: the kernel drops it as a martian unless
    // `route_localnet` is on, but only after this program, which would translate it if the
    // loopback address is a NodePort address (`nodePortAddresses` with 127.0.0.0/8). A
    // node's localhost NodePorts are for the node's own processes (the socket hooks), never
    // for a neighbour that routes 127.0.0.1 to the node (CVE-2020-8558; kube-proxy's
    // KUBE-FIREWALL drops such packets to 127.0.0.0/8 that are not from a loopback source).
    // No interface with these programs is loopback: whatever arrives here is from outside.
    if pkt.loopback_destination() {
        bump(StatIndex::TcDroppedLoopback);
        return DROP;
    }
    let now = clock::now_ns();
    // The key in the scratch slot, not on this frame: `new_flow` and its callees stack on it
    // within the verifier's 512 bytes. `new_flow` writes the same key there again.
    let Some(scratch) = scratch() else {
        return NEXT;
    };
    // SAFETY: the per-CPU slot is ours until the program ends.
    let key = unsafe { &mut (*scratch).flow_key };
    pkt.write_ct_key(key);
    // Every path that translates ends in the one `translate_view` below, with the entry to
    // translate to in the scratch slot's `view_a` (see there: the verifier walks the
    // translation once).
    let stat = 'flow: {
        // A copy in the scratch slot (no copy on this frame, for the stack); the agent writes
        // only new entries (the kernel's NATed flows it adopts at start, with `BPF_NOEXIST`),
        // and a racing datapath update writes a whole, equally valid translation.
        if let Some(value) = conntrack::lookup::<V6>(key, View::A)
            // An egress entry is keyed by a translated flow's packet as it leaves for the
            // backend (client → backend) or the client (backend → client): the egress
            // program's. A packet arriving here with that tuple was sent to the pod's own
            // address (the client's port reused, the flow closed or not): no flow of ours,
            // whatever the entry says.
            && value.flags & ct_flags::EGRESS == 0
        {
            if value.flags & ct_flags::REPLY != 0 {
                // Counted at ingress only: on the netfilter path the egress program sees the
                // packet again.
                traffic::count_tc_packet(ctx, value.service_id, TrafficDirection::Reply);
                // A backend's reply (a remote one's is addressed to the SNAT address).
                if conntrack::reply_seen::<V6>(key, value, pkt, now) {
                    bump(StatIndex::TcForwardRebuilt);
                }
                fragments::remember::<V6>(pkt);
                break 'flow StatIndex::TcReplyTranslated;
            }
            if conntrack::carries(value, pkt, now) {
                conntrack::touch::<V6>(key, value, pkt, now);
                // Before the adopted flows' exit too: their later fragments are looked up, and
                // passed on, by the flow's entry as well.
                fragments::remember::<V6>(pkt);
                // A flow the kernel's conntrack already NATs (adopted at the agent's start):
                // its entry there keeps the NAT without any rule, so the stack keeps its
                // backend.
                if value.flags & ct_flags::KERNEL_NAT != 0 {
                    bump(StatIndex::TcKernelNatPassed);
                    return NEXT;
                }
                traffic::count_tc_packet(ctx, value.service_id, TrafficDirection::Forward);
                break 'flow StatIndex::TcEstablished;
            }
        }
        // Draining for the iptables mode: new flows are its rules' (see
        // `node_flags::DRAINING`).
        if draining() {
            return NEXT;
        }
        let Some((frontend, internal)) = lookup_frontend::<V6>(pkt, side) else {
            if pkt.proto == proto::TCP && !pkt.syn() && orphan_segment(ctx, pkt) {
                bump(StatIndex::TcOrphanSegmentDropped);
                return DROP;
            }
            return NEXT;
        };
        // Only a SYN starts a TCP connection; `new_flow` recovers the flow of any other
        // segment without an entry (see there) or hands it to the stack.
        match new_flow::<V6, _>(ctx, pkt, &frontend, internal) {
            Verdict::Action(action) => return action,
            // Called from here, not from `new_flow`, so the two frames never stack up.
            Verdict::Reject => return icmp::reject(ctx, pkt),
            // Here, not in `new_flow`: three frames (`external`, `new_flow`, and this or
            // `reply_holder`) would exceed the verifier's 512-byte combined stack.
            Verdict::Translate => {
                if !insert_egress::<V6>(pkt) {
                    return DROP;
                }
                // Only now, with the flow's entries written: a first fragment to anything else
                // (no frontend, dropped, rejected) is not remembered, so a flood of them cannot
                // evict the datagrams of real flows from the LRU map.
                fragments::remember::<V6>(pkt);
                traffic::count_first_tc_packet(ctx, pkt, frontend.service_id);
                traffic::count_new_flow_endpoint(pkt, frontend.service_id);
                // To the forward tuple `new_flow` left in the scratch slot.
                // SAFETY: the per-CPU slot is ours until the program ends.
                unsafe { (*scratch).view_a = (*scratch).forward };
                break 'flow StatIndex::TcTranslated;
            }
        }
    };
    translate_view(ctx, pkt, stat)
}

/// What `new_flow` decided.
pub enum Verdict {
    Action(i32),
    /// kube-proxy REJECT: answer port unreachable.
    Reject,
    /// A new flow, its conntrack entries written: rewrite to the scratch slot's `forward`
    /// tuple. Done by the caller, so the new flow's frame and the rewrite's never stack up
    /// (with SCTP's CRC update the chain `external` → `new_flow` → `translate` exceeded the
    /// verifier's 512-byte combined stack).
    Translate,
}

/// The frontend for the packet's destination in the order of
/// `proxy_common::lookup::tc_frontend` (see there for each side), and whether it is an internal
/// one: internal frontends are load-balanced as the socket hooks do (no SNAT).
#[inline(always)]
fn lookup_frontend<const V6: bool>(pkt: &Packet, side: TcSide) -> Option<(FrontendValue, bool)> {
    let found = if V6 {
        let mut maps = Destination::<ip_family::V6>::new(&pkt.dst, pkt.dport, pkt.proto);
        lookup::tc_frontend(&mut maps, side)
    } else {
        let mut maps = Destination::<ip_family::V4>::new(&pkt.dst, pkt.dport, pkt.proto);
        lookup::tc_frontend(&mut maps, side)
    }?;
    Some((found.frontend, found.internal))
}

/// The external frontend for the packet's destination (an external interface's, see
/// `lookup_frontend`).
#[inline(always)]
pub fn external_frontend<const V6: bool>(pkt: &Packet) -> Option<FrontendValue> {
    lookup_frontend::<V6>(pkt, TcSide::External).map(|(frontend, _)| frontend)
}

/// Whether `pkt`, a TCP segment other than a SYN without a conntrack entry and not to a
/// frontend, is a backend's segment of a masqueraded flow whose entries the LRU evicted: to a
/// SNAT address and a port of the SNAT range that no socket of the node holds (the range is
/// reserved from the
/// node's ephemeral ports; a socket bound there explicitly keeps its segments). The stack
/// would answer it with a reset, which ends the flow at the backend before the client's next
/// segment can write its entries again (`new_flow`); dropped, the backend retransmits.
#[inline(never)]
fn orphan_segment(ctx: &TcContext, pkt: &Packet) -> bool {
    if !conntrack::in_snat_range(pkt.dport) || !is_snat_address(ctx, pkt) {
        return false;
    }
    let Some(scratch) = scratch() else {
        return false;
    };
    // SAFETY: the per-CPU slot is ours until the program ends.
    let tuple = unsafe { &mut (*scratch).sock_tuple };
    let ports = u32::from(pkt.sport) | (u32::from(pkt.dport) << 16);
    let size = if pkt.is_v6() {
        tuple[0] = pkt.src[0];
        tuple[1] = pkt.src[1];
        tuple[2] = pkt.src[2];
        tuple[3] = pkt.src[3];
        tuple[4] = pkt.dst[0];
        tuple[5] = pkt.dst[1];
        tuple[6] = pkt.dst[2];
        tuple[7] = pkt.dst[3];
        tuple[8] = ports;
        36
    } else {
        tuple[0] = pkt.src[0];
        tuple[1] = pkt.dst[0];
        tuple[2] = ports;
        12
    };
    // SAFETY: the tuple is 36 bytes of map memory (`size` of them are read); the context is
    // the program's own skb. A socket found is released before returning.
    unsafe {
        let sock = bpf_skc_lookup_tcp(
            ctx.skb.skb.cast(),
            core::ptr::from_mut(tuple).cast::<bpf_sock_tuple>(),
            size,
            BPF_F_CURRENT_NETNS as u64,
            0,
        );
        if sock.is_null() {
            return true;
        }
        bpf_sk_release(sock.cast());
    }
    false
}

/// Whether the packet is addressed to a SNAT address: the node's (`NodeConfig`), or the one a
/// flow routed out of the interface the packet came in by was given (`KPR_SNAT_IFACES`).
/// Anything else (a pod's address, forwarded) is not the node's to answer.
#[inline(always)]
fn is_snat_address(ctx: &TcContext, pkt: &Packet) -> bool {
    let Some(config) = KPR_NODE_CONFIG.get(0) else {
        return false;
    };
    let v6 = pkt.is_v6();
    if pkt.dst
        == if v6 {
            config.snat6
        } else {
            [config.snat4, 0, 0, 0]
        }
    {
        return true;
    }
    // SAFETY: the context pointer is the program's own __sk_buff.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: the value is plain integers, read at once; the agent writes whole values.
    unsafe { KPR_SNAT_IFACES.get(ifindex) }.is_some_and(|addrs| {
        pkt.dst
            == if v6 {
                addrs.snat6
            } else {
                [addrs.snat4, 0, 0, 0]
            }
    })
}

/// A TCP segment other than a SYN without a conntrack entry is not a new connection: a backend
/// chosen for it would answer with a reset. It goes to the stack unchanged — one the kernel's
/// conntrack NATs (from before a takeover) keeps that NAT there.
#[inline(always)]
fn pass_midstream() -> Verdict {
    bump(StatIndex::TcMidstreamPassed);
    Verdict::Action(NEXT)
}

// Not inlined: as one function with `external`, LLVM 22's BPF backend crashes (SIGSEGV in
// post-RA pseudo instruction expansion); as a BPF-to-BPF call it also keeps each frame's stack
// well under the verifier's 512 bytes.
//
// A mid-stream TCP segment (not a SYN) without a forward entry belongs to a flow whose entry
// the LRU evicted (the kernel's NATed flows have `KERNEL_NAT` entries from their adoption at
// start). Backend and SNAT port are both chosen from the client's tuple
// (`lb::select_backend`, `conntrack::snat_port`), so the same choice is made again and the
// flow's reply entry looked up: if it is there and ours, the forward entry is rebuilt and the
// segment goes to the same backend from the same port (`tc_ct_midstream_recovered`). If the
// reply entry is gone too, both are written again from that choice
// (`tc_ct_midstream_recreated`): the same backend while the Service's backends are the ones
// the flow started with, and the same port unless an earlier port of its sequence was freed
// meanwhile. A reply key another flow holds sends the segment to the stack
// (`pass_midstream`).
#[inline(never)]
pub fn new_flow<const V6: bool, C: Frame>(
    ctx: &C,
    pkt: &Packet,
    frontend: &FrontendValue,
    internal: bool,
) -> Verdict {
    // Read here rather than passed in (the time, and the packet's conntrack key into the
    // scratch slot): a BPF call takes at most 5 arguments (the verdict's return slot is one).
    let now = clock::now_ns();
    let midstream = pkt.proto == proto::TCP && !pkt.opens();
    // Until the agent has adopted the kernel's NATed flows, a segment without any entry may be
    // one of them: only a flow whose reply entry is ours is recovered.
    let rewrite = midstream
        && KPR_NODE_CONFIG
            .get(0)
            .is_some_and(|config| config.flags & node_flags::KERNEL_FLOWS == 0);
    if frontend.flags & frontend_flags::SOURCE_RANGES != 0 && !source_allowed(pkt, frontend) {
        if midstream {
            return pass_midstream();
        }
        bump(StatIndex::TcDroppedSourceRange);
        traffic::count(frontend.service_id, TrafficEvent::DroppedSourceRange);
        return Verdict::Action(DROP);
    }
    let (backend_addr, backend_port) = match choose(pkt, frontend) {
        Decision::Backend(backend, _) | Decision::Kept(backend) => backend,
        _ if midstream => return pass_midstream(),
        Decision::NoBackends if frontend.flags & frontend_flags::DROP_NO_BACKENDS != 0 => {
            bump(StatIndex::TcDroppedNoLocal);
            traffic::count(frontend.service_id, TrafficEvent::DroppedNoLocal);
            return Verdict::Action(DROP);
        }
        Decision::NoBackends => {
            traffic::count(frontend.service_id, TrafficEvent::Rejected);
            return Verdict::Reject;
        }
        Decision::BackendMissing => {
            bump(StatIndex::BackendMissing);
            return Verdict::Action(DROP);
        }
    };
    let Some(scratch) = scratch() else {
        bump(StatIndex::TcScratchUnavailable);
        return Verdict::Action(DROP);
    };
    // SAFETY: the per-CPU slot is ours until the program ends (no preemption on a CPU).
    let scratch = unsafe { &mut *scratch };
    pkt.write_ct_key(&mut scratch.flow_key);
    // A TCP SYN's flow waits apart until the client's next segment (`conntrack::promote`).
    scratch.ct_new = u32::from(pkt.proto == proto::TCP && !midstream);
    // Field by field: whole values would be built on this frame's stack first (the verifier's
    // 512 bytes are shared with `service` and the callees).
    let forward = &mut scratch.forward;
    forward.src = pkt.src;
    forward.dst = backend_addr;
    forward.sport = pkt.sport;
    forward.dport = backend_port;
    forward.flags = 0;
    forward._pad = 0;
    forward.out_mac = [0; 6];
    forward.out_ifindex = 0;
    forward.last_seen_ns = now;
    // The frontend whose packet and byte counters the flow's packets add to.
    forward.service_id = frontend.service_id;
    forward._pad2 = 0;
    forward.next_hop = NextHop::NONE;
    let reply_key = &mut scratch.reply_key;
    reply_key.src = backend_addr;
    reply_key.dst = pkt.src;
    reply_key.sport = backend_port;
    reply_key.dport = pkt.sport;
    reply_key.proto = pkt.proto;
    reply_key.family = pkt.family;
    reply_key._pad = 0;
    let reply = &mut scratch.reply;
    reply.src = pkt.dst;
    reply.dst = pkt.src;
    reply.sport = pkt.dport;
    reply.dport = pkt.sport;
    reply.flags = ct_flags::REPLY;
    reply._pad = 0;
    reply.out_mac = [0; 6];
    reply.out_ifindex = 0;
    reply.last_seen_ns = now;
    reply.service_id = scratch.forward.service_id;
    reply._pad2 = 0;
    reply.next_hop = NextHop::NONE;
    record_client_interface(ctx);
    // Another live flow holds the tuple this one would show the kernel and key its egress
    // entries by on the netfilter path (see `ct_flags::BYPASS`).
    let holder = if fast_path() {
        Tuple::Free
    } else {
        conntrack::tuple_holder::<V6>(&scratch.reply_key, &scratch.flow_key, now)
    };
    // A host-network backend on this node is delivered locally, never masqueraded (see
    // `ct_flags::HOST_BACKEND`): SNATed to the node's own address the packet would arrive with
    // a local source, a martian the stack drops.
    let snat = if route_to_backend(ctx, pkt) {
        scratch.reply.flags |= ct_flags::HOST_BACKEND;
        None
    } else if internal {
        hairpin_snat(pkt, &scratch.forward.dst)
    } else {
        snat_address(pkt, frontend, &scratch.egress_snat)
    };
    // Without SNAT the held tuple is this flow's own reply key: a flow of the kernel's is over
    // (its backend could not tell the two apart), a SNATed flow of ours gives it up for the
    // fast path, and one without SNAT keeps it (`insert_reply` refuses, as for any flow).
    let bypass = match holder {
        Tuple::Free => false,
        Tuple::Flow => snat.is_some(),
        Tuple::Kernel => true,
        Tuple::Egress => {
            if snat.is_none() {
                conntrack::divert_holder::<V6>();
            }
            true
        }
    };
    if bypass {
        scratch.forward.flags |= ct_flags::BYPASS;
        scratch.reply.flags |= ct_flags::BYPASS;
        if !midstream {
            bump(StatIndex::TcTupleBypassed);
        }
    }
    match snat {
        Some(addr) => {
            scratch.reply_key.dst = addr;
            let port = match conntrack::snat_port::<V6>(
                &mut scratch.reply_key,
                &scratch.reply,
                &scratch.flow_key,
                midstream,
                rewrite,
            ) {
                Some(SnatPort::Found(port)) => {
                    bump(StatIndex::TcMidstreamRecovered);
                    port
                }
                Some(SnatPort::Reserved(port)) => {
                    bump(if midstream {
                        StatIndex::TcMidstreamRecreated
                    } else {
                        StatIndex::TcSnat
                    });
                    port
                }
                None if midstream => return pass_midstream(),
                None => {
                    bump(StatIndex::TcSnatPortExhausted);
                    return Verdict::Action(DROP);
                }
            };
            scratch.forward.src = addr;
            scratch.forward.sport = port;
            scratch.forward.flags |= ct_flags::SNAT;
        }
        None if midstream => {
            match conntrack::reply_key_holder::<V6>(&scratch.reply_key, &scratch.reply) {
                ReplyKey::Flow => bump(StatIndex::TcMidstreamRecovered),
                ReplyKey::Free
                    if rewrite
                        && conntrack::insert_reply::<V6>(
                            &scratch.reply_key,
                            &scratch.reply,
                            &scratch.flow_key,
                        ) =>
                {
                    bump(StatIndex::TcMidstreamRecreated);
                }
                _ => return pass_midstream(),
            }
        }
        None => {
            // A bypassing flow's reply key was given up by its holder (see above).
            let inserted = if scratch.reply.flags & ct_flags::BYPASS != 0 {
                let inserted = conntrack::insert::<V6>(&scratch.reply_key, &scratch.reply);
                if !inserted {
                    bump(StatIndex::TcCtFailed);
                }
                inserted
            } else {
                // Counted there (`tc_ct_reply_clash`, `tc_ct_update_failed`).
                conntrack::insert_reply::<V6>(&scratch.reply_key, &scratch.reply, &scratch.flow_key)
            };
            if !inserted {
                return Verdict::Action(DROP);
            }
        }
    }
    if midstream {
        scratch.forward.flags |= ct_flags::ESTABLISHED;
    }
    if !conntrack::insert::<V6>(&scratch.flow_key, &scratch.forward) {
        if midstream {
            // The reply entry is the live flow's: keep it.
            bump(StatIndex::TcCtFailed);
            return Verdict::Action(DROP);
        }
        conntrack::remove::<V6>(&scratch.reply_key);
        bump(StatIndex::TcCtFailed);
        return Verdict::Action(DROP);
    }
    if !midstream {
        traffic::count_connection(pkt, frontend.service_id);
    }
    Verdict::Translate
}

/// Records in the new flow's reply entry (the scratch slot's `reply`) the interface the
/// client's packet arrived on and the neighbour it came from, for replies that must leave by
/// that interface (`nat::leave_by_ingress`); without them they are routed as any packet.
/// Inlined: as a call of its own it left `new_flow` 8 bytes more stack, not less (the
/// verifier's 512-byte combined stack is `kpr_tc_reply` → `new_flow` → `tuple_holder`).
#[inline(always)]
fn record_client_interface<C: Frame>(ctx: &C) {
    let Some(scratch) = scratch() else {
        return;
    };
    // SAFETY: the per-CPU slot is ours until the program ends.
    let reply = unsafe { &mut (*scratch).reply };
    reply.out_ifindex = if ctx.source_mac(&mut reply.out_mac) {
        ctx.ifindex()
    } else {
        0
    };
}

/// Netfilter path, SNATed flow: the egress program's two entries, keyed by what the host
/// routes after ingress rewrote the destination — the forward packet (client → backend,
/// rewritten to come from the SNAT address and port) and the backend's reply once un-SNATed
/// (backend → client, rewritten to come from the frontend). A flow without SNAT needs none:
/// its reply entry is already keyed by the backend's packet. Reads the new flow from the
/// scratch slot `new_flow` filled; on failure removes the flow's entries and counts it
/// (false: drop). Not inlined, and keys are built in the scratch slot field by field, for the
/// stack.
#[inline(never)]
fn insert_egress<const V6: bool>(pkt: &Packet) -> bool {
    let Some(scratch) = scratch() else {
        bump(StatIndex::TcScratchUnavailable);
        return false;
    };
    // SAFETY: the per-CPU slot is ours until the program ends.
    let scratch = unsafe { &mut *scratch };
    if fast_path() || scratch.forward.flags & ct_flags::BYPASS != 0 {
        return true;
    }
    let key = &mut scratch.egress_key;
    key.src = pkt.src;
    key.dst = scratch.forward.dst;
    key.sport = pkt.sport;
    key.dport = scratch.forward.dport;
    key.proto = pkt.proto;
    key.family = pkt.family;
    key._pad = 0;
    if scratch.forward.flags & ct_flags::SNAT == 0 {
        // An earlier SNATed flow of the same client tuple to the same backend (another
        // frontend, or the policy changed) may have left its egress entry under this key: it
        // would SNAT this flow. (Its reply-side egress entry was just overwritten by this
        // flow's reply entry, which has the same key.)
        conntrack::remove::<V6>(&scratch.egress_key);
        return true;
    }
    scratch.forward.flags |= ct_flags::EGRESS;
    let inserted = conntrack::insert::<V6>(&scratch.egress_key, &scratch.forward);
    scratch.forward.flags &= !ct_flags::EGRESS;
    if inserted {
        let key = &mut scratch.egress_key;
        key.src = scratch.forward.dst;
        key.dst = pkt.src;
        key.sport = scratch.forward.dport;
        key.dport = pkt.sport;
        scratch.reply.flags |= ct_flags::EGRESS;
        if conntrack::insert::<V6>(&scratch.egress_key, &scratch.reply) {
            return true;
        }
        let key = &mut scratch.egress_key;
        key.src = pkt.src;
        key.dst = scratch.forward.dst;
        key.sport = pkt.sport;
        key.dport = scratch.forward.dport;
        conntrack::remove::<V6>(&scratch.egress_key);
    }
    // Undo the flow: without its egress half it would leave SNAT undone.
    conntrack::remove::<V6>(&scratch.reply_key);
    let key = &mut scratch.egress_key;
    key.src = pkt.src;
    key.dst = pkt.dst;
    key.sport = pkt.sport;
    key.dport = pkt.dport;
    conntrack::remove::<V6>(&scratch.egress_key);
    bump(StatIndex::TcCtFailed);
    false
}

/// The kernel's route from the packet's interface to the backend of the new flow `new_flow`
/// is writing (its forward tuple in the scratch slot) — the forwarding lookup the stack does
/// for the DNATed packet, so policy routing picks the same way. Two answers from the one
/// lookup:
///
/// - the return value: whether the backend is an address of this node, a host-network
///   endpoint's (the route is local, which `bpf_fib_lookup` reports as not forwarded). The
///   routing table rather than `KPR_NODE_ADDRS`: that set holds only the NodePort addresses
///   (`--nodeport-addresses`), an endpoint may use any address of the node;
/// - `scratch.egress_snat`: the address of the packet's family of the interface the route
///   leaves by, if that is an external interface with one (`KPR_SNAT_IFACES`), else all-zero —
///   MASQUERADE's choice of the outgoing interface's address, so a backend behind the node's
///   second uplink sees (and answers) an address of that uplink's network.
///
/// Not inlined, and everything read from and built in the scratch slot: its frame stacks on
/// `new_flow`'s.
#[inline(never)]
fn route_to_backend<C: Frame>(ctx: &C, pkt: &Packet) -> bool {
    let Some(scratch) = scratch() else {
        return false;
    };
    // SAFETY: the per-CPU slot is ours until the program ends; `fib` is used by `new_flow`'s
    // callers only after it returns (the fast path's redirect), `forward` only read here.
    let scratch = unsafe { &mut *scratch };
    // Cleared first: the slot holds the previous packet's.
    scratch.egress_snat = [0; 4];
    // `forward` still holds the client's own source here (SNAT comes after this lookup).
    fib_query(
        &mut scratch.fib,
        pkt.family,
        pkt.proto,
        &scratch.forward,
        ctx.ingress_ifindex(),
    );
    let params: &mut FibLookup = &mut scratch.fib;
    // SAFETY: params points to a bpf_fib_lookup of the size passed.
    let ret =
        unsafe { bpf_fib_lookup(ctx.as_ptr(), params, mem::size_of::<FibLookup>() as i32, 0) };
    if ret == i64::from(BPF_FIB_LKUP_RET_NOT_FWDED) {
        return true;
    }
    // A route without a neighbour entry yet still names its interface.
    if ret != i64::from(BPF_FIB_LKUP_RET_SUCCESS) && ret != i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return false;
    }
    // The lookup leaves the egress interface in `ifindex`.
    let ifindex = scratch.fib.ifindex;
    // SAFETY: values are copied out at once (whole-value updates by the agent).
    if let Some(found) = unsafe { KPR_SNAT_IFACES.get(ifindex) } {
        scratch.egress_snat = if pkt.is_v6() {
            found.snat6
        } else {
            [found.snat4, 0, 0, 0]
        };
    }
    false
}

/// `loadBalancerSourceRanges`: the longest-prefix match on (service id, client address).
#[inline(always)]
pub fn source_allowed(pkt: &Packet, frontend: &FrontendValue) -> bool {
    let (prefix, key) = lookup::source_range_key(frontend.service_id, &pkt.src, pkt.is_v6());
    let key = Key::new(prefix, key);
    KPR_SOURCE_RANGES.get(&key).is_some()
}

/// Picks a backend; affinity is keyed by the client address
/// (`proxy_common::select::address_client`).
#[inline(always)]
fn choose(pkt: &Packet, frontend: &FrontendValue) -> Decision<([u32; 4], u16)> {
    if pkt.is_v6() {
        choose_in::<ip_family::V6>(pkt, frontend)
    } else {
        choose_in::<ip_family::V4>(pkt, frontend)
    }
}

#[inline(always)]
fn choose_in<F: FamilyMaps>(pkt: &Packet, frontend: &FrontendValue) -> Decision<([u32; 4], u16)> {
    let hash = || {
        let ports = (u32::from(pkt.sport) << 16) | u32::from(pkt.dport);
        Some(flow_hash(&pkt.src, &pkt.dst, ports, pkt.proto))
    };
    let client = || address_client(&pkt.src, F::V6);
    match select_backend(frontend, client, hash, None, F::backend_map()) {
        Decision::Backend(b, chosen) => Decision::Backend(F::backend_addr(&b), chosen),
        Decision::Kept(b) => Decision::Backend(F::backend_addr(&b), Chosen::Affinity),
        Decision::NoBackends => Decision::NoBackends,
        Decision::BackendMissing => Decision::BackendMissing,
    }
}

/// The address to source-NAT a new flow to, if any. kube-proxy masquerades all external
/// traffic with `externalTrafficPolicy: Cluster` (KUBE-EXT → KUBE-MARK-MASQ) and none with
/// `Local`; a ClusterIP reached from outside is masqueraded by the KUBE-SVC rule only with
/// masqueradeAll or when the client is outside the cluster CIDR. The address is the egress
/// interface's (`egress`, from `route_to_backend`) as MASQUERADE picks it, else — a route
/// through an interface that is not external, or one without an address of the family — the
/// node's SNAT address. The flag tests stay here: moved into a `proxy-common` function, in
/// three shapes, they compiled to a read of a register a call had clobbered, which the
/// verifier rejects.
#[inline(always)]
fn snat_address(pkt: &Packet, frontend: &FrontendValue, egress: &[u32; 4]) -> Option<[u32; 4]> {
    let config: NodeConfig = *KPR_NODE_CONFIG.get(0)?;
    if !lookup::masquerades(frontend.flags, config.flags, || {
        lookup::outside_cluster_cidr(&pkt.src, pkt.is_v6(), &config)
    }) {
        return None;
    }
    let addr = if *egress != [0; 4] {
        *egress
    } else if pkt.is_v6() {
        config.snat6
    } else {
        [config.snat4, 0, 0, 0]
    };
    // No node address of this family: translate without SNAT rather than not at all.
    (addr != [0; 4]).then_some(addr)
}

/// An internal frontend (a pod's packet, host-namespace-only socket LB) is not masqueraded, as
/// kube-proxy's KUBE-SVC chain does not masquerade pod traffic — except a pod sent to itself
/// (kube-proxy's KUBE-SEP `-s <endpoint> -j KUBE-MARK-MASQ`): its reply would otherwise stay
/// inside the pod, never reaching this program to be translated back.
#[inline(always)]
fn hairpin_snat(pkt: &Packet, backend: &[u32; 4]) -> Option<[u32; 4]> {
    if *backend != pkt.src {
        return None;
    }
    let config = KPR_NODE_CONFIG.get(0)?;
    let addr = if pkt.is_v6() {
        config.snat6
    } else {
        [config.snat4, 0, 0, 0]
    };
    (addr != [0; 4]).then_some(addr)
}
