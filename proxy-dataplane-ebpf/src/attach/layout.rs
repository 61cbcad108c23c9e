//! Versioned layouts of the pinned maps, and the migration of an older agent's maps at start.
//!
//! Every pinned map has a layout version ([`current`]). `KPR_LAYOUTS`, a pinned hash map that
//! only user space reads, records the version, key size and value size each pinned map was
//! created with; maps without a record (agents from before `KPR_LAYOUTS`) are recognised by
//! their key and value sizes. A build that changes a pinned key or value type bumps that map's
//! version in [`current`] (`layout_versions_follow_the_types` fails until it does) and, for a
//! map of datapath state ([`holds`]), registers the previous layout in [`OLDER`] with a
//! conversion; one that a build replaces by others under new names (the tc conntrack, split by
//! family) is registered there too, under its old name, with the conversion into its
//! successors. A map of service state needs none: it is rebuilt, filled by the first sync
//! before the new programs replace the previous agent's (`EbpfDataplane::start`).
//!
//! At start ([`plan`]) a map in a known older layout is unpinned but kept open, the object
//! loads with a new map under its name, and [`Plan::copy`] copies the old entries, converted,
//! into it — once before the new programs replace the previous ones, and once after, for the
//! entries the previous programs still wrote in between (those never replace an entry the new
//! programs made). A map whose layout this build does not know is unpinned and starts empty,
//! with a warning that says what that costs.

use std::path::Path;

use aya::{
    Pod,
    maps::{HashMap, Map, MapData, MapError, MapInfo},
};
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, BackendSlotKey, CtKey,
    CtKey4, CtValue, CtValue4, EndpointTrafficKey, Frontend4Key, Frontend6Key, FrontendValue,
    MaglevBlock, MaglevKey, NodeAddrKey, NodeConfig, PortFilter, RevNat4, RevNat4Key, RevNat6,
    RevNat6Key, ServiceName, ServicePackets, ServiceTraffic, SlotBlock, SnatAddrs, SourceRangeKey,
    map_names,
};
use tracing::{info, warn};

/// Pinned name of the layout records (not in the eBPF object: the datapath never reads it).
pub const LAYOUTS: &str = "KPR_LAYOUTS";
/// Records `KPR_LAYOUTS` holds at most (one per pinned map).
pub const LAYOUTS_CAPACITY: u32 = 64;
/// Bytes of a map name in a [`LayoutKey`] (the kernel's own limit is 16, bpffs' 255).
pub const NAME_LEN: usize = 32;

/// `BPF_NOEXIST` (include/uapi/linux/bpf.h): insert only if the key is absent.
const BPF_NOEXIST: u64 = 1;

/// Key of `KPR_LAYOUTS`: a pinned map's name, zero-padded. This type and [`LayoutRecord`]
/// never change (a new field would make every record unreadable to older agents).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutKey {
    pub name: [u8; NAME_LEN],
}

impl LayoutKey {
    /// `None` for a name longer than [`NAME_LEN`].
    pub fn new(name: &str) -> Option<Self> {
        let bytes = name.as_bytes();
        let mut key = [0u8; NAME_LEN];
        key.get_mut(..bytes.len())?.copy_from_slice(bytes);
        Some(Self { name: key })
    }
}

/// Value of `KPR_LAYOUTS`: the layout a pinned map was created with.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LayoutRecord {
    pub version: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub _pad: u32,
}

// SAFETY: `repr(C)` structs of integers without implicit padding, valid for any bytes.
unsafe impl Pod for LayoutKey {}
// SAFETY: as above.
unsafe impl Pod for LayoutRecord {}

/// One layout of one pinned map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub name: &'static str,
    pub version: u32,
    pub key_size: u32,
    pub value_size: u32,
}

fn size<T>() -> u32 {
    std::mem::size_of::<T>() as u32
}

fn layout<K, V>(name: &'static str, version: u32) -> Layout {
    Layout {
        name,
        version,
        key_size: size::<K>(),
        value_size: size::<V>(),
    }
}

