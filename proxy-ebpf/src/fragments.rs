//! IP fragments of translated flows. Only a datagram's first fragment carries the L4 header,
//! so the programs remember its ports by the datagram's identity (addresses, protocol, IP ID:
//! what the receiver reassembles by) and give the later fragments the same translation, as
//! Cilium's fragment map does; netfilter reassembles before NAT instead. Every program records
//! the first fragments it parses: ingress under the tuple as it arrives, egress under the tuple
//! ingress left (the kernel, where its conntrack reassembles, fragments again on the way out,
//! first fragment first).
//!
//! A later fragment whose first fragment was not seen here (reordered in front of it, or the
//! first one lost) cannot be matched to a flow: it goes to the stack as it is and is counted
//! (`tc_fragment_untracked`); the datagram is lost either way, never delivered elsewhere.

use aya_ebpf::{macros::map, maps::LruHashMap, programs::TcContext};
use proxy_common::{StatIndex, family};

use crate::{maps::scratch, parse::ETH_HLEN, stats::bump};

/// A datagram: its addresses, IP ID and protocol (IPv4 in word 0 of the addresses; the IPv4 ID
/// is 16 bits, IPv6's 32).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FragKey {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub id: u32,
    pub proto: u8,
    pub family: u8,
    pub _pad: u16,
}

/// The first fragment's ports, network byte order: source in the low half as loaded.
#[map]
static KPR_FRAGMENTS: LruHashMap<FragKey, u32> = LruHashMap::with_max_entries(8_192, 0);

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

/// Remembers the ports of a first fragment whose L4 header is at `l4`.
// Not inlined: every program parses, and the fragment paths are rare.
#[inline(never)]
#[expect(
    clippy::needless_borrows_for_generic_args,
    reason = "the key by reference: by value it would be copied onto this frame's stack"
)]
pub fn first<const V6: bool>(ctx: &TcContext, id: u32, proto: u8, l4: usize) {
    // Source in the low half, as loaded.
    let Ok(ports) = ctx.load::<u32>(l4) else {
        return;
    };
    if let Some(key) = key::<V6>(ctx, id, proto) {
        // SAFETY: the key lives in the scratch slot until the program ends.
        let _ = KPR_FRAGMENTS.insert(unsafe { &*key }, ports, 0);
    }
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
