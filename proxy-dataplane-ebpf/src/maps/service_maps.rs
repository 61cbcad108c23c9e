//! The service maps as typed handles: the [`MapOps`] the map writer writes through, and
//! their whole content read back (adoption, drift check).

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
};

use aya::maps::{
    Array, HashMap, MapData, PerCpuHashMap,
    lpm_trie::{Key, LpmTrie},
};
use ipnet::IpNet;
use proxy_common::{
    AffinityMatchKey, Backend4, Backend6, BackendEntry, BackendSlotKey, EndpointTrafficKey,
    Frontend4Key, Frontend6Key, FrontendValue, MaglevBlock, MaglevKey, PortFilter, RevNat4,
    RevNat4Key, RevNat6, RevNat6Key, ServicePackets, ServiceTraffic, SlotBlock, SourceRangeKey,
    map_names,
};

use crate::{
    MapOps, MapWriteError,
    maps::map_writer::{
        BackendValue, FrontendMapKey, MapsContent, ip4_from_map, ip4_to_map, ip6_from_map,
        ip6_to_map,
    },
    maps::port_filter::PortFilterMap,
    maps::touched_keys::Touched,
};
use proxy_kernel::bpf::{
    map_batch::{BatchReader, read_all, read_array_below, update_all, update_array_all},
    sockdiag::DiagSocket,
};

/// The service maps as typed handles.
pub(crate) struct ServiceMaps {
    pub(crate) frontends4: HashMap<MapData, Frontend4Key, FrontendValue>,
    pub(crate) frontends6: HashMap<MapData, Frontend6Key, FrontendValue>,
    pub(crate) slots: HashMap<MapData, BackendSlotKey, SlotBlock>,
    /// Indexed by backend id; a removed backend is the zero value (`BackendEntry`).
    pub(crate) backends4: Array<MapData, Backend4>,
    pub(crate) backends6: Array<MapData, Backend6>,
    pub(crate) affinity_match: HashMap<MapData, AffinityMatchKey, u8>,
    pub(crate) revnat4: HashMap<MapData, RevNat4Key, RevNat4>,
    pub(crate) revnat6: HashMap<MapData, RevNat6Key, RevNat6>,
    pub(crate) source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    pub(crate) maglev: HashMap<MapData, MaglevKey, MaglevBlock>,
    /// Each service id's traffic counters (written by the programs; zeroed here when an id is
    /// handed out again).
    pub(crate) traffic: Array<MapData, ServiceTraffic>,
    /// Each service id's packets and bytes (per CPU, written by the programs; the id's entry
    /// deleted here when it is handed out again).
    pub(crate) packets: PerCpuHashMap<MapData, u32, ServicePackets>,
    /// Each service id's new connections by endpoint (`--service-traffic-endpoints`; the id's
    /// entries deleted here when it is handed out again).
    pub(crate) endpoints: HashMap<MapData, EndpointTrafficKey, u64>,
    /// The programs' port filter (`None` in the drift reader's copy, which never writes).
    pub(crate) port_filter: Option<PortFilterMap>,
    /// While a drift check is out: the keys written or deleted since it started.
    pub(crate) touched: Option<Touched>,
    /// `KPR_ENDPOINT_TRAFFIC`'s keys by service id, read at the first id handed out in an
    /// apply (`None` until then). Finding an id's keys means walking the whole map: the
    /// kernel's first-key lookup scans every bucket even when the map is empty, ~100 µs at
    /// 64k buckets, which once per new frontend was most of a cold start's map writes.
    pub(crate) endpoint_keys: Option<std::collections::BTreeMap<u32, Vec<EndpointTrafficKey>>>,
    /// Service ids from this one up have never been handed out since the counters were created
    /// empty (`None`: they were pinned by an earlier run): nothing to reset for them. A cold
    /// start hands out ids upwards, so its frontends skip the two writes a reset costs.
    pub(crate) uncounted_from: Option<u32>,
    /// While a first fill is staged ([`ServiceMaps::begin_staging`]): its frontend, slot and
    /// backend writes, held for large batches.
    pub(crate) staged: Option<Staged>,
}

