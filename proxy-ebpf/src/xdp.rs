//! The XDP programs of the external interfaces (`--bpf-xdp`): packets of fast-path flows
//! translated in the driver, before the kernel builds an skb, and redirected to their next
//! hop; everything else goes on to the tc program (`XDP_PASS`), which does what it did without
//! XDP.
//!
//! What XDP takes: a whole (not an IP fragment) TCP or UDP packet of a flow in the tc conntrack (`KPR_CT4/6`, shared
//! with tc, so a flow moves between the two at any packet) that takes the fast path
//! (`node_flags::FAST_PATH`, or a `ct_flags::BYPASS` flow): a client's packet to its backend,
//! or a backend's reply to its client, whose next hop the fib lookup resolves to an interface
//! in `KPR_XDP_TARGETS` (the interfaces running this program). And on the fast path the first
//! packet of a new flow to an external frontend: `first_packet` (a program per family,
//! tail-called, as tc's are) runs tc's own `new_flow` on it — source ranges, eTP Local, backend
//! choice, affinity, Maglev, SNAT port, both conntrack entries — and sends it on as a later
//! packet. Left to tc:
//! - what `new_flow` does not translate: REJECT (tc answers it), a TCP segment other than a
//!   SYN without an entry (tc recovers evicted flows); and the netfilter path (the default),
//!   whose translation is split around the host's FORWARD and POSTROUTING, which need the
//!   skb: there XDP only makes the drops tc makes before any NAT (source ranges, eTP Local);
//! - a new flow whose client is routed back by another interface than the one it came in on
//!   (several uplinks; a VLAN device whose tag the NIC stripped, which XDP cannot see): tc
//!   starts it where the stack delivers it;
//! - next hops XDP cannot redirect to: a local pod's veth (its peer in the pod takes XDP frames
//!   only with NAPI on, which the agent cannot see), the node itself, a neighbour not resolved
//!   yet (tc's `bpf_redirect_neigh` resolves it);
//! - IP fragments, ICMP errors, SCTP (CRC32c update), VLAN-tagged frames, flows the kernel's
//!   conntrack NATs (adopted), and packets whose L4 checksum is only the pseudo-header sum
//!   (`CHECKSUM_PARTIAL`, sent by a local stack over veth: the incremental update below
//!   assumes a complete checksum, as every packet from a wire has).
//!
//! Checksums are updated here by RFC 1624 arithmetic (XDP has no `bpf_l3/l4_csum_replace`).
//!
//! The programs are multi-buffer (`xdp.frags`, see `main.rs`): on an interface whose MTU does
//! not fit a page (jumbo frames), a frame may come in several buffers, and direct packet
//! access (`data`..`data_end`) covers only the first. Everything read or written here is a
//! header (Ethernet, IP, the L4 header up to its checksum), which `parse_whole` requires in
//! that first buffer (a frame whose headers are not there is tc's); lengths come from the IP
//! header or `bpf_xdp_get_buff_len`, never from `data_end`. The incremental checksum updates
//! need nothing of the payload, wherever it is. A redirect takes the frame with all its
//! buffers: a veth target transmits multi-buffer frames (`NETDEV_XDP_ACT_NDO_XMIT_SG`, which
//! veth has whenever it takes redirected frames at all); a target whose driver does not fails
//! the redirect of one, and the frame is dropped (docs/xdp.md, known limits).

use core::mem;

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibLookup,
        xdp_action::{XDP_DROP, XDP_PASS, XDP_REDIRECT},
    },
    helpers::{bpf_fib_lookup, bpf_xdp_get_buff_len},
    programs::XdpContext,
};
use proxy_common::{
    CtValue, NextHop, StatIndex, TrafficDirection, TrafficEvent, ct_flags, frontend_flags, proto,
};

use crate::{
    clock,
    conntrack::{self, View},
    csum::{add_words, fold, store, sum_port, sum_word},
    maps::{
        KPR_ROUTE_GENERATION, KPR_SNAT_IFACES, KPR_XDP_NEW_FLOW_FRAGS, KPR_XDP_TARGETS, scratch,
    },
    nat::{self, draining, fast_path, fib_query, fib_query_addrs},
    parse::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6, Frame, Packet, linear_at, load, parse_whole},
    port_filter,
    stats::bump,
    tc::{DROP, Verdict, external_frontend, new_flow, source_allowed},
    traffic,
};