/// This build's layout of every pinned map (`map_names::PINNED`).
pub fn current() -> [Layout; 26] {
    [
        layout::<Frontend4Key, FrontendValue>(map_names::FRONTENDS4, 1),
        layout::<Frontend6Key, FrontendValue>(map_names::FRONTENDS6, 1),
        // Version 1: one backend id per slot (service state: rebuilt by the first sync).
        layout::<BackendSlotKey, SlotBlock>(map_names::BACKEND_SLOTS, 2),
        // Version 1: hash maps of the same key and value (service state: rebuilt, with the
        // maps that share its ids, and filled by the first sync; `ARRAYS`).
        layout::<u32, Backend4>(map_names::BACKENDS4, 2),
        layout::<u32, Backend6>(map_names::BACKENDS6, 2),
        // Version 1: the foundation's cookie → (service, backend); see `v1::RevNat4`.
        layout::<RevNat4Key, RevNat4>(map_names::REVNAT4, 2),
        layout::<RevNat6Key, RevNat6>(map_names::REVNAT6, 1),
        layout::<AffinityKey, AffinityValue>(map_names::AFFINITY, 1),
        layout::<AffinityMatchKey, u8>(map_names::AFFINITY_MATCH, 1),
        layout::<u32, u64>(map_names::STATS, 1),
        // Both replace the foundation's `KPR_CT` (see `v1::split_ct`). Version 1: without the
        // flow's service id (`v1::CtValue4V1`, `v1::CtValueV2`); version 2: without the next
        // hop (`v2::CtValue4`, `v2::CtValue`).
        layout::<CtKey4, CtValue4>(map_names::CT4, 3),
        layout::<CtKey, CtValue>(map_names::CT6, 3),
        layout::<CtKey4, CtValue4>(map_names::CT4_NEW, 3),
        layout::<CtKey, CtValue>(map_names::CT6_NEW, 3),
        // LPM trie keys carry the prefix length first.
        Layout {
            key_size: size::<u32>() + size::<SourceRangeKey>(),
            ..layout::<SourceRangeKey, u8>(map_names::SOURCE_RANGES, 1)
        },
        layout::<NodeAddrKey, u8>(map_names::NODE_ADDRS, 1),
        layout::<u32, NodeConfig>(map_names::NODE_CONFIG, 1),
        // Version 1: without the interface's MAC (service state: rebuilt by the first sync).
        layout::<u32, SnatAddrs>(map_names::SNAT_IFACES, 2),
        layout::<MaglevKey, MaglevBlock>(map_names::MAGLEV, 1),
        layout::<AffinityKey, AffinityValue>(map_names::UDP_STICKY, 1),
        layout::<u32, ServiceName>(map_names::SERVICE_NAMES, 1),
        layout::<u32, ServiceTraffic>(map_names::SERVICE_TRAFFIC, 1),
        // Per CPU: the kernel reports one CPU's value size.
        layout::<u32, ServicePackets>(map_names::SERVICE_PACKETS, 1),
        layout::<EndpointTrafficKey, u64>(map_names::ENDPOINT_TRAFFIC, 1),
        // Service state, but for the ports of flows to Services gone since: a new layout
        // would keep only what the first sync writes (the programs then pass those flows on).
        layout::<u32, PortFilter>(map_names::PORT_FILTER, 1),
        layout::<u32, u32>(map_names::ROUTE_GENERATION, 1),
    ]
}

/// The pinned maps that were another map type (hash maps) in an earlier layout of the same
/// key and value sizes: only the type tells such a map apart when it has no layout record, so
/// one of another type is rebuilt whatever its record says.
const ARRAYS: [&str; 2] = [map_names::BACKENDS4, map_names::BACKENDS6];

/// Whether the pinned map is of the type this build creates under its name, as far as
/// [`ARRAYS`] says (other maps never changed type).
fn type_matches(name: &str, info: Option<&MapInfo>) -> bool {
    !ARRAYS.contains(&name)
        || info.is_some_and(|info| matches!(info.map_type(), Ok(aya::maps::MapType::Array)))
}

/// What a pinned map holds, so what starting it empty costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holds {
    /// What the agent writes from the Services: its first sync fills it again.
    ServiceState,
    /// What only the datapath knows; the text says what is lost.
    DatapathState(&'static str),
    Counters,
}

pub fn holds(name: &str) -> Holds {
    match name {
        map_names::REVNAT4 | map_names::REVNAT6 => Holds::DatapathState(
            "sockets connected to a Service before now see the backend's address in \
             getpeername() and recvmsg()",
        ),
        map_names::AFFINITY => Holds::DatapathState(
            "clients with session affinity may be sent to another backend once",
        ),
        map_names::UDP_STICKY => {
            Holds::DatapathState("unconnected UDP sockets may be sent to another backend once")
        }
        map_names::CT4 | map_names::CT6 | v1::CT => Holds::DatapathState(
            "established external flows (NodePort, externalIPs, LB IPs) lose their \
             translation: their next packets are new flows, TCP ones are reset",
        ),
        map_names::CT4_NEW | map_names::CT6_NEW => Holds::DatapathState(
            "external TCP flows still in their handshake choose their backend again",
        ),
        map_names::STATS
        | map_names::SERVICE_TRAFFIC
        | map_names::SERVICE_PACKETS
        | map_names::ENDPOINT_TRAFFIC => Holds::Counters,
        _ => Holds::ServiceState,
    }
}

/// A registered older layout and how to convert its entries.
pub struct Migration {
    pub from: Layout,
    /// The maps its entries go to: the map of the same name, or the ones that replaced it.
    pub into: &'static [&'static str],
    /// Copies every entry of `old` into the new maps pinned in the directory, converted, with
    /// the given update flags.
    copy: fn(old: &Map, pin_dir: &Path, flags: u64) -> Result<CopyCount, MapError>,
}

