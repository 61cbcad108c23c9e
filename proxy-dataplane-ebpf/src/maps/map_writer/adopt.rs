//! After an agent restart: the record rebuilt from the maps the previous agent pinned, and what
//! no live frontend can reach removed.

use super::*;

impl MapWriter {
    /// Rebuilds the record from maps a previous agent left behind, and removes what no live
    /// frontend can reach (slots of an interrupted update, orphan backends and match entries).
    pub fn adopt(mut content: MapsContent, maps: &mut impl MapOps) -> Self {
        // In service id order, the slot blocks are looked up in their own order and the
        // backends (ids handed out as the frontends were first written) nearly so: at 100k
        // frontends, lookups that follow the trees' order instead of hash order.
        content
            .frontends
            .sort_unstable_by_key(|(_, value)| value.service_id);
        let mut map_writer = MapWriter::default();
        map_writer.backends.reserve(content.backends.len());
        let mut live_slots = Vec::with_capacity(content.slots.len());
        let mut live_matches = BTreeSet::new();
        let mut live_maglev = BTreeSet::new();
        let mut dropped = 0usize;
        // Grouped once: a filter of the whole set per frontend would be frontends × ranges.
        let mut ranges_of: BTreeMap<u32, Vec<IpNet>> = BTreeMap::new();
        for &(service_id, range) in &content.source_ranges {
            ranges_of.entry(service_id).or_default().push(range);
        }
        for (map_key, value) in content.frontends {
            let Some(key) = frontend_key_of(&map_key) else {
                // Not a protocol we program: remove it rather than carry it along.
                if let Err(reason) = maps.delete_frontend(map_key) {
                    warn!(?map_key, %reason, "cannot delete unknown frontend");
                }
                dropped += 1;
                continue;
            };
            let count = usize::from(value.backend_count);
            let mut slots = Vec::with_capacity(count);
            let mut damaged = false;
            // A block at a time: one lookup for its (up to) eight slots.
            for (block, first) in (0..count).step_by(SLOT_BLOCK_SLOTS as usize).enumerate() {
                let slot_key = BackendSlotKey {
                    service_id: value.service_id,
                    block: block as u16,
                    generation: value.generation,
                    _pad: 0,
                };
                let Some(ids) = content.slots.get(&slot_key) else {
                    damaged = true;
                    continue;
                };
                // A damaged frontend's blocks are all deleted below, live or not.
                live_slots.push(slot_key);
                let in_block = (count - first).min(SLOT_BLOCK_SLOTS as usize);
                for &id in ids.backend_ids.iter().take(in_block) {
                    // A backend value under a second id (maps no writer of ours leaves) is
                    // known by its first: the slot counts as missing, so the frontend is
                    // rewritten, and the second id is removed with the orphans.
                    match content.backends.get(&id) {
                        Some(&backend) if map_writer.backends.adopt(backend, id) => slots.push(id),
                        _ => damaged = true,
                    }
                }
            }
            let maglev_incomplete = !maglev_complete(&value, &content.maglev, &slots);
            if maglev_incomplete {
                // Its entries are deleted below and the next apply rewrites it; meanwhile the
                // datapath falls back to random choice where the table misses, and the slots
                // stay in use (unlike a damaged frontend's).
                warn!(frontend = %key, "adopted frontend has an incomplete Maglev table; it will be rewritten");
            } else {
                live_maglev.extend(maglev_keys(&value));
            }
            if damaged {
                // Keep what is there so the slots are cleaned up by the rewrite.
                warn!(frontend = %key, "adopted frontend has missing slots; it will be rewritten");
            }
            if tracks_members(&value) {
                live_matches.extend(slots.iter().map(|&backend_id| AffinityMatchKey {
                    service_id: value.service_id,
                    backend_id,
                }));
            }
            let source_ranges = ranges_of
                .get(&value.service_id)
                .map_or_else(Box::default, |ranges| ranges.as_slice().into());
            map_writer.frontends.insert(
                key,
                AppliedFrontend {
                    owner: None,
                    value,
                    slots: slots.into_boxed_slice(),
                    source_ranges,
                    damaged,
                    maglev_incomplete,
                },
            );
        }
        // Slots of damaged frontends are deleted below too; their rewrite uses fresh slots.
        let damaged_services: BTreeSet<u32> = map_writer
            .frontends
            .values()
            .filter(|f| f.damaged)
            .map(|f| f.value.service_id)
            .collect();
        let mut cleaned = 0usize;
        live_slots.sort_unstable();
        for slot in content.slots.keys() {
            if live_slots.binary_search(slot).is_err()
                || damaged_services.contains(&slot.service_id)
            {
                cleaned += usize::from(maps.delete_slot(*slot).is_ok());
            }
        }
        for key in content.maglev.keys() {
            if !live_maglev.contains(key) || damaged_services.contains(&key.service_id) {
                cleaned += usize::from(maps.delete_maglev(*key).is_ok());
            }
        }
        for (id, backend) in &content.backends {
            if map_writer.backends.value_of(*id).is_none() {
                cleaned += usize::from(maps.delete_backend(*id, *backend).is_ok());
            }
        }
        for key in content.affinity_matches.difference(&live_matches) {
            cleaned += usize::from(maps.delete_affinity_match(*key).is_ok());
        }
        let live_services: BTreeSet<u32> = map_writer
            .frontends
            .values()
            .map(|f| f.value.service_id)
            .collect();
        for (service_id, range) in &content.source_ranges {
            if !live_services.contains(service_id) {
                cleaned += usize::from(maps.delete_source_range(*service_id, *range).is_ok());
            }
        }
        map_writer.service_ids =
            IdAllocator::with_used(map_writer.frontends.values().map(|f| f.value.service_id));
        map_writer.backend_ids =
            IdAllocator::with_used(map_writer.backends.iter().map(|(id, _)| id));
        info!(
            frontends = map_writer.frontends.len(),
            backends = map_writer.backends.len(),
            cleaned,
            dropped,
            "adopted the service maps of a previous run"
        );
        map_writer
    }
}
