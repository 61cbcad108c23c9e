//! Programs a snapshot into the service maps, touching only what changed since the last one.
//!
//! Per changed frontend the order is the update protocol from `proxy_common::maps`: new backends
//! (and affinity match entries) first, then the slots of the idle generation, then one frontend
//! update that switches generation, count and affinity, then the old generation's slots, match
//! entries and unused backends go. If a step before the switch fails (a full map, say),
//! everything written for that frontend is taken back and the frontend keeps its previous,
//! complete backend set.
//!
//! With `--lb-algorithm maglev` an external frontend also gets a Maglev lookup table of the idle
//! generation, written with its slots before the switch and deleted with them after it.
//!
//! The old generation's slots, Maglev table and backends are not deleted at the switch but
//! [`GENERATION_GRACE`] later (a removed frontend's too): a program that read the frontend just
//! before the switch looks up its slot (the tc programs much later, after parsing and conntrack)
//! and must still find it. Generations are one bit, so a frontend's next switch would write over
//! its retired generation: a frontend whose retired generation is younger than the grace is not
//! switched again but deferred until it is gone (see [`MapWriter::apply_snapshot`]).
//!
//! Before anything is written for a frontend, its backends are cut to the first
//! `--bpf-max-endpoints-per-service` by address and port (the same ones on every node; reported
//! per service port as [`ApplyError::Truncated`]), and what the write would add to each map is
//! checked against its Service's and namespace's share ([`shares`]); a frontend refused there
//! is not written, or keeps its previous set, like one that met a full map.
//!
//! After an agent restart the state is read back from the pinned maps ([`MapWriter::adopt`]):
//! adopted frontends belong to no service port until a full apply claims them (unchanged ones
//! without a single write) and the ones nobody claims are removed then.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use ipnet::IpNet;
use proxy_common::{
    AffinityMatchKey, Backend4, Backend6, BackendSlotKey, Frontend4Key, Frontend6Key,
    FrontendValue, MAGLEV_BLOCK_SLOTS, MaglevBlock, MaglevKey, PortFilter, SLOT_BLOCK_SLOTS,
    SlotBlock, frontend_flags, scope,
};
use tracing::{debug, info, warn};

use crate::{maps::ids::IdAllocator, maps::maglev};
use frontend_writes::maglev_blocks;
use proxy_model::desired::{
    Frontend, FrontendKey, IpFamily, Protocol, Scope, ServicePortName, Snapshot,
    external_frontends, socket_frontends,
};
use usage::{BackendTable, FrontendTable, MapUsage, RetiredList};

/// How long a generation taken out of use (by a switch, or with its removed frontend) keeps its
/// slots, Maglev table and backends. A socket hook or tc program reads the frontend first and
/// the slot (and backend) afterwards; one held up in between (an interrupt, the hypervisor
/// taking the vCPU) must find them. The hook re-reads the frontend once when its slot is gone,
/// the tc programs cannot (the verifier's stack limit): this grace is what makes both safe
/// against any hold-up shorter than it, which a second is by orders of magnitude, while
/// bounding how long a removed backend's entries linger. Since generations are one bit, it is
/// also the shortest interval between two switches of one frontend (kube-proxy's default
/// `minSyncPeriod` in iptables mode is the same second).
pub const GENERATION_GRACE: Duration = Duration::from_secs(1);

/// A frontend map key of either family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrontendMapKey {
    V4(Frontend4Key),
    V6(Frontend6Key),
}

/// A backend map value of either family. Backend ids come from one id space; the family says
/// which backend map holds the id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BackendValue {
    V4(Backend4),
    V6(Backend6),
}

impl BackendValue {
    /// The map that holds it: `KPR_BACKENDS4` or `KPR_BACKENDS6`.
    pub fn map_name(&self) -> &'static str {
        match self {
            BackendValue::V4(_) => proxy_common::map_names::BACKENDS4,
            BackendValue::V6(_) => proxy_common::map_names::BACKENDS6,
        }
    }

    /// The backend's port (host order).
    pub fn port(&self) -> u16 {
        match self {
            BackendValue::V4(b) => u16::from_be(b.port),
            BackendValue::V6(b) => u16::from_be(b.port),
        }
    }

    /// The backend as a socket address (host-order port).
    pub fn socket_addr(&self) -> SocketAddr {
        match self {
            BackendValue::V4(b) => {
                SocketAddr::new(ip4_from_map(b.addr).into(), u16::from_be(b.port))
            }
            BackendValue::V6(b) => {
                SocketAddr::new(ip6_from_map(b.addr).into(), u16::from_be(b.port))
            }
        }
    }
}

/// Why a write to the service maps (or an id allocation sized like them) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapWriteError {
    /// No room for another entry: a capacity problem (`--bpf-map-*`), not a kernel fault. Kept
    /// apart so the agent can count and report the Services that did not fit.
    #[error("the {0} map is full (raise its --bpf-map-* capacity)")]
    Full(&'static str),
    /// The map has room, but not for this Service or namespace (see [`shares`]).
    #[error("{0}")]
    Share(shares::ShareLimit),
    /// Another service port holds the frontend. The desired state gives each frontend one
    /// owner, so this lasts only while the owner's own change is later in the same apply.
    #[error("the address is already used by {0}")]
    Owned(ServicePortName),
    #[error("{0}")]
    Other(String),
}

