//! The flows the kernel's conntrack already NATs, adopted into `KPR_CT` at start (and again
//! after the first sync, the last moment the other mode's rules start flows) so that a
//! takeover from netfilter (kube-proxy's iptables or nftables rules, or the iptables mode's)
//! keeps their backends.
//!
//! A packet of such a flow has no entry of the datapath's own: a UDP or SCTP packet would be
//! taken as a new flow, and a TCP segment other than a SYN as one of the datapath's flows
//! whose entries the LRU evicted, which it writes again from its own choice of backend — a
//! different one from the kernel's, most of the time. Each DNATed entry of the kernel's
//! conntrack is therefore written as a forward entry with `ct_flags::KERNEL_NAT`: its packets
//! go to the stack untranslated while it lives (the usual idle timeout of its protocol), where
//! the kernel's conntrack entry keeps applying its NAT after the rules are gone; its backend is
//! recorded for the purge of removed backends (UDP/SCTP), and once it idles out, closes or is
//! purged the next packet starts a flow of the datapath's own.
//!
//! Each such flow also holds, in the kernel's conntrack, the tuple its backend answers with,
//! and the datapath knows only its own conntrack. So the reply direction of each is written as
//! well, a `KERNEL_NAT` entry keyed by what the backend sends; the backend's packets hit it and
//! go to the stack untranslated, to the kernel's un-NAT, and it idles out with the flow (a FIN
//! or RST seen on it shortens it). Two kinds of new flows must not take that tuple:
//! - a flow the kernel masqueraded holds its SNAT port on the node's address towards its
//!   backend: a new flow given the same port to the same backend would reach it with the tuple
//!   of the live one (the backend drops the SYN). The SNAT port search skips the entry (it is
//!   not a stale reply);
//! - a flow the kernel did not masquerade (eTP Local, a pod's) holds the client's address and
//!   port towards its backend. A new flow of the same client port to the same backend through
//!   another frontend (clients reuse a port towards another destination) shows the kernel
//!   that same tuple on the netfilter path (`nat.rs`: ingress rewrites the destination, the
//!   source waits for egress): the kernel drops its packets as a clash, or netfilter's NAT
//!   remaps its source port behind the egress program's back. The datapath finds the entry
//!   and sends that flow by the fast path instead (`ct_flags::BYPASS`).

use std::net::IpAddr;

use aya::maps::MapData;
use proxy_common::{CtKey, CtValue, ct_flags, family, proto};
use tracing::{info, warn};

use crate::{
    conntrack::ct_maps::ConntrackMaps,
    maps::map_writer::{ip4_to_map, ip6_to_map},
};
use proxy_kernel::conntrack::{ConntrackEntry, Ctnetlink};
use proxy_model::desired::IpFamily;

/// `BPF_NOEXIST` (linux/bpf.h): write only if the key is absent.
const BPF_NOEXIST: u64 = 1;

