//! Where the agent's memory goes (item 6's profile): the agent library's structures built
//! in-process one after the other (objects, store, snapshot, the eBPF map writer's records) at a workload's size, with the resident set read after each
//! step. `malloc_trim` runs before every reading so that freed memory the allocator still
//! holds does not count: the differences are what each structure keeps alive.

use super::workload::{LiveSet, Workload};
use ipnet::IpNet;
use proxy_common::{
    AffinityMatchKey, BackendSlotKey, FrontendValue, MaglevBlock, MaglevKey, SlotBlock,
};
use proxy_dataplane_ebpf::{BackendValue, FrontendMapKey, MapOps, MapWriteError, MapWriter};
use proxy_model::desired::Snapshot;
use proxy_model::objects::{Kind, Store, Update};

/// Resident memory kept alive by each step, in KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryBreakdown {
    /// The Services in the agent's compact form (what a source delivers).
    pub services_kib: u64,
    /// The EndpointSlices in the agent's compact form.
    pub slices_kib: u64,
    /// What the store adds on top when it takes them (indexes; the objects move in).
    pub store_index_kib: u64,
    /// The desired state computed from the store.
    pub snapshot_kib: u64,
    /// The eBPF map writer's record of what it wrote (every frontend's backend ids, the
    /// backend table), after a full apply of the snapshot.
    pub map_writer_kib: u64,
}

/// Maps that take every write and keep nothing: the map writer's own records are what is
/// measured.
struct DiscardingMaps;

impl MapOps for DiscardingMaps {
    fn put_frontend(&mut self, _: FrontendMapKey, _: FrontendValue) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn delete_frontend(&mut self, _: FrontendMapKey) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn put_slot(&mut self, _: BackendSlotKey, _: SlotBlock) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn delete_slot(&mut self, _: BackendSlotKey) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn put_backend(&mut self, _: u32, _: BackendValue) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn delete_backend(&mut self, _: u32, _: BackendValue) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn put_affinity_match(&mut self, _: AffinityMatchKey) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn delete_affinity_match(&mut self, _: AffinityMatchKey) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn put_source_range(&mut self, _: u32, _: IpNet) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn delete_source_range(&mut self, _: u32, _: IpNet) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn put_maglev(&mut self, _: MaglevKey, _: MaglevBlock) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn delete_maglev(&mut self, _: MaglevKey) -> Result<(), MapWriteError> {
        Ok(())
    }
}

/// The resident set after giving freed memory back to the kernel.
fn trimmed_rss_kib() -> u64 {
    // SAFETY: malloc_trim only releases free memory of the allocator; no pointers change.
    unsafe { libc::malloc_trim(0) };
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status.lines().find_map(|line| {
                line.strip_prefix("VmRSS:")
                    .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

/// Builds the objects, the store and the snapshot for `w` and reads the resident set between
/// the steps. Runs in the benchmark process, which holds nothing large at that point.
pub fn breakdown(w: Workload, node: &str) -> MemoryBreakdown {
    let base = trimmed_rss_kib();
    let services = w.services();
    let with_services = trimmed_rss_kib();
    let slices = w.slices(LiveSet::A);
    let with_objects = trimmed_rss_kib();
    let mut store = Store::default();
    store.mark_synced(Kind::Node);
    store.apply(Update::ReplaceServices(services));
    store.apply(Update::ReplaceEndpointSlices(slices));
    store.take_changes();
    let with_store = trimmed_rss_kib();
    let mut snapshot = Snapshot::default();
    snapshot.update(store.objects(), node, None);
    let with_snapshot = trimmed_rss_kib();
    let mut map_writer = MapWriter::default();
    let _ = map_writer.apply_snapshot(&snapshot, None, &mut DiscardingMaps);
    let with_map_writer = trimmed_rss_kib();
    drop(map_writer);
    drop(snapshot);
    drop(store);
    MemoryBreakdown {
        services_kib: with_services.saturating_sub(base),
        slices_kib: with_objects.saturating_sub(with_services),
        store_index_kib: with_store.saturating_sub(with_objects),
        snapshot_kib: with_snapshot.saturating_sub(with_store),
        map_writer_kib: with_map_writer.saturating_sub(with_snapshot),
    }
}

impl MemoryBreakdown {
    /// Services and EndpointSlices together.
    pub fn objects_kib(&self) -> u64 {
        self.services_kib + self.slices_kib
    }
}
