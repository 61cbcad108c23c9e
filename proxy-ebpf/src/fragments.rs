//! IP fragments of translated flows. Only a datagram's first fragment carries the L4 header,
//! so the programs remember its ports by the datagram's identity (addresses, protocol, IP ID:
//! what the receiver reassembles by) and give the later fragments the same translation, as
//! Cilium's fragment map does; netfilter reassembles before NAT instead. A first fragment is
//! remembered only once the program knows it is a flow's: ingress after its conntrack entry
//! or its frontend (a new flow) was found, under the tuple as it arrives; egress for the
//! packets ingress translated, under the tuple ingress left (the kernel, where its conntrack
//! reassembles, fragments again on the way out, first fragment first). The map is an LRU of a
//! few thousand datagrams: first fragments of anything else (anyone can send them, to any
//! address and port) would evict those of Service flows, whose later fragments would then be
//! lost.
//!
//! A later fragment whose first fragment was not remembered here (reordered in front of it,
//! the first one lost, or a datagram of no flow) cannot be matched to a flow: it goes to the
//! stack as it is and is counted (`tc_fragment_untracked`); a flow's datagram is lost either
//! way, never delivered elsewhere.

use aya_ebpf::{macros::map, maps::LruHashMap, programs::TcContext};
use proxy_common::{FragmentKey as FragKey, StatIndex, default_sizes, family};

use crate::{
    maps::scratch,
    packet::{ETH_HLEN, Packet},
    stats::bump,
};

/// The first fragment's ports, network byte order: source in the low half as loaded.
#[map]
static KPR_FRAGMENTS: LruHashMap<FragKey, u32> =
    LruHashMap::with_max_entries(default_sizes::FRAGMENTS, 0);

/// Fills the scratch slot's fragment key from the packet's addresses; `None` if the slot or
/// the packet is unavailable.
#[inline(always)]
fn key<const V6: bool>(ctx: &TcContext, id: u32, proto: u8) -> Option<*mut FragKey> {
    let scratch = scratch()?;
    // SAFETY: the per-CPU slot is ours until the program ends; `frag_key` is used only here.
    let key = unsafe { &mut (*scratch).frag_key };
    if V6 {
        key.src = ctx.load(ETH_HLEN + 8).ok()?;
        key.dst = ctx.load(ETH_HLEN + 24).ok()?;
        key.family = family::V6;
    } else {
        key.src = [ctx.load(ETH_HLEN + 12).ok()?, 0, 0, 0];
        key.dst = [ctx.load(ETH_HLEN + 16).ok()?, 0, 0, 0];
        key.family = family::V4;
    }
    key.id = id;
    key.proto = proto;
    key._pad = 0;
    Some(key)
}

/// Remembers the ports of `pkt`'s datagram if `pkt` is its first fragment (`parse`), under
/// the tuple `pkt` was parsed with. Call it only for a packet of a flow (see the module).
#[inline(always)]
pub fn remember<const V6: bool>(pkt: &Packet) {
    if pkt.first_fragment {
        first::<V6>(pkt);
    }
}

// Not inlined: the fragment paths are rare, and their code is verified once per call site.
#[inline(never)]
fn first<const V6: bool>(pkt: &Packet) {
    let Some(scratch) = scratch() else {
        return;
    };
    // SAFETY: the per-CPU slot is ours until the program ends; `frag_key` is used only here.
    let key = unsafe { &mut (*scratch).frag_key };
    key.src = pkt.src;
    key.dst = pkt.dst;
    key.family = if V6 { family::V6 } else { family::V4 };
    key.id = pkt.fragment_id;
    key.proto = pkt.proto;
    key._pad = 0;
    // Source in the low half, as `later`'s callers split it (the L4 header's first word as
    // loaded).
    let ports = u32::from(pkt.sport) | (u32::from(pkt.dport) << 16);
    let _ = KPR_FRAGMENTS.insert(key, ports, 0);
}

/// The ports of a later fragment's datagram, as its first fragment carried them (source in
/// the low half); 0 if the first fragment was not seen (counted).
#[inline(never)]
#[expect(
    clippy::needless_borrows_for_generic_args,
    reason = "the key by reference: by value it would be copied onto this frame's stack"
)]
pub fn later<const V6: bool>(ctx: &TcContext, id: u32, proto: u8) -> u32 {
    let Some(key) = key::<V6>(ctx, id, proto) else {
        return 0;
    };
    // SAFETY: as above.
    match unsafe { KPR_FRAGMENTS.get(&*key) } {
        Some(ports) if *ports != 0 => *ports,
        _ => {
            bump(StatIndex::TcFragmentUntracked);
            0
        }
    }
}
