//! SCTP port rewrites with the CRC32c updated in constant work (`proxy_common::crc32c`): the
//! XOR of old and new ports, advanced through the packet's length, is XORed into the stored
//! checksum. No pass over the payload, and only the common header is read or written, so
//! non-linear skbs need nothing special (`bpf_skb_load_bytes`/`store_bytes`).
//!
//! An invalid CRC stays invalid by the same error, so the backend's stack drops what it would
//! have dropped untranslated. A `CHECKSUM_PARTIAL` skb (CRC offload, a local SCTP stack over
//! veth) carries no final CRC yet: the XOR lands in a field that is either filled in later from
//! scratch or never checked (the receiver trusts the offload), so it is harmless there too.

use aya_ebpf::{bindings::BPF_F_RECOMPUTE_CSUM, cty::c_long, programs::TcContext};
use proxy_common::crc32c::port_rewrite_delta;

use crate::parse::{ETH_HLEN, Packet};

/// Common header: ports (4), verification tag (4), checksum (4).
const COMMON_HLEN: u16 = 12;
const CRC_OFFSET: usize = 8;
/// `-EINVAL`: a length that cannot be an SCTP packet in this skb.
const EINVAL: c_long = -22;

/// Writes the ports `sport`/`dport` (network order) and updates the CRC32c.
// Inlined into `translate`: LLVM reuses the TCP/UDP branch's stack slots there (its frame stays
// 96 bytes), whereas a call of its own added a frame to the verifier's combined-stack count.
#[inline(always)]
pub fn replace_ports(ctx: &TcContext, pkt: &Packet, sport: u16, dport: u16) -> Result<(), c_long> {
    if sport == pkt.sport && dport == pkt.dport {
        return Ok(());
    }
    let len = sctp_len(ctx, pkt)?;
    let old = ports_word(pkt.sport, pkt.dport);
    let new = ports_word(sport, dport);
    let delta = port_rewrite_delta(u32::from_le(old), u32::from_le(new), len);
    let crc: u32 = ctx.load(pkt.l4 + CRC_OFFSET)?;
    // The ports and the CRC change the packet's one's-complement sum, and no other field
    // compensates (unlike the TCP/UDP checksum): the flag keeps `skb->csum` of a
    // CHECKSUM_COMPLETE skb true.
    let flags = u64::from(BPF_F_RECOMPUTE_CSUM);
    ctx.store(pkt.l4, &new, flags)?;
    ctx.store(pkt.l4 + CRC_OFFSET, &(crc ^ delta.to_le()), flags)
}

/// The two ports as the native word the packet's first four SCTP bytes load as.
#[inline(always)]
fn ports_word(sport: u16, dport: u16) -> u32 {
    let s = sport.to_ne_bytes();
    let d = dport.to_ne_bytes();
    u32::from_ne_bytes([s[0], s[1], d[0], d[1]])
}

/// The SCTP packet's length from the IP header: the skb may be longer (Ethernet padding of
/// short frames is still there at tc ingress; the IP layer trims it later), and the CRC covers
/// exactly the SCTP packet.
#[inline(always)]
fn sctp_len(ctx: &TcContext, pkt: &Packet) -> Result<u16, c_long> {
    let len = if pkt.is_v6() {
        // Payload length; the parser only accepts SCTP directly after the fixed header.
        u16::from_be(ctx.load::<u16>(ETH_HLEN + 4)?)
    } else {
        let total = u16::from_be(ctx.load::<u16>(ETH_HLEN + 2)?);
        total.wrapping_sub((pkt.l4 - ETH_HLEN) as u16)
    };
    if len < COMMON_HLEN || usize::from(len) > (ctx.len() as usize).saturating_sub(pkt.l4) {
        return Err(EINVAL);
    }
    Ok(len)
}
