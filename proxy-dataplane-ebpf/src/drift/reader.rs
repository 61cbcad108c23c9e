//! The drift check's map reads and comparison, done away from the agent's loop.
//!
//! Reading every entry of the service, affinity and conntrack maps takes 300–600 ms at 50k
//! Services (one `BPF_MAP_LOOKUP_BATCH` per 4k entries, plus the LPM trie entry by entry), and
//! building what they must hold from the map writer's record (a tree of a million slots, every
//! Maglev table again) and comparing takes as long again. Done in the loop, every EndpointSlice
//! change that arrived meanwhile waited for it: the p99 of a change through the API server was
//! that check. So the loop hands a [`DriftJob`] — its own descriptors of the same maps
//! ([`DriftReader`]) and a flat copy of the record ([`RecordCopy`]) — to a blocking thread and
//! goes on syncing; the thread reads, compares and sends back what differs ([`DriftFound`]).
//!
//! The loop may write the service maps while the thread reads them, so a key written meanwhile
//! may have been read before or after its write, and its expected value is the one from before.
//! The service maps record every key they touch while a check is out (`touched_keys::Touched`), and the
//! loop leaves those keys out of what the thread found: whatever they held was overwritten by
//! the agent itself, and the next check compares them. An entry not written meanwhile held the
//! copied record's value all along, so a repair of it writes what the agent holds now. The
//! record carries the check's number: a result is finished only under the record it was started
//! with (a result whose record was given up or replaced by a newer check is stale).

use std::{net::SocketAddr, os::fd::AsFd as _};

use aya::maps::{HashMap, IterableMap, Map, MapData, lpm_trie::LpmTrie};
use proxy_common::{AffinityKey, AffinityValue, CtKey, CtValue, map_names};

use crate::{
    MapsContent,
    conntrack::ct_maps::ConntrackMaps,
    drift::orphans,
    drift::{Drift, DriftKind, Keyed},
    error::EbpfError,
    maps::map_writer::{RecordCopy, RecordCopying},
    maps::service_maps::{BackendArrays, ServiceMaps},
    maps::touched_keys::Touched,
};
use proxy_kernel::bpf::map_batch::{BatchReader, read_all};

/// Whether an orphan found by the check may have stopped being one: the agent wrote its Service
/// or backend since the check copied the record.
fn revives(touched: &Touched, orphan: &OrphanEntry) -> bool {
    match orphan {
        OrphanEntry::Pinned { key, value, .. } => {
            touched.wrote_service(key.service_id) || touched.wrote_backend(value.backend_id)
        }
        OrphanEntry::Conntrack { backend, .. } => touched.wrote_backend_at(backend),
    }
}

/// A drift check for another thread: reads the maps and compares them with the copy of the map
/// writer's record taken when it started ([`super::EbpfDataplane::start_drift_check`]).
pub struct DriftJob {
    pub(crate) job: u64,
    pub(crate) reader: DriftReader,
    /// `None`: the record knows it differs from the maps (a damaged adopted frontend).
    pub(crate) record: Option<RecordCopy>,
}

/// A drift check whose copy of the record is still being taken, a step per loop turn
/// ([`super::EbpfDataplane::drift_check_step`]); the keys the agent writes are noted from its
/// start, so writes between the steps make no false drift (see `RecordCopying`).
pub struct DriftStart {
    pub(crate) job: u64,
    pub(crate) reader: DriftReader,
    pub(crate) copying: RecordCopying,
    /// The loop's time in the steps so far (the opening, then the copy).
    pub(crate) work: std::time::Duration,
}

impl std::fmt::Debug for DriftStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriftStart")
            .field("job", &self.job)
            .field("steps", &self.copying.steps())
            .finish_non_exhaustive()
    }
}

/// What one step of a [`DriftStart`] left.
#[derive(Debug)]
pub enum DriftStep {
    /// More of the record to copy: step again.
    More(DriftStart),
    /// The copy is complete: the job can run on its thread.
    Ready(DriftJob),
}

impl std::fmt::Debug for DriftJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriftJob")
            .field("job", &self.job)
            .finish_non_exhaustive()
    }
}