/// The `KPR_CT` entries for a kernel conntrack entry of a DNATed flow: its forward entry, keyed
/// by what the client sends (the original tuple), and the reservation of the tuple its backend
/// answers with (its SNAT port, or the client's address and port), keyed by what the backend
/// sends (the reply tuple). None
/// for flows without DNAT (the reply comes from the original destination) and mixed families.
pub fn adoptable(entry: &ConntrackEntry, now_ns: u64) -> Vec<(CtKey, CtValue)> {
    let original = &entry.original;
    let reply = &entry.reply;
    let mut entries = Vec::new();
    if !entry.dnat() {
        return entries;
    }
    let (Some((src, family)), Some((dst, dst_family)), Some((backend, backend_family))) =
        (words(original.src), words(original.dst), words(reply.src))
    else {
        return entries;
    };
    if dst_family != family || backend_family != family {
        return entries;
    }
    // A TCP flow that is live (the kernel still tracks it) has its handshake behind it: the
    // established timeout, not the half-open one.
    let established = if original.protocol == proto::TCP {
        ct_flags::ESTABLISHED
    } else {
        0
    };
    // A TCP connection that saw its FIN or RST (TIME_WAIT after a close): a SYN of its tuple is
    // a new connection, the datapath's own (`conntrack::carries`), not one for the kernel's
    // entry — which may have expired by then (120 s in TIME_WAIT), leaving the SYN
    // untranslated. Its reservation below keeps the established timeout: the kernel holds that
    // tuple as long as its entry lives.
    let closing = if entry.tcp_closing() {
        ct_flags::CLOSING
    } else {
        0
    };
    if [proto::TCP, proto::UDP, proto::SCTP].contains(&original.protocol) {
        entries.push((
            CtKey {
                src,
                dst,
                sport: original.src_port.to_be(),
                dport: original.dst_port.to_be(),
                proto: original.protocol,
                family,
                _pad: 0,
            },
            CtValue {
                src,
                dst: backend,
                sport: original.src_port.to_be(),
                dport: reply.src_port.to_be(),
                flags: ct_flags::KERNEL_NAT | established | closing,
                _pad: 0,
                out_mac: [0; 6],
                out_ifindex: 0,
                last_seen_ns: now_ns,
                // The kernel's NAT carries its packets: not counted here.
                service_id: 0,
                _pad2: 0,
                next_hop: proxy_common::NextHop::NONE,
            },
        ));
    }
    // Where the backend answers: the SNAT address, or the client's when the kernel did not
    // masquerade the flow.
    if let Some((answered, answered_family)) = words(reply.dst)
        && answered_family == family
    {
        entries.push((
            CtKey {
                src: backend,
                dst: answered,
                sport: reply.src_port.to_be(),
                dport: reply.dst_port.to_be(),
                proto: original.protocol,
                family,
                _pad: 0,
            },
            // Never used to translate (its packets go to the stack); names the backend where a
            // forward entry does, for the orphan check and `inspect`.
            CtValue {
                src: answered,
                dst: backend,
                sport: reply.dst_port.to_be(),
                dport: reply.src_port.to_be(),
                flags: ct_flags::KERNEL_NAT | established,
                _pad: 0,
                out_mac: [0; 6],
                out_ifindex: 0,
                last_seen_ns: now_ns,
                // The kernel's NAT carries its packets: not counted here.
                service_id: 0,
                _pad2: 0,
                next_hop: proxy_common::NextHop::NONE,
            },
        ));
    }
    entries
}

fn words(addr: IpAddr) -> Option<([u32; 4], u8)> {
    Some(match addr {
        IpAddr::V4(a) => ([ip4_to_map(a), 0, 0, 0], family::V4),
        IpAddr::V6(a) => (ip6_to_map(a), family::V6),
    })
}

/// Reads the kernel's conntrack (both families) and writes the entries of each adoptable flow
/// that the tc conntrack does not hold yet (a flow the datapath already tracks stays its own). Best
/// effort: a failed read or write only costs those flows their backend, so it is logged and
/// the start goes on. Returns the number of entries written.
pub fn adopt(ct: &mut ConntrackMaps<&mut MapData>, now_ns: u64) -> usize {
    write(ct, &read(now_ns))
}

/// The entries of the kernel's adoptable flows (both families), as [`adopt`] writes them: the
/// read alone, which needs no map, so that it can run off the agent's loop (a dump of the
/// kernel's conntrack is milliseconds on a busy node).
pub fn read(now_ns: u64) -> Vec<(CtKey, CtValue)> {
    let mut ctnetlink = match Ctnetlink::open() {
        Ok(ctnetlink) => ctnetlink,
        Err(error) => {
            warn!(%error, "cannot read the kernel's conntrack: UDP/SCTP flows it NATs are not adopted");
            return Vec::new();
        }
    };
    let mut adoptable_entries = Vec::new();
    for ip_family in IpFamily::ALL {
        match ctnetlink.dump(ip_family) {
            Ok(entries) => {
                adoptable_entries.extend(entries.iter().flat_map(|e| adoptable(e, now_ns)));
            }
            Err(error) => {
                warn!(%error, family = ?ip_family, "cannot read the kernel's conntrack: UDP/SCTP flows it NATs are not adopted");
            }
        }
    }
    adoptable_entries
}