/// The frontend, slot and backend writes of a first fill (every map of ours empty before it),
/// held back and written in large batches: one update call per frontend and one per
/// frontend's slots were most of a cold start's first sync (a syscall each, about as dear as
/// the update itself). Written in dependency order — backends, then slots, then frontends —
/// so no frontend is in a map before what it refers to, as the map writer's protocol wants;
/// every delete writes what is held first, so no delete overtakes an earlier write. The other
/// maps (Maglev, source ranges, affinity matches, counters, port filter) are written at once:
/// a frontend's entries there come before the frontend itself either way.
#[derive(Default)]
pub(crate) struct Staged {
    backends4: Vec<(u32, Backend4)>,
    backends6: Vec<(u32, Backend6)>,
    slots: Vec<(BackendSlotKey, SlotBlock)>,
    frontends4: Vec<(Frontend4Key, FrontendValue)>,
    frontends6: Vec<(Frontend6Key, FrontendValue)>,
    /// How much of each list (in the order above) is in the maps already.
    written: [usize; 5],
    /// The entries written at once meanwhile, taken out again if the fill fails.
    maglev: Vec<MaglevKey>,
    source_ranges: Vec<(u32, IpNet)>,
    affinity_matches: Vec<AffinityMatchKey>,
    /// The first write that failed: nothing more is written.
    failed: Option<MapWriteError>,
}

/// Entries per batch call: bounds the kernel's time in one call, with the syscall's cost
/// already spread thin.
const STAGED_BATCH: usize = 8192;

/// The LPM key of a frontend's source range: 32 bits of service id, then the prefix.
pub(crate) fn source_range_key(service_id: u32, range: IpNet) -> Key<SourceRangeKey> {
    let (addr, bits) = match range.trunc() {
        IpNet::V4(net) => ([ip4_to_map(net.network()), 0, 0, 0], net.prefix_len()),
        IpNet::V6(net) => (ip6_to_map(net.network()), net.prefix_len()),
    };
    Key::new(32 + u32::from(bits), SourceRangeKey { service_id, addr })
}

pub(crate) fn source_range_of(key: &Key<SourceRangeKey>, v6: bool) -> Option<(u32, IpNet)> {
    let data = key.data();
    let bits = u8::try_from(key.prefix_len().checked_sub(32)?).ok()?;
    let net = if v6 {
        IpNet::new(IpAddr::V6(ip6_from_map(data.addr)), bits).ok()?
    } else {
        IpNet::new(IpAddr::V4(ip4_from_map(data.addr[0])), bits).ok()?
    };
    Some((data.service_id, net))
}

impl ServiceMaps {
    /// Holds the frontend, slot and backend writes from now on, for [`ServiceMaps::finish_staging`]
    /// (see [`Staged`]): only for a first fill, into maps that hold none of our entries.
    pub(crate) fn begin_staging(&mut self) {
        self.staged = Some(Staged::default());
    }

    /// Writes what is held and ends the staging. On an error every staged entry is taken out
    /// of the maps again (they held none before) and the error returned: the caller writes
    /// the fill again entry by entry, which names what does not fit.
    pub(crate) fn finish_staging(&mut self) -> Result<(), MapWriteError> {
        self.write_staged();
        let Some(mut staged) = self.staged.take() else {
            return Ok(());
        };
        let Some(error) = staged.failed.take() else {
            return Ok(());
        };
        for (key, _) in &staged.frontends4 {
            let _ = self.frontends4.remove(key);
        }
        for (key, _) in &staged.frontends6 {
            let _ = self.frontends6.remove(key);
        }
        for (key, _) in &staged.slots {
            let _ = self.slots.remove(key);
        }
        for (id, _) in &staged.backends4 {
            let _ = self.backends4.set(*id, Backend4::default(), 0);
        }
        for (id, _) in &staged.backends6 {
            let _ = self.backends6.set(*id, Backend6::default(), 0);
        }
        for key in &staged.maglev {
            let _ = self.maglev.remove(key);
        }
        for &(service_id, range) in &staged.source_ranges {
            let _ = self
                .source_ranges
                .remove(&source_range_key(service_id, range));
        }
        for key in &staged.affinity_matches {
            let _ = self.affinity_match.remove(key);
        }
        Err(error)
    }