impl DriftJob {
    /// Reads and compares (blocking: hundreds of milliseconds at 50k Services). Nothing here
    /// touches the agent's state: the loop finishes the check with what this returns.
    pub fn run(self) -> DriftFound {
        let compared = match self.record {
            Some(record) => {
                let reading = self.reader.read();
                record
                    .expected_content()
                    .map(|expected| compare(&expected, reading))
            }
            None => None,
        };
        DriftFound {
            job: self.job,
            compared,
        }
    }
}

/// What a [`DriftJob`] found, before the loop leaves out the entries it wrote meanwhile.
#[derive(Debug, Clone)]
pub struct DriftFound {
    pub(crate) job: u64,
    /// `None`: nothing to compare with (a damaged adopted frontend, or a Maglev table that
    /// cannot be built again).
    pub(crate) compared: Option<Compared>,
}

impl DriftFound {
    /// Every difference the job saw, including those of entries written since it started.
    pub fn unfiltered(&self) -> impl Iterator<Item = &Drift> {
        self.compared.iter().flat_map(|compared| {
            compared
                .drift
                .iter()
                .map(|keyed| &keyed.drift)
                .chain(compared.orphans.iter().map(|orphan| &orphan.drift))
        })
    }
}

/// The differences and orphans of one job.
#[derive(Debug, Clone, Default)]
pub(crate) struct Compared {
    pub(crate) drift: Vec<Keyed>,
    pub(crate) orphans: Vec<Orphan>,
    pub(crate) entries_compared: usize,
}

impl Compared {
    /// What is left once the entries `touched` names are left out (their reading and their
    /// expected value may straddle a write of the agent's), and how many were.
    pub(crate) fn without(self, touched: &Touched) -> (Self, usize) {
        let before = self.drift.len() + self.orphans.len();
        let drift: Vec<Keyed> = self
            .drift
            .into_iter()
            .filter(|keyed| !touched.contains(&keyed.fix.entry()))
            .collect();
        let orphans: Vec<Orphan> = self
            .orphans
            .into_iter()
            .filter(|orphan| !revives(touched, &orphan.entry))
            .collect();
        let left_out = before - drift.len() - orphans.len();
        (
            Self {
                drift,
                orphans,
                entries_compared: self.entries_compared,
            },
            left_out,
        )
    }
}

/// An entry the datapath wrote that points at a Service or backend that is gone.
#[derive(Debug, Clone)]
pub(crate) struct Orphan {
    pub(crate) drift: Drift,
    pub(crate) entry: OrphanEntry,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum OrphanEntry {
    /// An affinity or UDP-socket entry (`map`), deleted only if it still holds `value`.
    Pinned {
        map: &'static str,
        key: AffinityKey,
        value: AffinityValue,
    },
    Conntrack {
        key: CtKey,
        backend: SocketAddr,
    },
}

/// The drift check's comparison: the service maps against `expected`, the datapath's entries
/// against the Services and backends it holds.
pub(crate) fn compare(expected: &MapsContent, reading: DriftReading) -> Compared {
    let drift = crate::drift::diff_keyed(expected, &reading.found);
    let mut entries_compared = crate::drift::entries(expected, &reading.found);
    let live = orphans::Live::of(expected);
    let mut found = Vec::new();
    for (map, entries) in [
        (map_names::AFFINITY, reading.affinity),
        (map_names::UDP_STICKY, reading.udp_sticky),
    ] {
        entries_compared += entries.len();
        for (key, value) in entries {
            let Some(why) = orphans::pinned_orphan(&live, &key, &value) else {
                continue;
            };
            found.push(Orphan {
                drift: Drift {
                    map,
                    kind: DriftKind::Orphan,
                    entry: format!("client {} service {}", key.client, key.service_id),
                    expected: None,
                    found: Some(why),
                },
                entry: OrphanEntry::Pinned { map, key, value },
            });
        }
    }
    entries_compared += reading.conntrack.len();
    for (key, value) in reading.conntrack {
        let Some((backend, why)) = orphans::ct_orphan(&live, &key, &value) else {
            continue;
        };
        let map = if key.family == proxy_common::family::V6 {
            map_names::CT6
        } else {
            map_names::CT4
        };
        found.push(Orphan {
            drift: Drift {
                map,
                kind: DriftKind::Orphan,
                entry: orphans::describe_ct(&key),
                expected: None,
                found: Some(why),
            },
            entry: OrphanEntry::Conntrack { key, backend },
        });
    }
    Compared {
        drift,
        orphans: found,
        entries_compared,
    }
}

/// What the drift check reads: the service maps, and the datapath's affinity, UDP-socket and
/// conntrack entries for the orphan check.
#[derive(Debug, Default, Clone)]
pub struct DriftReading {
    pub(crate) found: MapsContent,
    pub(crate) affinity: Vec<(AffinityKey, AffinityValue)>,
    pub(crate) udp_sticky: Vec<(AffinityKey, AffinityValue)>,
    pub(crate) conntrack: Vec<(CtKey, CtValue)>,
}

/// Descriptors of the maps the drift check reads, of its own, so it can read on another thread.
pub struct DriftReader {
    maps: ServiceMaps,
    affinity: Option<HashMap<MapData, AffinityKey, AffinityValue>>,
    udp_sticky: Option<HashMap<MapData, AffinityKey, AffinityValue>>,
    conntrack: Option<ConntrackMaps<MapData>>,
    batch: BatchReader,
}

impl std::fmt::Debug for DriftReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriftReader").finish_non_exhaustive()
    }
}