/// Offset of the IPv4 header checksum.
const IPV4_CSUM: usize = ETH_HLEN + 10;

/// `kpr_xdp_external`: one program for both families (the established path is small); a new
/// flow's first packet goes on to its family's `first_packet` program.
pub fn external(ctx: &XdpContext) -> u32 {
    let Some(eth) = linear_at(ctx, 0, ETH_HLEN) else {
        return XDP_PASS;
    };
    // SAFETY: the Ethernet header is checked (`linear_at`); unaligned, as in `parse`.
    let ethertype = u16::from_be(unsafe { core::ptr::read_unaligned((eth + 12) as *const u16) });
    let v6 = match ethertype {
        ETH_P_IP => false,
        ETH_P_IPV6 => true,
        _ => return XDP_PASS,
    };
    // Not a Service flow's: tc's entry program passes it on the same way.
    if port_filter::ingress_passes(ctx, v6) {
        return XDP_PASS;
    }
    if v6 {
        established::<true>(ctx)
    } else {
        established::<false>(ctx)
    }
}

#[inline(always)]
fn established<const V6: bool>(ctx: &XdpContext) -> u32 {
    let Some(pkt) = parse_whole::<V6>(ctx) else {
        return XDP_PASS;
    };
    // What tc drops first (`tc::service`: no flow of a neighbour's to the node's loopback
    // addresses), before the conntrack lookup as there.
    if pkt.loopback_destination() {
        bump(StatIndex::XdpDroppedLoopback);
        return XDP_DROP;
    }
    let Some(scratch) = scratch() else {
        return XDP_PASS;
    };
    // SAFETY: the per-CPU slot is ours until the program ends (see `KPR_TC_SCRATCH`).
    let key = unsafe { &mut (*scratch).flow_key };
    pkt.write_ct_key(key);
    let Some(value) = conntrack::lookup::<V6>(key, View::A) else {
        // Only a SYN starts a TCP flow (`first_packet` passes any other segment): the node's
        // own established connections pay no more than this lookup.
        if pkt.proto == proto::TCP && !pkt.opens() {
            return XDP_PASS;
        }
        return hand_to_first_packet::<V6>(ctx);
    };
    let now = clock::now_ns();
    let reply = value.flags & ct_flags::REPLY != 0;
    if !reply && value.flags & ct_flags::KERNEL_NAT == 0 && !conntrack::carries(value, pkt, now) {
        // A flow that starts over (its entry expired, or a SYN on a closing one) chooses its
        // backend again, as in tc.
        return hand_to_first_packet::<V6>(ctx);
    }
    if (!fast_path() && value.flags & ct_flags::BYPASS == 0)
        || (!reply && value.flags & ct_flags::KERNEL_NAT != 0)
    {
        return XDP_PASS;
    }
    if checksum_partial::<V6>(ctx, pkt) {
        bump(StatIndex::XdpPassedChecksumPartial);
        return XDP_PASS;
    }
    // Where it goes, before anything changes: what XDP cannot send on, tc gets as it came.
    let Some(ip_len) = next_hop(ctx, pkt, value) else {
        bump(StatIndex::XdpPassedToTc);
        return XDP_PASS;
    };
    // The conntrack state as tc keeps it.
    if reply {
        if conntrack::reply_seen::<V6>(key, value, pkt, now) {
            bump(StatIndex::TcForwardRebuilt);
        }
    } else {
        conntrack::touch::<V6>(key, value, pkt, now);
    }
    // Counted as tc counts it (a packet XDP sends on never reaches tc).
    count(
        ctx,
        ip_len,
        value.service_id,
        if reply {
            TrafficDirection::Reply
        } else {
            TrafficDirection::Forward
        },
    );
    if rewrite(ctx, pkt, value).is_none() {
        bump(StatIndex::XdpRewriteFailed);
        return XDP_DROP;
    }
    bump(if reply {
        StatIndex::XdpReplyTranslated
    } else {
        StatIndex::XdpEstablished
    });
    XDP_REDIRECT
}