    /// Writes what is held and not yet written, in dependency order (see [`Staged`]).
    fn write_staged(&mut self) {
        let Some(staged) = &mut self.staged else {
            return;
        };
        if staged.failed.is_some() {
            return;
        }
        let result = (|| {
            write_from(&mut staged.written[0], &staged.backends4, |chunk| {
                update_array_all(&mut self.backends4, chunk)
                    .map_err(|e| map_error(map_names::BACKENDS4, e))
            })?;
            write_from(&mut staged.written[1], &staged.backends6, |chunk| {
                update_array_all(&mut self.backends6, chunk)
                    .map_err(|e| map_error(map_names::BACKENDS6, e))
            })?;
            write_from(&mut staged.written[2], &staged.slots, |chunk| {
                update_all(&mut self.slots, chunk)
                    .map_err(|e| map_error(map_names::BACKEND_SLOTS, e))
            })?;
            write_from(&mut staged.written[3], &staged.frontends4, |chunk| {
                update_all(&mut self.frontends4, chunk)
                    .map_err(|e| map_error(map_names::FRONTENDS4, e))
            })?;
            write_from(&mut staged.written[4], &staged.frontends6, |chunk| {
                update_all(&mut self.frontends6, chunk)
                    .map_err(|e| map_error(map_names::FRONTENDS6, e))
            })
        })();
        if let Err(error) = result {
            staged.failed = Some(error);
        }
    }

    /// The id's `KPR_ENDPOINT_TRAFFIC` keys, from one walk of the map per apply. Exact for an
    /// id handed out: no frontend has it, so no program adds keys for it, and a frontend
    /// deleted since the walk drops the walk (`delete_frontend`).
    fn endpoint_keys_of(&mut self, service_id: u32) -> Vec<EndpointTrafficKey> {
        let endpoints = &self.endpoints;
        let keys = self.endpoint_keys.get_or_insert_with(|| {
            let mut entries = Vec::new();
            read_all(
                endpoints,
                &mut BatchReader::default(),
                map_names::ENDPOINT_TRAFFIC,
                &mut entries,
            );
            let mut by_id = std::collections::BTreeMap::<u32, Vec<EndpointTrafficKey>>::new();
            for (key, _) in entries {
                by_id.entry(key.service_id).or_default().push(key);
            }
            by_id
        });
        keys.remove(&service_id).unwrap_or_default()
    }
}