/// A second descriptor of the map behind `map`.
pub(crate) fn reopen_data(map: &MapData, name: &'static str) -> Result<MapData, EbpfError> {
    let fd = map
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|source| EbpfError::DupMap { name, source })?;
    MapData::from_fd(fd).map_err(|source| EbpfError::Map { name, source })
}

/// [`reopen_data`], typed again.
fn reopen<M: TryFrom<Map>>(map: &MapData, name: &'static str) -> Result<M, EbpfError> {
    let map = Map::from_map_data(reopen_data(map, name)?)
        .map_err(|source| EbpfError::Map { name, source })?;
    M::try_from(map).map_err(|_| EbpfError::MissingMap(name))
}

/// [`reopen`] of a map handed over whole.
fn retype<M: TryFrom<Map>>(data: MapData, name: &'static str) -> Result<M, EbpfError> {
    let map = Map::from_map_data(data).map_err(|source| EbpfError::Map { name, source })?;
    M::try_from(map).map_err(|_| EbpfError::MissingMap(name))
}

fn reopen_hash<K: aya::Pod, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>, EbpfError> {
    reopen(map.map(), name)
}

impl DriftReader {
    /// `affinity`, `udp_sticky`: the datapath's maps as the object holds them (absent when
    /// the object has none); `conntrack`: both tc conntrack maps.
    pub(crate) fn new(
        maps: &ServiceMaps,
        affinity: Option<MapData>,
        udp_sticky: Option<MapData>,
        conntrack: Option<(MapData, MapData)>,
        entry_by_entry: bool,
    ) -> Result<Self, EbpfError> {
        let trie = |trie: &LpmTrie<MapData, _, u8>| reopen(trie.map(), map_names::SOURCE_RANGES);
        let copy = ServiceMaps {
            frontends4: reopen_hash(&maps.frontends4, map_names::FRONTENDS4)?,
            frontends6: reopen_hash(&maps.frontends6, map_names::FRONTENDS6)?,
            slots: reopen_hash(&maps.slots, map_names::BACKEND_SLOTS)?,
            backends4: reopen(maps.backends4.map(), map_names::BACKENDS4)?,
            backends6: reopen(maps.backends6.map(), map_names::BACKENDS6)?,
            affinity_match: reopen_hash(&maps.affinity_match, map_names::AFFINITY_MATCH)?,
            revnat4: reopen_hash(&maps.revnat4, map_names::REVNAT4)?,
            revnat6: reopen_hash(&maps.revnat6, map_names::REVNAT6)?,
            source_ranges: trie(&maps.source_ranges)?,
            maglev: reopen_hash(&maps.maglev, map_names::MAGLEV)?,
            traffic: reopen(maps.traffic.map(), map_names::SERVICE_TRAFFIC)?,
            packets: reopen(maps.packets.map(), map_names::SERVICE_PACKETS)?,
            endpoints: reopen_hash(&maps.endpoints, map_names::ENDPOINT_TRAFFIC)?,
            // The reader never writes.
            port_filter: None,
            touched: None,
            endpoint_keys: None,
            uncounted_from: None,
            staged: None,
        };
        let conntrack = match conntrack {
            Some((v4, v6)) => Some(ConntrackMaps {
                v4: retype(v4, map_names::CT4)?,
                v6: retype(v6, map_names::CT6)?,
                // Drift compares the established flows: unanswered ones come and go faster
                // than a read.
                new4: None,
                new6: None,
            }),
            None => None,
        };
        let mut batch = BatchReader::default();
        batch.entry_by_entry = entry_by_entry;
        Ok(Self {
            maps: copy,
            affinity: affinity
                .map(|map| retype(map, map_names::AFFINITY))
                .transpose()?,
            udp_sticky: udp_sticky
                .map(|map| retype(map, map_names::UDP_STICKY))
                .transpose()?,
            conntrack,
            batch,
        })
    }

