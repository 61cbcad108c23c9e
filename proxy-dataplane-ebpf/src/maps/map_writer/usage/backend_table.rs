//! The backends in the maps: each with its id and how many generations use it, found by id
//! (the frontends' records hold ids only) and by value (a generation that names a backend
//! already in the maps shares its id).
//!
//! Each backend is held once, in the id index; the lookup by value is a hash table of ids
//! hashed by their backend's value, so it costs an id and a control byte per backend where a
//! map keyed by value would hold every value a second time (at 30k Services × 10 endpoints
//! the table was a third of the writer's records as a `BTreeMap` beside the index).

use std::hash::BuildHasher as _;

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::maps::map_writer::BackendValue;
use crate::maps::map_writer::id_index::IdIndex;
use crate::maps::map_writer::usage::MapUsage;

#[derive(Debug, Clone, Copy)]
struct Held {
    value: BackendValue,
    /// Generations (live and retired) that hold a slot on it: at most two per frontend.
    users: u32,
}

#[derive(Debug, Default)]
pub(in crate::maps::map_writer) struct BackendTable {
    by_id: IdIndex<Held>,
    ids: HashTable<u32>,
    hasher: DefaultHashBuilder,
    usage: MapUsage,
}

impl BackendTable {
    pub(in crate::maps::map_writer) fn usage(&self) -> MapUsage {
        self.usage
    }

    pub(in crate::maps::map_writer) fn len(&self) -> usize {
        self.ids.len()
    }

    /// The id of `backend`, if it is in the table.
    pub(in crate::maps::map_writer) fn id_of(&self, backend: &BackendValue) -> Option<u32> {
        self.id_of_hashed(self.hasher.hash_one(backend), backend)
    }

    /// [`Self::id_of`] with the value's hash already taken.
    fn id_of_hashed(&self, hash: u64, backend: &BackendValue) -> Option<u32> {
        self.ids
            .find(hash, |&id| {
                self.by_id
                    .get(id)
                    .is_some_and(|held| held.value == *backend)
            })
            .copied()
    }