impl MapOps for ServiceMaps {
    fn begin_apply(&mut self) {
        self.endpoint_keys = None;
    }
    fn reset_traffic(&mut self, service_id: u32) {
        if let Some(from) = &mut self.uncounted_from
            && service_id >= *from
        {
            *from = service_id.saturating_add(1);
            return;
        }
        // Past the array's end when counting is off: nothing to reset.
        if service_id < self.traffic.len()
            && let Err(error) = self.traffic.set(service_id, ServiceTraffic::default(), 0)
        {
            // Costs only the counts: the new frontend starts from the old one's.
            tracing::debug!(service_id, %error, "traffic counters not reset");
        }
        // Absent unless the id's frontend was reached through tc.
        let _ = self.packets.remove(&service_id);
        for key in self.endpoint_keys_of(service_id) {
            // Gone already if the walk raced a delete: nothing to reset.
            let _ = self.endpoints.remove(&key);
        }
    }
    fn put_frontend(
        &mut self,
        key: FrontendMapKey,
        value: FrontendValue,
    ) -> Result<(), MapWriteError> {
        if let Some(touched) = &mut self.touched {
            touched.frontend(key);
            touched.service(value.service_id);
        }
        if let Some(staged) = &mut self.staged {
            match key {
                FrontendMapKey::V4(key) => staged.frontends4.push((key, value)),
                FrontendMapKey::V6(key) => staged.frontends6.push((key, value)),
            }
            return Ok(());
        }
        match key {
            FrontendMapKey::V4(key) => self
                .frontends4
                .insert(key, value, 0)
                .map_err(|e| map_error(map_names::FRONTENDS4, e)),
            FrontendMapKey::V6(key) => self
                .frontends6
                .insert(key, value, 0)
                .map_err(|e| map_error(map_names::FRONTENDS6, e)),
        }
    }
    fn delete_frontend(&mut self, key: FrontendMapKey) -> Result<(), MapWriteError> {
        self.write_staged();
        // Its id goes free later; the programs may still count for it until then.
        self.endpoint_keys = None;
        if let Some(touched) = &mut self.touched {
            touched.frontend(key);
        }
        match key {
            FrontendMapKey::V4(key) => {
                ignore_missing(map_names::FRONTENDS4, self.frontends4.remove(&key))
            }
            FrontendMapKey::V6(key) => {
                ignore_missing(map_names::FRONTENDS6, self.frontends6.remove(&key))
            }
        }
    }
    fn put_slot(&mut self, key: BackendSlotKey, block: SlotBlock) -> Result<(), MapWriteError> {
        if let Some(touched) = &mut self.touched {
            touched.slot(key);
        }
        if let Some(staged) = &mut self.staged {
            staged.slots.push((key, block));
            return Ok(());
        }
        self.slots
            .insert(key, block, 0)
            .map_err(|e| map_error(map_names::BACKEND_SLOTS, e))
    }
    fn put_slots(&mut self, slots: &[(BackendSlotKey, SlotBlock)]) -> Result<(), MapWriteError> {
        if let Some(touched) = &mut self.touched {
            for &(key, _) in slots {
                touched.slot(key);
            }
        }
        if let Some(staged) = &mut self.staged {
            staged.slots.extend_from_slice(slots);
            return Ok(());
        }
        update_all(&mut self.slots, slots).map_err(|e| map_error(map_names::BACKEND_SLOTS, e))
    }
    fn delete_slot(&mut self, key: BackendSlotKey) -> Result<(), MapWriteError> {
        self.write_staged();
        if let Some(touched) = &mut self.touched {
            touched.slot(key);
        }
        ignore_missing(map_names::BACKEND_SLOTS, self.slots.remove(&key))
    }
    fn put_backend(&mut self, id: u32, backend: BackendValue) -> Result<(), MapWriteError> {
        if let Some(touched) = &mut self.touched {
            touched.backend_value(id, &backend);
        }
        if let Some(staged) = &mut self.staged {
            match backend {
                BackendValue::V4(b) => staged.backends4.push((id, b)),
                BackendValue::V6(b) => staged.backends6.push((id, b)),
            }
            return Ok(());
        }
        match backend {
            BackendValue::V4(b) => self
                .backends4
                .set(id, b, 0)
                .map_err(|e| map_error(map_names::BACKENDS4, e)),
            BackendValue::V6(b) => self
                .backends6
                .set(id, b, 0)
                .map_err(|e| map_error(map_names::BACKENDS6, e)),
        }
    }
    fn put_backends(&mut self, backends: &[(u32, BackendValue)]) -> Result<(), MapWriteError> {
        let mut v4 = Vec::new();
        let mut v6 = Vec::new();
        for &(id, backend) in backends {
            if let Some(touched) = &mut self.touched {
                touched.backend_value(id, &backend);
            }
            match backend {
                BackendValue::V4(b) => v4.push((id, b)),
                BackendValue::V6(b) => v6.push((id, b)),
            }
        }
        if let Some(staged) = &mut self.staged {
            staged.backends4.append(&mut v4);
            staged.backends6.append(&mut v6);
            return Ok(());
        }
        update_array_all(&mut self.backends4, &v4)
            .map_err(|e| map_error(map_names::BACKENDS4, e))?;
        update_array_all(&mut self.backends6, &v6).map_err(|e| map_error(map_names::BACKENDS6, e))
    }
    fn delete_backend(&mut self, id: u32, backend: BackendValue) -> Result<(), MapWriteError> {
        self.write_staged();
        if let Some(touched) = &mut self.touched {
            touched.backend(id);
        }
        // An array element cannot be deleted: the zero value is "no backend" to every reader.
        // An id past the end was never written, so there is nothing to clear.
        let cleared = match backend {
            BackendValue::V4(_) => (
                map_names::BACKENDS4,
                self.backends4.set(id, Backend4::default(), 0),
            ),
            BackendValue::V6(_) => (
                map_names::BACKENDS6,
                self.backends6.set(id, Backend6::default(), 0),
            ),
        };
        match cleared {
            (_, Ok(()) | Err(aya::maps::MapError::OutOfBounds { .. })) => Ok(()),
            (map, Err(error)) => Err(map_error(map, error)),
        }
    }
    fn put_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError> {
        if let Some(touched) = &mut self.touched {
            touched.affinity_match(key);
        }
        if let Some(staged) = &mut self.staged {
            staged.affinity_matches.push(key);
        }
        self.affinity_match
            .insert(key, 1, 0)
            .map_err(|e| map_error(map_names::AFFINITY_MATCH, e))
    }
    fn delete_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError> {
        self.write_staged();
        if let Some(touched) = &mut self.touched {
            touched.affinity_match(key);
        }
        ignore_missing(map_names::AFFINITY_MATCH, self.affinity_match.remove(&key))
    }
    fn put_source_range(&mut self, service_id: u32, range: IpNet) -> Result<(), MapWriteError> {
        if let Some(touched) = &mut self.touched {
            touched.source_ranges_of(service_id);
        }
        if let Some(staged) = &mut self.staged {
            staged.source_ranges.push((service_id, range));
        }
        self.source_ranges
            .insert(&source_range_key(service_id, range), 1, 0)
            .map_err(|e| map_error(map_names::SOURCE_RANGES, e))
    }
    fn delete_source_range(&mut self, service_id: u32, range: IpNet) -> Result<(), MapWriteError> {
        self.write_staged();
        if let Some(touched) = &mut self.touched {
            touched.source_ranges_of(service_id);
        }
        ignore_missing(
            map_names::SOURCE_RANGES,
            self.source_ranges
                .remove(&source_range_key(service_id, range)),
        )
    }
    fn put_maglev(&mut self, key: MaglevKey, block: MaglevBlock) -> Result<(), MapWriteError> {
        if let Some(touched) = &mut self.touched {
            touched.maglev(key);
        }
        if let Some(staged) = &mut self.staged {
            staged.maglev.push(key);
        }
        self.maglev
            .insert(key, block, 0)
            .map_err(|e| map_error(map_names::MAGLEV, e))
    }
    fn delete_maglev(&mut self, key: MaglevKey) -> Result<(), MapWriteError> {
        self.write_staged();
        if let Some(touched) = &mut self.touched {
            touched.maglev(key);
        }
        ignore_missing(map_names::MAGLEV, self.maglev.remove(&key))
    }
    fn add_ports(&mut self, destination: u16, sources: impl Iterator<Item = u16>) {
        if let Some(filter) = &self.port_filter {
            filter.add(destination, sources);
        }
    }
    fn arm_ports(&mut self, in_use: &PortFilter) {
        if let Some(filter) = &self.port_filter {
            filter.arm(in_use);
        }
    }
}

