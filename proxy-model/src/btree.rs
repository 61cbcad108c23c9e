//! B-trees rebuilt with full nodes after they were filled one entry at a time.
//!
//! A `BTreeMap` filled by inserting in key order (a list from the API server, a full sync of
//! the snapshot or the maps) splits every node it fills and never comes back to the left
//! half: its nodes stay about half full, so each entry costs about twice its size. Built from
//! a sorted sequence (`FromIterator` sorts, then bulk-builds), the same map has full nodes.
//! At 30k Services that is several MiB in each of the large maps (the objects, the
//! snapshot's service ports, the map writer's frontends).

use std::collections::BTreeMap;

/// Rebuilds `map` with full nodes (O(n); the entries move, nothing is cloned).
pub fn repack<K: Ord, V>(map: &mut BTreeMap<K, V>) {
    *map = std::mem::take(map).into_iter().collect();
}

/// `entries` (in any order; later ones win for equal keys, as inserting them would) as a map
/// with full nodes.
pub fn packed<K: Ord, V>(entries: impl IntoIterator<Item = (K, V)>) -> BTreeMap<K, V> {
    entries.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repacking_keeps_every_entry_in_order() {
        let mut map: BTreeMap<u32, String> = (0..10_000).map(|i| (i, i.to_string())).collect();
        map.remove(&77);
        let before: Vec<(u32, String)> = map.clone().into_iter().collect();
        repack(&mut map);
        assert_eq!(map.into_iter().collect::<Vec<_>>(), before);
        let later_wins = packed([(1, "a"), (2, "b"), (1, "c")]);
        assert_eq!(later_wins, BTreeMap::from([(1, "c"), (2, "b")]));
    }
}