/// Claims `target` for this packet's redirect (`bpf_redirect_map`: the kernel sends the frame
/// there once the program returns `XDP_REDIRECT`, whatever it wrote meanwhile); whether the
/// interface is in `KPR_XDP_TARGETS`. One lookup where a check and the redirect took two: on a
/// miss the frame is left untouched, for tc. A claim the program then does not use (the
/// rewrite failed: `XDP_DROP`) is never read: the kernel reads it only after a program returns
/// `XDP_REDIRECT`, and every such return here follows its own claim.
#[inline(always)]
fn claim_redirect(target: u32) -> bool {
    KPR_XDP_TARGETS.redirect(target, u64::from(XDP_PASS)) == Ok(XDP_REDIRECT)
}

/// Counts a packet XDP translates, as `traffic::count_tc_packet` does in tc: one packet (XDP
/// sees no GRO), its IP bytes; service id 0: not counted. `ip_len` is the IP header's length
/// of the packet, as `next_hop` read it. Not inlined, for the verifier (see there).
#[inline(never)]
fn count(ctx: &XdpContext, ip_len: u32, service_id: u32, direction: TrafficDirection) {
    if service_id == 0 {
        return;
    }
    let bytes =
        u32::try_from(frame_len(ctx, ip_len).saturating_sub(ETH_HLEN as u64)).unwrap_or(u32::MAX);
    traffic::count_packet(service_id, direction, 1, bytes);
}

/// The frame's length across all its buffers, as tc's `skb->len` is. `data_end` ends the
/// first buffer (multi-buffer): when the IP packet ends inside it, that buffer is the frame (a
/// driver starts a later buffer only for bytes the first could not hold, and a frame has
/// nothing after its IP packet but the Ethernet padding, which a short frame keeps in its one
/// buffer). Only a frame whose IP packet goes on in later buffers is measured by
/// `bpf_xdp_get_buff_len`: a helper call is tens of nanoseconds on a CPU that returns through
/// a mitigation thunk, a twentieth of the established path.
#[inline(always)]
fn frame_len(ctx: &XdpContext, ip_len: u32) -> u64 {
    let first = ctx.data_end().saturating_sub(ctx.data()) as u64;
    if ETH_HLEN as u64 + u64::from(ip_len) <= first {
        first
    } else {
        // SAFETY: the context pointer is the program's own xdp_md.
        unsafe { bpf_xdp_get_buff_len(ctx.ctx) }
    }
}

/// The IP packet's length from its header: IPv4's total length, or IPv6's payload length
/// after its fixed header (not wrapped at 16 bits: a payload near 64 KiB is longer than any
/// MTU, not shorter).
#[inline(always)]
fn ip_length(ctx: &XdpContext, v6: bool) -> Option<u32> {
    Some(if v6 {
        u32::from(u16::from_be(load::<u16, _>(ctx, ETH_HLEN + 4)?)) + 40
    } else {
        u32::from(u16::from_be(load::<u16, _>(ctx, ETH_HLEN + 2)?))
    })
}

/// Tail-calls the family's `first_packet` program (`KPR_XDP_NEW_FLOW_FRAGS`); to tc, counted as a
/// missing program, if its slot is empty.
#[inline(always)]
fn hand_to_first_packet<const V6: bool>(ctx: &XdpContext) -> u32 {
    // SAFETY: the slots hold this object's XDP programs; on success this never returns.
    unsafe { KPR_XDP_NEW_FLOW_FRAGS.tail_call(ctx, u32::from(V6)) };
    bump(StatIndex::TcFamilyProgramMissing);
    XDP_PASS
}