impl Migration {
    /// Whether the map it migrates has no successor of its own name (see [`OLDER`]).
    fn retired(&self) -> bool {
        !current().iter().any(|l| l.name == self.from.name)
    }
}

impl std::fmt::Debug for Migration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Migration")
            .field("from", &self.from)
            .finish_non_exhaustive()
    }
}

/// A map's older layout is registered once: its layout names it.
impl PartialEq for Migration {
    fn eq(&self, other: &Self) -> bool {
        self.from == other.from
    }
}

impl Eq for Migration {}

/// Layouts earlier agents pinned, with their conversions to this build's.
pub static OLDER: &[Migration] = &[
    Migration {
        from: Layout {
            name: map_names::REVNAT4,
            version: 1,
            key_size: 8,
            value_size: 16,
        },
        into: &[map_names::REVNAT4],
        copy: |old, pin_dir, flags| {
            copy_converted(
                old,
                &mut open(pin_dir, map_names::REVNAT4)?,
                flags,
                v1::revnat4,
            )
        },
    },
    Migration {
        from: Layout {
            name: v1::CT,
            version: 1,
            key_size: 40,
            value_size: 48,
        },
        into: &[map_names::CT4, map_names::CT6],
        copy: v1::split_ct::<v1::CtValueV1>,
    },
    Migration {
        from: Layout {
            name: v1::CT,
            version: 2,
            key_size: 40,
            value_size: 56,
        },
        into: &[map_names::CT4, map_names::CT6],
        copy: v1::split_ct::<v1::CtValueV2>,
    },
    // The per-family maps before their values carried the flow's service id: the flows keep
    // their translation, uncounted (service id 0) until they end.
    Migration {
        from: Layout {
            name: map_names::CT4,
            version: 1,
            key_size: 16,
            value_size: 32,
        },
        into: &[map_names::CT4],
        copy: |old, pin_dir, flags| v1::copy_ct4(old, pin_dir, map_names::CT4, flags),
    },
    Migration {
        from: Layout {
            name: map_names::CT4_NEW,
            version: 1,
            key_size: 16,
            value_size: 32,
        },
        into: &[map_names::CT4_NEW],
        copy: |old, pin_dir, flags| v1::copy_ct4(old, pin_dir, map_names::CT4_NEW, flags),
    },
    Migration {
        from: Layout {
            name: map_names::CT6,
            version: 1,
            key_size: 40,
            value_size: 56,
        },
        into: &[map_names::CT6],
        copy: |old, pin_dir, flags| v1::copy_ct6(old, pin_dir, map_names::CT6, flags),
    },
    Migration {
        from: Layout {
            name: map_names::CT6_NEW,
            version: 1,
            key_size: 40,
            value_size: 56,
        },
        into: &[map_names::CT6_NEW],
        copy: |old, pin_dir, flags| v1::copy_ct6(old, pin_dir, map_names::CT6_NEW, flags),
    },
    // The per-family maps before their values kept the next hop: the flows keep their
    // translation and look their next hop up again.
    Migration {
        from: Layout {
            name: map_names::CT4,
            version: 2,
            key_size: 16,
            value_size: 40,
        },
        into: &[map_names::CT4],
        copy: |old, pin_dir, flags| v2::copy_ct4(old, pin_dir, map_names::CT4, flags),
    },
    Migration {
        from: Layout {
            name: map_names::CT4_NEW,
            version: 2,
            key_size: 16,
            value_size: 40,
        },
        into: &[map_names::CT4_NEW],
        copy: |old, pin_dir, flags| v2::copy_ct4(old, pin_dir, map_names::CT4_NEW, flags),
    },
    Migration {
        from: Layout {
            name: map_names::CT6,
            version: 2,
            key_size: 40,
            value_size: 64,
        },
        into: &[map_names::CT6],
        copy: |old, pin_dir, flags| v2::copy_ct6(old, pin_dir, map_names::CT6, flags),
    },
    Migration {
        from: Layout {
            name: map_names::CT6_NEW,
            version: 2,
            key_size: 40,
            value_size: 64,
        },
        into: &[map_names::CT6_NEW],
        copy: |old, pin_dir, flags| v2::copy_ct6(old, pin_dir, map_names::CT6_NEW, flags),
    },
];

fn open(pin_dir: &Path, name: &str) -> Result<Map, MapError> {
    MapData::from_pin(pin_dir.join(name)).and_then(Map::from_map_data)
}

/// Layouts that existed in earlier agents (git history), kept for their conversions.
pub mod v1 {
    use std::path::Path;

    use aya::maps::{HashMap, Map, MapData, MapError};
    use proxy_common::{CtKey, CtKey4, CtValue, CtValue4, NextHop, RevNat4Key, map_names};