/// Raw writes to the service maps; implemented over the kernel maps, and over plain collections
/// in unit tests of the diff logic.
pub trait MapOps {
    /// An apply starts: what the maps were read to hold may have changed since the last one.
    fn begin_apply(&mut self) {}
    /// Zeroes the traffic counters of a service id about to be handed to a new frontend (best
    /// effort: the counters are not the datapath's state).
    fn reset_traffic(&mut self, _service_id: u32) {}
    fn put_frontend(
        &mut self,
        key: FrontendMapKey,
        value: FrontendValue,
    ) -> Result<(), MapWriteError>;
    fn delete_frontend(&mut self, key: FrontendMapKey) -> Result<(), MapWriteError>;
    fn put_slot(&mut self, key: BackendSlotKey, block: SlotBlock) -> Result<(), MapWriteError>;
    /// Several slot blocks at once (one generation's). On an error, any of them may be written.
    fn put_slots(&mut self, blocks: &[(BackendSlotKey, SlotBlock)]) -> Result<(), MapWriteError> {
        for &(key, block) in blocks {
            self.put_slot(key, block)?;
        }
        Ok(())
    }
    fn delete_slot(&mut self, key: BackendSlotKey) -> Result<(), MapWriteError>;
    fn put_backend(&mut self, id: u32, backend: BackendValue) -> Result<(), MapWriteError>;
    /// Several backends at once. On an error, any of them may be written.
    fn put_backends(&mut self, backends: &[(u32, BackendValue)]) -> Result<(), MapWriteError> {
        for &(id, backend) in backends {
            self.put_backend(id, backend)?;
        }
        Ok(())
    }
    /// `backend` says which family's map holds `id`.
    fn delete_backend(&mut self, id: u32, backend: BackendValue) -> Result<(), MapWriteError>;
    fn put_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError>;
    fn delete_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError>;
    fn put_source_range(&mut self, service_id: u32, range: IpNet) -> Result<(), MapWriteError>;
    fn delete_source_range(&mut self, service_id: u32, range: IpNet) -> Result<(), MapWriteError>;
    fn put_maglev(&mut self, key: MaglevKey, block: MaglevBlock) -> Result<(), MapWriteError>;
    fn delete_maglev(&mut self, key: MaglevKey) -> Result<(), MapWriteError>;
    /// A frontend's port and its backends' ports, before the frontend is written: the
    /// programs' port filter must let its packets in from its first one.
    fn add_ports(&mut self, _destination: u16, _sources: impl Iterator<Item = u16>) {}
    /// Every port the maps use (after the first apply and every full one or full pass): the
    /// port filter gets them all and is armed.
    fn arm_ports(&mut self, _in_use: &PortFilter) {}
}

pub use proxy_model::config::ebpf_settings::DEFAULT_MAX_ENDPOINTS_PER_SERVICE;

/// A generation taken out of use, deleted once `due` has passed (see [`GENERATION_GRACE`]).
#[derive(Debug)]
struct Retired {
    /// The frontend value that pointed at it: service id, generation, slot count, Maglev size.
    value: FrontendValue,
    /// Backend ids by slot, each a reference it holds (released when it is deleted).
    slots: Box<[u32]>,
    /// Its slots are in the maps (not so for an adopted frontend's damaged generation, whose
    /// slots the adoption deleted).
    slots_in_maps: bool,
    /// Its Maglev table is in the map (not so for an adopted frontend whose table was not).
    maglev_table: bool,
    due: Instant,
    /// Its frontend was removed: the service id is free once its last generation is deleted.
    frees_service_id: bool,
}

/// What [`MapWriter::write_frontend`] did.
enum FrontendWrite {
    Switched,
    /// Not written: its idle generation is still retired (in grace).
    Deferred,
}

#[derive(Debug)]
struct AppliedFrontend {
    /// `None`: adopted from pinned maps and not claimed by a service port yet.
    owner: Option<ServicePortName>,
    value: FrontendValue,
    /// Backend ids by slot, in the live generation: the only record of its backends (their
    /// values are the backend table's). A damaged frontend's are the ids it holds, some of
    /// whose slots are missing. (Boxed slices here, not vectors: 60k frontends at 30k
    /// Services, each record as small as it goes; the frontend's map key is its table key's.)
    slots: Box<[u32]>,
    /// `loadBalancerSourceRanges` written for this frontend's service id.
    source_ranges: Box<[IpNet]>,
    /// Read back from maps with missing slots: rewrite on the next apply even if it looks equal.
    /// Its slots were deleted at the adoption.
    damaged: bool,
    /// Read back with a Maglev table missing entries: rewrite on the next apply.
    maglev_incomplete: bool,
}

impl AppliedFrontend {
    fn affinity_timeout(&self) -> Option<u32> {
        affinity_of(&self.value)
    }

    /// The flags [`Frontend::flags`] holds (affinity and Maglev are set by the map_writer).
    fn policy_flags(&self) -> u8 {
        self.value.flags
            & !(frontend_flags::AFFINITY | frontend_flags::MAGLEV | frontend_flags::STICKY_SOCKET)
    }
}

/// Whether the frontend's live (service, backend) pairs are kept in `KPR_AFFINITY_MATCH`:
/// session affinity and per-socket UDP stickiness may only lead to members.
fn tracks_members(value: &FrontendValue) -> bool {
    value.flags & (frontend_flags::AFFINITY | frontend_flags::STICKY_SOCKET) != 0
}

/// Socket frontends of UDP ports keep an unconnected socket on its backend.
fn sticky_socket(key: &FrontendKey) -> bool {
    key.scope == Scope::Internal && key.protocol == Protocol::Udp
}

fn affinity_of(value: &FrontendValue) -> Option<u32> {
    (value.flags & frontend_flags::AFFINITY != 0).then_some(value.affinity_timeout)
}

/// The Maglev table blocks of a frontend value in its live generation (none without a table).
fn maglev_keys(value: &FrontendValue) -> impl Iterator<Item = MaglevKey> + use<> {
    let size = if value.flags & frontend_flags::MAGLEV != 0 {
        value.maglev_size
    } else {
        0
    };
    let (service_id, generation) = (value.service_id, value.generation);
    (0..size.div_ceil(MAGLEV_BLOCK_SLOTS)).map(move |block| MaglevKey {
        service_id,
        block,
        generation,
        _pad: [0; 3],
    })
}

