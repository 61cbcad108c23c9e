//! Applying a conntrack translation to a packet and sending it on. Two paths:
//!
//! - The netfilter path (default): ingress rewrites only the destination half of the
//!   translation (DNAT of a new or forward packet, the un-SNAT of a reply) and returns the
//!   packet to the stack, which routes it through the host's netfilter PREROUTING, FORWARD and
//!   POSTROUTING exactly as kube-proxy's iptables mode would (a CNI's FORWARD policy sees the
//!   real client and the backend). The source half (SNAT of a forward packet, the frontend
//!   address on a reply) is done by the egress program on the interface the stack chose, after
//!   POSTROUTING (`translate_source`), like kube-proxy's MASQUERADE. Rewriting the source at
//!   ingress is what made the stack drop these packets before: a packet arriving with a local
//!   address as its source is a martian (`fib_validate_source`), whether it is a SNATed
//!   forward packet or a reply whose source became a NodePort/ClusterIP address. Split this
//!   way, every packet the stack sees carries a client or a backend address, and the kernel's
//!   own conntrack sees one consistent flow (client ↔ backend). The host must forward
//!   (`net.ipv4.ip_forward`/`net.ipv6.conf.all.forwarding`), as kube-proxy requires.
//! - The fast path (`node_flags::FAST_PATH`, `--tc-fast-path`): both halves at ingress, then a
//!   redirect to the interface `bpf_fib_lookup` names for the new destination, with the next
//!   hop's MACs it resolved (`bpf_redirect_neigh` while it resolves none), bypassing the host
//!   stack — and with it FORWARD/POSTROUTING, so netfilter policy does not apply. The resolved
//!   next hop is kept in the flow's conntrack entry for its next packets (`next_hop`). When
//!   the fib lookup finds no forwarding route (the backend is the node itself, or forwarding
//!   is off) the packet goes up the stack with `TC_ACT_OK`.
//!
//! On either path a reply whose route leaves by another interface than the one its client's
//! packets come in on (a node with several uplinks, the client reached through the second)
//! leaves by the client's interface instead, to the neighbour the client's packets came from
//! (`leave_by_ingress`): routed by the table, it would reach a network that does not lead back
//! to the client, or one whose filters drop a source address from the other uplink. kube-proxy
//! leaves this to the routing table (policy routing by connmark is the operator's).

use core::{mem, ptr};

use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_fib_lookup as FibLookup,
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC,
    },
    helpers::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh, bpf_skb_vlan_pop},
    programs::TcContext,
};
use proxy_common::{
    CtValue, NextHop, StatIndex, TRANSLATED_MARK, ct_flags, family, node_flags, proto,
};

use crate::{
    conntrack,
    csum::{Rewrite, replace_addr_outside_l4, rewrite_tuple, store},
    icmp,
    maps::{KPR_NODE_CONFIG, KPR_ROUTE_GENERATION, KPR_SNAT_IFACES, scratch},
    parse::{ETH_HLEN, Packet},
    sctp,
    stats::{bump, bump_slot},
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Whether translated packets take the redirect fast path (`node_flags::FAST_PATH`).
#[inline(always)]
pub fn fast_path() -> bool {
    KPR_NODE_CONFIG
        .get(0)
        .is_some_and(|config| config.flags & node_flags::FAST_PATH != 0)
}

/// Whether the node switched to the iptables mode and these programs only drain their flows
/// (`node_flags::DRAINING`).
#[inline(always)]
pub fn draining() -> bool {
    KPR_NODE_CONFIG
        .get(0)
        .is_some_and(|config| config.flags & node_flags::DRAINING != 0)
}

/// Which halves of a translation to apply.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Half {
    Both,
    Destination,
    Source,
}

