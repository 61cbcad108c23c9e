//! One frontend's writes in the update protocol's order (backends, the idle generation's slots
//! and Maglev table, the switch), their undo when a step fails, and the removal of a frontend
//! and of retired generations.

use super::*;

impl MapWriter {
    pub(super) fn write_frontend(
        &mut self,
        target: Target,
        maps: &mut impl MapOps,
        summary: &mut ApplySummary,
    ) -> Result<FrontendWrite, MapWriteError> {
        let Target {
            key,
            map_key,
            backends,
            affinity_timeout,
            flags,
            source_ranges,
            owner,
        } = target;
        let slot_count = u16::try_from(backends.len()).map_err(|_| {
            MapWriteError::Other(format!(
                "{} backends exceed the 65535 slots of a frontend",
                backends.len()
            ))
        })?;
        let previous = self
            .frontends
            .get(&key)
            .map(|applied| (applied.value, matches_of(applied)));
        let old_ranges = self
            .frontends
            .get(&key)
            .map(|applied| applied.source_ranges.to_vec())
            .unwrap_or_default();
        let (service_id, new_generation) = match previous {
            Some((value, _)) => (value.service_id, value.generation ^ 1),
            None => (
                self.service_ids
                    .allocate()
                    .ok_or(MapWriteError::Full("service id"))?,
                0,
            ),
        };
        let is_new = previous.is_none();
        if is_new {
            maps.reset_traffic(service_id);
        }
        if !is_new {
            // The idle generation is the one the last switch retired: overwriting or deleting
            // it before its grace would pull slots from under a program that read the frontend
            // before that switch. Waiting here would hold up the sync; the frontend keeps its
            // current, complete set for at most the grace and is written by a later apply.
            let now = (self.clock)();
            let blocking = self.retired.iter().position(|r| {
                r.value.service_id == service_id && r.value.generation == new_generation
            });
            if let Some(index) = blocking {
                if self.retired[index].due > now {
                    return Ok(FrontendWrite::Deferred);
                }
                let retired = self.retired.remove(index);
                self.delete_retired(retired, maps);
            }
        }
        let old_matches = previous.map(|(_, m)| m).unwrap_or_default();
        let sticky = sticky_socket(&key);
        let tracks = affinity_timeout.is_some() || sticky;

        let mut written = Written::default();
        let maglev_size = self.maglev_size_for(&key, backends.len());
        maps.add_ports(key.port, backends.iter().map(BackendValue::port));
        let result =
            self.write_generation(service_id, new_generation, &backends, maps, &mut written);
        let result = result.and_then(|slots| {
            if maglev_size > 0 {
                write_maglev(
                    service_id,
                    new_generation,
                    &backends,
                    &slots,
                    maglev_size,
                    maps,
                    &mut written,
                )?;
            }
            // Affinity entries may only lead to members of the live set: add the new members
            // before the switch; the ones leaving go after it.
            // Source ranges are keyed by service id, which the new generation keeps: add the
            // new ranges before the switch, remove the dropped ones after it.
            for range in &source_ranges {
                if !old_ranges.contains(range) {
                    maps.put_source_range(service_id, *range)?;
                    written.ranges.push((service_id, *range));
                }
            }
            if tracks {
                for &backend_id in &slots {
                    let match_key = AffinityMatchKey {
                        service_id,
                        backend_id,
                    };
                    if !old_matches.contains(&match_key) {
                        maps.put_affinity_match(match_key)?;
                        written.matches.push(match_key);
                    }
                }
            }
            let value = FrontendValue {
                service_id,
                backend_count: slot_count,
                generation: new_generation,
                flags: flags
                    | if affinity_timeout.is_some() {
                        frontend_flags::AFFINITY
                    } else {
                        0
                    }
                    | if maglev_size > 0 {
                        frontend_flags::MAGLEV
                    } else {
                        0
                    }
                    | if sticky {
                        frontend_flags::STICKY_SOCKET
                    } else {
                        0
                    },
                affinity_timeout: affinity_timeout.unwrap_or(0),
                maglev_size,
            };
            maps.put_frontend(map_key, value)?;
            Ok((value, slots))
        });
        let (value, slots) = match result {
            Ok(done) => done,
            Err(reason) => {
                self.undo(written, maps);
                if is_new {
                    self.service_ids.release(service_id);
                }
                return Err(reason);
            }
        };

        // The frontend now points at the new generation: the old one is unreachable.
        let new_matches: BTreeSet<AffinityMatchKey> = if tracks {
            slots
                .iter()
                .map(|&backend_id| AffinityMatchKey {
                    service_id,
                    backend_id,
                })
                .collect()
        } else {
            BTreeSet::new()
        };
        for stale in old_matches.difference(&new_matches) {
            if let Err(reason) = maps.delete_affinity_match(*stale) {
                warn!(?stale, %reason, "cannot delete stale affinity match");
            }
        }
        for range in old_ranges.iter().filter(|r| !source_ranges.contains(r)) {
            if let Err(reason) = maps.delete_source_range(service_id, *range) {
                warn!(%range, %reason, "cannot delete stale source range");
            }
        }
        let old = self.frontends.insert(
            key,
            AppliedFrontend {
                owner: Some(owner),
                value,
                slots: slots.into_boxed_slice(),
                source_ranges: source_ranges.into_boxed_slice(),
                damaged: false,
                maglev_incomplete: false,
            },
        );
        if let Some(old) = old {
            // Ids, as the backend table gives one id per backend; the old generation's
            // references keep its ids in the table until it is deleted.
            let current = &self.frontends[&key].slots;
            summary.removed_backends.extend(
                old.slots
                    .iter()
                    .filter(|id| !current.contains(id))
                    .filter_map(|&id| self.backends.value_of(id))
                    .map(|b| RemovedBackend {
                        frontend: key,
                        backend: b.socket_addr(),
                    }),
            );
            let due = (self.clock)() + self.grace;
            self.retire(
                Retired {
                    maglev_table: !old.damaged && !old.maglev_incomplete,
                    value: old.value,
                    slots: old.slots,
                    slots_in_maps: !old.damaged,
                    due,
                    frees_service_id: false,
                },
                maps,
            );
        }
        debug!(frontend = %key, service_id, generation = new_generation, slots = slot_count, maglev_size, affinity = ?affinity_timeout, "frontend programmed");
        Ok(FrontendWrite::Switched)
    }