/// Whether every slot of `value`'s live Maglev table is in `maglev` and one of `slots`.
fn maglev_complete(
    value: &FrontendValue,
    maglev: &BTreeMap<MaglevKey, MaglevBlock>,
    slots: &[u32],
) -> bool {
    maglev_keys(value).all(|key| {
        let used = value
            .maglev_size
            .saturating_sub(key.block * MAGLEV_BLOCK_SLOTS)
            .min(MAGLEV_BLOCK_SLOTS) as usize;
        maglev.get(&key).is_some_and(|block| {
            block
                .backend_ids
                .iter()
                .take(used)
                .all(|id| slots.contains(id))
        })
    })
}

/// Candidates per family [`MapWriter::probe_targets`] returns: a NodePort needs a NodePort
/// address of its family, so the self-test may have to pass over the first.
pub const PROBE_CANDIDATES: usize = 4;

/// A frontend the datapath self-test sends a synthetic packet to ([`MapWriter::probe_targets`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    pub family: IpFamily,
    /// The frontend's address; unspecified for a NodePort (any NodePort address).
    pub addr: IpAddr,
    pub port: u16,
    /// The service port that owns it (`namespace/name:port`).
    pub service: String,
    /// Its backends as written: a translated packet must be addressed to one of them.
    pub backends: Vec<SocketAddr>,
}

/// The content of the pinned service maps, as read back after a restart.
#[derive(Debug, Default, Clone)]
pub struct MapsContent {
    pub frontends: Vec<(FrontendMapKey, FrontendValue)>,
    pub slots: BTreeMap<BackendSlotKey, SlotBlock>,
    pub backends: BTreeMap<u32, BackendValue>,
    pub affinity_matches: BTreeSet<AffinityMatchKey>,
    /// (service id, range) entries of the source-range map.
    pub source_ranges: BTreeSet<(u32, IpNet)>,
    pub maglev: BTreeMap<MaglevKey, MaglevBlock>,
}

/// The agent's record of what is in the maps, so each apply writes only the difference.
#[derive(Debug)]
pub struct MapWriter {
    frontends: FrontendTable,
    /// Which frontends each service port owns (boxed: a `Vec` grown by one push holds room
    /// for four, and there is one per service port).
    owned: BTreeMap<ServicePortName, Box<[FrontendKey]>>,
    backends: BackendTable,
    service_ids: IdAllocator,
    backend_ids: IdAllocator,
    /// Frontends whose last write did not fit in the maps, with their service port. They are
    /// not in the maps at all (new ones) or still on their previous complete set (grown ones).
    unfit: BTreeMap<FrontendKey, ServicePortName>,
    /// `--lb-algorithm maglev`: the table size external frontends get; `None`: random.
    maglev_table_size: Option<u32>,
    /// Generations out of use, oldest first, until their grace has passed. A live frontend has
    /// at most one (its next switch waits for it), a removed one at most its two: never more
    /// than the two generations per frontend an update holds anyway, so the slot and Maglev
    /// capacities still hold.
    retired: RetiredList,
    /// Changed frontends waiting for their retired generation to go, with their service port.
    deferred: BTreeMap<FrontendKey, ServicePortName>,
    /// Service ports of the current apply that met a frontend another one still held.
    claimed_by_other: BTreeSet<ServicePortName>,
    /// `--bpf-max-endpoints-per-service`: the most backends one frontend is programmed with.
    max_endpoints: usize,
    /// Retired generations were deleted since the last [`MapWriter::apply_snapshot`] (by it or
    /// by the loop's timer): the next one retries the frontends that did not fit.
    room_freed: bool,
    /// [`GENERATION_GRACE`]; zero (delete at the switch) only in unit tests of other behaviour.
    grace: Duration,
    /// `Instant::now`, or a test's clock.
    clock: fn() -> Instant,
    /// The programs' port filter was armed (`MapOps::arm_ports`) after an apply.
    ports_armed: bool,
}

impl Default for MapWriter {
    fn default() -> Self {
        Self {
            frontends: FrontendTable::default(),
            owned: BTreeMap::new(),
            backends: BackendTable::default(),
            service_ids: IdAllocator::default(),
            backend_ids: IdAllocator::default(),
            unfit: BTreeMap::new(),
            maglev_table_size: None,
            retired: RetiredList::default(),
            deferred: BTreeMap::new(),
            claimed_by_other: BTreeSet::new(),
            max_endpoints: DEFAULT_MAX_ENDPOINTS_PER_SERVICE as usize,
            room_freed: false,
            grace: GENERATION_GRACE,
            clock: Instant::now,
            ports_armed: false,
        }
    }
}

impl MapWriter {
    /// Limits what one Service and one namespace may take of the shared maps, of `capacity`
    /// entries each (see [`shares`]); one Service takes at most `max_frontends_per_service`
    /// frontends. After [`MapWriter::set_maglev_table_size`]: a table's blocks are what the
    /// Maglev map's reserve must hold at least.
    pub fn set_shares(&mut self, capacity: shares::Entries, max_frontends_per_service: u32) {
        use shares::{Entries, SharedMap};
        let table_blocks = self
            .maglev_table_size
            .map_or(1, |size| size.div_ceil(MAGLEV_BLOCK_SLOTS));
        self.frontends.set_share_limits(
            capacity,
            Entries::splat(u64::MAX)
                .with(SharedMap::Frontends, u64::from(max_frontends_per_service)),
            Entries::splat(1).with(SharedMap::Maglev, table_blocks.into()),
        );
    }

    /// Backend ids index the backend arrays, of `limit` elements (the shorter of the two
    /// families' arrays; index 0 unused): a backend that would need an id past them does not
    /// fit (`MapWriteError::Full` naming its family's map).
    pub fn set_backend_id_limit(&mut self, limit: u32) {
        self.backend_ids.set_limit(limit);
    }

