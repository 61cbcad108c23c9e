//! Programs a snapshot into the service maps, touching only what changed since the last one.
//!
//! Per changed frontend the order is the update protocol from `proxy_common::maps`: new backends
//! first, then the slots of the idle generation, then one frontend update that switches
//! generation and count, then the old generation's slots and unused backends go. If a step before
//! the switch fails (a full map, say), everything written for that frontend is taken back and the
//! frontend keeps its previous, complete backend set.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use proxy_common::{Backend4, BackendSlotKey, Frontend4Key, FrontendValue, scope};
use tracing::{debug, warn};

use super::ids::IdAllocator;
use crate::desired::{
    Frontend, FrontendKey, IpFamily, ServicePortName, Snapshot, socket_frontends,
};

/// Raw writes to the service maps; implemented over the kernel maps, and over plain collections
/// in unit tests of the diff logic.
pub trait MapOps {
    fn put_frontend(&mut self, key: Frontend4Key, value: FrontendValue) -> Result<(), String>;
    fn delete_frontend(&mut self, key: Frontend4Key) -> Result<(), String>;
    fn put_slot(&mut self, key: BackendSlotKey, backend_id: u32) -> Result<(), String>;
    fn delete_slot(&mut self, key: BackendSlotKey) -> Result<(), String>;
    fn put_backend(&mut self, id: u32, backend: Backend4) -> Result<(), String>;
    fn delete_backend(&mut self, id: u32) -> Result<(), String>;
}

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("frontend {frontend} ({service}): {reason}; it keeps its previous backends")]
    Frontend {
        frontend: FrontendKey,
        service: String,
        reason: String,
    },
    #[error("frontend {frontend}: removing it failed: {reason}")]
    Remove {
        frontend: FrontendKey,
        reason: String,
    },
}

/// What one apply did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplySummary {
    pub frontends_written: usize,
    pub frontends_removed: usize,
    pub frontends_unchanged: usize,
    /// Frontends this dataplane cannot serve yet (IPv6 comes with the socket-LB work).
    pub frontends_unsupported: usize,
}

#[derive(Debug)]
struct AppliedFrontend {
    owner: ServicePortName,
    value: FrontendValue,
    /// Backend ids by slot, in the live generation.
    slots: Vec<u32>,
    backends: Vec<Backend4>,
}

#[derive(Debug, Default)]
struct BackendEntry {
    id: u32,
    users: usize,
}

/// The agent's record of what is in the maps, so each apply writes only the difference.
#[derive(Debug, Default)]
pub struct Programmer {
    frontends: BTreeMap<FrontendKey, AppliedFrontend>,
    /// Which frontends each service port owns.
    owned: BTreeMap<ServicePortName, Vec<FrontendKey>>,
    backends: BTreeMap<Backend4, BackendEntry>,
    service_ids: IdAllocator,
    backend_ids: IdAllocator,
}

impl Programmer {
    /// Applies the snapshot for the service ports in `changed` (`None`: every service port,
    /// known or new — a full resync).
    pub fn apply_snapshot(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
        maps: &mut impl MapOps,
    ) -> (ApplySummary, Vec<ApplyError>) {
        let names: BTreeSet<ServicePortName> = match changed {
            Some(changed) => changed.clone(),
            None => self
                .owned
                .keys()
                .chain(snapshot.v4.service_ports.keys())
                .chain(snapshot.v6.service_ports.keys())
                .cloned()
                .collect(),
        };
        let updates = names.into_iter().map(|name| {
            let frontends = IpFamily::ALL
                .iter()
                .filter_map(|&family| snapshot.family(family).service_ports.get(&name))
                .flat_map(socket_frontends)
                .collect();
            (name, frontends)
        });
        self.apply(updates, maps)
    }

