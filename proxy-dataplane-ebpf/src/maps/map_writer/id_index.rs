//! Backend values by backend id, for the frontends' records, which keep only ids.
//!
//! Ids are small and dense (`IdAllocator`), so a flat vector would do for the ids the writer
//! hands out; but adopted ids come from pinned maps, where any u32 may stand. Pages of
//! [`PAGE`] ids, allocated as ids land in them, keep one vector's cost for dense ids
//! (300k backends: 293 pages of 24 KiB) and one page for a stray large id.

use std::collections::BTreeMap;

/// Ids per page.
const PAGE: usize = 1024;

#[derive(Debug)]
pub(super) struct IdIndex<T> {
    pages: BTreeMap<u32, Page<T>>,
}

#[derive(Debug)]
struct Page<T> {
    /// Values present, so that an emptied page is found without a scan.
    used: usize,
    values: Box<[Option<T>]>,
}

impl<T> Default for IdIndex<T> {
    fn default() -> Self {
        Self {
            pages: BTreeMap::new(),
        }
    }
}

fn split(id: u32) -> (u32, usize) {
    (id / PAGE as u32, id as usize % PAGE)
}

impl<T: Copy> IdIndex<T> {
    pub(super) fn get(&self, id: u32) -> Option<T> {
        let (page, at) = split(id);
        self.pages.get(&page).and_then(|page| page.values[at])
    }

    pub(super) fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        let (page, at) = split(id);
        self.pages
            .get_mut(&page)
            .and_then(|page| page.values[at].as_mut())
    }

    /// Every id with its value, in id order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        // `0u32..` rather than `first..`: the last page ends at `u32::MAX`, past which a
        // range from its first id would step.
        self.pages.iter().flat_map(|(&page, values)| {
            let first = page * PAGE as u32;
            (0u32..)
                .zip(values.values.iter())
                .filter_map(move |(at, value)| Some((first + at, value.as_ref()?)))
        })
    }

    pub(super) fn insert(&mut self, id: u32, value: T) {
        let (page, at) = split(id);
        let page = self.pages.entry(page).or_insert_with(|| Page {
            used: 0,
            values: vec![None; PAGE].into_boxed_slice(),
        });
        if page.values[at].replace(value).is_none() {
            page.used += 1;
        }
    }

    /// Removes `id`'s value; a page left empty is freed.
    pub(super) fn remove(&mut self, id: u32) {
        let (index, at) = split(id);
        let Some(page) = self.pages.get_mut(&index) else {
            return;
        };
        if page.values[at].take().is_some() {
            page.used -= 1;
            if page.used == 0 {
                self.pages.remove(&index);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_found_by_id_across_pages_and_pages_go_when_empty() {
        let mut index = IdIndex::default();
        index.insert(1, 'a');
        index.insert(1023, 'b');
        index.insert(1024, 'c');
        index.insert(u32::MAX, 'z');
        index.insert(1, 'a');
        assert_eq!(
            [1, 1023, 1024, u32::MAX, 2].map(|id| index.get(id)),
            [Some('a'), Some('b'), Some('c'), Some('z'), None]
        );
        assert_eq!(index.pages.len(), 3, "a stray large id costs one page");
        assert_eq!(
            index.iter().collect::<Vec<_>>(),
            [(1, &'a'), (1023, &'b'), (1024, &'c'), (u32::MAX, &'z')]
        );
        if let Some(value) = index.get_mut(1024) {
            *value = 'd';
        }
        assert_eq!(index.get(1024), Some('d'));
        index.remove(1024);
        index.remove(u32::MAX);
        assert_eq!(index.pages.len(), 1);
        index.remove(7);
        index.remove(1);
        assert_eq!(index.get(1023), Some('b'));
        index.remove(1023);
        assert!(index.pages.is_empty(), "a value inserted twice counts once");
    }
}