    /// `--bpf-max-endpoints-per-service`: each frontend is programmed with at most this many
    /// backends, the first by address and port (at most [`DEFAULT_MAX_ENDPOINTS_PER_SERVICE`],
    /// what a frontend's slots address). Frontends programmed with more are rewritten by the
    /// next apply that covers them.
    pub fn set_max_endpoints_per_service(&mut self, max: u32) {
        self.max_endpoints = max.clamp(1, DEFAULT_MAX_ENDPOINTS_PER_SERVICE) as usize;
    }

    /// Unit tests: the grace and the clock.
    #[cfg(test)]
    pub(crate) fn with_grace(mut self, grace: Duration, clock: fn() -> Instant) -> Self {
        self.grace = grace;
        self.clock = clock;
        self
    }

    /// When the oldest retired generation may be deleted ([`MapWriter::retire_expired`]); the
    /// agent's loop wakes up then even if no sync comes.
    pub fn next_retirement(&self) -> Option<Instant> {
        self.retired.iter().map(|r| r.due).min()
    }

    /// Deletes the retired generations whose grace has passed.
    pub fn retire_expired(&mut self, maps: &mut impl MapOps) -> Retirement {
        let now = (self.clock)();
        let due = self.retired.take_due(|r| r.due <= now);
        let deleted = due.len();
        self.room_freed |= deleted > 0;
        for retired in due {
            self.delete_retired(retired, maps);
        }
        #[cfg(test)]
        self.assert_usage_counted();
        Retirement {
            deleted,
            sync_needed: deleted > 0 && !(self.deferred.is_empty() && self.unfit.is_empty()),
        }
    }

    /// Takes a generation out of use: deleted after the grace (at once without one).
    fn retire(&mut self, retired: Retired, maps: &mut impl MapOps) {
        if self.grace.is_zero() {
            self.delete_retired(retired, maps);
        } else {
            self.retired.push(retired);
        }
    }

    fn delete_retired(&mut self, retired: Retired, maps: &mut impl MapOps) {
        self.delete_generation(&retired.value, &retired.slots, retired.slots_in_maps, maps);
        if !retired.frees_service_id {
            return;
        }
        let service_id = retired.value.service_id;
        // An older generation of the removed frontend still pending (it is due first, so this
        // is only defensive): the id goes free with that one.
        if !self.retired.hand_over_service_id(service_id) {
            self.service_ids.release(service_id);
        }
    }

    /// Selects `--lb-algorithm`: `Some(table size)` for Maglev on external frontends. Frontends
    /// programmed otherwise (adopted from a run with another setting) are rewritten by the next
    /// apply that covers them; a full apply covers all.
    pub fn set_maglev_table_size(&mut self, table_size: Option<u32>) {
        self.maglev_table_size = table_size.filter(|&m| maglev::is_valid_table_size(m));
    }

    /// The Maglev table size `key` should have with `backend_count` backends (0: none).
    fn maglev_size_for(&self, key: &FrontendKey, backend_count: usize) -> u32 {
        match self.maglev_table_size {
            Some(m) if key.scope == Scope::External && backend_count > 0 => m,
            _ => 0,
        }
    }

    /// Entries this map_writer has in each map it writes (the live generation, and retired ones
    /// for their grace), by pinned map name: the fill level `--bpf-map-*` sizes.
    pub fn entries(&self) -> [(&'static str, u64); 7] {
        MapUsage::sum(&[
            self.frontends.usage(),
            self.retired.usage(),
            self.backends.usage(),
        ])
        .by_map()
    }

    /// The service ids (one per frontend) a service port owns, for `proxy-agent inspect`.
    pub fn service_ids_of(&self, name: &ServicePortName) -> Vec<u32> {
        self.owned
            .get(name)
            .into_iter()
            .flatten()
            .filter_map(|key| self.frontends.get(key))
            .map(|applied| applied.value.service_id)
            .collect()
    }

    /// The frontends `name` owns, with their service ids.
    pub fn frontends_of(&self, name: &ServicePortName) -> Vec<(u32, FrontendKey)> {
        self.owned
            .get(name)
            .into_iter()
            .flatten()
            .filter_map(|key| Some((self.frontends.get(key)?.value.service_id, *key)))
            .collect()
    }

    /// Every service port that owns frontends.
    pub fn owners(&self) -> impl Iterator<Item = &ServicePortName> {
        self.owned.keys()
    }

    /// The service ports that own frontends after `after` (all of them from `None`), in name
    /// order.
    pub fn owners_after(
        &self,
        after: Option<&ServicePortName>,
    ) -> impl Iterator<Item = &ServicePortName> {
        let from = match after {
            Some(after) => std::ops::Bound::Excluded(after.clone()),
            None => std::ops::Bound::Unbounded,
        };
        self.owned
            .range((from, std::ops::Bound::Unbounded))
            .map(|(name, _)| name)
    }

    /// The next `count` service ports (in name order) after `after` that a full pass goes
    /// through: those the writer owns and those the snapshot has. A full pass in steps (the
    /// periodic resync) applies them with [`MapWriter::apply_snapshot`] and ends with
    /// [`MapWriter::finish_full_pass`]; fewer than `count` means the pass has reached the end.
    pub fn full_pass_names(
        &self,
        snapshot: &Snapshot,
        after: Option<&ServicePortName>,
        count: usize,
    ) -> BTreeSet<ServicePortName> {
        fn next<'a, V>(
            map: &'a BTreeMap<ServicePortName, V>,
            after: Option<&ServicePortName>,
            count: usize,
        ) -> impl Iterator<Item = &'a ServicePortName> + 'a {
            let from = match after {
                Some(after) => std::ops::Bound::Excluded(after.clone()),
                None => std::ops::Bound::Unbounded,
            };
            map.range((from, std::ops::Bound::Unbounded))
                .map(|(name, _)| name)
                .take(count)
        }
        let mut names: BTreeSet<ServicePortName> = next(&self.owned, after, count)
            .chain(next(&snapshot.v4.service_ports, after, count))
            .chain(next(&snapshot.v6.service_ports, after, count))
            .cloned()
            .collect();
        // Each source gave its first `count`: beyond the `count`th of their union one of them
        // may have names it did not give yet, which the next step takes.
        if let Some(last) = names.iter().nth(count).cloned() {
            names.split_off(&last);
        }
        names
    }

