//! The Internet checksum (RFC 1071) and the L4 checksums over the pseudo-header, computed
//! whole over a packet on the host: the agent's self-test builds its probe with them, the
//! test rig its packets and their checks. (The programs update checksums incrementally,
//! `proxy-ebpf`'s `csum.rs`.)

use core::net::IpAddr;

/// One's-complement sum of `bytes` (odd length padded with a zero byte), not folded.
fn sum(mut acc: u32, bytes: &[u8]) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    for c in &mut chunks {
        acc += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u32::from(u16::from_be_bytes([*last, 0]));
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// The Internet checksum of `bytes` (its checksum field zeroed or not: a valid packet sums to
/// 0 including its checksum).
pub fn inet_checksum(bytes: &[u8]) -> u16 {
    fold(sum(0, bytes))
}

fn pseudo_sum(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> u32 {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let acc = sum(sum(0, &s.octets()), &d.octets());
            acc + u32::from(proto) + len as u32
        }
        (s, d) => {
            let octets = |a: IpAddr| match a {
                IpAddr::V6(a) => a.octets(),
                IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
            };
            let acc = sum(sum(0, &octets(s)), &octets(d));
            acc + (len as u32 >> 16) + (len as u32 & 0xffff) + u32::from(proto)
        }
    }
}

/// The L4 checksum (TCP, UDP, ICMPv6) over the pseudo-header and `l4` (checksum field
/// included: a valid segment gives 0).
pub fn l4_checksum(src: IpAddr, dst: IpAddr, proto: u8, l4: &[u8]) -> u16 {
    fold(sum(pseudo_sum(src, dst, proto, l4.len()), l4))
}
