//! Whole-map reads with `BPF_MAP_LOOKUP_BATCH`, for the drift check and adoption, and writes
//! of many entries with `BPF_MAP_UPDATE_BATCH`, for the map writer.
//!
//! Reading a map through aya costs two syscalls per entry (`BPF_MAP_GET_NEXT_KEY`, then
//! `BPF_MAP_LOOKUP_ELEM`), and `get_next_key` on a sparse hash map walks empty buckets from the
//! previous key each time: at 30k Services the service maps hold about a million entries and
//! the reads were most of a drift check's cost. The batch command (kernel 5.6) copies up to
//! `count` entries per call; aya 0.14 has no API for it, hence the raw `bpf(2)` call below.
//! Map types without batch operations (socket maps; LPM tries before 6.x), and kernels older
//! than 5.6, refuse it before copying anything: [`read_all`] then reads entry by entry as
//! before.

use std::{
    borrow::Borrow,
    io,
    mem::size_of,
    os::fd::{AsFd as _, AsRawFd as _},
};

use aya::{
    Pod,
    maps::{Array, HashMap, IterableMap as _, MapData},
};

/// `BPF_MAP_LOOKUP_BATCH` in `enum bpf_cmd`, include/uapi/linux/bpf.h.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// `BPF_MAP_UPDATE_BATCH` in `enum bpf_cmd`.
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
/// The kernel-internal "not supported" (include/linux/errno.h) that `bpf(2)` returns for a map
/// type without batch operations; libc has no name for it.
const ENOTSUPP: i32 = 524;
/// Entries asked for per call: enough that the syscall's own cost is small per entry, small
/// enough that the buffers stay well under a megabyte for every map the agent reads.
const ENTRIES_PER_CALL: usize = 4096;
/// A hash bucket with more entries than `count` makes the kernel answer ENOSPC; the buffers
/// then double, up to this many entries (a bucket never holds that many).
const MAX_ENTRIES_PER_CALL: usize = 1 << 20;

/// The `batch` member of `union bpf_attr` (include/uapi/linux/bpf.h, "struct used by
/// BPF_MAP_*_BATCH commands"; https://github.com/torvalds/linux/blob/v6.6/include/uapi/linux/bpf.h#L1531):
///
/// ```c
/// struct {
///     __aligned_u64 in_batch;  /* start batch, NULL to start from beginning */
///     __aligned_u64 out_batch; /* output: next start batch */
///     __aligned_u64 keys;
///     __aligned_u64 values;
///     __u32 count;             /* input/output: input: # of key/value elements,
///                               * output: # of filled elements */
///     __u32 map_fd;
///     __u64 elem_flags;
///     __u64 flags;
/// } batch;
/// ```
///
/// The kernel copies `size_of::<BatchAttr>()` bytes and treats the rest of the union as zero.
#[repr(C)]
#[derive(Debug, Default)]
pub struct BatchAttr {
    pub in_batch: u64,
    pub out_batch: u64,
    pub keys: u64,
    pub values: u64,
    pub count: u32,
    pub map_fd: u32,
    pub elem_flags: u64,
    pub flags: u64,
}