    /// The end of a full pass in steps: what only a whole pass can do — remove the adopted
    /// frontends no service port claimed and, when the pass wrote, repack the trees (see
    /// [`MapWriter::apply_snapshot`] with `None`).
    pub fn finish_full_pass(
        &mut self,
        maps: &mut impl MapOps,
        wrote: bool,
    ) -> (ApplySummary, Vec<ApplyError>) {
        let mut summary = ApplySummary::default();
        let mut errors = Vec::new();
        self.remove_unclaimed(maps, &mut summary, &mut errors);
        if wrote || summary.changed_frontends() {
            self.frontends.repack();
            proxy_model::btree::repack(&mut self.owned);
        }
        self.arm_port_filter(maps);
        (summary, errors)
    }

    /// Hands the port filter every port the records use and arms it: they hold everything in
    /// the maps, adopted frontends included, and each write added its ports before it.
    fn arm_port_filter(&mut self, maps: &mut impl MapOps) {
        let mut in_use = Box::new(PortFilter::EMPTY);
        self.ports_in_use(&mut in_use);
        maps.arm_ports(&in_use);
        self.ports_armed = true;
    }

    /// Applies the snapshot for the service ports in `changed` (`None`: every service port,
    /// known or new — a full resync, which also removes adopted frontends nobody claimed).
    /// Service ports with deferred frontends are applied again whatever `changed` says, and
    /// after retired generations were deleted the ones that did not fit too.
    pub fn apply_snapshot(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
        maps: &mut impl MapOps,
    ) -> (ApplySummary, Vec<ApplyError>) {
        self.retire_expired(maps);
        let mut names: BTreeSet<ServicePortName> = match changed {
            Some(changed) => changed.clone(),
            None => self
                .owned
                .keys()
                .chain(snapshot.v4.service_ports.keys())
                .chain(snapshot.v6.service_ports.keys())
                .cloned()
                .collect(),
        };
        names.extend(self.deferred.values().cloned());
        if changed.is_none() {
            // At most one new backend per endpoint (fewer where service ports share one).
            let endpoints: usize = [&snapshot.v4, &snapshot.v6]
                .iter()
                .flat_map(|family| family.service_ports.values())
                .map(|port| port.endpoints.len())
                .sum();
            self.backends
                .reserve(endpoints.saturating_sub(self.backends.len()));
        }
        // Only this apply's hand-overs: a direct `apply` leaves its own behind.
        self.claimed_by_other.clear();
        if std::mem::take(&mut self.room_freed) {
            names.extend(self.unfit.values().cloned());
        }
        let (mut summary, mut errors) = self.apply(updates_of(snapshot, names), maps);
        // A frontend handed from one Service to another (its older owner went) is claimed by
        // the new owner before, in name order, the old one lets go: claimed again now that
        // every service port of this apply has let go of what it no longer has.
        let handed_over = std::mem::take(&mut self.claimed_by_other);
        if !handed_over.is_empty() {
            errors.retain(|error| {
                !matches!(
                    error,
                    ApplyError::Frontend {
                        reason: MapWriteError::Owned(_),
                        ..
                    }
                )
            });
            drop_truncations(&mut errors, &handed_over);
            let (again, again_errors) = self.apply(updates_of(snapshot, handed_over), maps);
            summary.add_retry(again);
            errors.extend(again_errors);
        }
        if changed.is_none() {
            self.remove_unclaimed(maps, &mut summary, &mut errors);
            // Every service port was written in name order: half-full B-tree nodes otherwise.
            // A full pass that wrote nothing (a periodic resync) left the trees as they were.
            if summary.changed_frontends() {
                self.frontends.repack();
                proxy_model::btree::repack(&mut self.owned);
            }
        }
        // Armed after the first apply; again after a full one (and a full pass in steps),
        // which also repairs a filter someone else cleared.
        if changed.is_none() || !self.ports_armed {
            self.arm_port_filter(maps);
        }
        // Space freed by this apply may now hold what did not fit, possibly earlier in this
        // very apply (service ports go in name order): retry those now rather than at the next
        // periodic resync.
        if summary.frontends_removed > 0 && !self.unfit.is_empty() {
            let retry: BTreeSet<ServicePortName> = self.unfit.values().cloned().collect();
            let retried_keys: BTreeSet<FrontendKey> = self.unfit.keys().copied().collect();
            errors.retain(|error| match error {
                ApplyError::Frontend { frontend, .. } if error.is_capacity() => {
                    !retried_keys.contains(frontend)
                }
                _ => true,
            });
            drop_truncations(&mut errors, &retry);
            let (again, again_errors) = self.apply(updates_of(snapshot, retry), maps);
            summary.add_retry(again);
            errors.extend(again_errors);
        }
        (summary, errors)
    }

    /// Adds the ports of every frontend in the records to `ports`' destination half and of
    /// every backend (live or retired generations') to its source half.
    pub fn ports_in_use(&self, ports: &mut PortFilter) {
        for key in self.frontends.keys() {
            ports.set_destination(key.port);
        }
        for backend in self.backends.values() {
            ports.set_source(backend.port());
        }
    }

    /// Nothing of this writer's is in the maps: no frontend, no generation waiting for its
    /// grace (what a writer made anew over empty maps is, until its first apply).
    pub fn is_empty(&self) -> bool {
        self.frontends.is_empty() && self.retired.is_empty()
    }