    use super::{CopyCount, copy_converted, open};
    use crate::conntrack::ct_maps::ConntrackMaps;

    /// The tc conntrack of both families in one map, before `KPR_CT4` and `KPR_CT6`.
    pub const CT: &str = "KPR_CT";

    /// Its value: [`CtValue`] without the interface and neighbour a reply leaves by.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct CtValueV1 {
        pub src: [u32; 4],
        pub dst: [u32; 4],
        pub sport: u16,
        pub dport: u16,
        pub flags: u8,
        pub _pad: [u8; 3],
        pub last_seen_ns: u64,
    }

    // SAFETY: `repr(C)` integers without implicit padding, valid for any bytes.
    unsafe impl aya::Pod for CtValueV1 {}

    /// Lossless but for the reply interface, which the old entries did not record: their
    /// replies stay routed by the table, as they were.
    impl From<CtValueV1> for CtValue {
        fn from(old: CtValueV1) -> CtValue {
            CtValue {
                src: old.src,
                dst: old.dst,
                sport: old.sport,
                dport: old.dport,
                flags: old.flags,
                _pad: 0,
                out_mac: [0; 6],
                out_ifindex: 0,
                last_seen_ns: old.last_seen_ns,
                service_id: 0,
                _pad2: 0,
                next_hop: NextHop::NONE,
            }
        }
    }

    /// [`CtValue`] before it carried the flow's service id: the value of `KPR_CT6` and
    /// `KPR_CT6_NEW` in their version 1, and of `KPR_CT` in its version 2.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct CtValueV2 {
        pub src: [u32; 4],
        pub dst: [u32; 4],
        pub sport: u16,
        pub dport: u16,
        pub flags: u8,
        pub _pad: u8,
        pub out_mac: [u8; 6],
        pub out_ifindex: u32,
        pub last_seen_ns: u64,
    }

    // SAFETY: `repr(C)` integers without implicit padding, valid for any bytes.
    unsafe impl aya::Pod for CtValueV2 {}

    /// Lossless but for the service id, which the old entries did not record: the flow's
    /// packets are not counted (0), its translation is kept.
    impl From<CtValueV2> for CtValue {
        fn from(old: CtValueV2) -> CtValue {
            CtValue {
                src: old.src,
                dst: old.dst,
                sport: old.sport,
                dport: old.dport,
                flags: old.flags,
                _pad: 0,
                out_mac: old.out_mac,
                out_ifindex: old.out_ifindex,
                last_seen_ns: old.last_seen_ns,
                service_id: 0,
                _pad2: 0,
                next_hop: NextHop::NONE,
            }
        }
    }

    /// [`CtValue4`] before it carried the flow's service id (`KPR_CT4`, `KPR_CT4_NEW` version 1).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct CtValue4V1 {
        pub src: u32,
        pub dst: u32,
        pub sport: u16,
        pub dport: u16,
        pub flags: u8,
        pub _pad: u8,
        pub out_mac: [u8; 6],
        pub out_ifindex: u32,
        pub last_seen_ns: u64,
    }

    // SAFETY: `repr(C)` integers without implicit padding, valid for any bytes.
    unsafe impl aya::Pod for CtValue4V1 {}

    /// As for [`CtValueV2`]: uncounted, translation kept.
    impl From<CtValue4V1> for CtValue4 {
        fn from(old: CtValue4V1) -> CtValue4 {
            CtValue4 {
                src: old.src,
                dst: old.dst,
                sport: old.sport,
                dport: old.dport,
                flags: old.flags,
                _pad: 0,
                out_mac: old.out_mac,
                out_ifindex: old.out_ifindex,
                last_seen_ns: old.last_seen_ns,
                service_id: 0,
                _pad2: 0,
                next_hop: NextHop::NONE,
            }
        }
    }

    /// Every entry of an IPv4 conntrack map of version 1 into the map `name` of this version.
    pub fn copy_ct4(
        old: &Map,
        pin_dir: &Path,
        name: &str,
        flags: u64,
    ) -> Result<CopyCount, MapError> {
        copy_converted(
            old,
            &mut open(pin_dir, name)?,
            flags,
            |key: CtKey4, value: CtValue4V1| Some((key, CtValue4::from(value))),
        )
    }

    /// Every entry of an IPv6 conntrack map of version 1 into the map `name` of this version.
    pub fn copy_ct6(
        old: &Map,
        pin_dir: &Path,
        name: &str,
        flags: u64,
    ) -> Result<CopyCount, MapError> {
        copy_converted(
            old,
            &mut open(pin_dir, name)?,
            flags,
            |key: CtKey, value: CtValueV2| Some((key, CtValue::from(value))),
        )
    }

    /// Each entry of `KPR_CT` (its value in layout `V`) into the map of its family (keys stay
    /// as they were: the wide key is `KPR_CT6`'s, and narrows losslessly for IPv4).
    pub fn split_ct<V: aya::Pod + Into<CtValue>>(
        old: &Map,
        pin_dir: &Path,
        flags: u64,
    ) -> Result<CopyCount, MapError> {
        let old = HashMap::<&MapData, CtKey, V>::try_from(old)?;
        let mut new = ConntrackMaps {
            v4: HashMap::try_from(open(pin_dir, map_names::CT4)?)?,
            v6: HashMap::try_from(open(pin_dir, map_names::CT6)?)?,
            // The foundation's flows are all past their handshake or gone.
            new4: None,
            new6: None,
        };
        let mut count = CopyCount::default();
        for (key, value) in old.iter().flatten() {
            count.add(new.insert(&key, &value.into(), flags));
        }
        Ok(count)
    }

    /// The foundation's `KPR_REVNAT4` value (key: the socket cookie), before the key became
    /// Cilium's `(cookie, backend address, backend port)`: a socket's service and backend.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct RevNat4 {
        pub frontend_addr: u32,
        pub backend_addr: u32,
        pub frontend_port: u16,
        pub backend_port: u16,
        pub _pad: u32,
    }

    // SAFETY: `repr(C)` integers without implicit padding, valid for any bytes.
    unsafe impl aya::Pod for RevNat4 {}

    /// Lossless: the old value names the backend the new key needs.
    pub fn revnat4(cookie: u64, old: RevNat4) -> Option<(RevNat4Key, super::RevNat4)> {
        Some((
            RevNat4Key {
                cookie,
                addr: old.backend_addr,
                port: old.backend_port,
                _pad: 0,
            },
            super::RevNat4 {
                addr: old.frontend_addr,
                port: old.frontend_port,
                _pad: 0,
            },
        ))
    }
}