/// Why a batch read failed.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// The kernel has no batch lookup for this map (type or kernel version); nothing was read.
    #[error("BPF_MAP_LOOKUP_BATCH is not supported for this map")]
    Unsupported,
    /// The map's key or value size is not the type's: reading would overrun the buffers.
    #[error("map has key/value sizes {map_key}/{map_value}, the reader expects {key}/{value}")]
    Layout {
        map_key: u32,
        map_value: u32,
        key: usize,
        value: usize,
    },
    #[error("reading the map's info: {0}")]
    Info(#[from] aya::maps::MapError),
    #[error("BPF_MAP_LOOKUP_BATCH: {0}")]
    Syscall(#[source] io::Error),
}

/// Buffers kept between reads so that a periodic check does not allocate them again.
#[derive(Debug, Default)]
pub struct BatchReader {
    keys: Vec<u8>,
    values: Vec<u8>,
    /// The kernel's resume position: a bucket index (u32) for hash maps, a key for arrays;
    /// `u64` words keep it aligned and a key of any of our types fits in eight.
    in_batch: [u64; 8],
    out_batch: [u64; 8],
    /// Every read entry by entry: the benchmark's same-run baseline.
    pub entry_by_entry: bool,
}

impl BatchReader {
    /// Replaces `out` with every entry of `map`, read `ENTRIES_PER_CALL` at a time. On an error
    /// `out` holds what was read before it (nothing with [`BatchError::Unsupported`]).
    pub fn read<K: Pod, V: Pod>(
        &mut self,
        map: &MapData,
        out: &mut Vec<(K, V)>,
    ) -> Result<(), BatchError> {
        self.read_first(map, usize::MAX, out)
    }

    /// Replaces `out` with the first `limit` entries of `map` (or all, if it has fewer), in
    /// the kernel's order: an array's, from index 0.
    fn read_first<K: Pod, V: Pod>(
        &mut self,
        map: &MapData,
        limit: usize,
        out: &mut Vec<(K, V)>,
    ) -> Result<(), BatchError> {
        out.clear();
        let info = map.info()?;
        let (key_size, value_size) = (size_of::<K>(), size_of::<V>());
        if info.key_size() as usize != key_size
            || info.value_size() as usize != value_size
            || key_size > size_of::<[u64; 8]>()
        {
            return Err(BatchError::Layout {
                map_key: info.key_size(),
                map_value: info.value_size(),
                key: key_size,
                value: value_size,
            });
        }
        let mut capacity = ENTRIES_PER_CALL;
        let mut first = true;
        loop {
            let wanted = limit.saturating_sub(out.len()).min(capacity);
            if wanted == 0 {
                return Ok(());
            }
            self.keys.resize(capacity * key_size, 0);
            self.values.resize(capacity * value_size, 0);
            let mut attr = BatchAttr {
                // The first call starts at the beginning (NULL); later ones where the last
                // stopped.
                in_batch: if first {
                    0
                } else {
                    self.in_batch.as_ptr() as u64
                },
                out_batch: self.out_batch.as_mut_ptr() as u64,
                keys: self.keys.as_mut_ptr() as u64,
                values: self.values.as_mut_ptr() as u64,
                count: u32::try_from(wanted).unwrap_or(u32::MAX),
                map_fd: u32::try_from(map.fd().as_fd().as_raw_fd()).unwrap_or(u32::MAX),
                elem_flags: 0,
                flags: 0,
            };
            // SAFETY: `attr` is a valid `bpf_attr.batch`; `keys` and `values` point to buffers of
            // `count` entries of the map's key and value sizes (checked against the map's info
            // above) and `in_batch`/`out_batch` to 64 bytes, more than a bucket index or any key
            // the caller accepts; all outlive the call.
            let result = unsafe { lookup_batch(&mut attr) };
            // The kernel sets `count` to the entries it copied, also with ENOENT (the last
            // batch); never more than it was given, which the buffers hold.
            let filled = (attr.count as usize).min(wanted);
            match result {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    self.push(filled, out);
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && filled == 0 => {
                    if capacity >= MAX_ENTRIES_PER_CALL {
                        return Err(BatchError::Syscall(e));
                    }
                    capacity *= 2;
                    continue;
                }
                // Old kernels do not know the command (EINVAL); map types without batch ops
                // answer ENOTSUPP (EOPNOTSUPP in some versions). Always before any copy.
                Err(e)
                    if first
                        && matches!(
                            e.raw_os_error(),
                            Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
                        ) =>
                {
                    return Err(BatchError::Unsupported);
                }
                Err(e) => return Err(BatchError::Syscall(e)),
            }
            self.push(filled, out);
            self.in_batch = self.out_batch;
            first = false;
        }
    }

    fn push<K: Pod, V: Pod>(&self, filled: usize, out: &mut Vec<(K, V)>) {
        let keys = self.keys.chunks_exact(size_of::<K>());
        let values = self.values.chunks_exact(size_of::<V>());
        out.extend(keys.zip(values).take(filled).map(|(key, value)| {
            // SAFETY: each chunk is exactly `size_of` the type, the kernel wrote a whole key and
            // value into it, and `Pod` types are valid for any bytes; `read_unaligned` because
            // a byte buffer gives no alignment.
            unsafe {
                (
                    std::ptr::read_unaligned(key.as_ptr().cast::<K>()),
                    std::ptr::read_unaligned(value.as_ptr().cast::<V>()),
                )
            }
        }));
    }
}

/// `BPF_MAP_LOOKUP_BATCH`: the kernel sets `attr.count` to the entries it copied (also with
/// `ENOENT`, the last batch) and `out_batch` to where the next call starts.
///
/// # Safety
/// `keys` and `values` point to buffers of `count` entries of the map's key and value sizes,
/// `out_batch` (and `in_batch`, unless 0) to memory that holds the map's batch token (a bucket
/// index for hash maps), all alive across the call.
pub unsafe fn lookup_batch(attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a whole `bpf_attr.batch`; its pointers are valid as the caller
    // guarantees.
    unsafe { crate::bpf::bpf_syscall::sys_bpf(BPF_MAP_LOOKUP_BATCH, attr) }.map(drop)
}

/// Replaces `out` with every entry of the hash map: batched when the kernel can, else (or
/// after a failed batch, logged) entry by entry, skipping entries deleted under the walk.
pub fn read_all<T: Borrow<MapData>, K: Pod, V: Pod>(
    map: &HashMap<T, K, V>,
    reader: &mut BatchReader,
    name: &'static str,
    out: &mut Vec<(K, V)>,
) {
    if !reader.entry_by_entry {
        match reader.read(map.map(), out) {
            Ok(()) => return,
            Err(BatchError::Unsupported) => {}
            Err(error) => {
                tracing::warn!(map = name, %error, "batched read failed; reading entry by entry");
            }
        }
    }
    out.clear();
    out.extend(map.iter().flatten());
}

/// Replaces `out` with the elements of the array whose value `keep` accepts, with their
/// index: batched when the kernel can, else (or after a failed batch, logged) index by index.
/// An array has every index, so `keep` is what tells a held element from an empty one.
pub fn read_array<T: Borrow<MapData>, V: Pod>(
    map: &Array<T, V>,
    reader: &mut BatchReader,
    name: &'static str,
    keep: impl Fn(&V) -> bool,
    out: &mut Vec<(u32, V)>,
) {
    read_array_below(map, reader, name, map.len(), keep, out);
}

/// [`read_array`] of the indices below `end` only (all of them if the array is shorter).
pub fn read_array_below<T: Borrow<MapData>, V: Pod>(
    map: &Array<T, V>,
    reader: &mut BatchReader,
    name: &'static str,
    end: u32,
    keep: impl Fn(&V) -> bool,
    out: &mut Vec<(u32, V)>,
) {
    let end = end.min(map.len());
    if !reader.entry_by_entry {
        match reader.read_first(map.map(), end as usize, out) {
            Ok(()) => {
                out.retain(|(_, value)| keep(value));
                return;
            }
            Err(BatchError::Unsupported) => {}
            Err(error) => {
                tracing::warn!(map = name, %error, "batched read failed; reading entry by entry");
            }
        }
    }
    out.clear();
    out.extend(
        (0..end)
            .filter_map(|index| Some((index, map.get(&index, 0).ok()?)))
            .filter(|(_, value)| keep(value)),
    );
}

/// Writes `entries` (index, value) into the array, as [`update_all`] does into a hash map: one
/// `BPF_MAP_UPDATE_BATCH` call where the kernel has it. An index past the array's end fails
/// with `E2BIG`, as a full hash map refuses a new key.
pub fn update_array_all<T: std::borrow::BorrowMut<MapData>, V: Pod>(
    map: &mut Array<T, V>,
    entries: &[(u32, V)],
) -> Result<(), aya::maps::MapError> {
    if entries.len() > 1 {
        let keys: Vec<u32> = entries.iter().map(|(index, _)| *index).collect();
        let values: Vec<V> = entries.iter().map(|(_, value)| *value).collect();
        match update_batch(map.map(), &keys, &values) {
            Ok(()) => return Ok(()),
            Err(Some(done)) => {
                for (index, value) in &entries[done..] {
                    map.set(*index, value, 0)?;
                }
                return Ok(());
            }
            Err(None) => {}
        }
    }
    for (index, value) in entries {
        map.set(*index, value, 0)?;
    }
    Ok(())
}

/// One `BPF_MAP_UPDATE_BATCH` of `keys` and `values` (as many of each). `Err(None)`: the
/// kernel has no batch update for the map (nothing written); `Err(Some(done))`: the entry at
/// `done` failed, the ones before it are written.
fn update_batch<K: Pod, V: Pod>(
    map: &MapData,
    keys: &[K],
    values: &[V],
) -> Result<(), Option<usize>> {
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: u32::try_from(keys.len().min(values.len())).unwrap_or(u32::MAX),
        map_fd: map.fd().as_fd().as_raw_fd() as u32,
        ..BatchAttr::default()
    };
    // SAFETY: `attr` is a valid `bpf_attr.batch`; `keys` and `values` hold `count` entries of
    // the map's key and value types (aya checked their sizes against the map when the typed
    // handle was made) and outlive the call; the kernel only reads them.
    let result = unsafe { crate::bpf::bpf_syscall::sys_bpf(BPF_MAP_UPDATE_BATCH, &mut attr) };
    let done = (attr.count as usize).min(keys.len());
    match result {
        Ok(_) => Ok(()),
        // Unknown command (before 5.6) or a map type without it: nothing was written.
        Err(e)
            if done == 0
                && matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
                ) =>
        {
            Err(None)
        }
        Err(_) => Err(Some(done)),
    }
}