    /// Writes backends and slots of one generation; records every write in `written`.
    pub(super) fn write_generation(
        &mut self,
        service_id: u32,
        generation: u8,
        backends: &[BackendValue],
        maps: &mut impl MapOps,
        written: &mut Written,
    ) -> Result<Vec<u32>, MapWriteError> {
        if backends.len() > usize::from(u16::MAX) {
            return Err(MapWriteError::Other("too many slots".to_owned()));
        }
        let mut slots = Vec::with_capacity(backends.len());
        let mut new_backends = Vec::new();
        for backend in backends {
            let id = self.acquire_backend(*backend, &mut new_backends, written)?;
            slots.push(id);
        }
        let value = FrontendValue {
            service_id,
            generation,
            ..FrontendValue::default()
        };
        let entries: Vec<(BackendSlotKey, SlotBlock)> = slot_entries(&value, &slots).collect();
        // Acquired (and so released by an undo) before the write: a failed batch may have
        // written some of them.
        maps.put_backends(&new_backends)?;
        written.slots.extend(entries.iter().map(|&(key, _)| key));
        maps.put_slots(&entries)?;
        Ok(slots)
    }

    /// A reference to `backend`'s id; a backend not in the maps yet gets an id and is added to
    /// `new` (for the caller to write before anything refers to it).
    pub(super) fn acquire_backend(
        &mut self,
        backend: BackendValue,
        new: &mut Vec<(u32, BackendValue)>,
        written: &mut Written,
    ) -> Result<u32, MapWriteError> {
        if let Some(id) = self.backends.hold(&backend) {
            written.acquired.push(backend);
            return Ok(id);
        }
        // The backend maps are arrays indexed by id: no id left below their length is their
        // being full, as a hash map refused a new key.
        let id = self
            .backend_ids
            .allocate()
            .ok_or(MapWriteError::Full(backend.map_name()))?;
        self.backends.insert(backend, id);
        written.acquired.push(backend);
        new.push((id, backend));
        Ok(id)
    }