/// The conntrack layouts of version 2, before the values kept the next hop.
pub mod v2 {
    use std::path::Path;

    use aya::maps::{Map, MapError};
    use proxy_common::{CtKey, CtKey4, NextHop};

    use super::{CopyCount, copy_converted, open};

    /// `KPR_CT4`'s and `KPR_CT4_NEW`'s value of version 2: [`proxy_common::CtValue4`] without
    /// the next hop.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct CtValue4 {
        pub src: u32,
        pub dst: u32,
        pub sport: u16,
        pub dport: u16,
        pub flags: u8,
        pub _pad: u8,
        pub out_mac: [u8; 6],
        pub out_ifindex: u32,
        pub last_seen_ns: u64,
        pub service_id: u32,
        pub _pad2: u32,
    }

    // SAFETY: `repr(C)` integers without implicit padding, valid for any bytes.
    unsafe impl aya::Pod for CtValue4 {}

    /// Lossless: no next hop kept yet, so the flow's next packet looks it up.
    impl From<CtValue4> for proxy_common::CtValue4 {
        fn from(old: CtValue4) -> Self {
            Self {
                src: old.src,
                dst: old.dst,
                sport: old.sport,
                dport: old.dport,
                flags: old.flags,
                _pad: 0,
                out_mac: old.out_mac,
                out_ifindex: old.out_ifindex,
                last_seen_ns: old.last_seen_ns,
                service_id: old.service_id,
                _pad2: 0,
                next_hop: NextHop::NONE,
            }
        }
    }

    /// `KPR_CT6`'s and `KPR_CT6_NEW`'s value of version 2.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct CtValue {
        pub src: [u32; 4],
        pub dst: [u32; 4],
        pub sport: u16,
        pub dport: u16,
        pub flags: u8,
        pub _pad: u8,
        pub out_mac: [u8; 6],
        pub out_ifindex: u32,
        pub last_seen_ns: u64,
        pub service_id: u32,
        pub _pad2: u32,
    }

    // SAFETY: as above.
    unsafe impl aya::Pod for CtValue {}

    /// As for [`CtValue4`].
    impl From<CtValue> for proxy_common::CtValue {
        fn from(old: CtValue) -> Self {
            Self {
                src: old.src,
                dst: old.dst,
                sport: old.sport,
                dport: old.dport,
                flags: old.flags,
                _pad: 0,
                out_mac: old.out_mac,
                out_ifindex: old.out_ifindex,
                last_seen_ns: old.last_seen_ns,
                service_id: old.service_id,
                _pad2: 0,
                next_hop: NextHop::NONE,
            }
        }
    }

    /// Every entry of an IPv4 conntrack map of version 2 into the map `name` of this version.
    pub fn copy_ct4(
        old: &Map,
        pin_dir: &Path,
        name: &str,
        flags: u64,
    ) -> Result<CopyCount, MapError> {
        copy_converted(
            old,
            &mut open(pin_dir, name)?,
            flags,
            |key: CtKey4, value: CtValue4| Some((key, proxy_common::CtValue4::from(value))),
        )
    }

    /// Every entry of an IPv6 conntrack map of version 2 into the map `name` of this version.
    pub fn copy_ct6(
        old: &Map,
        pin_dir: &Path,
        name: &str,
        flags: u64,
    ) -> Result<CopyCount, MapError> {
        copy_converted(
            old,
            &mut open(pin_dir, name)?,
            flags,
            |key: CtKey, value: CtValue| Some((key, proxy_common::CtValue::from(value))),
        )
    }
}