/// Rewrites `pkt` to the tuple in `to` (only the fields of `half` that differ), checksums
/// included.
#[inline(always)]
fn rewrite(ctx: &TcContext, pkt: &Packet, to: &CtValue, half: Half) -> Result<(), i64> {
    let source = half != Half::Destination;
    let destination = half != Half::Source;
    let new_src = source && to.src != pkt.src;
    let new_dst = destination && to.dst != pkt.dst;
    let sport = if source { to.sport } else { pkt.sport };
    let dport = if destination { to.dport } else { pkt.dport };
    if pkt.later_fragment || pkt.proto == proto::SCTP {
        // Addresses no L4 checksum covers here: a later fragment's ports and checksum are in
        // its first fragment, and SCTP's CRC32c has no pseudo-header.
        if new_src {
            replace_addr_outside_l4(ctx, pkt, pkt.src_offset(), &pkt.src, &to.src)?;
        }
        if new_dst {
            replace_addr_outside_l4(ctx, pkt, pkt.dst_offset(), &pkt.dst, &to.dst)?;
        }
        if pkt.later_fragment {
            return Ok(());
        }
        return sctp::replace_ports(ctx, pkt, sport, dport);
    }
    let rewrite = Rewrite {
        src: &to.src,
        new_src,
        dst: &to.dst,
        new_dst,
        sport,
        dport,
    };
    rewrite_tuple(ctx, pkt, &rewrite)
}

/// [`translate`] to the entry in the scratch slot's `view_a` (where `conntrack::lookup` with
/// `View::A` copies it), counted under `stat`. Every path of a program that translates calls
/// this once, at one place: the verifier walks `translate` (some forty thousand instructions
/// with its callees) once for all of them, as the state it reaches that call with is then the
/// same — the same pointer, and `stat` read back from memory, a value it does not
/// know — where a call for each path, or one with a different pointer or a known counter, was
/// walked once each.
#[inline(always)]
pub fn translate_view(ctx: &TcContext, pkt: &Packet, stat: StatIndex) -> i32 {
    let Some(scratch) = scratch() else {
        bump(StatIndex::TcScratchUnavailable);
        return TC_ACT_SHOT;
    };
    // SAFETY: the per-CPU slot is ours until the program ends; `translate` only reads
    // `view_a` (its callees write `fib`, `hop_key` and `hop`).
    let (to, stat) = unsafe {
        core::ptr::write_volatile(&raw mut (*scratch).translate_stat, stat as u32);
        (
            &(*scratch).view_a,
            core::ptr::read_volatile(&raw const (*scratch).translate_stat),
        )
    };
    translate(ctx, pkt, to, stat)
}