    pub(super) fn release_backend_id(&mut self, id: u32, maps: &mut impl MapOps) {
        if let Some(backend) = self.backends.release_id(id) {
            self.delete_backend(id, backend, maps);
        }
    }

    pub(super) fn release_backend(&mut self, backend: &BackendValue, maps: &mut impl MapOps) {
        if let Some(id) = self.backends.release(backend) {
            self.delete_backend(id, *backend, maps);
        }
    }

    /// A backend no generation uses any more: out of the maps, its id free again.
    pub(super) fn delete_backend(
        &mut self,
        id: u32,
        backend: BackendValue,
        maps: &mut impl MapOps,
    ) {
        if let Err(reason) = maps.delete_backend(id, backend) {
            warn!(backend_id = id, %reason, "cannot delete unused backend");
        }
        self.backend_ids.release(id);
    }

    pub(super) fn undo(&mut self, written: Written, maps: &mut impl MapOps) {
        for (service_id, range) in written.ranges {
            if let Err(reason) = maps.delete_source_range(service_id, range) {
                warn!(%range, %reason, "cannot delete source range while rolling back");
            }
        }
        for key in written.matches {
            if let Err(reason) = maps.delete_affinity_match(key) {
                warn!(?key, %reason, "cannot delete affinity match while rolling back");
            }
        }
        for slot in written.slots {
            if let Err(reason) = maps.delete_slot(slot) {
                warn!(?slot, %reason, "cannot delete slot while rolling back");
            }
        }
        for key in written.maglev {
            if let Err(reason) = maps.delete_maglev(key) {
                warn!(?key, %reason, "cannot delete Maglev slot while rolling back");
            }
        }
        for backend in written.acquired {
            self.release_backend(&backend, maps);
        }
    }

    /// Deletes one generation of `value`'s service id: its slots (if `slots_in_maps`), its
    /// Maglev table, and its references to the backends `slots` holds.
    pub(super) fn delete_generation(
        &mut self,
        value: &FrontendValue,
        slots: &[u32],
        slots_in_maps: bool,
        maps: &mut impl MapOps,
    ) {
        let slot_count = if slots_in_maps { slots.len() } else { 0 };
        for key in slot_keys(value.service_id, value.generation, slot_count) {
            if let Err(reason) = maps.delete_slot(key) {
                warn!(?key, %reason, "cannot delete stale slot");
            }
        }
        for key in maglev_keys(value) {
            if let Err(reason) = maps.delete_maglev(key) {
                warn!(?key, %reason, "cannot delete stale Maglev slot");
                // The rest most likely fail alike (a kernel error, not a missing key).
                break;
            }
        }
        for &id in slots {
            self.release_backend_id(id, maps);
        }
    }