/// What one copy did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyCount {
    pub copied: usize,
    /// Entries the new map already had (second copy) or that the conversion drops.
    pub skipped: usize,
    /// Inserts the kernel refused (a full map).
    pub failed: usize,
}

impl CopyCount {
    /// Counts one insert's result.
    fn add(&mut self, inserted: Result<(), MapError>) {
        match inserted {
            Ok(()) => self.copied += 1,
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                self.skipped += 1;
            }
            Err(_) => self.failed += 1,
        }
    }
}

fn copy_converted<OK: Pod, OV: Pod, NK: Pod, NV: Pod>(
    old: &Map,
    new: &mut Map,
    flags: u64,
    convert: fn(OK, OV) -> Option<(NK, NV)>,
) -> Result<CopyCount, MapError> {
    let old = HashMap::<&MapData, OK, OV>::try_from(old)?;
    let mut new = HashMap::<&mut MapData, NK, NV>::try_from(new)?;
    let mut count = CopyCount::default();
    // Entries deleted under the walk (LRU eviction, a closing socket) are skipped.
    for (key, value) in old.iter().flatten() {
        let Some((key, value)) = convert(key, value) else {
            count.skipped += 1;
            continue;
        };
        count.add(new.insert(key, value, flags));
    }
    Ok(count)
}

/// A map being migrated: the old map, unpinned but open until the second copy.
#[derive(Debug)]
struct Pending {
    migration: &'static Migration,
    old: Map,
}

/// What [`plan`] decided for the pin directory.
#[derive(Debug, Default)]
pub struct Plan {
    pending: Vec<Pending>,
    /// Maps unpinned because their layout is unknown: they start empty.
    pub rebuilt: Vec<&'static str>,
}

/// Where a pinned map's layout comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// `KPR_LAYOUTS` has a record whose sizes are the map's.
    Recorded(u32),
    /// No (matching) record: only the sizes are known.
    Unrecorded,
}

/// What to do with one pinned map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    Adopt,
    Migrate(&'static Migration),
    Rebuild,
}

fn decide(current: &Layout, found: Found, key_size: u32, value_size: u32) -> Decision {
    let sizes_match = |l: &Layout| l.key_size == key_size && l.value_size == value_size;
    let older = OLDER.iter().filter(|m| m.from.name == current.name);
    match found {
        Found::Recorded(version) if version == current.version && sizes_match(current) => {
            Decision::Adopt
        }
        Found::Recorded(version) => older
            .into_iter()
            .find(|m| m.from.version == version && sizes_match(&m.from))
            .map_or(Decision::Rebuild, Decision::Migrate),
        // The sizes decide only when exactly one known layout has them.
        Found::Unrecorded => {
            let older: Vec<&'static Migration> = older.filter(|m| sizes_match(&m.from)).collect();
            match (sizes_match(current), older.as_slice()) {
                (true, []) => Decision::Adopt,
                (false, [one]) => Decision::Migrate(one),
                _ => Decision::Rebuild,
            }
        }
    }
}

/// The records of `KPR_LAYOUTS` in `pin_dir` (none if it is not pinned or unreadable).
fn read_records(pin_dir: &Path) -> Vec<(String, LayoutRecord)> {
    let pin = pin_dir.join(LAYOUTS);
    if !pin.exists() {
        return Vec::new();
    }
    let map = MapData::from_pin(&pin)
        .and_then(Map::from_map_data)
        .and_then(HashMap::<MapData, LayoutKey, LayoutRecord>::try_from);
    match map {
        Ok(map) => map
            .iter()
            .flatten()
            .map(|(key, record)| {
                let end = key.name.iter().position(|&b| b == 0).unwrap_or(NAME_LEN);
                (
                    String::from_utf8_lossy(&key.name[..end]).into_owned(),
                    record,
                )
            })
            .collect(),
        Err(error) => {
            warn!(pin = %pin.display(), %error, "cannot read the pinned maps' layout records; \
                judging the maps by their key and value sizes");
            Vec::new()
        }
    }
}

