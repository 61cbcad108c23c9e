//! Addresses as the maps hold them (network byte order in native-endian words, as the socket
//! hooks see them in `bpf_sock_addr`), from and to `core::net` addresses, for user space.

use core::net::{Ipv4Addr, Ipv6Addr};

/// An IPv4 address as the maps hold it (network byte order in a native `u32`).
pub fn ip4_to_map(addr: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(addr.octets())
}

pub fn ip4_from_map(addr: u32) -> Ipv4Addr {
    Ipv4Addr::from(addr.to_ne_bytes())
}

/// An IPv6 address as the maps hold it: four network-order words, like `user_ip6`.
pub fn ip6_to_map(addr: Ipv6Addr) -> [u32; 4] {
    let o = addr.octets();
    [0, 4, 8, 12].map(|i| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]))
}

pub fn ip6_from_map(words: [u32; 4]) -> Ipv6Addr {
    let mut octets = [0u8; 16];
    for (chunk, word) in octets.chunks_exact_mut(4).zip(words) {
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(octets)
}
