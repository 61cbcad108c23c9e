//! Small-integer id allocation for map keys (service ids, backend ids).

use std::collections::BTreeSet;

/// Hands out ids from 1 upwards and reuses released ones, so ids stay dense and below the map
/// capacity. 0 is never handed out (it means "none" in the maps).
#[derive(Debug, Default)]
pub struct IdAllocator {
    next: u32,
    free: BTreeSet<u32>,
}

impl IdAllocator {
    pub fn allocate(&mut self) -> Option<u32> {
        if let Some(id) = self.free.pop_first() {
            return Some(id);
        }
        self.next = self.next.checked_add(1)?;
        Some(self.next)
    }

    /// An allocator that considers exactly `used` taken (state read back from pinned maps).
    pub fn with_used(used: impl IntoIterator<Item = u32>) -> Self {
        let used: BTreeSet<u32> = used.into_iter().filter(|&id| id != 0).collect();
        let next = used.last().copied().unwrap_or(0);
        let free = (1..next).filter(|id| !used.contains(id)).collect();
        Self { next, free }
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
    fn with_used_hands_out_the_gaps_first() {
        let mut ids = IdAllocator::with_used([2, 5]);
        assert_eq!(ids.allocate(), Some(1));
        assert_eq!(ids.allocate(), Some(3));
        assert_eq!(ids.allocate(), Some(4));
        assert_eq!(ids.allocate(), Some(6));
    }
}
