//! A flat copy of the map writer's record, for the drift check's comparison on another thread.
//!
//! Turning the record into the maps' expected content means a tree of every slot (a million at
//! 30k Services) and every Maglev table built again: hundreds of milliseconds that must not
//! hold up the agent's loop. The loop copies what that needs into a few flat vectors (one copy
//! of the ids, no allocation per frontend), a few thousand frontends per loop turn
//! ([`RecordCopying`]), and the drift thread builds the content from them.

use std::{collections::BTreeSet, ops::Bound};

use ipnet::IpNet;
use proxy_common::{AffinityMatchKey, FrontendValue, frontend_flags};

use proxy_model::desired::FrontendKey;

use crate::maps::map_writer::{
    BackendValue, FrontendMapKey, MapWriter, MapsContent, maglev_blocks, map_key_of, slot_entries,
    tracks_members,
};

/// One live frontend or retired generation: its value and where its backend ids (by slot) and
/// source ranges are in [`RecordCopy`]'s shared vectors.
#[derive(Debug, Clone, Copy)]
struct Generation {
    value: FrontendValue,
    ids: (usize, usize),
    /// Retired generations: whether their slots and Maglev table are still in the maps.
    slots_in_maps: bool,
    maglev_table: bool,
}

/// What the map writer had written when it was copied ([`MapWriter::record_copy`]).
#[derive(Debug, Clone, Default)]
pub struct RecordCopy {
    frontends: Vec<(FrontendMapKey, Generation, (usize, usize))>,
    retired: Vec<Generation>,
    ids: Vec<u32>,
    ranges: Vec<IpNet>,
    backends: Vec<(u32, BackendValue)>,
}

fn push<T: Copy>(into: &mut Vec<T>, items: &[T]) -> (usize, usize) {
    let start = into.len();
    into.extend_from_slice(items);
    (start, into.len())
}

/// A [`RecordCopy`] taken in steps ([`MapWriter::record_copy_step`]), so that no single step
/// holds the agent's loop for the whole copy (8–26 ms at 50k Services): the frontends a few
/// thousand at a time in key order, then the retired generations and the backends.
///
/// The agent may write between steps. The drift check notes every key written from before the
/// first step (`touched_keys::Touched`) and leaves those out of what it reports, so a frontend
/// copied before its change (or added behind the cursor, or removed after its copy) only
/// differs in entries that are left out; an entry not written since the first step held one
/// value for the whole copy. Backends come last: every id a copied frontend names is still
/// held then (by the frontend, or by its retired generation during the grace), so the copy
/// has its value.
#[derive(Debug, Default)]
pub struct RecordCopying {
    copy: RecordCopy,
    /// The last frontend copied: the next step resumes after it.
    after: Option<FrontendKey>,
    /// Every frontend is copied: the next step copies the rest and ends.
    frontends_done: bool,
    steps: usize,
}

impl RecordCopying {
    /// Steps taken so far.
    pub fn steps(&self) -> usize {
        self.steps
    }
}

/// What one [`MapWriter::record_copy_step`] left.
#[derive(Debug)]
pub enum CopyStep {
    /// More to copy.
    More(RecordCopying),
    /// The copy is complete.
    Done(RecordCopy),
    /// An adopted frontend is damaged or has an incomplete Maglev table: the record knows it
    /// differs from the maps (see [`MapWriter::record_copy`]).
    Damaged,
}

impl MapWriter {
    /// The record, copied for [`RecordCopy::expected_content`]. `None` while an adopted frontend
    /// is damaged or has an incomplete Maglev table: the record then knows it differs from the
    /// maps, and the next full apply rewrites that frontend anyway. In one go: the tests'; the
    /// dataplane copies in steps.
    #[cfg(test)]
    pub(crate) fn record_copy(&self) -> Option<RecordCopy> {
        let mut copying = RecordCopying::default();
        loop {
            match self.record_copy_step(copying, usize::MAX) {
                CopyStep::More(more) => copying = more,
                CopyStep::Done(copy) => return Some(copy),
                CopyStep::Damaged => return None,
            }
        }
    }