/// Writes what [`read`] found, leaving every flow the tc conntrack holds already as it is.
/// Returns the number of entries written.
pub fn write(ct: &mut ConntrackMaps<&mut MapData>, entries: &[(CtKey, CtValue)]) -> usize {
    let mut adopted = 0;
    for (key, value) in entries {
        // An error leaves the flow as it is: already tracked by the datapath (EEXIST), or
        // the map is full.
        if ct.insert(key, value, BPF_NOEXIST).is_ok() {
            adopted += 1;
        }
    }
    if adopted > 0 {
        info!(
            entries = adopted,
            "flows the kernel's conntrack NATs keep their backends and SNAT ports (adopted into the tc conntrack)"
        );
    }
    adopted
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use proxy_kernel::conntrack::Tuple;

    fn entry(protocol: u8, dst: IpAddr, backend: IpAddr, backend_port: u16) -> ConntrackEntry {
        let client: IpAddr = if dst.is_ipv4() {
            Ipv4Addr::new(10, 10, 0, 2).into()
        } else {
            Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 2).into()
        };
        ConntrackEntry {
            tcp_state: None,
            original: Tuple {
                src: client,
                dst,
                protocol,
                src_port: 40_000,
                dst_port: 30_081,
            },
            reply: Tuple {
                src: backend,
                // Masqueraded: the reply goes to the node's address and a port of its own.
                dst,
                protocol,
                src_port: backend_port,
                dst_port: 51_234,
            },
        }
    }

    #[test]
    fn a_dnated_udp_flow_is_adopted_with_its_backend_and_its_snat_port_reserved() {
        let node: IpAddr = Ipv4Addr::new(10, 10, 0, 1).into();
        let backend: IpAddr = Ipv4Addr::new(10, 244, 2, 2).into();
        let entries = adoptable(&entry(proto::UDP, node, backend, 8080), 7);
        let [(key, value), (reply_key, reply_value)] = entries.as_slice() else {
            panic!("a forward entry and a reservation: {entries:?}");
        };
        assert_eq!(key.src, [ip4_to_map(Ipv4Addr::new(10, 10, 0, 2)), 0, 0, 0]);
        assert_eq!(key.dst, [ip4_to_map(Ipv4Addr::new(10, 10, 0, 1)), 0, 0, 0]);
        assert_eq!(
            (key.sport, key.dport),
            (40_000u16.to_be(), 30_081u16.to_be())
        );
        assert_eq!((key.proto, key.family), (proto::UDP, family::V4));
        assert_eq!(
            value.dst,
            [ip4_to_map(Ipv4Addr::new(10, 244, 2, 2)), 0, 0, 0]
        );
        assert_eq!(value.dport, 8080u16.to_be());
        assert_eq!(value.flags, ct_flags::KERNEL_NAT);
        assert_eq!(value.last_seen_ns, 7);
        // The backend's packets to the masquerade address and port.
        assert_eq!(reply_key.src, value.dst);
        assert_eq!(reply_key.dst, key.dst);
        assert_eq!(
            (reply_key.sport, reply_key.dport),
            (8080u16.to_be(), 51_234u16.to_be())
        );
        assert_eq!(reply_value.flags, ct_flags::KERNEL_NAT);
        // The backend where a forward entry names it (the orphan check reads it there).
        assert_eq!(
            (reply_value.dst, reply_value.dport),
            (value.dst, value.dport)
        );
    }

    #[test]
    fn ipv6_and_sctp_flows_are_adopted() {
        let node: IpAddr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 1).into();
        let backend: IpAddr = Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 2).into();
        let entries = adoptable(&entry(proto::SCTP, node, backend, 9000), 1);
        let (key, value) = entries[0];
        assert_eq!(key.family, family::V6);
        assert_eq!(key.proto, proto::SCTP);
        assert_eq!(
            value.dst,
            ip6_to_map(Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 2))
        );
    }

    #[test]
    fn a_masqueraded_tcp_flow_is_adopted_established() {
        let node: IpAddr = Ipv4Addr::new(10, 10, 0, 1).into();
        let backend: IpAddr = Ipv4Addr::new(10, 244, 2, 2).into();
        // TCP: a segment without an entry would be taken for an evicted flow of the
        // datapath's own and written again to its own choice of backend.
        let entries = adoptable(&entry(proto::TCP, node, backend, 8080), 1);
        let [(forward_key, forward), (key, value)] = entries.as_slice() else {
            panic!("the forward entry and the reservation: {entries:?}");
        };
        assert_eq!(forward_key.proto, proto::TCP);
        assert_eq!(
            forward.dst,
            [ip4_to_map(Ipv4Addr::new(10, 244, 2, 2)), 0, 0, 0]
        );
        assert_eq!(forward.flags, ct_flags::KERNEL_NAT | ct_flags::ESTABLISHED);
        assert_eq!(key.dport, 51_234u16.to_be());
        assert_eq!(value.flags, ct_flags::KERNEL_NAT | ct_flags::ESTABLISHED);
    }

    #[test]
    fn a_flow_without_masquerade_reserves_the_client_tuple_its_backend_answers() {
        let node: IpAddr = Ipv4Addr::new(10, 10, 0, 1).into();
        let backend: IpAddr = Ipv4Addr::new(10, 244, 2, 2).into();
        // eTP Local: the kernel only DNATed, the backend answers the client itself.
        let mut kept = entry(proto::TCP, node, backend, 8080);
        kept.reply.dst = kept.original.src;
        kept.reply.dst_port = kept.original.src_port;
        let entries = adoptable(&kept, 1);
        let [(forward_key, _), (key, value)] = entries.as_slice() else {
            panic!("the forward entry and the reservation: {entries:?}");
        };
        // What the backend sends: from its port to the client's address and port, the tuple
        // a new flow of that client port to that backend would show the kernel.
        assert_eq!(key.src, [ip4_to_map(Ipv4Addr::new(10, 244, 2, 2)), 0, 0, 0]);
        assert_eq!((key.dst, key.dport), (forward_key.src, forward_key.sport));
        assert_eq!(key.sport, 8080u16.to_be());
        assert_eq!(value.flags, ct_flags::KERNEL_NAT | ct_flags::ESTABLISHED);
    }

    #[test]
    fn a_closed_tcp_flow_leaves_its_tuple_to_a_new_connection_but_keeps_its_reservation() {
        let node: IpAddr = Ipv4Addr::new(10, 10, 0, 1).into();
        let backend: IpAddr = Ipv4Addr::new(10, 244, 2, 2).into();
        let mut closed = entry(proto::TCP, node, backend, 8080);
        // TCP_CONNTRACK_TIME_WAIT.
        closed.tcp_state = Some(7);
        let entries = adoptable(&closed, 1);
        let [(_, forward), (_, reservation)] = entries.as_slice() else {
            panic!("the forward entry and the reservation: {entries:?}");
        };
        assert_eq!(
            forward.flags,
            ct_flags::KERNEL_NAT | ct_flags::ESTABLISHED | ct_flags::CLOSING
        );
        assert_eq!(
            reservation.flags,
            ct_flags::KERNEL_NAT | ct_flags::ESTABLISHED
        );
    }

    #[test]
    fn flows_without_dnat_are_left_alone() {
        let node: IpAddr = Ipv4Addr::new(10, 10, 0, 1).into();
        // The reply comes from the original destination: no DNAT (a plain or masqueraded flow,
        // or one the datapath translated itself before the kernel saw it).
        assert!(adoptable(&entry(proto::UDP, node, node, 30_081), 1).is_empty());
        // A port-only DNAT (a REDIRECT) is still a DNAT.
        assert!(!adoptable(&entry(proto::UDP, node, node, 8080), 1).is_empty());
    }
}