    /// Makes each given service port own exactly the given frontends.
    pub fn apply(
        &mut self,
        updates: impl IntoIterator<Item = (ServicePortName, Vec<(FrontendKey, Frontend)>)>,
        maps: &mut impl MapOps,
    ) -> (ApplySummary, Vec<ApplyError>) {
        let mut summary = ApplySummary::default();
        let mut errors = Vec::new();
        for (name, frontends) in updates {
            let previous = self.owned.remove(&name).unwrap_or_default();
            for key in previous {
                if frontends.iter().any(|(k, _)| *k == key) {
                    continue;
                }
                match self.remove_frontend(key, maps) {
                    Ok(()) => summary.frontends_removed += 1,
                    Err(reason) => errors.push(ApplyError::Remove {
                        frontend: key,
                        reason,
                    }),
                }
            }
            let mut owned = Vec::new();
            for (key, frontend) in frontends {
                if let Some(owner) = self.owner_other_than(&key, &name) {
                    errors.push(ApplyError::Frontend {
                        frontend: key,
                        service: name.to_string(),
                        reason: format!("the address is already used by {owner}"),
                    });
                    continue;
                }
                let (Some(map_key), Some(backends)) =
                    (frontend_map_key(&key), backends4(&frontend))
                else {
                    summary.frontends_unsupported += 1;
                    continue;
                };
                owned.push(key);
                if self
                    .frontends
                    .get(&key)
                    .is_some_and(|applied| applied.backends == backends)
                {
                    summary.frontends_unchanged += 1;
                    continue;
                }
                match self.write_frontend(key, map_key, backends, name.clone(), maps) {
                    Ok(()) => summary.frontends_written += 1,
                    Err(reason) => errors.push(ApplyError::Frontend {
                        frontend: key,
                        service: name.to_string(),
                        reason,
                    }),
                }
            }
            if !owned.is_empty() {
                self.owned.insert(name, owned);
            }
        }
        (summary, errors)
    }

    fn owner_other_than(
        &self,
        key: &FrontendKey,
        name: &ServicePortName,
    ) -> Option<&ServicePortName> {
        self.frontends
            .get(key)
            .map(|applied| &applied.owner)
            .filter(|owner| *owner != name)
    }

    fn write_frontend(
        &mut self,
        key: FrontendKey,
        map_key: Frontend4Key,
        backends: Vec<Backend4>,
        owner: ServicePortName,
        maps: &mut impl MapOps,
    ) -> Result<(), String> {
        let slot_count = u16::try_from(backends.len()).map_err(|_| {
            format!(
                "{} backends exceed the 65535 slots of a frontend",
                backends.len()
            )
        })?;
        let previous = self.frontends.get(&key).map(|applied| applied.value);
        let (service_id, new_generation) = match previous {
            Some(value) => (value.service_id, value.generation ^ 1),
            None => (
                self.service_ids
                    .allocate()
                    .ok_or_else(|| "no service id left".to_owned())?,
                0,
            ),
        };

        let mut written = Written::default();
        let result =
            self.write_generation(service_id, new_generation, &backends, maps, &mut written);
        let result = result.and_then(|slots| {
            let value = FrontendValue {
                service_id,
                backend_count: slot_count,
                generation: new_generation,
                flags: 0,
            };
            maps.put_frontend(map_key, value)?;
            Ok((value, slots))
        });
        let (value, slots) = match result {
            Ok(done) => done,
            Err(reason) => {
                self.undo(written, maps);
                if previous.is_none() {
                    self.service_ids.release(service_id);
                }
                return Err(reason);
            }
        };

        // The frontend now points at the new generation: the old one is unreachable.
        let old = self.frontends.insert(
            key,
            AppliedFrontend {
                owner,
                value,
                slots,
                backends,
            },
        );
        if let Some(old) = old {
            self.delete_generation(&old, maps);
        }
        debug!(frontend = %key, service_id, generation = new_generation, slots = slot_count, "frontend programmed");
        Ok(())
    }

    /// Writes backends and slots of one generation; records every write in `written`.
    fn write_generation(
        &mut self,
        service_id: u32,
        generation: u8,
        backends: &[Backend4],
        maps: &mut impl MapOps,
        written: &mut Written,
    ) -> Result<Vec<u32>, String> {
        let mut slots = Vec::with_capacity(backends.len());
        for (slot, backend) in backends.iter().enumerate() {
            let id = self.acquire_backend(*backend, maps, written)?;
            let slot_key = BackendSlotKey {
                service_id,
                slot: u16::try_from(slot).map_err(|_| "too many slots".to_owned())?,
                generation,
                _pad: 0,
            };
            maps.put_slot(slot_key, id)?;
            written.slots.push(slot_key);
            slots.push(id);
        }
        Ok(slots)
    }