impl ServiceMaps {
    /// Everything in the service maps, for [`MapWriter::adopt`] and the drift check: the hash
    /// maps in batches (`map_batch`), the LPM trie entry by entry (the kernel has no batch
    /// lookup for it), the backend arrays as `arrays` says. Entries deleted under an
    /// entry-by-entry walk are skipped.
    pub(crate) fn content(&self, reader: &mut BatchReader, arrays: BackendArrays) -> MapsContent {
        let mut content = MapsContent::default();
        let mut frontends4 = Vec::new();
        read_all(
            &self.frontends4,
            reader,
            map_names::FRONTENDS4,
            &mut frontends4,
        );
        let mut frontends6 = Vec::new();
        read_all(
            &self.frontends6,
            reader,
            map_names::FRONTENDS6,
            &mut frontends6,
        );
        content
            .frontends
            .reserve(frontends4.len() + frontends6.len());
        content.frontends.extend(
            frontends4
                .into_iter()
                .map(|(k, v)| (FrontendMapKey::V4(k), v)),
        );
        content.frontends.extend(
            frontends6
                .into_iter()
                .map(|(k, v)| (FrontendMapKey::V6(k), v)),
        );
        // Collected rather than inserted one by one: the standard library sorts once and
        // builds the tree in bulk.
        let mut slots = Vec::new();
        read_all(&self.slots, reader, map_names::BACKEND_SLOTS, &mut slots);
        content.slots = slots.into_iter().collect();
        let mut maglev = Vec::new();
        read_all(&self.maglev, reader, map_names::MAGLEV, &mut maglev);
        content.maglev = maglev.into_iter().collect();
        // Only the indices holding a backend are entries.
        let (end4, end6) = arrays.ends(&content);
        let mut backends4 = Vec::new();
        read_array_below(
            &self.backends4,
            reader,
            map_names::BACKENDS4,
            end4,
            BackendEntry::in_use,
            &mut backends4,
        );
        let mut backends6 = Vec::new();
        read_array_below(
            &self.backends6,
            reader,
            map_names::BACKENDS6,
            end6,
            BackendEntry::in_use,
            &mut backends6,
        );
        content.backends = backends4
            .into_iter()
            .map(|(id, b)| (id, BackendValue::V4(b)))
            .chain(
                backends6
                    .into_iter()
                    .map(|(id, b)| (id, BackendValue::V6(b))),
            )
            .collect();
        // The value is always 1 and never compared: a key is the whole entry.
        let mut matches = Vec::new();
        read_all(
            &self.affinity_match,
            reader,
            map_names::AFFINITY_MATCH,
            &mut matches,
        );
        content.affinity_matches = matches.into_iter().map(|(key, _)| key).collect();
        // The family is not in the key: a range belongs to a frontend of one family, so the
        // frontend's service id tells which reading is right.
        let v6_services: BTreeSet<u32> = content
            .frontends
            .iter()
            .filter(|(key, _)| matches!(key, FrontendMapKey::V6(_)))
            .map(|(_, value)| value.service_id)
            .collect();
        for key in self.source_ranges.keys().flatten() {
            let v6 = v6_services.contains(&key.data().service_id);
            if let Some(range) = source_range_of(&key, v6) {
                content.source_ranges.insert(range);
            }
        }
        content
    }

