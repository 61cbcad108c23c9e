//! Maglev table sizes: the agent's configuration validates them, the agent's table builder and
//! the tc programs use them, so they live below both.

/// The default table size: a prime well above the backend counts Services have, small enough
/// that a table (4 bytes per slot) stays a few KiB per frontend. Cilium's default is 16381.
pub const DEFAULT_TABLE_SIZE: u32 = 1021;

/// The largest table size accepted (Cilium's largest, 2^17 - 1): a table is rebuilt and
/// rewritten in full on every change of its frontend, one map update per slot.
pub const MAX_TABLE_SIZE: u32 = 131_071;

/// Whether `m` is usable as a table size (a prime ≥ 3: the permutation's skip must be coprime
/// with `m` for every backend to visit every slot).
pub fn is_valid_table_size(m: u32) -> bool {
    m >= 3
        && (2..)
            .take_while(|d: &u32| d * d <= m)
            .all(|d| !m.is_multiple_of(d))
}
