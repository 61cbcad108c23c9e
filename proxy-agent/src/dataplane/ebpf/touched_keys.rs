//! Keys of the service maps the agent writes while a drift reading is out: the map writer
//! records them (`service_maps.rs`) and the drift reading leaves them out of its comparison
//! (`drift_reader.rs`), since either value may be the one it read.

use std::collections::BTreeSet;

use ipnet::IpNet;
use proxy_common::{AffinityMatchKey, BackendSlotKey, MaglevKey};

use super::map_writer::{FrontendMapKey, MapsContent};

/// Keys of the service maps the agent wrote or deleted while a drift reading was out.
#[derive(Debug, Default)]
pub struct Touched {
    frontends: BTreeSet<FrontendMapKey>,
    slots: BTreeSet<BackendSlotKey>,
    backends: BTreeSet<u32>,
    affinity_matches: BTreeSet<AffinityMatchKey>,
    source_ranges: BTreeSet<u32>,
    maglev: BTreeSet<MaglevKey>,
}

impl Touched {
    pub(super) fn frontend(&mut self, key: FrontendMapKey) {
        self.frontends.insert(key);
    }
    pub(super) fn slot(&mut self, key: BackendSlotKey) {
        self.slots.insert(key);
    }
    pub(super) fn backend(&mut self, id: u32) {
        self.backends.insert(id);
    }
    pub(super) fn affinity_match(&mut self, key: AffinityMatchKey) {
        self.affinity_matches.insert(key);
    }
    /// Source ranges by service id: the LPM key's family is not in the key (see
    /// `ServiceMaps::content`), so a whole service's ranges are left out.
    pub(super) fn source_ranges_of(&mut self, service_id: u32) {
        self.source_ranges.insert(service_id);
    }
    pub(super) fn maglev(&mut self, key: MaglevKey) {
        self.maglev.insert(key);
    }

    /// Removes every touched key from `content`.
    pub(super) fn remove_from(&self, content: &mut MapsContent) {
        if !self.frontends.is_empty() {
            content
                .frontends
                .retain(|(key, _)| !self.frontends.contains(key));
        }
        for key in &self.slots {
            content.slots.remove(key);
        }
        for id in &self.backends {
            content.backends.remove(id);
        }
        for key in &self.affinity_matches {
            content.affinity_matches.remove(key);
        }
        if !self.source_ranges.is_empty() {
            content
                .source_ranges
                .retain(|(id, _): &(u32, IpNet)| !self.source_ranges.contains(id));
        }
        for key in &self.maglev {
            content.maglev.remove(key);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.frontends.len()
            + self.slots.len()
            + self.backends.len()
            + self.affinity_matches.len()
            + self.source_ranges.len()
            + self.maglev.len()
    }
}