/// Writes `entries` into the hash map (`BPF_ANY`), in one `BPF_MAP_UPDATE_BATCH` call when the
/// kernel has it (5.6) and else one update each. A frontend's slots are written together: one
/// call instead of one per backend made up most of a cold start's map writes (a syscall costs
/// about as much as the update itself). On an error, the entries before the failed one are
/// written and the ones after it are not; the error is the failed entry's own (`E2BIG` for a
/// full map, as a single update gives).
pub fn update_all<T: std::borrow::BorrowMut<MapData>, K: Pod, V: Pod>(
    map: &mut HashMap<T, K, V>,
    entries: &[(K, V)],
) -> Result<(), aya::maps::MapError> {
    if entries.len() > 1 {
        let keys: Vec<K> = entries.iter().map(|(key, _)| *key).collect();
        let values: Vec<V> = entries.iter().map(|(_, value)| *value).collect();
        match update_batch(map.map(), &keys, &values) {
            Ok(()) => return Ok(()),
            // The entry at `done` failed: written one by one from there, it gives its own error
            // (and the entries after it are not written, as before).
            Err(Some(done)) => {
                for (key, value) in &entries[done..] {
                    map.insert(key, value, 0)?;
                }
                return Ok(());
            }
            Err(None) => {}
        }
    }
    for (key, value) in entries {
        map.insert(key, value, 0)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
