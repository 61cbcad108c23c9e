//! Maglev consistent hashing (Eisenbud et al., NSDI 2016), as Cilium's `bpf/lib/lb.h` uses it
//! for external traffic: a lookup table of prime size `M` per frontend, filled from each
//! backend's own permutation of the slots, so that (1) backends get `M/k` slots each (±1) and
//! (2) removing one backend moves few flows of the others — a flow hashed to a slot keeps its
//! backend unless that slot was the removed backend's, or was taken over while refilling.
//!
//! `--lb-algorithm maglev`: the map_writer writes each external frontend's table into
//! `KPR_MAGLEV` (see `program`), the tc programs look up slot = hash of the 5-tuple mod `M`.

use std::net::SocketAddr;

pub use proxy_common::maglev::{DEFAULT_TABLE_SIZE, MAX_TABLE_SIZE, is_valid_table_size};

/// FNV-1a 64 over the backend's address and port with a seed: stable across processes and
/// restarts (the table must not change when the agent does).
fn hash(backend: &SocketAddr, seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    match backend {
        SocketAddr::V4(a) => a.ip().octets().into_iter().for_each(&mut eat),
        SocketAddr::V6(a) => a.ip().octets().into_iter().for_each(&mut eat),
    }
    backend.port().to_be_bytes().into_iter().for_each(&mut eat);
    h
}

/// The lookup table: `m` slots, each the index of a backend in `backends`. Empty when there
/// are no backends. `m` must satisfy [`is_valid_table_size`]; callers validate it once (the
/// flag), so an invalid one here is a programming error reported as an empty table.
pub fn table(backends: &[SocketAddr], m: u32) -> Vec<u32> {
    if backends.is_empty() || !is_valid_table_size(m) {
        return Vec::new();
    }
    let m64 = u64::from(m);
    let perms: Vec<(u64, u64)> = backends
        .iter()
        .map(|b| {
            (
                hash(b, 0) % m64,
                hash(b, 0x9e37_79b9_7f4a_7c15) % (m64 - 1) + 1,
            )
        })
        .collect();
    let mut next = vec![0u64; backends.len()];
    let mut entry = vec![u32::MAX; m as usize];
    let mut filled = 0u32;
    // Each round gives every backend its next preferred free slot; at most m rounds, and each
    // backend's walk over its permutation ends within m steps (it visits every slot).
    while filled < m {
        for (i, (offset, skip)) in perms.iter().enumerate() {
            let mut slot;
            loop {
                slot = ((offset + next[i] * skip) % m64) as usize;
                next[i] += 1;
                if entry[slot] == u32::MAX {
                    break;
                }
            }
            entry[slot] = i as u32;
            filled += 1;
            if filled == m {
                break;
            }
        }
    }
    entry
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backends(k: usize) -> Vec<SocketAddr> {
        (0..k)
            .map(|i| SocketAddr::from(([10, 244, (i / 200) as u8, (i % 200 + 2) as u8], 8080)))
            .collect()
    }

    /// A flow hash as the datapath would compute it from a 5-tuple.
    fn flow_hash(i: u32) -> u32 {
        i.wrapping_mul(0x9e37_79b1).rotate_left(13) ^ i
    }

    #[test]
    fn table_sizes_must_be_prime() {
        assert!(is_valid_table_size(DEFAULT_TABLE_SIZE));
        assert!(is_valid_table_size(16381));
        assert!(!is_valid_table_size(1024));
        assert!(!is_valid_table_size(1));
    }

    #[test]
    fn slots_are_balanced() {
        for k in [1, 2, 3, 10, 100] {
            let t = table(&backends(k), DEFAULT_TABLE_SIZE);
            let mut counts = vec![0u32; k];
            for b in &t {
                counts[*b as usize] += 1;
            }
            let (min, max) = (counts.iter().min(), counts.iter().max());
            assert!(
                max.zip(min).is_some_and(|(max, min)| max - min <= 1),
                "k={k}: {counts:?}"
            );
        }
    }

    /// The disruption when one of k backends leaves: the flows of the removed backend (≈1/k)
    /// must move; Maglev keeps the moves of the others small. Bound: all moves ≤ 1.5/k, with a
    /// table of at least ~100 slots per backend (the paper's regime; with 1021 slots and 20
    /// backends 3.5% of the other flows move, 8.5% in all).
    #[test]
    fn removing_one_backend_moves_few_flows() {
        const FLOWS: u32 = 100_000;
        for (k, m) in [
            (5usize, DEFAULT_TABLE_SIZE),
            (10, DEFAULT_TABLE_SIZE),
            (20, 16381),
        ] {
            let all = backends(k);
            let before = table(&all, m);
            let removed = k / 2;
            let mut rest = all.clone();
            rest.remove(removed);
            let after = table(&rest, m);
            let mut moved = 0u32;
            let mut of_removed = 0u32;
            for i in 0..FLOWS {
                let slot = (flow_hash(i) % m) as usize;
                let old = all[before[slot] as usize];
                let new = rest[after[slot] as usize];
                if old != new {
                    moved += 1;
                }
                if before[slot] as usize == removed {
                    of_removed += 1;
                }
            }
            let share = f64::from(moved) / f64::from(FLOWS);
            let others = f64::from(moved - of_removed) / f64::from(FLOWS);
            eprintln!(
                "k={k} m={m}: {:.1}% of flows moved ({:.1}% were on the removed backend, {:.1}% others)",
                share * 100.0,
                f64::from(of_removed) / f64::from(FLOWS) * 100.0,
                others * 100.0
            );
            assert!(share <= 1.5 / k as f64, "k={k}: {share}");
        }
    }

    #[test]
    fn the_table_is_stable_and_order_sensitive_only_in_indices() {
        let b = backends(7);
        assert_eq!(table(&b, 1021), table(&b, 1021));
        assert!(table(&[], 1021).is_empty());
    }
}
