//! How many entries the map writer has in each map it writes, kept up to date as it writes.
//!
//! The fill levels go to the metrics after every sync. Counting them off the writer's records
//! walked every frontend four times: 12 ms of a one-Service sync at 50k Services, more than the
//! sync itself. So the records live in collections that adjust the counts on every insert and
//! removal, and only reads and count-neutral changes are open to the rest of the writer. The
//! same goes for what each Service and namespace holds of the shared maps (`shares`).

use std::{collections::BTreeMap, ops::Deref};

use proxy_common::map_names;

mod backend_table;

pub(super) use backend_table::BackendTable;

use crate::maps::map_writer::{
    AppliedFrontend, BackendValue, Retired, maglev_keys,
    shares::{Entries, SharedMap, Shares},
};
use proxy_model::desired::{FrontendKey, ServicePortName};

/// Entries per written map.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct MapUsage {
    frontends4: u64,
    frontends6: u64,
    backends4: u64,
    backends6: u64,
    slots: u64,
    source_ranges: u64,
    maglev: u64,
}

impl MapUsage {
    fn of_frontend(key: &FrontendKey, applied: &AppliedFrontend) -> Self {
        let v4 = key.addr.is_ipv4();
        Self {
            frontends4: u64::from(v4),
            frontends6: u64::from(!v4),
            // A damaged frontend's slots were deleted at its adoption.
            slots: if applied.damaged {
                0
            } else {
                applied.slots.len() as u64
            },
            source_ranges: applied.source_ranges.len() as u64,
            maglev: maglev_keys(&applied.value).count() as u64,
            ..Self::default()
        }
    }

    fn of_retired(retired: &Retired) -> Self {
        Self {
            slots: if retired.slots_in_maps {
                retired.slots.len() as u64
            } else {
                0
            },
            maglev: maglev_keys(&retired.value).count() as u64,
            ..Self::default()
        }
    }

    fn of_backend(backend: &BackendValue) -> Self {
        let v4 = matches!(backend, BackendValue::V4(_));
        Self {
            backends4: u64::from(v4),
            backends6: u64::from(!v4),
            ..Self::default()
        }
    }

    fn add(&mut self, other: Self) {
        self.frontends4 += other.frontends4;
        self.frontends6 += other.frontends6;
        self.backends4 += other.backends4;
        self.backends6 += other.backends6;
        self.slots += other.slots;
        self.source_ranges += other.source_ranges;
        self.maglev += other.maglev;
    }

    fn sub(&mut self, other: Self) {
        self.frontends4 = self.frontends4.saturating_sub(other.frontends4);
        self.frontends6 = self.frontends6.saturating_sub(other.frontends6);
        self.backends4 = self.backends4.saturating_sub(other.backends4);
        self.backends6 = self.backends6.saturating_sub(other.backends6);
        self.slots = self.slots.saturating_sub(other.slots);
        self.source_ranges = self.source_ranges.saturating_sub(other.source_ranges);
        self.maglev = self.maglev.saturating_sub(other.maglev);
    }

    /// Backend slot entries: what a copy of the record holds as many backend ids as.
    pub(super) fn slots(&self) -> u64 {
        self.slots
    }

    pub(super) fn sum(parts: &[Self]) -> Self {
        let mut total = Self::default();
        for part in parts {
            total.add(*part);
        }
        total
    }

    /// Entries of the shared maps (`shares`), the frontend map being `key`'s family's.
    pub(super) fn shared(&self, key: &FrontendKey) -> Entries {
        let frontends = if key.addr.is_ipv4() {
            self.frontends4
        } else {
            self.frontends6
        };
        Entries::default()
            .with(SharedMap::Frontends, frontends)
            .with(SharedMap::Slots, self.slots)
            .with(SharedMap::Maglev, self.maglev)
            .with(SharedMap::SourceRanges, self.source_ranges)
    }