/// `kpr_xdp_new_flow4/6`: a packet without a (live) conntrack entry. To an external frontend
/// (exact address, else the NodePort wildcard at a node address), on the fast path, it starts
/// its flow here with tc's own `new_flow` (the same checks and choices, the same entries) and
/// is translated and redirected as a later packet would be; one that `new_flow` does not
/// translate (REJECT, a stray TCP segment) goes on to tc unchanged, which decides it again. On the
/// netfilter path only the drops tc makes before any NAT are made here (a client outside the
/// frontend's `loadBalancerSourceRanges`, a frontend whose endpoints are all on other nodes
/// with `externalTrafficPolicy: Local`), so a flood of those never costs an skb. As in tc, a
/// TCP segment other than a SYN is never dropped for them (the stack answers a stray segment),
/// and nothing while the node drains to the iptables mode (their rules decide).
pub fn first_packet<const V6: bool>(ctx: &XdpContext) -> u32 {
    let Some(pkt) = parse_whole::<V6>(ctx) else {
        return XDP_PASS;
    };
    if draining() || (pkt.proto == proto::TCP && !pkt.opens()) {
        return XDP_PASS;
    }
    let Some(frontend) = external_frontend::<V6>(pkt) else {
        return XDP_PASS;
    };
    if frontend.flags & frontend_flags::SOURCE_RANGES != 0 && !source_allowed(pkt, &frontend) {
        bump(StatIndex::XdpDroppedSourceRange);
        traffic::count(frontend.service_id, TrafficEvent::DroppedSourceRange);
        return XDP_DROP;
    }
    if frontend.backend_count == 0 && frontend.flags & frontend_flags::DROP_NO_BACKENDS != 0 {
        bump(StatIndex::XdpDroppedNoLocal);
        traffic::count(frontend.service_id, TrafficEvent::DroppedNoLocal);
        return XDP_DROP;
    }
    if !fast_path() || frontend.backend_count == 0 || !takes_first_packet::<V6>(ctx, pkt) {
        return XDP_PASS;
    }
    match new_flow::<V6, _>(ctx, pkt, &frontend, false) {
        Verdict::Translate => {
            // Here, whoever sends the packet on: tc finds the flow's entries written.
            traffic::count_new_flow_endpoint(pkt, frontend.service_id);
            send_first_packet(ctx, pkt)
        }
        Verdict::Action(DROP) => XDP_DROP,
        Verdict::Action(_) | Verdict::Reject => XDP_PASS,
    }
}

/// Whether XDP can finish a new flow's first packet (see `checksum_partial` and
/// `returns_by_ingress`); counted if not. A call of its own, like `send_first_packet`: their
/// locals would otherwise sit in `first_packet`'s frame under `new_flow`'s, past the
/// verifier's 512-byte combined stack.
#[inline(never)]
fn takes_first_packet<const V6: bool>(ctx: &XdpContext, pkt: &Packet) -> bool {
    if checksum_partial::<V6>(ctx, pkt) {
        bump(StatIndex::XdpPassedChecksumPartial);
        return false;
    }
    if !returns_by_ingress(ctx, pkt) {
        bump(StatIndex::XdpPassedReturnRoute);
        return false;
    }
    true
}

/// Sends a new flow's first packet on as a later packet of its flow: to the forward tuple
/// `new_flow` left in the scratch slot, redirected to its next hop; to tc, which follows the
/// entries now written, where XDP cannot send it.
#[inline(never)]
fn send_first_packet(ctx: &XdpContext, pkt: &Packet) -> u32 {
    let Some(scratch) = scratch() else {
        return XDP_PASS;
    };
    // SAFETY: the per-CPU slot is ours until the program ends; `new_flow` left the flow's
    // forward tuple in `forward`, which `next_hop` and `rewrite` only read (they write `fib`).
    let forward = unsafe { &(*scratch).forward };
    // The flow's entries are written: a packet XDP cannot send on is tc's later packet.
    let Some(ip_len) = next_hop(ctx, pkt, forward) else {
        bump(StatIndex::XdpPassedToTc);
        return XDP_PASS;
    };
    count(ctx, ip_len, forward.service_id, TrafficDirection::Forward);
    if rewrite(ctx, pkt, forward).is_none() {
        bump(StatIndex::XdpRewriteFailed);
        return XDP_DROP;
    }
    bump(StatIndex::XdpTranslated);
    XDP_REDIRECT
}