/// Decides, for every pinned map of `pin_dir`, whether it is adopted, migrated or rebuilt;
/// unpins the last two (a migrated map stays open in the plan). Before the object loads.
pub fn plan(pin_dir: &Path) -> std::io::Result<Plan> {
    let records = read_records(pin_dir);
    let mut plan = Plan::default();
    for current in current() {
        let pin = pin_dir.join(current.name);
        if !pin.exists() {
            continue;
        }
        let data = match MapData::from_pin(&pin) {
            Ok(data) => data,
            Err(error) => {
                warn!(map = current.name, %error, "cannot open the pinned map; it starts empty");
                crate::attach::pin_files::remove_if_present(&pin)?;
                plan.rebuilt.push(current.name);
                continue;
            }
        };
        let info = MapInfo::from_pin(&pin).ok();
        let (key_size, value_size) = info
            .as_ref()
            .map_or((0, 0), |i| (i.key_size(), i.value_size()));
        let record = records
            .iter()
            .find(|(name, _)| name == current.name)
            .map(|(_, r)| *r);
        // A record whose sizes are not the map's was not written for this map (a crash
        // between unpinning and recording): the sizes are all that is known then.
        let found = match record {
            Some(r) if r.key_size == key_size && r.value_size == value_size => {
                Found::Recorded(r.version)
            }
            _ => Found::Unrecorded,
        };
        let decision = if type_matches(current.name, info.as_ref()) {
            decide(&current, found, key_size, value_size)
        } else {
            Decision::Rebuild
        };
        match decision {
            Decision::Adopt => {}
            Decision::Migrate(migration) => match Map::from_map_data(data) {
                Ok(old) => {
                    info!(
                        map = current.name,
                        from_version = migration.from.version,
                        to_version = current.version,
                        key_size,
                        value_size,
                        "pinned map has an older layout; its entries are migrated to this \
                         version's"
                    );
                    crate::attach::pin_files::remove_if_present(&pin)?;
                    plan.pending.push(Pending { migration, old });
                }
                Err(error) => {
                    warn!(map = current.name, %error, "cannot read the pinned map in its older \
                        layout; it starts empty");
                    crate::attach::pin_files::remove_if_present(&pin)?;
                    plan.rebuilt.push(current.name);
                }
            },
            Decision::Rebuild => {
                let version = match found {
                    Found::Recorded(v) => v.to_string(),
                    Found::Unrecorded => "unrecorded".to_owned(),
                };
                let consequence = match holds(current.name) {
                    Holds::ServiceState => {
                        "its entries are written again from the Services before this agent's \
                         programs replace the running ones"
                    }
                    Holds::DatapathState(lost) => lost,
                    Holds::Counters => "its counters start from 0",
                };
                // An older agent's layout of what the first sync writes again (the hash maps
                // the backend arrays replaced): expected at an upgrade, nothing is lost.
                let older_service_state = holds(current.name) == Holds::ServiceState
                    && match found {
                        Found::Recorded(v) => v < current.version,
                        Found::Unrecorded => !type_matches(current.name, info.as_ref()),
                    };
                if older_service_state {
                    info!(
                        map = current.name,
                        version = %version,
                        this_version = current.version,
                        consequence,
                        "pinned map has an older layout of service state; it is rebuilt"
                    );
                    crate::attach::pin_files::remove_if_present(&pin)?;
                    plan.rebuilt.push(current.name);
                    continue;
                }
                warn!(
                    map = current.name,
                    version = %version,
                    key_size,
                    value_size,
                    this_version = current.version,
                    this_key_size = current.key_size,
                    this_value_size = current.value_size,
                    consequence,
                    "pinned map has a layout this agent does not know (a newer or foreign \
                     agent's); it is rebuilt empty"
                );
                crate::attach::pin_files::remove_if_present(&pin)?;
                plan.rebuilt.push(current.name);
            }
        }
    }
    plan_retired(pin_dir, &records, &mut plan)?;
    rebuild_with_the_others(pin_dir, &mut plan)?;
    Ok(plan)
}

/// The pinned maps of [`OLDER`] that this build replaced by maps of other names: migrated into
/// them when their layout is the registered one, else unpinned (they would only hold memory).
fn plan_retired(
    pin_dir: &Path,
    records: &[(String, LayoutRecord)],
    plan: &mut Plan,
) -> std::io::Result<()> {
    let mut names: Vec<&str> = OLDER
        .iter()
        .filter(|m| m.retired())
        .map(|m| m.from.name)
        .collect();
    names.dedup();
    for name in names {
        let pin = pin_dir.join(name);
        if !pin.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&pin).ok();
        let sizes = info
            .as_ref()
            .map_or((0, 0), |i| (i.key_size(), i.value_size()));
        let recorded = records
            .iter()
            .find(|(recorded, _)| recorded == name)
            .map(|(_, r)| r.version);
        // A retired map went through layouts of its own before it was retired: the one that
        // matches the pinned map's sizes (and its record, where it has one) converts it.
        let migration = OLDER.iter().find(|m| {
            m.from.name == name
                && sizes == (m.from.key_size, m.from.value_size)
                && recorded.is_none_or(|version| version == m.from.version)
        });
        let old = MapData::from_pin(&pin).and_then(Map::from_map_data);
        crate::attach::pin_files::remove_if_present(&pin)?;
        match (old, migration) {
            (Ok(old), Some(migration)) => {
                info!(
                    map = name,
                    version = migration.from.version,
                    into = ?migration.into,
                    "pinned map replaced by this version's; its entries are migrated"
                );
                plan.pending.push(Pending { migration, old });
            }
            _ => warn!(
                map = name,
                key_size = sizes.0,
                value_size = sizes.1,
                "pinned map of an older agent in a layout this agent does not know; unpinned"
            ),
        }
    }
    Ok(())
}

