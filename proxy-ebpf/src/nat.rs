//! Applying a conntrack translation to a packet and sending it on.
//!
//! Forwarding: after the rewrite the packet is redirected with `bpf_redirect_neigh` to the
//! interface `bpf_fib_lookup` names for its new destination, bypassing the host stack.
//! `TC_ACT_OK` (let the kernel route) does not work here: a source-NATed packet carries a
//! node address as its source and arrives on a node interface, which the kernel drops as a
//! martian; the same happens to replies whose new source is a local NodePort/ClusterIP
//! address. Bypassing the stack also keeps the kernel's own conntrack from seeing half of a
//! translated flow (it would mark the other half INVALID). When the fib lookup finds no
//! forwarding route (the backend is the node itself, or forwarding is off) the packet goes up
//! the stack with `TC_ACT_OK`.

use core::{mem, ptr};

use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_fib_lookup as FibLookup,
    bindings::{BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_fib_lookup, bpf_redirect_neigh},
    programs::TcContext,
};
use proxy_common::{CtValue, StatIndex, family, proto};

use crate::{
    csum::{replace_addr, replace_port},
    maps::KPR_TC_SCRATCH,
    parse::Packet,
    sctp,
    stats::bump,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Rewrites `pkt` to the tuple in `to` (only the fields that differ), checksums included.
#[inline(always)]
fn rewrite(ctx: &TcContext, pkt: &Packet, to: &CtValue) -> Result<(), i64> {
    if to.src != pkt.src {
        replace_addr(ctx, pkt, pkt.src_offset(), &pkt.src, &to.src)?;
    }
    if to.dst != pkt.dst {
        replace_addr(ctx, pkt, pkt.dst_offset(), &pkt.dst, &to.dst)?;
    }
    if pkt.proto == proto::SCTP {
        return sctp::replace_ports(ctx, pkt, to.sport, to.dport);
    }
    if to.sport != pkt.sport {
        replace_port(ctx, pkt, pkt.l4, pkt.sport, to.sport)?;
    }
    if to.dport != pkt.dport {
        replace_port(ctx, pkt, pkt.l4 + 2, pkt.dport, to.dport)?;
    }
    Ok(())
}

/// Rewrites the packet, counts it under `stat` and forwards it; drops it if the rewrite fails
/// (a half-rewritten packet must not leave).
// Not inlined, for the stack: see `icmp::reject`.
#[inline(never)]
pub fn translate(ctx: &TcContext, pkt: &Packet, to: &CtValue, stat: StatIndex) -> i32 {
    if rewrite(ctx, pkt, to).is_err() {
        bump(StatIndex::TcRewriteFailed);
        return TC_ACT_SHOT;
    }
    bump(stat);
    forward(ctx, pkt, to)
}

#[inline(always)]
fn forward(ctx: &TcContext, pkt: &Packet, to: &CtValue) -> i32 {
    let Some(scratch) = KPR_TC_SCRATCH.get_ptr_mut(0) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: the per-CPU slot is ours until the program ends; `fib` is only used here.
    let params: &mut FibLookup = unsafe { &mut (*scratch).fib };
    // SAFETY: an all-zero bpf_fib_lookup is a valid (empty) query.
    *params = unsafe { mem::zeroed() };
    params.family = if pkt.family == family::V6 {
        AF_INET6
    } else {
        AF_INET
    };
    params.l4_protocol = pkt.proto;
    params.sport = to.sport;
    params.dport = to.dport;
    // SAFETY: the context pointer is the program's own __sk_buff.
    params.ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    if pkt.family == family::V6 {
        params.__bindgen_anon_3.ipv6_src = to.src;
        params.__bindgen_anon_4.ipv6_dst = to.dst;
    } else {
        params.__bindgen_anon_3.ipv4_src = to.src[0];
        params.__bindgen_anon_4.ipv4_dst = to.dst[0];
    }
    // SAFETY: params is a stack value of the size passed.
    let ret =
        unsafe { bpf_fib_lookup(ctx.as_ptr(), params, mem::size_of::<FibLookup>() as i32, 0) };
    if ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) || ret == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        // SAFETY: no neighbour parameters: the kernel resolves the next hop itself.
        return unsafe { bpf_redirect_neigh(params.ifindex, ptr::null_mut(), 0, 0) } as i32;
    }
    bump(StatIndex::TcPassedToStack);
    TC_ACT_OK
}
