//! The batched read against the kernel: maps created here (needs root, like the rest of the
//! eBPF tests), filled through aya, read back and compared with what was written.

use std::os::fd::{FromRawFd as _, OwnedFd};

use aya::maps::{Array, HashMap, IterableMap, Map, MapData};
use proxy_common::BackendSlotKey;

use crate::bpf::map_batch::{
    BatchError, BatchReader, read_all, read_array, read_array_below, update_all, update_array_all,
};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_SOCKHASH: u32 = 18;

/// The first members of `bpf_attr` for `BPF_MAP_CREATE` (include/uapi/linux/bpf.h); the
/// kernel zero-fills the rest.
#[repr(C)]
struct CreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

fn create(map_type: u32, key_size: usize, value_size: usize, max: u32, flags: u32) -> MapData {
    let attr = CreateAttr {
        map_type,
        key_size: u32::try_from(key_size).expect("small key"),
        value_size: u32::try_from(value_size).expect("small value"),
        max_entries: max,
        map_flags: flags,
    };
    // SAFETY: `attr` is a valid prefix of `bpf_attr` of the size passed and outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_CREATE,
            std::ptr::from_ref(&attr),
            size_of::<CreateAttr>(),
        )
    };
    assert!(
        fd >= 0,
        "BPF_MAP_CREATE (needs root): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the kernel just returned this descriptor and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(i32::try_from(fd).expect("an fd fits in i32")) };
    MapData::from_fd(fd).expect("map info")
}

fn slot_key(i: u32) -> BackendSlotKey {
    BackendSlotKey {
        service_id: i / 10,
        block: u16::try_from(i % 10).expect("< 10"),
        generation: u8::try_from(i % 2).expect("< 2"),
        _pad: 0,
    }
}

/// A sparse hash map (few entries, many buckets, as the service maps are) and more entries
/// than one call returns: every entry comes back exactly once, with its value.
#[test]
fn batch_reads_every_entry_of_a_hash_map() {
    let data = create(
        BPF_MAP_TYPE_HASH,
        size_of::<BackendSlotKey>(),
        size_of::<u32>(),
        65_536,
        0,
    );
    let mut map: HashMap<_, BackendSlotKey, u32> =
        HashMap::try_from(Map::from_map_data(data).expect("a hash map")).expect("typed");
    let count = 10_000u32; // more than two batches of ENTRIES_PER_CALL
    let mut written: Vec<(BackendSlotKey, u32)> = (0..count)
        .map(|i| (slot_key(i), i.wrapping_mul(2_654_435_761)))
        .collect();
    for (key, value) in &written {
        map.insert(key, value, 0).expect("insert");
    }
    let mut reader = BatchReader::default();
    let mut read = Vec::new();
    reader
        .read(IterableMap::map(&map), &mut read)
        .expect("batched read");
    let sort = |v: &mut Vec<(BackendSlotKey, u32)>| {
        v.sort_by_key(|(k, _)| (k.service_id, k.block, k.generation))
    };
    sort(&mut written);
    sort(&mut read);
    assert_eq!(read.len(), written.len());
    assert!(
        read == written,
        "the batched read differs from what was written"
    );

    // The same reader again after a change (buffers reused, the output replaced).
    let (gone, _) = written.remove(17);
    map.remove(&gone).expect("remove");
    reader
        .read(IterableMap::map(&map), &mut read)
        .expect("second batched read");
    sort(&mut read);
    assert!(read == written, "the second read differs");

    // And an empty map: no entries, no error.
    let empty = create(BPF_MAP_TYPE_HASH, 8, 4, 1024, 0);
    let mut none: Vec<(BackendSlotKey, u32)> = vec![(slot_key(1), 1)];
    reader.read(&empty, &mut none).expect("empty read");
    assert!(none.is_empty());
}

/// A map type without batch operations is reported as such (the caller then walks it entry by
/// entry): a socket hash has none (an LPM trie has them since 6.x kernels, so it would not
/// do), and [`read_all`] on a hash map gives what was written.
#[test]
fn sockhash_is_unsupported_and_read_all_reads_a_hash_map() {
    let sockhash = create(BPF_MAP_TYPE_SOCKHASH, 4, 4, 16, 0);
    let mut out: Vec<(u32, u32)> = vec![(1, 1)];
    let result = BatchReader::default().read(&sockhash, &mut out);
    assert!(
        matches!(result, Err(BatchError::Unsupported)),
        "a socket hash read in batches: {result:?}"
    );
    assert!(out.is_empty(), "nothing read, and the old content gone");

    let data = create(BPF_MAP_TYPE_HASH, 4, 4, 256, 0);
    let mut map: HashMap<_, u32, u32> =
        HashMap::try_from(Map::from_map_data(data).expect("a hash map")).expect("typed");
    for i in 0..100u32 {
        map.insert(i, i + 1, 0).expect("insert");
    }
    let mut read = Vec::new();
    read_all(&map, &mut BatchReader::default(), "test", &mut read);
    read.sort_unstable();
    assert_eq!(read, (0..100).map(|i| (i, i + 1)).collect::<Vec<_>>());
}