/// The service maps the agent fills together: they refer to each other by service and backend
/// id, which the agent allocates anew when it fills an empty frontend map.
const ID_LINKED: [&str; 9] = [
    map_names::FRONTENDS4,
    map_names::FRONTENDS6,
    map_names::BACKEND_SLOTS,
    map_names::BACKENDS4,
    map_names::BACKENDS6,
    map_names::AFFINITY_MATCH,
    map_names::SOURCE_RANGES,
    map_names::MAGLEV,
    map_names::SERVICE_NAMES,
];

/// One rebuilt id-linked map takes the others with it: the previous agent's programs keep
/// serving with their own complete set until this agent's first sync has filled the new one,
/// instead of reading slots or backends this agent rewrites under the ids it allocates.
fn rebuild_with_the_others(pin_dir: &Path, plan: &mut Plan) -> std::io::Result<()> {
    let Some(&cause) = plan.rebuilt.iter().find(|name| ID_LINKED.contains(name)) else {
        return Ok(());
    };
    for name in ID_LINKED {
        let pin = pin_dir.join(name);
        if plan.rebuilt.contains(&name) || !pin.exists() {
            continue;
        }
        info!(
            map = name,
            with = cause,
            "service map rebuilt with the one of unknown layout (they share service and backend \
             ids); filled again by the first sync"
        );
        crate::attach::pin_files::remove_if_present(&pin)?;
        plan.rebuilt.push(name);
    }
    Ok(())
}

impl Plan {
    /// Whether a map the agent refills from the Services starts empty.
    pub fn rebuilds_service_state(&self) -> bool {
        self.rebuilt
            .iter()
            .any(|name| holds(name) == Holds::ServiceState)
    }

    pub fn migrates(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Copies the old maps' entries into the new maps pinned in `pin_dir`. `last`: after the
    /// new programs replaced the old ones, so nothing writes the old maps any more: entries are
    /// added only where the new map has none, and the old maps are closed.
    pub fn copy(&mut self, pin_dir: &Path, last: bool) {
        let flags = if last { BPF_NOEXIST } else { 0 };
        for pending in &self.pending {
            let name = pending.migration.from.name;
            let result = (pending.migration.copy)(&pending.old, pin_dir, flags);
            match result {
                Ok(count) if count.failed > 0 => warn!(
                    map = name,
                    copied = count.copied,
                    failed = count.failed,
                    "some entries of the older layout did not fit the new map"
                ),
                Ok(count) => info!(
                    map = name,
                    from_version = pending.migration.from.version,
                    into = ?pending.migration.into,
                    copied = count.copied,
                    skipped = count.skipped,
                    after_attach = last,
                    "entries migrated from the older layout"
                ),
                Err(error) => {
                    warn!(map = name, %error, "migrating the older layout's entries failed; the map keeps what it has")
                }
            }
        }
        if last {
            self.pending.clear();
        }
    }
}

/// Records this build's layout of every map in `KPR_LAYOUTS` (created and pinned if absent).
/// Best effort: without records the next agent judges the maps by their sizes.
pub fn write_records(pin_dir: &Path) {
    let pin = pin_dir.join(LAYOUTS);
    let created = if pin.exists() {
        Ok(())
    } else {
        // `pin` consumes the map; the pin keeps it, reopened below.
        HashMap::<MapData, LayoutKey, LayoutRecord>::create(LAYOUTS_CAPACITY, 0).and_then(|map| {
            map.pin(&pin).map_err(|error| MapError::PinError {
                name: Some(LAYOUTS.to_owned()),
                error,
            })
        })
    };
    let map = created.and_then(|()| {
        MapData::from_pin(&pin)
            .and_then(Map::from_map_data)
            .and_then(HashMap::<MapData, LayoutKey, LayoutRecord>::try_from)
    });
    let mut map = match map {
        Ok(map) => map,
        Err(error) => {
            warn!(pin = %pin.display(), %error, "cannot record the pinned maps' layouts");
            return;
        }
    };
    for layout in current() {
        let Some(key) = LayoutKey::new(layout.name) else {
            continue;
        };
        let record = LayoutRecord {
            version: layout.version,
            key_size: layout.key_size,
            value_size: layout.value_size,
            _pad: 0,
        };
        if map.get(&key, 0).ok() != Some(record)
            && let Err(error) = map.insert(key, record, 0)
        {
            warn!(map = layout.name, %error, "cannot record the map's layout");
        }
    }
}

#[cfg(test)]
mod tests;
