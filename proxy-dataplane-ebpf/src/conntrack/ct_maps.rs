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

use crate::EbpfError;

/// Both conntrack maps, and the unanswered flows' maps beside them (`KPR_CT4_NEW`,
/// `KPR_CT6_NEW`: TCP flows whose client has sent only its SYN; none where a reader has only
/// the established ones, as a migration does). A key is in one of a family's maps at most:
/// lookups try the established map first, as the datapath does.
#[derive(Debug)]
pub struct ConntrackMaps<T> {
    pub v4: HashMap<T, CtKey4, CtValue4>,
    pub v6: HashMap<T, CtKey, CtValue>,
    pub new4: Option<HashMap<T, CtKey4, CtValue4>>,
    pub new6: Option<HashMap<T, CtKey, CtValue>>,
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
        // Pinned by an agent from before they existed: none.
        let optional = |name: &'static str| {
            if pin_dir.join(name).exists() {
                open(name).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Self {
            v4: HashMap::try_from(open(map_names::CT4)?).map_err(named(map_names::CT4))?,
            v6: HashMap::try_from(open(map_names::CT6)?).map_err(named(map_names::CT6))?,
            new4: optional(map_names::CT4_NEW)?
                .map(HashMap::try_from)
                .transpose()
                .map_err(named(map_names::CT4_NEW))?,
            new6: optional(map_names::CT6_NEW)?
                .map(HashMap::try_from)
                .transpose()
                .map_err(named(map_names::CT6_NEW))?,
        })
    }
}

impl<'a> ConntrackMaps<&'a mut MapData> {
    /// The maps as aya [`Map`]s (the worker's, or an object's): the established ones and
    /// the unanswered flows'.
    pub fn borrow(
        v4: &'a mut Map,
        v6: &'a mut Map,
        new4: &'a mut Map,
        new6: &'a mut Map,
    ) -> Result<Self, EbpfError> {
        Ok(Self {
            v4: HashMap::try_from(v4).map_err(named(map_names::CT4))?,
            v6: HashMap::try_from(v6).map_err(named(map_names::CT6))?,
            new4: Some(HashMap::try_from(new4).map_err(named(map_names::CT4_NEW))?),
            new6: Some(HashMap::try_from(new6).map_err(named(map_names::CT6_NEW))?),
        })
    }
}

impl<T: Borrow<MapData>> ConntrackMaps<T> {
    pub fn get(&self, key: &CtKey) -> Option<CtValue> {
        if key.family == family::V6 {
            self.v6
                .get(key, 0)
                .ok()
                .or_else(|| self.new6.as_ref()?.get(key, 0).ok())
        } else {
            let key4 = CtKey4::narrow(key);
            self.v4
                .get(&key4, 0)
                .ok()
                .or_else(|| self.new4.as_ref()?.get(&key4, 0).ok())
                .map(|v| v.widen())
        }
    }

    /// Whether `key` is an unanswered flow's (in `KPR_CT4_NEW` or `KPR_CT6_NEW`).
    pub fn unanswered(&self, key: &CtKey) -> bool {
        if key.family == family::V6 {
            self.v6.get(key, 0).is_err()
                && self.new6.as_ref().is_some_and(|m| m.get(key, 0).is_ok())
        } else {
            let key4 = CtKey4::narrow(key);
            self.v4.get(&key4, 0).is_err()
                && self.new4.as_ref().is_some_and(|m| m.get(&key4, 0).is_ok())
        }
    }

    /// Every entry of the maps; entries that vanish during the walk (LRU eviction, the
    /// datapath) are skipped.
    pub fn entries(&self) -> Vec<(CtKey, CtValue)> {
        let narrow = |map: &HashMap<T, CtKey4, CtValue4>| {
            map.iter()
                .filter_map(Result::ok)
                .map(|(k, v)| (k.widen(), v.widen()))
                .collect::<Vec<_>>()
        };
        let wide = |map: &HashMap<T, CtKey, CtValue>| {
            map.iter().filter_map(Result::ok).collect::<Vec<_>>()
        };
        let mut all = narrow(&self.v4);
        all.extend(wide(&self.v6));
        all.extend(self.new4.as_ref().map(narrow).unwrap_or_default());
        all.extend(self.new6.as_ref().map(wide).unwrap_or_default());
        all
    }

    /// Every key of the maps.
    pub fn keys(&self) -> Vec<CtKey> {
        let narrow = |map: &HashMap<T, CtKey4, CtValue4>| {
            map.keys()
                .filter_map(Result::ok)
                .map(|k| k.widen())
                .collect::<Vec<_>>()
        };
        let wide = |map: &HashMap<T, CtKey, CtValue>| {
            map.keys().filter_map(Result::ok).collect::<Vec<_>>()
        };
        let mut all = narrow(&self.v4);
        all.extend(wide(&self.v6));
        all.extend(self.new4.as_ref().map(narrow).unwrap_or_default());
        all.extend(self.new6.as_ref().map(wide).unwrap_or_default());
        all
    }
}

impl<T: BorrowMut<MapData>> ConntrackMaps<T> {
    /// Writes `value` under `key` with the map update `flags` (`BPF_NOEXIST`: only if absent):
    /// into the unanswered flows' map if the key is there, else into the established one.
    pub fn insert(&mut self, key: &CtKey, value: &CtValue, flags: u64) -> Result<(), MapError> {
        let unanswered = self.unanswered(key);
        if key.family == family::V6 {
            match &mut self.new6 {
                Some(new6) if unanswered => new6.insert(key, value, flags),
                _ => self.v6.insert(key, value, flags),
            }
        } else {
            let (key4, value4) = (CtKey4::narrow(key), CtValue4::narrow(value));
            match &mut self.new4 {
                Some(new4) if unanswered => new4.insert(key4, value4, flags),
                _ => self.v4.insert(key4, value4, flags),
            }
        }
    }

    /// Deletes `key` from whichever map holds it (an error: from none).
    pub fn remove(&mut self, key: &CtKey) -> Result<(), MapError> {
        if key.family == family::V6 {
            let established = self.v6.remove(key);
            match &mut self.new6 {
                Some(new6) if established.is_err() => new6.remove(key),
                _ => established,
            }
        } else {
            let key4 = CtKey4::narrow(key);
            let established = self.v4.remove(&key4);
            match &mut self.new4 {
                Some(new4) if established.is_err() => new4.remove(&key4),
                _ => established,
            }
        }
    }
}