    /// Reads everything (blocking: hundreds of milliseconds at 50k Services).
    pub fn read(mut self) -> DriftReading {
        let found = self.maps.content(&mut self.batch, BackendArrays::Whole);
        let mut reading = DriftReading {
            found,
            ..DriftReading::default()
        };
        if let Some(map) = &self.affinity {
            read_all(
                map,
                &mut self.batch,
                map_names::AFFINITY,
                &mut reading.affinity,
            );
        }
        if let Some(map) = &self.udp_sticky {
            read_all(
                map,
                &mut self.batch,
                map_names::UDP_STICKY,
                &mut reading.udp_sticky,
            );
        }
        if let Some(ct) = &self.conntrack {
            let mut narrow = Vec::new();
            read_all(&ct.v4, &mut self.batch, map_names::CT4, &mut narrow);
            reading
                .conntrack
                .extend(narrow.iter().map(|(k, v)| (k.widen(), v.widen())));
            let mut wide = Vec::new();
            read_all(&ct.v6, &mut self.batch, map_names::CT6, &mut wide);
            reading.conntrack.extend(wide);
        }
        reading
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, net::Ipv4Addr};

    use proxy_common::{
        Backend4, BackendSlotKey, Frontend4Key, FrontendValue, SlotBlock, ct_flags, family, proto,
    };

    use super::*;
    use crate::maps::map_writer::{BackendValue, FrontendMapKey, ip4_to_map};

    const WEB: u32 = 3;

    fn backend(last: u8) -> BackendValue {
        BackendValue::V4(Backend4 {
            addr: ip4_to_map(Ipv4Addr::new(10, 244, 1, last)),
            port: 8080u16.to_be(),
            proto: proto::TCP,
            flags: 0,
        })
    }

    fn frontend() -> FrontendMapKey {
        FrontendMapKey::V4(Frontend4Key {
            addr: ip4_to_map(Ipv4Addr::new(10, 96, 0, 10)),
            port: 80u16.to_be(),
            proto: proto::TCP,
            scope: 0,
        })
    }

    /// The key of web's first block of slots.
    fn slots_key() -> BackendSlotKey {
        BackendSlotKey {
            service_id: WEB,
            block: 0,
            generation: 0,
            _pad: 0,
        }
    }

    fn block(ids: &[u32]) -> SlotBlock {
        let mut block = SlotBlock::default();
        block.backend_ids[..ids.len()].copy_from_slice(ids);
        block
    }

    /// What the record held when the check started: web with backend 7 in slot 0.
    fn expected() -> MapsContent {
        MapsContent {
            frontends: vec![(
                frontend(),
                FrontendValue {
                    service_id: WEB,
                    backend_count: 1,
                    ..FrontendValue::default()
                },
            )],
            slots: BTreeMap::from([(slots_key(), block(&[7]))]),
            backends: BTreeMap::from([(7, backend(7))]),
            ..MapsContent::default()
        }
    }