    /// The frontends whose last write did not fit in the maps, with their service ports.
    pub fn unfit(&self) -> &BTreeMap<FrontendKey, ServicePortName> {
        &self.unfit
    }

    /// Makes each given service port own exactly the given frontends (a frontend whose previous
    /// generation is still in its grace is deferred: `frontends_deferred`).
    pub fn apply(
        &mut self,
        updates: impl IntoIterator<Item = (ServicePortName, Vec<(FrontendKey, Frontend)>)>,
        maps: &mut impl MapOps,
    ) -> (ApplySummary, Vec<ApplyError>) {
        maps.begin_apply();
        self.retire_expired(maps);
        let mut summary = ApplySummary::default();
        let mut errors = Vec::new();
        // What did not fit or was deferred, by service port: each one's entries are recomputed
        // below for the frontends it still has. A scan of both lists per service port made a
        // node whose maps are too small pay for every frontend that did not fit, for each one
        // (34k of 50k: minutes for a full apply). The updates stay lazy: a full apply builds
        // one service port's frontends at a time.
        let mut pending: BTreeMap<ServicePortName, Vec<FrontendKey>> = BTreeMap::new();
        for (key, owner) in self.unfit.iter().chain(self.deferred.iter()) {
            pending.entry(owner.clone()).or_default().push(*key);
        }
        for (name, frontends) in updates {
            for key in pending.remove(&name).unwrap_or_default() {
                for list in [&mut self.unfit, &mut self.deferred] {
                    if list.get(&key) == Some(&name) {
                        list.remove(&key);
                    }
                }
            }
            // Left in place (not removed and inserted again) when the list stays the same: a
            // periodic resync goes through every service port, most of them unchanged.
            let previous = self.owned.get(&name).cloned().unwrap_or_default();
            for &key in &previous {
                if frontends.iter().any(|(k, _)| *k == key) {
                    continue;
                }
                match self.remove_frontend(key, maps, &mut summary) {
                    Ok(()) => summary.frontends_removed += 1,
                    Err(reason) => errors.push(ApplyError::Remove {
                        frontend: key,
                        reason,
                    }),
                }
            }
            let mut owned = Vec::new();
            // Over `--bpf-max-endpoints-per-service`: the most endpoints one of its programmed
            // frontends has, and how many it is programmed with.
            let mut truncated: Option<(usize, usize)> = None;
            for (key, frontend) in frontends {
                // One lookup for the owner check, the comparison and the share below.
                let applied = self.frontends.get(&key);
                if let Some(owner) = applied
                    .and_then(|applied| applied.owner.as_ref())
                    .filter(|owner| **owner != name)
                {
                    errors.push(ApplyError::Frontend {
                        frontend: key,
                        service: name.to_string(),
                        reason: MapWriteError::Owned(owner.clone()),
                    });
                    self.claimed_by_other.insert(name.clone());
                    continue;
                }
                let (Some(map_key), Some(mut backends)) =
                    (frontend_map_key(&key), backend_values(&key, &frontend))
                else {
                    summary.frontends_unsupported += 1;
                    continue;
                };
                let (endpoints, max) = (backends.len(), self.max_endpoints);
                if endpoints > max {
                    truncate_backends(&mut backends, max);
                }
                // Reported for a frontend that is programmed with the truncated set (one that
                // does not fit is reported as such).
                let mut programmed_truncated = || {
                    if endpoints > max {
                        let most = truncated.map_or(endpoints, |(most, _)| most.max(endpoints));
                        truncated = Some((most, max));
                    }
                };
                let maglev_size = self.maglev_size_for(&key, backends.len());
                // Another owner was ruled out above: an owner is this service port.
                let ours = applied.is_some_and(|applied| applied.owner.is_some());
                let unchanged = applied.is_some_and(|applied| {
                    !applied.damaged
                        && !applied.maglev_incomplete
                        && self
                            .backends
                            .values_of(&applied.slots)
                            .eq(backends.iter().copied().map(Some))
                        && applied.affinity_timeout() == frontend.affinity_timeout
                        && applied.policy_flags() == frontend.flags
                        && *applied.source_ranges == *frontend.source_ranges
                        && applied.value.maglev_size == maglev_size
                });
                // What it takes of the shared maps: an unchanged one nothing new (also how an
                // adopted frontend is claimed: without a single map write, if its entries are
                // within the share); a written one its new generation, which comes before the
                // old one goes.
                if !(ours && unchanged) {
                    let held = applied.map_or_else(shares::Entries::default, |applied| {
                        usage::shared_entries(&key, applied)
                    });
                    let (after, adds) = if unchanged {
                        (held, shares::Entries::default())
                    } else {
                        let old_ranges = applied.map_or(&[][..], |a| &*a.source_ranges);
                        let new_ranges = frontend
                            .source_ranges
                            .iter()
                            .filter(|range| !old_ranges.contains(range))
                            .count();
                        (
                            entries_of(backends.len(), maglev_size, frontend.source_ranges.len()),
                            entries_of(backends.len(), maglev_size, new_ranges)
                                .with(shares::SharedMap::Frontends, u64::from(applied.is_none())),
                        )
                    };
                    let before = if ours {
                        held
                    } else {
                        shares::Entries::default()
                    };
                    let in_map =
                        MapUsage::sum(&[self.frontends.usage(), self.retired.usage()]).shared(&key);
                    if let Err(limit) =
                        self.frontends
                            .shares()
                            .check(&name.service, before, after, adds, in_map)
                    {
                        if ours {
                            // Still in the maps on its previous, complete set.
                            owned.push(key);
                        }
                        self.unfit.insert(key, name.clone());
                        errors.push(ApplyError::Frontend {
                            frontend: key,
                            service: name.to_string(),
                            reason: MapWriteError::Share(limit),
                        });
                        continue;
                    }
                }
                owned.push(key);
                if unchanged {
                    if !ours {
                        self.frontends.set_owner(&key, name.clone());
                    }
                    summary.frontends_unchanged += 1;
                    programmed_truncated();
                    continue;
                }
                let target = Target {
                    key,
                    map_key,
                    backends,
                    affinity_timeout: frontend.affinity_timeout,
                    flags: frontend.flags,
                    source_ranges: frontend.source_ranges,
                    owner: name.clone(),
                };
                match self.write_frontend(target, maps, &mut summary) {
                    Ok(FrontendWrite::Switched) => {
                        summary.frontends_written += 1;
                        programmed_truncated();
                    }
                    Ok(FrontendWrite::Deferred) => {
                        summary.frontends_deferred += 1;
                        self.deferred.insert(key, name.clone());
                    }
                    Err(reason) => {
                        if matches!(reason, MapWriteError::Full(_)) {
                            // Tracked so that an apply that frees space retries it.
                            self.unfit.insert(key, name.clone());
                        }
                        errors.push(ApplyError::Frontend {
                            frontend: key,
                            service: name.to_string(),
                            reason,
                        });
                    }
                }
            }
            if let Some((endpoints, programmed)) = truncated {
                errors.push(ApplyError::Truncated {
                    service: name.to_string(),
                    endpoints,
                    programmed,
                });
            }
            if owned.is_empty() {
                if !previous.is_empty() {
                    self.owned.remove(&name);
                }
            } else if *owned != *previous {
                self.owned.insert(name, owned.into_boxed_slice());
            }
        }
        #[cfg(test)]
        self.assert_usage_counted();
        (summary, errors)
    }