    /// One step of a copy of the record: up to `frontends` frontends, or (once they are all
    /// copied) the retired generations and the backends. See [`RecordCopying`] for why the
    /// agent's writes between steps make no false drift.
    pub(crate) fn record_copy_step(
        &self,
        mut copying: RecordCopying,
        frontends: usize,
    ) -> CopyStep {
        copying.steps += 1;
        let copy = &mut copying.copy;
        if !copying.frontends_done {
            if copying.after.is_none() {
                // Room for the whole copy up front: a vector that grows reallocates and copies
                // everything so far within one step (4-7 ms steps at 50k Services).
                copy.frontends.reserve(self.frontends.len());
                let ids = self.frontends.usage().slots() + self.retired.usage().slots();
                copy.ids.reserve(usize::try_from(ids).unwrap_or_default());
            }
            let rest = match copying.after {
                Some(after) => self
                    .frontends
                    .range((Bound::Excluded(after), Bound::Unbounded)),
                None => self.frontends.range(..),
            };
            let mut taken = 0;
            for (key, applied) in rest {
                if taken == frontends {
                    return CopyStep::More(copying);
                }
                if applied.damaged || applied.maglev_incomplete {
                    return CopyStep::Damaged;
                }
                let ids = push(&mut copy.ids, &applied.slots);
                let ranges = push(&mut copy.ranges, &applied.source_ranges);
                let generation = Generation {
                    value: applied.value,
                    ids,
                    slots_in_maps: true,
                    maglev_table: true,
                };
                copy.frontends.push((map_key_of(key), generation, ranges));
                copying.after = Some(*key);
                taken += 1;
            }
            copying.frontends_done = true;
            // A step of its own for the rest when this one copied frontends: the backends are
            // as many again.
            if taken > 0 && frontends != usize::MAX {
                return CopyStep::More(copying);
            }
        }
        copy.retired.reserve(self.retired.len());
        for retired in self.retired.iter() {
            let ids = push(&mut copy.ids, &retired.slots);
            copy.retired.push(Generation {
                value: retired.value,
                ids,
                slots_in_maps: retired.slots_in_maps,
                maglev_table: retired.maglev_table,
            });
        }
        copy.backends = self.backends.iter().collect();
        CopyStep::Done(copying.copy)
    }
}

impl RecordCopy {
    fn ids(&self, generation: &Generation) -> &[u32] {
        self.ids
            .get(generation.ids.0..generation.ids.1)
            .unwrap_or_default()
    }

    /// What the service maps must hold, entry by entry (the drift check compares it with what
    /// they do hold). `None` when a Maglev table cannot be built again (it was, when written).
    pub fn expected_content(&self) -> Option<MapsContent> {
        let mut content = MapsContent {
            backends: self.backends.iter().copied().collect(),
            ..MapsContent::default()
        };
        // Collected, then built in one go: the standard library sorts once and builds the
        // tree in bulk instead of a tree insert per slot.
        let mut slots = Vec::with_capacity(self.ids.len());
        let mut matches = Vec::new();
        let mut ranges = Vec::new();
        for (key, generation, (start, end)) in &self.frontends {
            let value = generation.value;
            content.frontends.push((*key, value));
            let ids = self.ids(generation);
            slots.extend(slot_entries(&value, ids));
            if tracks_members(&value) {
                matches.extend(ids.iter().map(|&backend_id| AffinityMatchKey {
                    service_id: value.service_id,
                    backend_id,
                }));
            }
            // The LPM trie stores the network: a range given with host bits reads back without.
            ranges.extend(
                self.ranges
                    .get(*start..*end)
                    .unwrap_or_default()
                    .iter()
                    .map(|range| (value.service_id, range.trunc())),
            );
            self.maglev_of(generation, &mut content)?;
        }
        // Retired generations are the agent's own until their grace has passed: expected, so
        // that a drift repair does not delete them early.
        for generation in &self.retired {
            if generation.slots_in_maps {
                slots.extend(slot_entries(&generation.value, self.ids(generation)));
            }
            self.maglev_of(generation, &mut content)?;
        }
        content.slots = slots.into_iter().collect();
        content.affinity_matches = matches.into_iter().collect::<BTreeSet<_>>();
        content.source_ranges = ranges.into_iter().collect();
        Some(content)
    }

    /// The generation's Maglev table into `content`, if it has one in the maps.
    fn maglev_of(&self, generation: &Generation, content: &mut MapsContent) -> Option<()> {
        let value = generation.value;
        if value.flags & frontend_flags::MAGLEV == 0 || !generation.maglev_table {
            return Some(());
        }
        let ids = self.ids(generation);
        let backends: Option<Vec<BackendValue>> = ids
            .iter()
            .map(|id| content.backends.get(id).copied())
            .collect();
        let blocks = maglev_blocks(
            value.service_id,
            value.generation,
            &backends?,
            ids,
            value.maglev_size,
        )
        .ok()?;
        content.maglev.extend(blocks);
        Some(())
    }
}