/// Whether the route back to the client (from the frontend, as its replies will leave) goes
/// out of the interface its packet came in on. A new flow's reply entry records that interface
/// for its replies (`tc::record_client_interface`): right for a client the node routes there,
/// wrong for one whose packets came through a VLAN device stacked on this interface with the
/// tag stripped by the NIC (XDP sees the parent; the stack would deliver it to the VLAN
/// device, whose tc program records that). Such flows, and those of clients routed by another
/// uplink, are left to tc. A fib lookup of the kind the stack would do for a packet to the
/// client arriving here (forwarding on, as NodePorts need).
#[inline(always)]
fn returns_by_ingress(ctx: &XdpContext, pkt: &Packet) -> bool {
    let Some(scratch) = scratch() else {
        return false;
    };
    // SAFETY: the per-CPU slot is ours until the program ends; `fib` is rewritten by every
    // lookup that uses it.
    let params: &mut FibLookup = unsafe { &mut (*scratch).fib };
    let ingress = Frame::ingress_ifindex(ctx);
    fib_query_addrs(params, pkt.family, pkt.proto, &pkt.dst, &pkt.src, ingress);
    params.sport = pkt.dport;
    params.dport = pkt.sport;
    // SAFETY: params is a scratch value of the size passed.
    let ret =
        unsafe { bpf_fib_lookup(ctx.as_ptr(), params, mem::size_of::<FibLookup>() as i32, 0) };
    (ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) || ret == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH))
        && params.ifindex == ingress
}

/// Whether the L4 checksum field holds the pseudo-header sum alone (`CHECKSUM_PARTIAL`: the
/// sender left the rest to a device that would sum the packet, as a local stack does over
/// veth) rather than a complete checksum. A complete one equals it by chance once in 65536
/// packets, which then only take the tc path.
#[inline(always)]
fn checksum_partial<const V6: bool>(ctx: &XdpContext, pkt: &Packet) -> bool {
    let Some(field) = load::<u16, _>(ctx, pkt.l4_csum_offset()) else {
        return false;
    };
    // IPv4: total length minus the header; IPv6: payload length minus what precedes the L4
    // header after the fixed header. From the IP header, so the whole packet's also when it
    // spans several buffers.
    let length = if V6 {
        load::<u16, _>(ctx, ETH_HLEN + 4)
            .map(|len| u16::from_be(len).wrapping_sub((pkt.l4 - ETH_HLEN - 40) as u16))
    } else {
        load::<u16, _>(ctx, ETH_HLEN + 2)
            .map(|len| u16::from_be(len).wrapping_sub((pkt.l4 - ETH_HLEN) as u16))
    };
    let Some(length) = length else {
        return false;
    };
    // The pseudo-header (addresses, protocol, L4 length), summed as `add_words` does: native
    // loads of network-order words, so the folded sum compares with the field as loaded.
    let sum = u32::from(u16::from(pkt.proto).to_be()) + u32::from(length.to_be());
    let sum = add_words(add_words(sum, &pkt.src), &pkt.dst);
    // `fold` complements; the field of a partial checksum holds the sum itself.
    field == !fold(sum)
}

/// Finds the interface the translated packet leaves by and claims the redirect there
/// (`claim_redirect`), with the MACs for it in the scratch slot's fib parameters: the next hop
/// the flow's conntrack entry keeps while valid (as tc's fast path, `nat::next_hop`), else the
/// fib lookup's (only `SUCCESS`, a resolved neighbour), which the entry then keeps; or for a
/// reply whose route leaves elsewhere the interface its client's packets come in on (as
/// `nat::leave_by_ingress`). `None` (nothing claimed) unless it is in `KPR_XDP_TARGETS`;
/// else the IP packet's length (`ip_length`), which `count` needs too.
#[inline(always)]
fn next_hop(ctx: &XdpContext, pkt: &Packet, to: &CtValue) -> Option<u32> {
    let scratch = scratch()?;
    // SAFETY: the per-CPU slot is ours until the program ends; `fib` is only used here and by
    // `rewrite`, after this.
    let params: &mut FibLookup = unsafe { &mut (*scratch).fib };
    // With the packet's length the lookup checks the next hop's MTU (XDP frames are never
    // aggregates): one too big is tc's, which answers it as a router would. The IP header's
    // length, not the first buffer's (a jumbo frame's spans several).
    let ip_len = ip_length(ctx, pkt.is_v6())?;
    let length = u16::try_from(ip_len).unwrap_or(u16::MAX);
    let generation = KPR_ROUTE_GENERATION.get(0).copied().unwrap_or(0);
    let hop = &to.next_hop;
    let mut target = if hop.kept_under(generation, to.last_seen_ns) && length <= hop.mtu {
        params.dmac = hop.dmac;
        params.smac = hop.smac;
        hop.ifindex
    } else {
        bump(StatIndex::TcNextHopLookedUp);
        // SAFETY: the context pointer is the program's own xdp_md.
        fib_query(params, pkt.family, pkt.proto, to, unsafe {
            (*ctx.ctx).ingress_ifindex
        });
        params.__bindgen_anon_1.tot_len = length;
        // SAFETY: params is a scratch value of the size passed.
        let ret =
            unsafe { bpf_fib_lookup(ctx.as_ptr(), params, mem::size_of::<FibLookup>() as i32, 0) };
        if ret != i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
            return None;
        }
        // A successful lookup with `tot_len` reports no MTU: the length that passed is what
        // the entry knows fits (a longer packet is looked up again).
        nat::keep_next_hop(
            pkt,
            params.ifindex,
            length,
            generation,
            NextHop::epoch_of(to.last_seen_ns),
        );
        params.ifindex
    };
    if to.out_ifindex != 0 && to.out_ifindex != target {
        // SAFETY: the value is plain bytes, read in place; the agent writes whole values.
        let own = unsafe { KPR_SNAT_IFACES.get(to.out_ifindex) }?;
        if own.mac == [0; 6] {
            return None;
        }
        params.smac = own.mac;
        params.dmac = to.out_mac;
        target = to.out_ifindex;
        bump(StatIndex::TcReplyViaIngress);
    }
    claim_redirect(target).then_some(ip_len)
}