    /// Removes adopted frontends that no service port claimed in a full apply.
    fn remove_unclaimed(
        &mut self,
        maps: &mut impl MapOps,
        summary: &mut ApplySummary,
        errors: &mut Vec<ApplyError>,
    ) {
        let unclaimed: Vec<FrontendKey> = self
            .frontends
            .iter()
            .filter(|(_, applied)| applied.owner.is_none())
            .map(|(key, _)| *key)
            .collect();
        for key in unclaimed {
            match self.remove_frontend(key, maps, summary) {
                Ok(()) => summary.frontends_removed += 1,
                Err(reason) => errors.push(ApplyError::Remove {
                    frontend: key,
                    reason,
                }),
            }
        }
    }

    /// Number of frontends and distinct backends currently programmed.
    pub fn counts(&self) -> (usize, usize) {
        (self.frontends.len(), self.backends.len())
    }

    /// Per IP family, the first few ([`PROBE_CANDIDATES`]) external TCP frontends the datapath
    /// self-test can send a synthetic SYN to and expect translated: ones with backends in its live generation, whose
    /// owner is known, without session affinity (a probe would leave an affinity entry for its
    /// client) or source ranges (they may refuse the probe's documentation address).
    pub fn probe_targets(&self) -> Vec<ProbeTarget> {
        let mut found: Vec<ProbeTarget> = Vec::new();
        for (key, applied) in self.frontends.iter() {
            let family = match key.addr {
                IpAddr::V4(_) => IpFamily::V4,
                IpAddr::V6(_) => IpFamily::V6,
            };
            if found
                .iter()
                .filter(|target| target.family == family)
                .count()
                >= PROBE_CANDIDATES
            {
                continue;
            }
            let skip = frontend_flags::AFFINITY | frontend_flags::SOURCE_RANGES;
            if key.scope != Scope::External
                || key.protocol != Protocol::Tcp
                || applied.value.backend_count == 0
                || applied.value.flags & skip != 0
                || applied.damaged
            {
                continue;
            }
            let Some(owner) = &applied.owner else {
                continue;
            };
            let backends: Vec<SocketAddr> = applied
                .slots
                .iter()
                .filter_map(|&id| self.backends.value_of(id))
                .map(|backend| backend.socket_addr())
                .collect();
            if backends.is_empty() {
                continue;
            }
            found.push(ProbeTarget {
                family,
                addr: key.addr,
                port: key.port,
                service: owner.to_string(),
                backends,
            });
        }
        found
    }

    /// What the service maps must hold according to this record, entry by entry (the drift
    /// check compares it with what they do hold). `None` while an adopted frontend is damaged
    /// or has an incomplete Maglev table: the record then knows it differs from the maps, and
    /// the next full apply rewrites that frontend anyway. The agent's loop only copies the
    /// record, in steps ([`MapWriter::record_copy_step`]); the drift thread builds this from
    /// the copy.
    #[cfg(test)]
    pub(crate) fn expected_content(&self) -> Option<MapsContent> {
        self.record_copy()?.expected_content()
    }
}

/// Drops the truncation reports of `names`: they are applied again, which reports them again.
fn drop_truncations(errors: &mut Vec<ApplyError>, names: &BTreeSet<ServicePortName>) {
    if !errors
        .iter()
        .any(|error| matches!(error, ApplyError::Truncated { .. }))
    {
        return;
    }
    let names: BTreeSet<String> = names.iter().map(ToString::to_string).collect();
    errors.retain(|error| match error {
        ApplyError::Truncated { service, .. } => !names.contains(service),
        _ => true,
    });
}

/// The per-service-port updates for `names` from `snapshot` (a name absent from the snapshot
/// gets no frontends: it is removed).
fn updates_of(
    snapshot: &Snapshot,
    names: BTreeSet<ServicePortName>,
) -> impl Iterator<Item = (ServicePortName, Vec<(FrontendKey, Frontend)>)> + '_ {
    names.into_iter().map(|name| {
        let frontends = IpFamily::ALL
            .iter()
            .filter_map(|&family| snapshot.family(family).service_ports.get(&name))
            .flat_map(|port| {
                let mut frontends = socket_frontends(port);
                frontends.extend(external_frontends(port));
                frontends
            })
            .collect();
        (name, frontends)
    })
}

