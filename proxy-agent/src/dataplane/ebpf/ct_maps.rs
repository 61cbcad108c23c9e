//! The tc conntrack's two maps, `KPR_CT4` and `KPR_CT6`, as one table of [`CtKey`] →
//! [`CtValue`] entries: IPv4 entries are stored narrow ([`CtKey4`], [`CtValue4`]: a third of
//! an IPv6 entry's key and two thirds of its value) and widened here, so everything that reads
//! or writes flows (GC, purges, adoption, drift, inspect, tests) works on one type for both
//! families, as the datapath does (`proxy-ebpf`'s `conntrack`).

use std::{
    borrow::{Borrow, BorrowMut},
    path::Path,
};

use aya::maps::{HashMap, Map, MapData, MapError};
use proxy_common::{CtKey, CtKey4, CtValue, CtValue4, family, map_names};

use super::EbpfError;

/// Both conntrack maps.
#[derive(Debug)]
pub struct ConntrackMaps<T> {
    pub v4: HashMap<T, CtKey4, CtValue4>,
    pub v6: HashMap<T, CtKey, CtValue>,
}

/// An error of one of the maps, named.
fn named(name: &'static str) -> impl Fn(MapError) -> EbpfError {
    move |source| EbpfError::Map { name, source }
}

impl ConntrackMaps<MapData> {
    /// Opens the maps pinned in `pin_dir` (as another process, bpftool or a test, would).
    pub fn open_pinned(pin_dir: &Path) -> Result<Self, EbpfError> {
        let open = |name: &'static str| {
            MapData::from_pin(pin_dir.join(name))
                .and_then(Map::from_map_data)
                .map_err(named(name))
        };
        Ok(Self {
            v4: HashMap::try_from(open(map_names::CT4)?).map_err(named(map_names::CT4))?,
            v6: HashMap::try_from(open(map_names::CT6)?).map_err(named(map_names::CT6))?,
        })
    }
}

impl<'a> ConntrackMaps<&'a mut MapData> {
    /// The maps as two aya [`Map`]s (the worker's, or an object's).
    pub fn borrow(v4: &'a mut Map, v6: &'a mut Map) -> Result<Self, EbpfError> {
        Ok(Self {
            v4: HashMap::try_from(v4).map_err(named(map_names::CT4))?,
            v6: HashMap::try_from(v6).map_err(named(map_names::CT6))?,
        })
    }
}

impl<T: Borrow<MapData>> ConntrackMaps<T> {
    pub fn get(&self, key: &CtKey) -> Option<CtValue> {
        if key.family == family::V6 {
            self.v6.get(key, 0).ok()
        } else {
            self.v4.get(&CtKey4::narrow(key), 0).ok().map(|v| v.widen())
        }
    }

    /// Every entry of both maps; entries that vanish during the walk (LRU eviction, the
    /// datapath) are skipped.
    pub fn entries(&self) -> Vec<(CtKey, CtValue)> {
        let v4 = self
            .v4
            .iter()
            .filter_map(Result::ok)
            .map(|(k, v)| (k.widen(), v.widen()));
        let v6 = self.v6.iter().filter_map(Result::ok);
        v4.chain(v6).collect()
    }

    /// Every key of both maps.
    pub fn keys(&self) -> Vec<CtKey> {
        let v4 = self.v4.keys().filter_map(Result::ok).map(|k| k.widen());
        let v6 = self.v6.keys().filter_map(Result::ok);
        v4.chain(v6).collect()
    }
}

impl<T: BorrowMut<MapData>> ConntrackMaps<T> {
    /// Writes `value` under `key` with the map update `flags` (`BPF_NOEXIST`: only if absent).
    pub fn insert(&mut self, key: &CtKey, value: &CtValue, flags: u64) -> Result<(), MapError> {
        if key.family == family::V6 {
            self.v6.insert(key, value, flags)
        } else {
            self.v4
                .insert(CtKey4::narrow(key), CtValue4::narrow(value), flags)
        }
    }

    pub fn remove(&mut self, key: &CtKey) -> Result<(), MapError> {
        if key.family == family::V6 {
            self.v6.remove(key)
        } else {
            self.v4.remove(&CtKey4::narrow(key))
        }
    }
}