/// Rewrites `pkt` to the tuple in `to` (both halves, as tc's fast path), checksums by RFC 1624,
/// and the MACs `next_hop` left in the scratch slot. `None`: a header was not where `parse`
/// found it (not seen).
#[inline(always)]
fn rewrite(ctx: &XdpContext, pkt: &Packet, to: &CtValue) -> Option<()> {
    let l4_csum = pkt.l4_csum_offset();
    let old_l4 = load::<u16, _>(ctx, l4_csum)?;
    // UDP over IPv4 may carry checksum 0 ("none"): it stays so. Over IPv6 it is invalid, yet
    // left as it is too, as tc's `BPF_F_MARK_MANGLED_0` leaves it (the receiver drops it
    // either way).
    let l4_none = pkt.proto == proto::UDP && old_l4 == 0;
    let mut l4 = u32::from(!old_l4);
    let words = if pkt.is_v6() { 4 } else { 1 };
    let mut i = 0;
    while i < words {
        l4 = sum_word(l4, pkt.src[i], to.src[i]);
        l4 = sum_word(l4, pkt.dst[i], to.dst[i]);
        i += 1;
    }
    if !pkt.is_v6() {
        let old_ip = load::<u16, _>(ctx, IPV4_CSUM)?;
        let mut ip = u32::from(!old_ip);
        ip = sum_word(ip, pkt.src[0], to.src[0]);
        ip = sum_word(ip, pkt.dst[0], to.dst[0]);
        store(ctx, IPV4_CSUM, &fold(ip))?;
        store(ctx, pkt.src_offset(), &to.src[0])?;
        store(ctx, pkt.dst_offset(), &to.dst[0])?;
    } else {
        store(ctx, pkt.src_offset(), &to.src)?;
        store(ctx, pkt.dst_offset(), &to.dst)?;
    }
    l4 = sum_port(l4, pkt.sport, to.sport);
    l4 = sum_port(l4, pkt.dport, to.dport);
    store(ctx, pkt.l4, &to.sport)?;
    store(ctx, pkt.l4 + 2, &to.dport)?;
    if !l4_none {
        let mut check = fold(l4);
        // A computed 0 is sent as 0xffff for UDP (0 means "no checksum").
        if check == 0 && pkt.proto == proto::UDP {
            check = 0xffff;
        }
        store(ctx, l4_csum, &check)?;
    }
    let scratch = scratch()?;
    // SAFETY: the per-CPU slot is ours until the program ends; `next_hop` filled `fib`.
    let (dmac, smac) = unsafe { ((*scratch).fib.dmac, (*scratch).fib.smac) };
    store(ctx, 0, &dmac)?;
    store(ctx, 6, &smac)?;
    Some(())
}