    /// By pinned map name: the fill level `--bpf-map-*` sizes.
    pub(super) fn by_map(&self) -> [(&'static str, u64); 7] {
        [
            (map_names::FRONTENDS4, self.frontends4),
            (map_names::FRONTENDS6, self.frontends6),
            (map_names::BACKENDS4, self.backends4),
            (map_names::BACKENDS6, self.backends6),
            (map_names::BACKEND_SLOTS, self.slots),
            (map_names::SOURCE_RANGES, self.source_ranges),
            (map_names::MAGLEV, self.maglev),
        ]
    }
}

/// The entries of the shared maps the frontend `key` holds as `applied`.
pub(super) fn shared_entries(key: &FrontendKey, applied: &AppliedFrontend) -> Entries {
    MapUsage::of_frontend(key, applied).shared(key)
}

/// The applied frontends by key, with their entry counts, in all and by owner.
#[derive(Debug, Default)]
pub(super) struct FrontendTable {
    map: BTreeMap<FrontendKey, AppliedFrontend>,
    usage: MapUsage,
    /// What each owner's Service and namespace holds (adopted frontends, owned by no one yet,
    /// count in no share).
    shares: Shares,
}

impl Deref for FrontendTable {
    type Target = BTreeMap<FrontendKey, AppliedFrontend>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl FrontendTable {
    pub(super) fn usage(&self) -> MapUsage {
        self.usage
    }

    pub(super) fn shares(&self) -> &Shares {
        &self.shares
    }

    /// Sets the limits of the shared maps; what each one holds stays counted.
    pub(super) fn set_share_limits(
        &mut self,
        capacity: Entries,
        per_service: Entries,
        unit: Entries,
    ) {
        self.shares.set_limits(capacity, per_service, unit);
    }

    /// See [`proxy_model::btree`].
    pub(super) fn repack(&mut self) {
        proxy_model::btree::repack(&mut self.map);
    }

    pub(super) fn insert(
        &mut self,
        key: FrontendKey,
        applied: AppliedFrontend,
    ) -> Option<AppliedFrontend> {
        let usage = MapUsage::of_frontend(&key, &applied);
        self.usage.add(usage);
        if let Some(owner) = &applied.owner {
            self.shares.add(&owner.service, usage.shared(&key));
        }
        let old = self.map.insert(key, applied);
        if let Some(old) = &old {
            self.forget(&key, old);
        }
        old
    }

    pub(super) fn remove(&mut self, key: &FrontendKey) -> Option<AppliedFrontend> {
        let old = self.map.remove(key);
        if let Some(old) = &old {
            self.forget(key, old);
        }
        old
    }

    /// Takes a frontend that left the table out of the counts.
    fn forget(&mut self, key: &FrontendKey, old: &AppliedFrontend) {
        let usage = MapUsage::of_frontend(key, old);
        self.usage.sub(usage);
        if let Some(owner) = &old.owner {
            self.shares.sub(&owner.service, usage.shared(key));
        }
    }

    /// Claims a frontend for a service port: its entries count in the owner's share from now.
    pub(super) fn set_owner(&mut self, key: &FrontendKey, owner: ServicePortName) {
        if let Some(applied) = self.map.get_mut(key) {
            let entries = MapUsage::of_frontend(key, applied).shared(key);
            if let Some(previous) = &applied.owner {
                self.shares.sub(&previous.service, entries);
            }
            self.shares.add(&owner.service, entries);
            applied.owner = Some(owner);
        }
    }
}

/// Generations out of use, oldest first, with their entry counts.
#[derive(Debug, Default)]
pub(super) struct RetiredList {
    list: Vec<Retired>,
    usage: MapUsage,
}

impl Deref for RetiredList {
    type Target = [Retired];
    fn deref(&self) -> &Self::Target {
        &self.list
    }
}

impl RetiredList {
    pub(super) fn usage(&self) -> MapUsage {
        self.usage
    }

    pub(super) fn push(&mut self, retired: Retired) {
        self.usage.add(MapUsage::of_retired(&retired));
        self.list.push(retired);
    }

    pub(super) fn remove(&mut self, index: usize) -> Retired {
        let retired = self.list.remove(index);
        self.usage.sub(MapUsage::of_retired(&retired));
        retired
    }

    /// Takes out the generations `due` says are due, keeping the others in order.
    pub(super) fn take_due(&mut self, due: impl Fn(&Retired) -> bool) -> Vec<Retired> {
        let (taken, kept): (Vec<Retired>, Vec<Retired>) =
            std::mem::take(&mut self.list).into_iter().partition(due);
        self.list = kept;
        for retired in &taken {
            self.usage.sub(MapUsage::of_retired(retired));
        }
        taken
    }

    /// Marks the pending generation of `service_id` as the one that frees it; false when there
    /// is none.
    pub(super) fn hand_over_service_id(&mut self, service_id: u32) -> bool {
        match self
            .list
            .iter_mut()
            .find(|r| r.value.service_id == service_id)
        {
            Some(other) => {
                other.frees_service_id = true;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
impl crate::maps::map_writer::MapWriter {
    /// The counts kept as the writer goes equal a count over its records: checked after every
    /// apply and retirement of the map writer's unit tests.
    pub(super) fn assert_usage_counted(&self) {
        let mut recounted = MapUsage::default();
        let mut shares = Shares::default();
        for (key, applied) in self.frontends.iter() {
            let usage = MapUsage::of_frontend(key, applied);
            recounted.add(usage);
            if let Some(owner) = &applied.owner {
                shares.add(&owner.service, usage.shared(key));
            }
        }
        assert!(
            self.frontends.shares().same_counts(&shares),
            "the shares kept as the writer goes differ from a recount"
        );
        for retired in self.retired.iter() {
            recounted.add(MapUsage::of_retired(retired));
        }
        for (_, backend) in self.backends.iter() {
            recounted.add(MapUsage::of_backend(&backend));
        }
        assert_eq!(
            MapUsage::sum(&[
                self.frontends.usage(),
                self.retired.usage(),
                self.backends.usage()
            ]),
            recounted
        );
    }
}