/// What a frontend must become.
struct Target {
    key: FrontendKey,
    map_key: FrontendMapKey,
    backends: Vec<BackendValue>,
    affinity_timeout: Option<u32>,
    flags: u8,
    source_ranges: Vec<IpNet>,
    owner: ServicePortName,
}

fn matches_of(applied: &AppliedFrontend) -> BTreeSet<AffinityMatchKey> {
    if !tracks_members(&applied.value) {
        return BTreeSet::new();
    }
    applied
        .slots
        .iter()
        .map(|&backend_id| AffinityMatchKey {
            service_id: applied.value.service_id,
            backend_id,
        })
        .collect()
}

pub use proxy_common::addr::{ip4_from_map, ip4_to_map, ip6_from_map, ip6_to_map};

pub fn frontend_map_key(key: &FrontendKey) -> Option<FrontendMapKey> {
    Some(map_key_of(key))
}

/// The frontend map's key for `key` (every frontend key has one).
fn map_key_of(key: &FrontendKey) -> FrontendMapKey {
    let port = key.port.to_be();
    let proto = key.protocol.number();
    let scope = match key.scope {
        Scope::Internal => scope::INTERNAL,
        Scope::External => scope::EXTERNAL,
    };
    match key.addr {
        IpAddr::V4(addr) => FrontendMapKey::V4(Frontend4Key {
            addr: ip4_to_map(addr),
            port,
            proto,
            scope,
        }),
        IpAddr::V6(addr) => FrontendMapKey::V6(Frontend6Key {
            addr: ip6_to_map(addr),
            port,
            proto,
            scope,
        }),
    }
}

pub(crate) fn frontend_key_of(map_key: &FrontendMapKey) -> Option<FrontendKey> {
    let (addr, port, proto, scope_value) = match map_key {
        FrontendMapKey::V4(k) => (IpAddr::from(ip4_from_map(k.addr)), k.port, k.proto, k.scope),
        FrontendMapKey::V6(k) => (IpAddr::from(ip6_from_map(k.addr)), k.port, k.proto, k.scope),
    };
    let scope = match scope_value {
        scope::INTERNAL => Scope::Internal,
        scope::EXTERNAL => Scope::External,
        _ => return None,
    };
    let protocol = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
        .into_iter()
        .find(|p| p.number() == proto)?;
    Some(FrontendKey {
        addr,
        port: u16::from_be(port),
        protocol,
        scope,
    })
}

/// The frontend's backends as map values, or `None` if one is of the other family (the desired
/// state never does that; the datapath could not serve it).
fn backend_values(key: &FrontendKey, frontend: &Frontend) -> Option<Vec<BackendValue>> {
    let proto = frontend.service_port.protocol.number();
    // Backends are a set for the datapath: the order of slots does not matter, only membership
    // (sorted and without duplicates; a vector sorted in place, as this runs for every frontend
    // of a full pass).
    let mut set: Vec<BackendValue> = frontend
        .backends
        .iter()
        .map(|backend| {
            let port = backend.port.to_be();
            match (key.addr, backend.addr) {
                (IpAddr::V4(_), IpAddr::V4(addr)) => Some(BackendValue::V4(Backend4 {
                    addr: ip4_to_map(addr),
                    port,
                    proto,
                    flags: 0,
                })),
                (IpAddr::V6(_), IpAddr::V6(addr)) => Some(BackendValue::V6(Backend6 {
                    addr: ip6_to_map(addr),
                    port,
                    proto,
                    flags: 0,
                })),
                _ => None,
            }
        })
        .collect::<Option<_>>()?;
    set.sort_unstable();
    set.dedup();
    Some(set)
}

/// Keeps the first `max` of `backends` by address and port (the same ones on every node), a
/// sorted set again.
fn truncate_backends(backends: &mut Vec<BackendValue>, max: usize) {
    backends.sort_unstable_by_key(BackendValue::socket_addr);
    backends.truncate(max);
    backends.sort_unstable();
}

/// The entries of the shared maps one frontend holds with `slots` backends, a Maglev table of
/// `maglev_size` slots and `source_ranges` ranges (as `usage` counts them).
fn entries_of(slots: usize, maglev_size: u32, source_ranges: usize) -> shares::Entries {
    use shares::SharedMap;
    shares::Entries::default()
        .with(SharedMap::Frontends, 1)
        .with(SharedMap::Slots, slots as u64)
        .with(
            SharedMap::Maglev,
            u64::from(maglev_size.div_ceil(MAGLEV_BLOCK_SLOTS)),
        )
        .with(SharedMap::SourceRanges, source_ranges as u64)
}

/// The keys of the slot blocks of a generation of `slots` slots.
fn slot_keys(
    service_id: u32,
    generation: u8,
    slots: usize,
) -> impl Iterator<Item = BackendSlotKey> + use<> {
    (0..slots.div_ceil(SLOT_BLOCK_SLOTS as usize)).map(move |block| BackendSlotKey {
        service_id,
        block: block as u16,
        generation,
        _pad: 0,
    })
}

/// The slot map entries of one generation of `value`: its backend ids by slot, in blocks.
fn slot_entries<'a>(
    value: &'a FrontendValue,
    slots: &'a [u32],
) -> impl Iterator<Item = (BackendSlotKey, SlotBlock)> + 'a {
    slot_keys(value.service_id, value.generation, slots.len())
        .zip(slots.chunks(SLOT_BLOCK_SLOTS as usize))
        .map(|(key, ids)| {
            let mut block = SlotBlock::default();
            block.backend_ids[..ids.len()].copy_from_slice(ids);
            (key, block)
        })
}

#[cfg(test)]
mod tests;

mod adopt;
mod frontend_writes;
mod id_index;
mod record_copy;
pub mod shares;
mod summary;
mod usage;

pub use record_copy::{CopyStep, RecordCopy, RecordCopying};
pub use summary::{ApplyError, ApplySummary, RemovedBackend, Retirement};