/// Ingress: rewrites the packet, counts it under `stat` (a `StatIndex` slot) and sends it on —
/// the destination half back to the stack (netfilter path), or both halves redirected (fast
/// path); drops it if the rewrite fails (a half-rewritten packet must not leave).
// Not inlined, for the stack: see `icmp::reject`.
#[inline(never)]
fn translate(ctx: &TcContext, pkt: &Packet, to: &CtValue, stat: u32) -> i32 {
    // A flow the kernel's conntrack must not see takes the fast path on either path.
    let fast = fast_path() || to.flags & ct_flags::BYPASS != 0;
    // The route is looked up before the rewrite: a packet too big for the next hop's link is
    // answered as its sender sent it (the quote must be its own packet to match its socket).
    let next = if fast {
        match next_hop(ctx, pkt, to) {
            Next::TooBig(mtu) if pkt.is_v6() || dont_fragment(ctx) => {
                return icmp::too_big(ctx, pkt, mtu);
            }
            Next::TooBig(_) => {
                bump(StatIndex::TcTooBigToStack);
                Next::Stack
            }
            next => next,
        }
    } else {
        Next::Stack
    };
    let half = if fast { Half::Both } else { Half::Destination };
    if rewrite(ctx, pkt, to, half).is_err() {
        bump(StatIndex::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    bump_slot(stat);
    if !fast {
        // SAFETY: the context pointer is the program's own __sk_buff.
        let mark = unsafe { (*ctx.skb.skb).mark };
        ctx.set_mark(mark | TRANSLATED_MARK);
        // The stack routes it (PREROUTING, FORWARD or INPUT, POSTROUTING); the egress
        // program finishes the translation. `TC_ACT_UNSPEC` (`TCX_NEXT`), not `TC_ACT_OK`
        // (`TCX_PASS`, which ends the chain): programs and tc filters behind ours keep seeing
        // the interface's Service traffic, DNATed as a netfilter hook after PREROUTING would.
        return TC_ACT_UNSPEC;
    }
    forward(ctx, to, next)
}

/// IPv4's Don't Fragment bit.
#[inline(always)]
fn dont_fragment(ctx: &TcContext) -> bool {
    ctx.load::<u8>(ETH_HLEN + 6)
        .is_ok_and(|flags| flags & 0x40 != 0)
}

/// Egress (netfilter path): the source half of a translation, on a packet the host has
/// routed and filtered. Drops the packet if the rewrite fails.
#[inline(never)]
pub fn translate_source(ctx: &TcContext, pkt: &Packet, to: &CtValue) -> i32 {
    if rewrite(ctx, pkt, to, Half::Source).is_err() {
        bump(StatIndex::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    bump(StatIndex::TcEgressTranslated);
    // SAFETY: the context pointer is the program's own __sk_buff.
    let via = unsafe { (*ctx.skb.skb).ifindex };
    if let Some(action) = leave_by_ingress(ctx, to, via) {
        return action;
    }
    // As in `translate`: programs behind ours still see the packet.
    TC_ACT_UNSPEC
}

/// A reply (`to` a reply entry with `out_ifindex`) that its route sends out by `via`, another
/// interface than the one its client's packets arrive on, is redirected there instead, to the
/// neighbour those packets came from and from that interface's MAC (`KPR_SNAT_IFACES`).
/// `None`: the route's interface is the client's, or the entry or the interface has no
/// link-layer facts (routing decides, as before).
#[inline(always)]
fn leave_by_ingress(ctx: &TcContext, to: &CtValue, via: u32) -> Option<i32> {
    if to.out_ifindex == 0 || to.out_ifindex == via {
        return None;
    }
    // SAFETY: the value is plain bytes, read in place; the agent writes whole values.
    let own = unsafe { KPR_SNAT_IFACES.get(to.out_ifindex) }?;
    if own.mac == [0; 6] {
        return None;
    }
    // By reference: the MACs go from map memory into the frame without a stack copy.
    if ctx.store(0, &to.out_mac, 0).is_err() || ctx.store(6, &own.mac, 0).is_err() {
        bump(StatIndex::TcRewriteFailed);
        return Some(TC_ACT_SHOT);
    }
    bump(StatIndex::TcReplyViaIngress);
    // SAFETY: plain helper call; the ifindex is the one the client's packet arrived on.
    Some(unsafe { bpf_redirect(to.out_ifindex, 0) } as i32)
}

/// Fills `params` with the fib query for a packet of `family` and L4 `protocol` translated to
/// `to`, arriving on `ifindex` (tc's fast path and XDP alike).
#[inline(always)]
pub fn fib_query(params: &mut FibLookup, family: u8, protocol: u8, to: &CtValue, ifindex: u32) {
    fib_query_addrs(params, family, protocol, &to.src, &to.dst, ifindex);
    params.sport = to.sport;
    params.dport = to.dport;
}

/// Fills `params` with a fib query from `src` to `dst` for a packet of `family` and L4
/// `protocol` arriving on `ifindex`, without ports (the caller sets them).
#[inline(always)]
pub fn fib_query_addrs(
    params: &mut FibLookup,
    family: u8,
    protocol: u8,
    src: &[u32; 4],
    dst: &[u32; 4],
    ifindex: u32,
) {
    // SAFETY: an all-zero bpf_fib_lookup is a valid (empty) query.
    *params = unsafe { mem::zeroed() };
    params.family = if family == family::V6 {
        AF_INET6
    } else {
        AF_INET
    };
    params.l4_protocol = protocol;
    params.ifindex = ifindex;
    if family == family::V6 {
        params.__bindgen_anon_3.ipv6_src = *src;
        params.__bindgen_anon_4.ipv6_dst = *dst;
    } else {
        params.__bindgen_anon_3.ipv4_src = src[0];
        params.__bindgen_anon_4.ipv4_dst = dst[0];
    }
}

/// Where the fast path sends a translated packet.
#[derive(Clone, Copy)]
pub enum Next {
    /// Out of this interface, to the next hop the kernel resolves.
    Redirect(u32),
    /// Out of this interface, to the next hop whose MACs the fib lookup left in the scratch
    /// slot's `fib`.
    Resolved(u32),
    /// The link to the next hop takes at most this many bytes, fewer than the packet has
    /// (checked against the skb's length, so a GRO aggregate the stack would segment passes).
    TooBig(u16),
    /// No forwarding route (the node itself is the destination, or forwarding is off): up the
    /// stack.
    Stack,
}

/// The fast path's route for `pkt` translated to `to`: the next hop the flow's conntrack entry
/// keeps while it is valid ([`NextHop`]: resolved under the node's current route generation,
/// in the epoch of the entry's last packet, and the packet fits the link), else a fib lookup,
/// whose resolved next hop the entry then keeps. So a flow's packets pay the lookup once, and
/// again after a route, rule, neighbour or link change (the agent bumps the generation) and
/// about once a second. Not inlined: `translate`'s own frame stays as small as before, for the
/// chains under it (`icmp::too_big`) that the verifier bounds at 512 bytes of stack.
#[inline(never)]
fn next_hop(ctx: &TcContext, pkt: &Packet, to: &CtValue) -> Next {
    let generation = KPR_ROUTE_GENERATION.get(0).copied().unwrap_or(0);
    let hop = &to.next_hop;
    if hop.kept_under(generation, to.last_seen_ns)
        && fits(ctx, hop.mtu)
        && let Some(scratch) = scratch()
    {
        // Where `forward` takes a lookup's MACs from: one path on from here for both, which
        // keeps the verifier's work (every caller of `translate` is checked apart) as it was.
        // SAFETY: the per-CPU slot is ours until the program ends; `fib` is only used by the
        // route of this packet.
        let params: &mut FibLookup = unsafe { &mut (*scratch).fib };
        params.dmac = hop.dmac;
        params.smac = hop.smac;
        return Next::Resolved(hop.ifindex);
    }
    bump(StatIndex::TcNextHopLookedUp);
    // The generation is read before the lookup: a change the lookup may have missed bumps it
    // past the one kept.
    let next = route(ctx, pkt.family, pkt.proto, to);
    if let Next::Resolved(ifindex) = next {
        // SAFETY: `route` filled `fib`; on SUCCESS of a lookup without `tot_len` the kernel
        // wrote the egress device's MTU into this union member.
        let mtu = scratch().map_or(0, |scratch| unsafe {
            (*scratch).fib.__bindgen_anon_1.mtu_result
        });
        keep_next_hop(
            pkt,
            ifindex,
            mtu,
            generation,
            NextHop::epoch_of(to.last_seen_ns),
        );
    }
    next
}

/// Whether the packet fits a link of `mtu` without the fib lookup's check: as the kernel's
/// `is_skb_forwardable`, its length up to the MTU plus an Ethernet header and a VLAN tag, or
/// any GSO packet (segmented to fit on transmit).
#[inline(always)]
fn fits(ctx: &TcContext, mtu: u16) -> bool {
    // SAFETY: the context pointer is the program's own __sk_buff.
    let (len, gso_size) = unsafe { ((*ctx.skb.skb).len, (*ctx.skb.skb).gso_size) };
    gso_size != 0 || len <= u32::from(mtu) + ETH_HLEN as u32 + VLAN_HLEN
}

/// An 802.1Q tag's length.
const VLAN_HLEN: u32 = 4;

/// Keeps the next hop a fib lookup resolved (its MACs in the scratch slot's `fib`, and `mtu`)
/// in the conntrack entry keyed by `pkt`'s own tuple: the entry its translation came from
/// (tc's fast path and XDP alike). Not inlined: it runs once per flow and route change, and
/// stays off the frame of the packets that skip it.
#[inline(never)]
pub fn keep_next_hop(pkt: &Packet, ifindex: u32, mtu: u16, generation: u32, epoch: u16) {
    let Some(scratch) = scratch() else {
        return;
    };
    // SAFETY: the per-CPU slot is ours until the program ends; `route` filled `fib`, and
    // `hop`/`hop_key` are only used here.
    let (params, hop, key) = unsafe {
        (
            &(*scratch).fib,
            &mut (*scratch).hop,
            &mut (*scratch).hop_key,
        )
    };
    hop.ifindex = ifindex;
    hop.mtu = mtu;
    hop.dmac = params.dmac;
    hop.smac = params.smac;
    hop.epoch = epoch;
    hop.generation = generation;
    pkt.write_ct_key(key);
    let hop: &NextHop = hop;
    if pkt.is_v6() {
        conntrack::keep_next_hop::<true>(key, hop);
    } else {
        conntrack::keep_next_hop::<false>(key, hop);
    }
}

/// The fib lookup of the fast path for a packet of `family` and L4 `protocol` translated to
/// `to`. Not inlined: one copy for the flow's packets and for errors about them.
#[inline(never)]
pub fn route(ctx: &TcContext, family: u8, protocol: u8, to: &CtValue) -> Next {
    let Some(scratch) = scratch() else {
        return Next::Stack;
    };
    // SAFETY: the per-CPU slot is ours until the program ends; `fib` is only used here.
    let params: &mut FibLookup = unsafe { &mut (*scratch).fib };
    // SAFETY: the context pointer is the program's own __sk_buff.
    fib_query(params, family, protocol, to, unsafe {
        (*ctx.skb.skb).ingress_ifindex
    });
    // SAFETY: params is a stack value of the size passed.
    let ret =
        unsafe { bpf_fib_lookup(ctx.as_ptr(), params, mem::size_of::<FibLookup>() as i32, 0) };
    if ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        return Next::Resolved(params.ifindex);
    }
    if ret == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return Next::Redirect(params.ifindex);
    }
    if ret == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) {
        // SAFETY: on FRAG_NEEDED the kernel wrote the MTU into this union member.
        let mtu = unsafe { params.__bindgen_anon_1.mtu_result };
        return Next::TooBig(mtu);
    }
    Next::Stack
}

/// Sends a packet the fast path has translated where [`route`] said.
#[inline(always)]
pub fn forward(ctx: &TcContext, to: &CtValue, next: Next) -> i32 {
    let (ifindex, resolved) = match next {
        Next::Redirect(ifindex) => (ifindex, false),
        Next::Resolved(ifindex) => (ifindex, true),
        Next::TooBig(_) | Next::Stack => {
            bump(StatIndex::TcPassedToStack);
            return TC_ACT_OK;
        }
    };
    // A priority tag (VLAN 0, 802.1p) stripped by the NIC rides in `vlan_tci` and would
    // leave with the packet on the backend's interface: the stack would have dropped it on
    // receive, so it goes here too (other VLANs never get this far, see `tc::service`).
    // SAFETY: the context pointer is the program's own __sk_buff; the helper only clears the
    // skb's out-of-band tag (the program holds no packet pointers it invalidates).
    unsafe {
        if (*ctx.skb.skb).vlan_present != 0 && bpf_skb_vlan_pop(ctx.skb.skb) != 0 {
            bump(StatIndex::TcRewriteFailed);
            return TC_ACT_SHOT;
        }
    }
    if let Some(action) = leave_by_ingress(ctx, to, ifindex) {
        return action;
    }
    if resolved && let Some(action) = redirect_resolved(ctx, ifindex) {
        return action;
    }
    // SAFETY: no neighbour parameters: the kernel resolves the next hop itself.
    unsafe { bpf_redirect_neigh(ifindex, ptr::null_mut(), 0, 0) as i32 }
}

/// Writes the MACs the fib lookup resolved (or the flow's entry kept, [`next_hop`]) and
/// redirects straight to the interface's queue: `bpf_redirect_neigh` would look the same
/// neighbour up again on transmit. A neighbour the kernel no longer holds valid comes back from
/// the lookup as `NO_NEIGH`, and the packet then takes `bpf_redirect_neigh`, which resolves it
/// (as Cilium's fast path does). `None`: the scratch slot is gone, so the kernel resolves it.
#[inline(always)]
fn redirect_resolved(ctx: &TcContext, ifindex: u32) -> Option<i32> {
    let scratch = scratch()?;
    // SAFETY: the per-CPU slot is ours until the program ends; `route` (or `next_hop`) filled
    // the MACs of `fib`.
    let params: &FibLookup = unsafe { &(*scratch).fib };
    if store(ctx, 0, &params.dmac).is_none() || store(ctx, 6, &params.smac).is_none() {
        bump(StatIndex::TcRewriteFailed);
        return Some(TC_ACT_SHOT);
    }
    // SAFETY: plain helper call; the ifindex is the one the fib lookup chose.
    Some(unsafe { bpf_redirect(ifindex, 0) } as i32)
}
