//! The datapath self-test's probe client (`proxy-dataplane-ebpf`'s `self_test`): the address
//! and port its synthetic SYN comes from, which the programs leave out of the per-Service
//! traffic counters. The self-test runs the live ingress program with `BPF_PROG_TEST_RUN`, so
//! its SYN starts a flow like a client's would; counted, every periodic self-test would add a
//! connection (and a packet) to the Service it probes that no client made.

use core::net::{Ipv4Addr, Ipv6Addr};

/// The probe's IPv4 client: TEST-NET-1's last address (RFC 5737), which no real client has.
pub const CLIENT4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 254);
/// The probe's IPv6 client, in the documentation prefix (RFC 3849).
pub const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0xdead, 0xbeef);
/// The probe's source port (its entries are deleted around each run, so one port serves).
pub const PORT: u16 = 40_999;

/// [`CLIENT4`] as the maps and packets hold it (network order in a native word).
const CLIENT4_WORD: u32 = u32::from_ne_bytes(CLIENT4.octets());

/// [`CLIENT6`] as the maps and packets hold it (four network-order words).
const CLIENT6_WORDS: [u32; 4] = {
    let o = CLIENT6.octets();
    [
        u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
        u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
        u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
        u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
    ]
};

/// Whether a packet from `src` (map words) and `sport` (network order) is the self-test's probe.
#[inline(always)]
pub fn is_probe(src: &[u32; 4], sport: u16, v6: bool) -> bool {
    if sport != PORT.to_be() {
        return false;
    }
    if v6 {
        *src == CLIENT6_WORDS
    } else {
        src[0] == CLIENT4_WORD
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::{ip4_to_map, ip6_to_map};

    #[test]
    fn only_the_probe_client_and_port_are_the_probe() {
        let v4 = [ip4_to_map(CLIENT4), 0, 0, 0];
        let v6 = ip6_to_map(CLIENT6);
        assert!(is_probe(&v4, PORT.to_be(), false));
        assert!(is_probe(&v6, PORT.to_be(), true));
        assert!(!is_probe(&v4, (PORT + 1).to_be(), false));
        assert!(!is_probe(&v4, PORT.to_be(), true));
        let other = [ip4_to_map(Ipv4Addr::new(192, 0, 2, 253)), 0, 0, 0];
        assert!(!is_probe(&other, PORT.to_be(), false));
    }
}