/// A reader typed for another layout refuses before the kernel could write past its buffers.
#[test]
fn wrong_layout_is_refused() {
    let data = create(BPF_MAP_TYPE_HASH, 4, 4, 16, 0);
    let mut out: Vec<(u32, u64)> = Vec::new();
    match BatchReader::default().read(&data, &mut out) {
        Err(BatchError::Layout {
            map_key: 4,
            map_value: 4,
            key: 4,
            value: 8,
        }) => {}
        other => panic!("expected a layout error, got {other:?}"),
    }
}

/// A batched write puts every entry with its value (overwriting an existing one, as `BPF_ANY`
/// does), and into a map with room for only part of them it writes the entries up to the
/// first that does not fit, and reports the full map as a single update would (`E2BIG`).
#[test]
fn batched_writes_write_every_entry_and_stop_at_a_full_map() {
    const NO_PREALLOC: u32 = 1;
    let data = create(
        BPF_MAP_TYPE_HASH,
        size_of::<BackendSlotKey>(),
        size_of::<u32>(),
        64,
        NO_PREALLOC,
    );
    let mut map: HashMap<_, BackendSlotKey, u32> =
        HashMap::try_from(Map::from_map_data(data).expect("a hash map")).expect("typed");
    map.insert(slot_key(3), 999, 0).expect("insert");
    let entries: Vec<(BackendSlotKey, u32)> = (0..40).map(|i| (slot_key(i), i + 7)).collect();
    update_all(&mut map, &entries).expect("batched write");
    let mut read: Vec<(BackendSlotKey, u32)> = map.iter().map(|e| e.expect("entry")).collect();
    read.sort_by_key(|(k, v)| (k.service_id, k.block, k.generation, *v));
    let mut expected = entries.clone();
    expected.sort_by_key(|(k, v)| (k.service_id, k.block, k.generation, *v));
    assert!(
        read == expected,
        "the map holds something else than was written"
    );

    let more: Vec<(BackendSlotKey, u32)> = (40..80).map(|i| (slot_key(i), i)).collect();
    let result = update_all(&mut map, &more);
    let full = matches!(
        &result,
        Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::E2BIG)
    );
    assert!(full, "a full map is E2BIG, got {result:?}");
    let written: Vec<u32> = (40..80)
        .filter(|&i| map.get(&slot_key(i), 0).is_ok())
        .collect();
    assert_eq!(
        written,
        (40..64).collect::<Vec<_>>(),
        "the entries before the full one"
    );
}

/// An array (the backend maps) written in one batch and read back, batched and index by index:
/// only the elements `keep` accepts come back, and an index past the end fails as a full map.
#[test]
fn arrays_are_written_in_a_batch_and_read_back_without_their_empty_elements() {
    const BPF_MAP_TYPE_ARRAY: u32 = 2;
    let data = create(BPF_MAP_TYPE_ARRAY, 4, 8, 5000, 0);
    let mut array = Array::<MapData, u64>::try_from(Map::Array(data)).expect("array");
    // More than one batch call's worth of elements, with a gap at every third index.
    let written: Vec<(u32, u64)> = (1..5000)
        .filter(|i| i % 3 != 0)
        .map(|i| (i, u64::from(i) << 8))
        .collect();
    update_array_all(&mut array, &written).expect("batched write");
    for entry_by_entry in [false, true] {
        let mut reader = BatchReader {
            entry_by_entry,
            ..BatchReader::default()
        };
        let mut read = Vec::new();
        read_array(&array, &mut reader, "test", |v| *v != 0, &mut read);
        assert_eq!(read, written, "entry by entry: {entry_by_entry}");
        // Below an index past one batch call's worth, and past the array's end.
        for end in [0, 1, 4097, 4500, 5000, 9000] {
            read_array_below(&array, &mut reader, "test", end, |v| *v != 0, &mut read);
            let below: Vec<(u32, u64)> =
                written.iter().copied().filter(|(i, _)| *i < end).collect();
            assert_eq!(read, below, "below {end}, entry by entry: {entry_by_entry}");
        }
    }
    let past_the_end = update_array_all(&mut array, &[(4999, 1), (5000, 2)]);
    assert!(past_the_end.is_err(), "{past_the_end:?}");
    assert_eq!(
        array.get(&4999, 0).expect("written before the failed one"),
        1
    );
}
