//! Small-integer id allocation for map keys (service ids, backend ids).

use std::collections::BTreeSet;

/// Hands out ids from 1 upwards and reuses released ones, so ids stay dense and below the map
/// capacity. 0 is never handed out (it means "none" in the maps).
#[derive(Debug, Default)]
pub struct IdAllocator {
    next: u32,
    free: BTreeSet<u32>,
    /// Ids must stay below this (`set_limit`): the length of the arrays they index.
    limit: Option<u32>,
}

impl IdAllocator {
    /// The lowest free id; `None` when every id below the limit (or `u32::MAX`) is taken.
    pub fn allocate(&mut self) -> Option<u32> {
        if let Some(id) = self.free.pop_first() {
            return Some(id);
        }
        let id = self.next.checked_add(1)?;
        if self.limit.is_some_and(|limit| id >= limit) {
            return None;
        }
        self.next = id;
        Some(id)
    }

    /// Ids index arrays of `limit` elements from now on: no id at or past it is handed out.
    pub fn set_limit(&mut self, limit: u32) {
        self.limit = Some(limit);
        self.free.retain(|&id| id < limit);
    }

    /// An allocator that considers exactly `used` taken (state read back from pinned maps).
    pub fn with_used(used: impl IntoIterator<Item = u32>) -> Self {
        let used: BTreeSet<u32> = used.into_iter().filter(|&id| id != 0).collect();
        let next = used.last().copied().unwrap_or(0);
        let free = (1..next).filter(|id| !used.contains(id)).collect();
        Self {
            next,
            free,
            limit: None,
        }
    }

    pub fn release(&mut self, id: u32) {
        if id != 0 && id <= self.next {
            self.free.insert(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_start_at_one_and_are_reused() {
        let mut ids = IdAllocator::default();
        assert_eq!(ids.allocate(), Some(1));
        assert_eq!(ids.allocate(), Some(2));
        ids.release(1);
        assert_eq!(ids.allocate(), Some(1));
        assert_eq!(ids.allocate(), Some(3));
    }

    #[test]
    fn a_limit_refuses_ids_at_or_past_it_and_released_ones_come_back() {
        let mut ids = IdAllocator::default();
        ids.set_limit(3);
        assert_eq!(ids.allocate(), Some(1));
        assert_eq!(ids.allocate(), Some(2));
        assert_eq!(ids.allocate(), None);
        // Refused, not skipped: the next free id is still the one below the limit.
        ids.release(2);
        assert_eq!(ids.allocate(), Some(2));
        assert_eq!(ids.allocate(), None);
    }

    #[test]
    fn with_used_hands_out_the_gaps_first() {
        let mut ids = IdAllocator::with_used([2, 5]);
        assert_eq!(ids.allocate(), Some(1));
        assert_eq!(ids.allocate(), Some(3));
        assert_eq!(ids.allocate(), Some(4));
        assert_eq!(ids.allocate(), Some(6));
    }
}