    fn acquire_backend(
        &mut self,
        backend: Backend4,
        maps: &mut impl MapOps,
        written: &mut Written,
    ) -> Result<u32, String> {
        if let Some(entry) = self.backends.get_mut(&backend) {
            entry.users += 1;
            written.acquired.push(backend);
            return Ok(entry.id);
        }
        let id = self
            .backend_ids
            .allocate()
            .ok_or_else(|| "no backend id left".to_owned())?;
        if let Err(reason) = maps.put_backend(id, backend) {
            self.backend_ids.release(id);
            return Err(reason);
        }
        self.backends.insert(backend, BackendEntry { id, users: 1 });
        written.acquired.push(backend);
        Ok(id)
    }

    fn release_backend(&mut self, backend: &Backend4, maps: &mut impl MapOps) {
        let Some(entry) = self.backends.get_mut(backend) else {
            return;
        };
        entry.users = entry.users.saturating_sub(1);
        if entry.users > 0 {
            return;
        }
        let id = entry.id;
        self.backends.remove(backend);
        if let Err(reason) = maps.delete_backend(id) {
            warn!(backend_id = id, %reason, "cannot delete unused backend");
        }
        self.backend_ids.release(id);
    }

    fn undo(&mut self, written: Written, maps: &mut impl MapOps) {
        for slot in written.slots {
            if let Err(reason) = maps.delete_slot(slot) {
                warn!(?slot, %reason, "cannot delete slot while rolling back");
            }
        }
        for backend in written.acquired {
            self.release_backend(&backend, maps);
        }
    }

    fn delete_generation(&mut self, applied: &AppliedFrontend, maps: &mut impl MapOps) {
        for slot in 0..applied.slots.len() {
            let key = BackendSlotKey {
                service_id: applied.value.service_id,
                slot: slot as u16,
                generation: applied.value.generation,
                _pad: 0,
            };
            if let Err(reason) = maps.delete_slot(key) {
                warn!(?key, %reason, "cannot delete stale slot");
            }
        }
        for backend in &applied.backends {
            self.release_backend(backend, maps);
        }
    }

    fn remove_frontend(&mut self, key: FrontendKey, maps: &mut impl MapOps) -> Result<(), String> {
        let Some(map_key) = frontend_map_key(&key) else {
            return Ok(());
        };
        if !self.frontends.contains_key(&key) {
            return Ok(());
        }
        // Unlink the frontend first: from then on no new connection can reach its slots.
        maps.delete_frontend(map_key)?;
        if let Some(applied) = self.frontends.remove(&key) {
            self.delete_generation(&applied, maps);
            self.service_ids.release(applied.value.service_id);
        }
        Ok(())
    }

    /// Number of frontends and distinct backends currently programmed.
    pub fn counts(&self) -> (usize, usize) {
        (self.frontends.len(), self.backends.len())
    }
}

/// Everything written for one frontend before its switch, to take back on failure.
#[derive(Debug, Default)]
struct Written {
    slots: Vec<BackendSlotKey>,
    acquired: Vec<Backend4>,
}

fn frontend_map_key(key: &FrontendKey) -> Option<Frontend4Key> {
    let IpAddr::V4(addr) = key.addr else {
        return None;
    };
    Some(Frontend4Key {
        addr: u32::from_ne_bytes(addr.octets()),
        port: key.port.to_be(),
        proto: key.protocol.number(),
        scope: scope::INTERNAL,
    })
}

fn backends4(frontend: &Frontend) -> Option<Vec<Backend4>> {
    let proto = frontend.service_port.protocol.number();
    // Backends are a set for the datapath: the order of slots does not matter, only membership.
    let set: BTreeSet<Backend4> = frontend
        .backends
        .iter()
        .map(|backend| match backend.addr {
            IpAddr::V4(addr) => Some(Backend4 {
                addr: u32::from_ne_bytes(addr.octets()),
                port: backend.port.to_be(),
                proto,
                flags: 0,
            }),
            IpAddr::V6(_) => None,
        })
        .collect::<Option<_>>()?;
    Some(set.into_iter().collect())
}

#[cfg(test)]
mod tests;
