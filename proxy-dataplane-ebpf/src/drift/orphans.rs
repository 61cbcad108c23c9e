//! Orphans: entries the datapath wrote itself (session affinity, the backends of unconnected
//! UDP sockets, tc conntrack) that point at a Service or backend the agent no longer programs.
//! The datapath never follows them (affinity and sticky entries are checked against
//! `KPR_AFFINITY_MATCH`; a conntrack entry of a gone backend leads nowhere), but they hold LRU
//! room and, for conntrack, keep a UDP flow pinned to an address that answers nothing until it
//! idles out. The drift check reports them and, when repairing, deletes them.
//!
//! What is never an orphan: an entry whose backend still exists, whatever Service it serves
//! now, and any TCP conntrack entry. TCP flows drain on their backend (a terminating backend
//! leaves the live set first and must keep its established connections; README: "TCP
//! connections are left to drain, as with kube-proxy"), so they end by FIN/RST or idle out
//! like upstream's conntrack, exactly as the purge after an apply leaves them
//! (`tc_conntrack`).

use std::collections::BTreeSet;
use std::net::SocketAddr;

use proxy_common::{AffinityKey, AffinityValue, CtKey, CtValue, ct_flags, family, proto};

use crate::maps::map_writer::{MapsContent, ip4_from_map, ip6_from_map};

/// What the live configuration still has: Service ids (of any frontend) and backends.
#[derive(Debug, Default)]
pub struct Live {
    services: BTreeSet<u32>,
    backend_ids: BTreeSet<u32>,
    backend_addrs: BTreeSet<SocketAddr>,
}

impl Live {
    pub fn of(expected: &MapsContent) -> Self {
        Self {
            services: expected
                .frontends
                .iter()
                .map(|(_, f)| f.service_id)
                .collect(),
            backend_ids: expected.backends.keys().copied().collect(),
            backend_addrs: expected
                .backends
                .values()
                .map(|b| b.socket_addr())
                .collect(),
        }
    }
}

/// Why an affinity or sticky entry is an orphan, if it is one.
pub fn pinned_orphan(live: &Live, key: &AffinityKey, value: &AffinityValue) -> Option<String> {
    if !live.services.contains(&key.service_id) {
        return Some(format!("service {} no longer exists", key.service_id));
    }
    if !live.backend_ids.contains(&value.backend_id) {
        return Some(format!("backend {} no longer exists", value.backend_id));
    }
    None
}

/// The backend of a conntrack entry: where a forward entry translates to, or where a reply
/// entry's packets come from.
fn ct_backend(key: &CtKey, value: &CtValue) -> Option<SocketAddr> {
    let (words, port) = if value.flags & ct_flags::REPLY == 0 {
        (value.dst, value.dport)
    } else {
        (key.src, key.sport)
    };
    let ip = match key.family {
        family::V4 => ip4_from_map(words[0]).into(),
        family::V6 => ip6_from_map(words).into(),
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::from_be(port)))
}

/// Why a conntrack entry is an orphan, with its backend, if it is one (never for TCP: see the
/// module docs).
pub fn ct_orphan(live: &Live, key: &CtKey, value: &CtValue) -> Option<(SocketAddr, String)> {
    if key.proto == proto::TCP {
        return None;
    }
    let backend = ct_backend(key, value)?;
    (!live.backend_addrs.contains(&backend))
        .then(|| (backend, format!("backend {backend} no longer exists")))
}

/// A conntrack key for people: `proto src:port → dst:port`.
pub fn describe_ct(key: &CtKey) -> String {
    let addr = |words: [u32; 4], port: u16| match key.family {
        family::V6 => SocketAddr::new(ip6_from_map(words).into(), u16::from_be(port)),
        _ => SocketAddr::new(ip4_from_map(words[0]).into(), u16::from_be(port)),
    };
    let name = match key.proto {
        proto::UDP => "UDP",
        proto::SCTP => "SCTP",
        proto::TCP => "TCP",
        _ => "?",
    };
    format!(
        "{name} {} → {}",
        addr(key.src, key.sport),
        addr(key.dst, key.dport)
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::Ipv4Addr;

    use proxy_common::{Backend4, FrontendValue};

    use super::*;
    use crate::maps::map_writer::{BackendValue, FrontendMapKey, ip4_to_map};

    fn live() -> Live {
        let mut backends = BTreeMap::new();
        backends.insert(
            7,
            BackendValue::V4(Backend4 {
                addr: ip4_to_map(Ipv4Addr::new(10, 244, 1, 2)),
                port: 8080u16.to_be(),
                proto: proto::UDP,
                flags: 0,
            }),
        );
        let content = MapsContent {
            frontends: vec![(
                FrontendMapKey::V4(proxy_common::Frontend4Key {
                    addr: 0,
                    port: 0,
                    proto: proto::UDP,
                    scope: 0,
                }),
                FrontendValue {
                    service_id: 3,
                    ..FrontendValue::default()
                },
            )],
            backends,
            ..MapsContent::default()
        };
        Live::of(&content)
    }

    fn ct(protocol: u8, backend: Ipv4Addr, reply: bool) -> (CtKey, CtValue) {
        let client = [ip4_to_map(Ipv4Addr::new(10, 10, 0, 2)), 0, 0, 0];
        let b = [ip4_to_map(backend), 0, 0, 0];
        let mut key = CtKey {
            src: client,
            dst: [ip4_to_map(Ipv4Addr::new(10, 96, 0, 10)), 0, 0, 0],
            sport: 40000u16.to_be(),
            dport: 53u16.to_be(),
            proto: protocol,
            family: family::V4,
            _pad: 0,
        };
        let mut value = CtValue {
            dst: b,
            dport: 8080u16.to_be(),
            ..CtValue::default()
        };
        if reply {
            key.src = b;
            key.sport = 8080u16.to_be();
            value = CtValue {
                flags: ct_flags::REPLY,
                ..CtValue::default()
            };
        }
        (key, value)
    }

    #[test]
    fn entries_of_gone_services_or_backends_are_orphans_and_tcp_flows_never_are() {
        let live = live();
        let key = |service_id| AffinityKey {
            client: 1,
            service_id,
            _pad: 0,
        };
        let value = |backend_id| AffinityValue {
            backend_id,
            ..AffinityValue::default()
        };
        assert_eq!(pinned_orphan(&live, &key(3), &value(7)), None);
        assert!(pinned_orphan(&live, &key(4), &value(7)).is_some());
        assert!(pinned_orphan(&live, &key(3), &value(8)).is_some());

        let existing = Ipv4Addr::new(10, 244, 1, 2);
        let gone = Ipv4Addr::new(10, 244, 9, 2);
        for reply in [false, true] {
            let (k, v) = ct(proto::UDP, existing, reply);
            assert_eq!(ct_orphan(&live, &k, &v), None, "reply {reply}");
            let (k, v) = ct(proto::UDP, gone, reply);
            assert!(ct_orphan(&live, &k, &v).is_some(), "reply {reply}");
            // A TCP flow to a backend that left drains: never an orphan.
            let (k, v) = ct(proto::TCP, gone, reply);
            assert_eq!(ct_orphan(&live, &k, &v), None, "reply {reply}");
        }
    }
}
