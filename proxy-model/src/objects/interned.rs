//! Interned strings for the values that repeat across objects: node names, zones, port names
//! and protocols. At 30k Services × 10 endpoints the same few hundred node names and zones
//! appear hundreds of thousands of times; one shared copy each is what keeps an endpoint small.

use std::{
    collections::HashSet,
    sync::{Arc, LazyLock, Mutex, PoisonError},
};

/// A shared, immutable string.
pub type Name = Arc<str>;

/// Table size below which it is never pruned.
const PRUNE_FLOOR: usize = 1024;

#[derive(Default)]
struct Table {
    names: HashSet<Name>,
    /// Size after the last prune; the next one comes when the table has doubled since.
    pruned_at: usize,
}

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

/// The shared copy of `text`.
pub fn intern(text: &str) -> Name {
    // A panic elsewhere while holding the lock leaves the table consistent (every operation
    // on it is one HashSet call), so a poisoned lock is used as is.
    let mut table = TABLE.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(name) = table.names.get(text) {
        return Arc::clone(name);
    }
    if table.names.len() >= PRUNE_FLOOR.max(table.pruned_at * 2) {
        // Names no object holds any more (nodes gone from the cluster, renamed ports): the
        // table itself is their only owner.
        table.names.retain(|name| Arc::strong_count(name) > 1);
        table.pruned_at = table.names.len();
    }
    let name: Name = Arc::from(text);
    table.names.insert(Arc::clone(&name));
    name
}

/// `a.cmp(b)`, without reading the text when both are one shared copy: the namespaces and
/// port names that keys are ordered by are interned, and the keys a B-tree search compares
/// mostly share them (a tree keyed by Service compares their namespaces before their names).
pub fn cmp_shared(a: &Name, b: &Name) -> std::cmp::Ordering {
    if Arc::ptr_eq(a, b) {
        std::cmp::Ordering::Equal
    } else {
        a.cmp(b)
    }
}

/// [`intern`] of each item, as a boxed slice (no spare capacity).
pub fn intern_all<'a>(texts: impl IntoIterator<Item = &'a str>) -> Box<[Name]> {
    texts.into_iter().map(intern).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_texts_share_one_copy() {
        let a = intern("node-interned-test-a");
        let b = intern(&String::from("node-interned-test-a"));
        assert!(Arc::ptr_eq(&a, &b));
        assert_ne!(&*intern("node-interned-test-b"), &*a);
    }

    #[test]
    fn names_nobody_holds_are_pruned_as_the_table_grows() {
        let kept = intern("interned-prune-kept");
        for i in 0..3 * PRUNE_FLOOR {
            drop(intern(&format!("interned-prune-dropped-{i}")));
        }
        let table = TABLE.lock().unwrap_or_else(PoisonError::into_inner);
        assert!(table.names.contains("interned-prune-kept"));
        // Other tests intern concurrently, so only a bound is asserted: without pruning the
        // table would hold all 3 × PRUNE_FLOOR dropped names.
        let dropped = table
            .names
            .iter()
            .filter(|name| name.starts_with("interned-prune-dropped-"))
            .count();
        assert!(
            dropped < 2 * PRUNE_FLOOR,
            "{dropped} dropped names still held"
        );
        drop(kept);
    }
}
