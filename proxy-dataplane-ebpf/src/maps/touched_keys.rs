//! Keys of the service maps the agent writes while a drift check is out: the map writer records
//! them (`service_maps.rs`) and the check's finish leaves them out of what it found
//! (`drift_reader.rs`), since either value may be the one it read.

use std::{collections::BTreeSet, net::SocketAddr};

use proxy_common::{AffinityMatchKey, BackendSlotKey, MaglevKey};

use crate::maps::map_writer::{BackendValue, FrontendMapKey};

/// Keys of the service maps the agent wrote or deleted while a drift check was out (from
/// [`super::EbpfDataplane::start_drift_check`] to its finish), under the check's number: a
/// finish compares only the result of the check the record was started for.
#[derive(Debug, Default)]
pub struct Touched {
    job: u64,
    frontends: BTreeSet<FrontendMapKey>,
    slots: BTreeSet<BackendSlotKey>,
    backends: BTreeSet<u32>,
    affinity_matches: BTreeSet<AffinityMatchKey>,
    source_ranges: BTreeSet<u32>,
    maglev: BTreeSet<MaglevKey>,
    /// Service ids of frontends written: such a Service may have become live after the check
    /// copied the record, so its datapath entries are no orphans.
    services: BTreeSet<u32>,
    /// Addresses of backends written, for the same reason.
    backend_addrs: BTreeSet<SocketAddr>,
}

impl Touched {
    pub(crate) fn new(job: u64) -> Self {
        Self {
            job,
            ..Self::default()
        }
    }
    pub(crate) fn job(&self) -> u64 {
        self.job
    }
    pub(crate) fn frontend(&mut self, key: FrontendMapKey) {
        self.frontends.insert(key);
    }
    pub(crate) fn service(&mut self, service_id: u32) {
        self.services.insert(service_id);
    }
    pub(crate) fn slot(&mut self, key: BackendSlotKey) {
        self.slots.insert(key);
    }
    pub(crate) fn backend(&mut self, id: u32) {
        self.backends.insert(id);
    }
    pub(crate) fn backend_value(&mut self, id: u32, backend: &BackendValue) {
        self.backends.insert(id);
        self.backend_addrs.insert(backend.socket_addr());
    }
    pub(crate) fn affinity_match(&mut self, key: AffinityMatchKey) {
        self.affinity_matches.insert(key);
    }
    /// Source ranges by service id: the LPM key's family is not in the key (see
    /// `ServiceMaps::content`), so a whole service's ranges are left out.
    pub(crate) fn source_ranges_of(&mut self, service_id: u32) {
        self.source_ranges.insert(service_id);
    }
    pub(crate) fn maglev(&mut self, key: MaglevKey) {
        self.maglev.insert(key);
    }

    /// Whether the agent wrote or deleted `entry` since the check started: what the check read
    /// of it may be from before or after that write, and what it expected is from before.
    pub(crate) fn contains(&self, entry: &Entry) -> bool {
        match entry {
            Entry::Frontend(key) => self.frontends.contains(key),
            Entry::Slot(key) => self.slots.contains(key),
            Entry::Backend(id) => self.backends.contains(id),
            Entry::AffinityMatch(key) => self.affinity_matches.contains(key),
            Entry::SourceRangesOf(id) => self.source_ranges.contains(id),
            Entry::Maglev(key) => self.maglev.contains(key),
        }
    }

    /// Whether the agent wrote a frontend of Service `service_id` since the check started.
    pub(crate) fn wrote_service(&self, service_id: u32) -> bool {
        self.services.contains(&service_id)
    }
    /// Whether the agent wrote backend `id` since the check started.
    pub(crate) fn wrote_backend(&self, id: u32) -> bool {
        self.backends.contains(&id)
    }
    /// Whether the agent wrote a backend at `addr` since the check started.
    pub(crate) fn wrote_backend_at(&self, addr: &SocketAddr) -> bool {
        self.backend_addrs.contains(addr)
    }

    pub(crate) fn len(&self) -> usize {
        self.frontends.len()
            + self.slots.len()
            + self.backends.len()
            + self.affinity_matches.len()
            + self.source_ranges.len()
            + self.maglev.len()
    }
}

/// An entry of the service maps, by map and key (source ranges by service id: the LPM key's
/// family is not in the key, so the writes of a service's ranges are recorded per service).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    Frontend(FrontendMapKey),
    Slot(BackendSlotKey),
    Backend(u32),
    AffinityMatch(AffinityMatchKey),
    SourceRangesOf(u32),
    Maglev(MaglevKey),
}