    /// What the thread read: web grown to backends 7 and 8 (by the agent or by someone else),
    /// an affinity entry of a Service id the record did not have, and a UDP flow to a backend
    /// it did not have.
    fn reading() -> DriftReading {
        let mut found = expected();
        found.frontends[0].1.backend_count = 2;
        found.slots.insert(slots_key(), block(&[7, 8]));
        found.backends.insert(8, backend(8));
        let gone = [ip4_to_map(Ipv4Addr::new(10, 244, 9, 9)), 0, 0, 0];
        DriftReading {
            found,
            affinity: vec![(
                AffinityKey {
                    client: 1,
                    service_id: 9,
                    _pad: 0,
                },
                AffinityValue {
                    backend_id: 7,
                    ..AffinityValue::default()
                },
            )],
            udp_sticky: Vec::new(),
            conntrack: vec![(
                CtKey {
                    src: gone,
                    dst: [ip4_to_map(Ipv4Addr::new(10, 10, 0, 2)), 0, 0, 0],
                    sport: 53u16.to_be(),
                    dport: 40000u16.to_be(),
                    proto: proto::UDP,
                    family: family::V4,
                    _pad: 0,
                },
                CtValue {
                    flags: ct_flags::REPLY,
                    ..CtValue::default()
                },
            )],
        }
    }

    fn maps_of(compared: &Compared) -> Vec<(&'static str, DriftKind)> {
        let mut maps: Vec<_> = compared
            .drift
            .iter()
            .map(|keyed| &keyed.drift)
            .chain(compared.orphans.iter().map(|orphan| &orphan.drift))
            .map(|drift| (drift.map, drift.kind))
            .collect();
        maps.sort();
        maps
    }

    #[test]
    fn nothing_written_meanwhile_leaves_everything_found() {
        let compared = compare(&expected(), reading());
        let all = maps_of(&compared);
        assert_eq!(
            all,
            [
                (map_names::AFFINITY, DriftKind::Orphan),
                (map_names::BACKENDS4, DriftKind::Extra),
                (map_names::BACKEND_SLOTS, DriftKind::Changed),
                (map_names::CT4, DriftKind::Orphan),
                (map_names::FRONTENDS4, DriftKind::Changed),
            ]
        );
        let (kept, left_out) = compared.without(&Touched::new(1));
        assert_eq!((maps_of(&kept), left_out), (all, 0));
    }

    #[test]
    fn entries_the_agent_wrote_meanwhile_are_left_out() {
        // The agent grew web itself while the check was out: its frontend, the slot block and
        // backend were written, so what the thread saw of them is the agent's own write.
        let mut touched = Touched::new(1);
        touched.frontend(frontend());
        touched.service(WEB);
        touched.slot(slots_key());
        touched.backend_value(8, &backend(8));
        let (kept, left_out) = compare(&expected(), reading()).without(&touched);
        assert_eq!(
            maps_of(&kept),
            [
                (map_names::AFFINITY, DriftKind::Orphan),
                (map_names::CT4, DriftKind::Orphan)
            ]
        );
        assert_eq!(left_out, 3);
        // What is left repairs nothing the agent wrote.
        assert!(kept.drift.is_empty());
    }

    #[test]
    fn orphans_of_services_or_backends_written_meanwhile_are_left_out() {
        // Service 9 and a backend at the flow's address became live during the check: their
        // datapath entries are no orphans any more, and must not be deleted.
        let mut touched = Touched::new(1);
        touched.service(9);
        touched.backend_value(
            12,
            &BackendValue::V4(Backend4 {
                addr: ip4_to_map(Ipv4Addr::new(10, 244, 9, 9)),
                port: 53u16.to_be(),
                proto: proto::UDP,
                flags: 0,
            }),
        );
        let (kept, left_out) = compare(&expected(), reading()).without(&touched);
        assert!(kept.orphans.is_empty(), "{:?}", kept.orphans);
        assert_eq!((kept.drift.len(), left_out), (3, 2));

        // A backend id written meanwhile revives an affinity entry that names it.
        let mut touched = Touched::new(1);
        touched.backend(7);
        let (kept, _) = compare(&expected(), reading()).without(&touched);
        assert!(
            kept.orphans
                .iter()
                .all(|orphan| matches!(orphan.entry, OrphanEntry::Conntrack { .. })),
            "{:?}",
            kept.orphans
        );
    }
}