    /// Every backend in the table.
    pub(in crate::maps::map_writer) fn values(&self) -> impl Iterator<Item = BackendValue> + '_ {
        self.by_id.iter().map(|(_, held)| held.value)
    }

    /// The backend with `id`.
    pub(in crate::maps::map_writer) fn value_of(&self, id: u32) -> Option<BackendValue> {
        self.by_id.get(id).map(|held| held.value)
    }

    /// The backends with `ids`, in order (`None` for an id not in the table).
    pub(in crate::maps::map_writer) fn values_of<'a>(
        &'a self,
        ids: &'a [u32],
    ) -> impl Iterator<Item = Option<BackendValue>> + 'a {
        ids.iter().map(|&id| self.value_of(id))
    }

    /// One more user of `backend`, if it is in the table: its id.
    pub(in crate::maps::map_writer) fn hold(&mut self, backend: &BackendValue) -> Option<u32> {
        let id = self.id_of(backend)?;
        self.add_user(id);
        Some(id)
    }

    /// One more user of `backend` under `id` (an adopted slot's): added with its first user if
    /// the table does not have it; `false` (nothing changed) if it has it under another id.
    /// One hash of the value where [`Self::id_of`] then [`Self::hold`] or [`Self::insert`]
    /// took two or three: an adoption does this for every slot in the maps.
    pub(in crate::maps::map_writer) fn adopt(&mut self, backend: BackendValue, id: u32) -> bool {
        let hash = self.hasher.hash_one(backend);
        match self.id_of_hashed(hash, &backend) {
            Some(known) if known != id => false,
            Some(_) => {
                self.add_user(id);
                true
            }
            None => {
                self.insert_hashed(hash, backend, id);
                true
            }
        }
    }

    fn add_user(&mut self, id: u32) {
        if let Some(held) = self.by_id.get_mut(id) {
            held.users = held.users.saturating_add(1);
        }
    }

    /// Room for `additional` more backends in the id lookup, so that a full apply into an
    /// empty table does not grow it (rehashing every id it holds) a dozen times over.
    pub(in crate::maps::map_writer) fn reserve(&mut self, additional: usize) {
        let Self {
            by_id, ids, hasher, ..
        } = self;
        ids.reserve(additional, |&other| {
            by_id
                .get(other)
                .map_or(0, |held| hasher.hash_one(held.value))
        });
    }

    /// Adds `backend`, not in the table, under `id`, which no backend has, with one user.
    pub(in crate::maps::map_writer) fn insert(&mut self, backend: BackendValue, id: u32) {
        self.insert_hashed(self.hasher.hash_one(backend), backend, id);
    }

    /// [`Self::insert`] with the value's hash already taken.
    fn insert_hashed(&mut self, hash: u64, backend: BackendValue, id: u32) {
        let Self {
            by_id, ids, hasher, ..
        } = self;
        ids.insert_unique(hash, id, |&other| {
            by_id
                .get(other)
                .map_or(0, |held| hasher.hash_one(held.value))
        });
        by_id.insert(
            id,
            Held {
                value: backend,
                users: 1,
            },
        );
        self.usage.add(MapUsage::of_backend(&backend));
    }

    /// One user less of `backend`; its id if that was the last, when it has left the table.
    pub(in crate::maps::map_writer) fn release(&mut self, backend: &BackendValue) -> Option<u32> {
        let id = self.id_of(backend)?;
        self.release_id(id).map(|_| id)
    }

    /// One user less of the backend with `id` (what a frontend's record holds: no lookup by
    /// value); the backend if that was the last, when it has left the table.
    pub(in crate::maps::map_writer) fn release_id(&mut self, id: u32) -> Option<BackendValue> {
        let held = self.by_id.get_mut(id)?;
        held.users = held.users.saturating_sub(1);
        if held.users > 0 {
            return None;
        }
        let backend = held.value;
        self.by_id.remove(id);
        let hash = self.hasher.hash_one(backend);
        if let Ok(entry) = self.ids.find_entry(hash, |&other| other == id) {
            entry.remove();
        }
        self.usage.sub(MapUsage::of_backend(&backend));
        Some(backend)
    }

    /// Every backend with its id, in id order.
    pub(in crate::maps::map_writer) fn iter(
        &self,
    ) -> impl Iterator<Item = (u32, BackendValue)> + '_ {
        self.by_id.iter().map(|(id, held)| (id, held.value))
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::Backend4;

    use super::*;

    fn pod(last: u8) -> BackendValue {
        BackendValue::V4(Backend4 {
            addr: u32::from_be_bytes([10, 244, 0, last]),
            port: 8080,
            proto: 6,
            flags: 0,
        })
    }

    #[test]
    fn a_backend_is_found_by_id_and_by_value_until_its_last_user_releases_it() {
        let mut table = BackendTable::default();
        for last in 1..=200u8 {
            table.insert(pod(last), u32::from(last) * 7);
        }
        assert_eq!(table.len(), 200);
        assert_eq!(table.id_of(&pod(9)), Some(63));
        assert_eq!(table.value_of(63), Some(pod(9)));
        assert_eq!(table.hold(&pod(9)), Some(63));
        assert_eq!(table.release(&pod(9)), None, "one user is left");
        assert_eq!(table.release(&pod(9)), Some(63));
        assert_eq!((table.id_of(&pod(9)), table.value_of(63)), (None, None));
        assert_eq!(table.release(&pod(9)), None, "gone");
        assert_eq!(table.hold(&pod(9)), None);
        assert_eq!(table.len(), 199);
        assert_eq!(table.iter().count(), 199);
        assert_eq!(table.id_of(&pod(200)), Some(1400));
        assert_eq!(table.hold(&pod(200)), Some(1400));
        assert_eq!(table.release_id(1400), None, "one user is left");
        assert_eq!(table.release_id(1400), Some(pod(200)));
        assert_eq!((table.id_of(&pod(200)), table.value_of(1400)), (None, None));
        assert_eq!(table.release_id(1400), None, "gone");
        assert_eq!(table.len(), 198);
    }

    #[test]
    fn an_adopted_backend_is_added_once_held_again_under_its_id_and_refused_under_another() {
        let mut table = BackendTable::default();
        assert!(table.adopt(pod(1), 5), "added");
        assert!(table.adopt(pod(1), 5), "a second slot of it");
        assert!(!table.adopt(pod(1), 6), "the same value under a second id");
        assert_eq!((table.len(), table.value_of(6)), (1, None));
        assert!(table.adopt(pod(2), 6));
        assert_eq!(table.release_id(5), None, "one user is left");
        assert_eq!(table.release_id(5), Some(pod(1)));
        assert_eq!(table.id_of(&pod(2)), Some(6));
        assert_eq!(table.usage(), {
            let mut one = BackendTable::default();
            one.insert(pod(2), 6);
            one.usage()
        });
    }
}