    /// Whether our datapath translated `socket` to its destination through `frontend`.
    pub(crate) fn translated_via(&self, socket: &DiagSocket, frontend: SocketAddr) -> bool {
        let destination = socket.destination;
        match (destination.ip(), frontend.ip()) {
            (IpAddr::V4(backend), IpAddr::V4(service)) => {
                let key = RevNat4Key {
                    cookie: socket.cookie,
                    addr: ip4_to_map(backend),
                    port: destination.port().to_be(),
                    _pad: 0,
                };
                self.revnat4.get(&key, 0).is_ok_and(|revnat| {
                    revnat.addr == ip4_to_map(service) && revnat.port == frontend.port().to_be()
                })
            }
            (IpAddr::V6(backend), IpAddr::V6(service)) => {
                let key = RevNat6Key {
                    cookie: socket.cookie,
                    addr: ip6_to_map(backend),
                    port: destination.port().to_be(),
                    _pad: [0; 3],
                };
                self.revnat6.get(&key, 0).is_ok_and(|revnat| {
                    revnat.addr == ip6_to_map(service) && revnat.port == frontend.port().to_be()
                })
            }
            _ => false,
        }
    }
}

/// How much of the backend arrays [`ServiceMaps::content`] reads. An array has every index
/// up to its length (`--bpf-map-backends`, 524k with the benchmark's flags), and reading all
/// of both families' took a restart at 50k Services a third of a second for 100k backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackendArrays {
    /// Every index: the drift check reports (and removes) backends no slot names too.
    Whole,
    /// The indices up to the highest backend id a slot read holds, in the arrays of the
    /// families frontends were read for: all an adopted record can reach. A backend past it is
    /// neither read nor removed as an orphan; no slot names it, and an id handed out again is
    /// written before any slot names it (backends, then slots, then frontends).
    NamedBySlots,
}

impl BackendArrays {
    /// The end (exclusive) of the indices to read in the IPv4 and the IPv6 array, given the
    /// frontends and slots already read.
    fn ends(self, content: &MapsContent) -> (u32, u32) {
        match self {
            Self::Whole => (u32::MAX, u32::MAX),
            Self::NamedBySlots => {
                let end = content
                    .slots
                    .values()
                    .flat_map(|block| block.backend_ids)
                    .max()
                    .map_or(0, |highest| highest.saturating_add(1));
                let has = |v6: bool| {
                    content
                        .frontends
                        .iter()
                        .any(|(key, _)| matches!(key, FrontendMapKey::V6(_)) == v6)
                };
                (
                    if has(false) { end } else { 0 },
                    if has(true) { end } else { 0 },
                )
            }
        }
    }
}

/// A hash map refuses a new key with E2BIG when it holds `max_entries` already; an array an
/// index past its end, with E2BIG from the kernel or `OutOfBounds` from aya's own check.
/// Writes `entries` from `*written` on, in batches of [`STAGED_BATCH`], advancing `*written`
/// past each batch written.
fn write_from<E>(
    written: &mut usize,
    entries: &[E],
    mut write: impl FnMut(&[E]) -> Result<(), MapWriteError>,
) -> Result<(), MapWriteError> {
    for chunk in entries
        .get(*written..)
        .unwrap_or_default()
        .chunks(STAGED_BATCH)
    {
        write(chunk)?;
        *written += chunk.len();
    }
    Ok(())
}

pub(crate) fn map_error(map: &'static str, error: aya::maps::MapError) -> MapWriteError {
    match &error {
        aya::maps::MapError::SyscallError(syscall)
            if syscall.io_error.raw_os_error() == Some(libc::E2BIG) =>
        {
            MapWriteError::Full(map)
        }
        aya::maps::MapError::OutOfBounds { .. } => MapWriteError::Full(map),
        _ => MapWriteError::Other(format!("map {map}: {error}")),
    }
}

pub(crate) fn ignore_missing(
    map: &'static str,
    result: Result<(), aya::maps::MapError>,
) -> Result<(), MapWriteError> {
    match result {
        Err(aya::maps::MapError::KeyNotFound) | Ok(()) => Ok(()),
        Err(error) => Err(map_error(map, error)),
    }
}
