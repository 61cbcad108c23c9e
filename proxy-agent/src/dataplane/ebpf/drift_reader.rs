//! The drift check's map reads, done away from the agent's loop.
//!
//! Reading every entry of the service, affinity and conntrack maps takes 300–600 ms at 50k
//! Services (one `BPF_MAP_LOOKUP_BATCH` per 4k entries, plus the LPM trie entry by entry). Done
//! in the loop, every EndpointSlice change that arrived meanwhile waited for it: the p99 of a
//! change through the API server was that read. So the loop hands a [`DriftReader`] (its own
//! descriptors of the same maps) to a blocking thread and goes on syncing; when the reading
//! comes back it compares it with what the map writer holds then.
//!
//! The loop may write the service maps while the thread reads them, so a key written meanwhile
//! may have been read before or after its write. The service maps record every key they touch
//! while a read is out (`touched_keys::Touched`), and those keys are left out of the comparison: whatever
//! they held was overwritten by the agent itself, and the next check compares them.

use std::os::fd::AsFd as _;

use aya::maps::{HashMap, IterableMap, Map, MapData, lpm_trie::LpmTrie};
use proxy_common::{AffinityKey, AffinityValue, CtKey, CtValue, map_names};

use super::{
    MapsContent,
    ct_maps::ConntrackMaps,
    error::EbpfError,
    map_batch::{BatchReader, read_all},
    service_maps::ServiceMaps,
};

/// What the drift check reads: the service maps, and the datapath's affinity, UDP-socket and
/// conntrack entries for the orphan check.
#[derive(Debug, Default, Clone)]
pub struct DriftReading {
    pub(super) found: MapsContent,
    pub(super) affinity: Vec<(AffinityKey, AffinityValue)>,
    pub(super) udp_sticky: Vec<(AffinityKey, AffinityValue)>,
    pub(super) conntrack: Vec<(CtKey, CtValue)>,
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
pub(super) fn reopen_data(map: &MapData, name: &'static str) -> Result<MapData, EbpfError> {
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
    pub(super) fn new(
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
            backends4: reopen_hash(&maps.backends4, map_names::BACKENDS4)?,
            backends6: reopen_hash(&maps.backends6, map_names::BACKENDS6)?,
            affinity_match: reopen_hash(&maps.affinity_match, map_names::AFFINITY_MATCH)?,
            revnat4: reopen_hash(&maps.revnat4, map_names::REVNAT4)?,
            revnat6: reopen_hash(&maps.revnat6, map_names::REVNAT6)?,
            source_ranges: trie(&maps.source_ranges)?,
            maglev: reopen_hash(&maps.maglev, map_names::MAGLEV)?,
            touched: None,
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
        let found = self.maps.content(&mut self.batch);
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