    pub(super) fn remove_frontend(
        &mut self,
        key: FrontendKey,
        maps: &mut impl MapOps,
        summary: &mut ApplySummary,
    ) -> Result<(), MapWriteError> {
        if !self.frontends.contains_key(&key) {
            return Ok(());
        }
        // Unlink the frontend first: from then on no new connection can reach its slots.
        maps.delete_frontend(map_key_of(&key))?;
        if let Some(applied) = self.frontends.remove(&key) {
            for stale in matches_of(&applied) {
                if let Err(reason) = maps.delete_affinity_match(stale) {
                    warn!(?stale, %reason, "cannot delete affinity match");
                }
            }
            for range in &applied.source_ranges {
                if let Err(reason) = maps.delete_source_range(applied.value.service_id, *range) {
                    warn!(%range, %reason, "cannot delete source range");
                }
            }
            summary
                .removed_backends
                .extend(self.backends.values_of(&applied.slots).flatten().map(|b| {
                    RemovedBackend {
                        frontend: key,
                        backend: b.socket_addr(),
                    }
                }));
            // Its slots and backends stay for the grace, like a switched-out generation's, for
            // programs that read the frontend just before it went; so does its service id, which
            // a new frontend would otherwise take with these very slot keys.
            self.deferred.remove(&key);
            let due = (self.clock)() + self.grace;
            self.retire(
                Retired {
                    maglev_table: !applied.damaged && !applied.maglev_incomplete,
                    value: applied.value,
                    slots: applied.slots,
                    slots_in_maps: !applied.damaged,
                    due,
                    frees_service_id: true,
                },
                maps,
            );
        }
        Ok(())
    }
}

/// Writes the Maglev table of `backends` (whose ids are `slots`, index for index) for one
/// generation; records every write in `written`.
pub(super) fn write_maglev(
    service_id: u32,
    generation: u8,
    backends: &[BackendValue],
    slots: &[u32],
    size: u32,
    maps: &mut impl MapOps,
    written: &mut Written,
) -> Result<(), MapWriteError> {
    // `backends` is sorted (a set), so the table depends only on the backend set: the same set
    // gives the same table in every generation and after a restart.
    for (key, value) in maglev_blocks(service_id, generation, backends, slots, size)? {
        maps.put_maglev(key, value)?;
        written.maglev.push(key);
    }
    Ok(())
}

/// The Maglev table of `backends` (whose ids are `slots`, index for index) for one generation,
/// as map entries.
pub(crate) fn maglev_blocks(
    service_id: u32,
    generation: u8,
    backends: &[BackendValue],
    slots: &[u32],
    size: u32,
) -> Result<Vec<(MaglevKey, MaglevBlock)>, MapWriteError> {
    let addrs: Vec<SocketAddr> = backends.iter().map(BackendValue::socket_addr).collect();
    let table = maglev::table(&addrs, size);
    if table.len() != size as usize {
        return Err(MapWriteError::Other(format!(
            "cannot build a Maglev table of {size} slots for {} backends",
            backends.len()
        )));
    }
    let ids = table
        .iter()
        .map(|&index| {
            slots.get(index as usize).copied().ok_or_else(|| {
                MapWriteError::Other(format!("Maglev table entry {index} is not a backend"))
            })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let mut blocks = Vec::with_capacity(ids.len().div_ceil(MAGLEV_BLOCK_SLOTS as usize));
    for (block, chunk) in (0u32..).zip(ids.chunks(MAGLEV_BLOCK_SLOTS as usize)) {
        // The last block's tail is past the table size and never read: repeat a valid id.
        let mut value = MaglevBlock {
            backend_ids: [chunk.first().copied().unwrap_or_default(); MAGLEV_BLOCK_SLOTS as usize],
        };
        for (entry, id) in value.backend_ids.iter_mut().zip(chunk) {
            *entry = *id;
        }
        let key = MaglevKey {
            service_id,
            block,
            generation,
            _pad: [0; 3],
        };
        blocks.push((key, value));
    }
    Ok(blocks)
}

/// Everything written for one frontend before its switch, to take back on failure.
#[derive(Debug, Default)]
pub(super) struct Written {
    pub(super) maglev: Vec<MaglevKey>,
    pub(super) slots: Vec<BackendSlotKey>,
    pub(super) acquired: Vec<BackendValue>,
    pub(super) matches: Vec<AffinityMatchKey>,
    pub(super) ranges: Vec<(u32, IpNet)>,
}
