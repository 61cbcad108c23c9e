//! Programming latency measured in-process with the agent's library: the store, the snapshot
//! update and the dataplane apply, exactly the calls `run.rs` makes per sync, without the
//! source, the sync runner or process start-up.
//!
//! - eBPF: a real [`EbpfDataplane`] (programs attached to an empty child cgroup, maps pinned in
//!   a private bpffs) so every map write is a real syscall.
//! - iptables: a real [`IptablesDataplane`] on a thread that entered a private network
//!   namespace, so `iptables-restore` (a child of that thread) writes that namespace's tables.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use proxy_dataplane_ebpf::TcOptions;
use proxy_dataplane_ebpf::{self as ebpf, EbpfDataplane, EbpfOptions, LbOptions};
use proxy_dataplane_iptables::{
    FamilyRules, HostFeatures, IptablesConfig, IptablesDataplane, SyncInput, generate,
};
use proxy_model::desired::{IpFamily, Snapshot};
use proxy_model::objects::{Kind, Store, Update};

use super::agent_runs::IptablesBackend;
use super::stats::Percentiles;
use super::sysinfo::bpf_maps;
use super::workload::{LiveSet, Workload};
use crate::cgroup::ChildCgroup;
use crate::netns::Netns;
use crate::scenario::HOSTNAME;
use crate::{Result, RigError, unique_name};

/// The agent's default `--bpf-map-backends`.
pub const DEFAULT_BACKENDS_CAPACITY: u32 = 262_144;
/// The agent's default `--bpf-map-frontends`.
pub const DEFAULT_FRONTENDS_CAPACITY: u32 = 65_536;

/// Frontends a ClusterIP service port has: socket-level and external (tc).
const FRONTENDS_PER_CLUSTER_IP_PORT: usize = 2;

/// Frontend map capacity for a workload: the default, or the next power of two with room for
/// every Service's frontends (50k Services have 100k: more than the default 65536).
pub fn frontends_capacity(w: Workload) -> u32 {
    let frontends = w.services * FRONTENDS_PER_CLUSTER_IP_PORT;
    let needed = u32::try_from(frontends + 4096).unwrap_or(u32::MAX);
    needed.next_power_of_two().max(DEFAULT_FRONTENDS_CAPACITY)
}

/// Backend/slot map capacity for a workload (one flag sizes both maps): the default, or the
/// next power of two with room for every endpoint's slot in each of its Service's frontends
/// (300k endpoints need 600k slots: more than the default 262144 and than 2^19).
pub fn backends_capacity(w: Workload) -> u32 {
    let slots = w.total_endpoints() * FRONTENDS_PER_CLUSTER_IP_PORT;
    let needed = u32::try_from(slots + 4096).unwrap_or(u32::MAX);
    needed.next_power_of_two().max(DEFAULT_BACKENDS_CAPACITY)
}

/// A private bpffs mount for in-process pins; Drop removes the pins (detaching the programs),
/// unmounts and deletes the directory.
#[derive(Debug)]
struct BpfRoot {
    dir: PathBuf,
}

impl BpfRoot {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(unique_name("bpf"));
        fs::create_dir_all(&dir)
            .map_err(|e| RigError::io(format!("creating {}", dir.display()), e))?;
        Ok(Self { dir })
    }

    fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for BpfRoot {
    fn drop(&mut self) {
        if let Err(e) = ebpf::cleanup(&self.dir) {
            eprintln!("bench: removing pins under {}: {e}", self.dir.display());
        }
        crate::agent::unmount_if_mounted(&self.dir);
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("bench: removing {}: {e}", self.dir.display());
        }
    }
}

/// In-process eBPF programming at one size.
#[derive(Debug, Clone)]
pub struct EbpfResult {
    pub workload: Workload,
    /// `Snapshot::update` of everything (first sync).
    pub full_snapshot: Duration,
    /// `EbpfDataplane::apply` of everything into empty maps.
    pub full_apply: Duration,
    /// One EndpointSlice change: store + snapshot update + apply.
    pub change: Percentiles,
    pub change_snapshot: Percentiles,
    pub change_apply: Percentiles,
    /// Sum of the kernel's memlock accounting over the dataplane's maps.
    pub map_memlock: u64,
    pub backends_capacity: u32,
    /// One full drift check (every entry of the service maps read and compared; nothing to
    /// repair) with batched map reads, as the agent runs it: the median of three.
    pub drift_check: DriftCost,
    /// The same check reading every map entry by entry (`get_next_key` + lookup, the read path
    /// before `BPF_MAP_LOOKUP_BATCH`), interleaved with the batched ones: the same-run baseline.
    pub drift_check_unbatched: DriftCost,
    /// A full `EbpfDataplane::apply` with nothing to write, as the eBPF mode's periodic resync
    /// runs in the agent's loop (changes wait behind it): the median of three.
    pub idle_resync: Duration,
}

/// What one full drift check costs: elapsed time, and CPU time of the checking thread (user
/// and system: the map reads are syscalls), which is what the check takes from a core.
#[derive(Debug, Clone, Copy)]
pub struct DriftCost {
    pub wall: Duration,
    pub cpu: Duration,
}

/// CPU time of the calling thread (user + system).
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill; the clock id is a constant the
    // kernel always has.
    let ret = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if ret != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// The median (by CPU time) of `costs`.
fn median(mut costs: Vec<DriftCost>) -> DriftCost {
    costs.sort_by_key(|c| c.cpu);
    costs[costs.len() / 2]
}

fn store_for(w: Workload) -> Store {
    let (services, slices) = w.objects(LiveSet::A);
    let mut store = Store::default();
    // Standalone mode: no Node object, which counts as listed.
    store.mark_synced(Kind::Node);
    store.apply(Update::ReplaceServices(services));
    store.apply(Update::ReplaceEndpointSlices(slices));
    store.take_changes();
    store
}

/// Applies change `k` to the store and updates the snapshot; returns the changed service
/// ports.
fn change(
    w: Workload,
    k: usize,
    store: &mut Store,
    snapshot: &mut Snapshot,
) -> std::collections::BTreeSet<proxy_model::desired::ServicePortName> {
    let (slice_key, slice, _) = w.change(k);
    // The conversion a source makes on each event is part of the change's cost.
    store.apply(Update::EndpointSliceApplied(slice_key, (&slice).into()));
    let changes = store.take_changes();
    snapshot
        .update(store.objects(), HOSTNAME, Some(&changes.services))
        .changed
}

/// The eBPF dataplane attaches tc programs to the interfaces of the namespace it runs in, so
/// the measurement runs on a thread inside a namespace of its own (never the host's).
pub fn ebpf(w: Workload, changes: usize) -> Result<EbpfResult> {
    let netns = Netns::new("ebpf")?;
    let path = netns.path();
    let worker = std::thread::spawn(move || -> Result<EbpfResult> {
        crate::netns::enter_netns(&path)?;
        ebpf_in_current_netns(w, changes)
    });
    let result = worker
        .join()
        .map_err(|_| RigError::Other("the eBPF benchmark thread panicked".into()))?;
    drop(netns);
    result
}

fn ebpf_in_current_netns(w: Workload, changes: usize) -> Result<EbpfResult> {
    // Declaration order is drop order reversed: the dataplane goes before its pins, runtime
    // and cgroup.
    let cgroup = ChildCgroup::new()?;
    let root = BpfRoot::new()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| RigError::io("starting a tokio runtime", e))?;
    // The dataplane's log drain is a tokio task.
    let _entered = runtime.enter();
    let capacity = backends_capacity(w);
    let mut dataplane = EbpfDataplane::start(&EbpfOptions {
        cgroup_path: Some(cgroup.path().to_path_buf()),
        bpf_root: root.path().to_path_buf(),
        frontends_capacity: DEFAULT_FRONTENDS_CAPACITY,
        max_frontends_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_FRONTENDS_PER_SERVICE,
        max_endpoints_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_ENDPOINTS_PER_SERVICE,
        backends_capacity: capacity,
        conntrack_capacity: Some(proxy_dataplane_ebpf::DEFAULT_CONNTRACK_CAPACITY),
        lru_budget: proxy_dataplane_ebpf::maps::map_sizes::LruBudget::MemoryShare(
            proxy_dataplane_ebpf::maps::map_sizes::DEFAULT_DYNAMIC_SIZE_RATIO,
        ),
        lb: LbOptions::default(),
        tc: TcOptions::default(),
        disabled_features: Default::default(),
        // Every REJECT answered: the rate limit has its own test.
        icmp_ratelimit: Some(std::time::Duration::ZERO),
        snat_ports: proxy_dataplane_ebpf::conntrack::reserved_ports::DEFAULT_RANGE,
    })
    .map_err(|e| RigError::Other(format!("starting the eBPF dataplane: {e}")))?;

    let mut store = store_for(w);
    let mut snapshot = Snapshot::default();
    let t0 = Instant::now();
    snapshot.update(store.objects(), HOSTNAME, None);
    let full_snapshot = t0.elapsed();
    let t1 = Instant::now();
    let (summary, errors) = dataplane.apply(&snapshot, None);
    let full_apply = t1.elapsed();
    if let Some(error) = errors.first() {
        return Err(RigError::Other(format!(
            "full apply of {} Services: {} errors, first: {error}",
            w.services,
            errors.len()
        )));
    }
    if summary.frontends_written < w.services {
        return Err(RigError::Other(format!(
            "full apply wrote {} frontends for {} Services",
            summary.frontends_written, w.services
        )));
    }

    // Each change to another Service: a second change of one Service within the map writer's
    // generation grace (1 s; these come faster) is deferred, which is not what is measured.
    let changes = changes.min(w.decoys().max(1));
    let mut totals = Vec::with_capacity(changes);
    let mut snapshots = Vec::with_capacity(changes);
    let mut applies = Vec::with_capacity(changes);
    for k in 0..changes {
        let t0 = Instant::now();
        let changed = change(w, k, &mut store, &mut snapshot);
        let t1 = Instant::now();
        let (summary, errors) = dataplane.apply(&snapshot, Some(&changed));
        let t2 = Instant::now();
        if let Some(error) = errors.first() {
            return Err(RigError::Other(format!("change {k}: {error}")));
        }
        // One EndpointSlice change rewrites the Service's two frontends: the socket-level one
        // and the ClusterIP as reached from outside the node (tc).
        if summary.frontends_written != FRONTENDS_PER_CLUSTER_IP_PORT {
            return Err(RigError::Other(format!(
                "change {k} wrote {} frontends, expected {FRONTENDS_PER_CLUSTER_IP_PORT}",
                summary.frontends_written
            )));
        }
        totals.push(t2 - t0);
        snapshots.push(t1 - t0);
        applies.push(t2 - t1);
    }
    let mut idle_resyncs = Vec::with_capacity(3);
    for _ in 0..3 {
        let started = Instant::now();
        let (summary, errors) = dataplane.apply(&snapshot, None);
        idle_resyncs.push(started.elapsed());
        if summary.frontends_written > 0 || summary.frontends_removed > 0 || !errors.is_empty() {
            return Err(RigError::Other(format!(
                "a resync with nothing changed wrote {} and removed {} frontends ({} errors)",
                summary.frontends_written,
                summary.frontends_removed,
                errors.len()
            )));
        }
    }
    idle_resyncs.sort();
    let idle_resync = idle_resyncs[idle_resyncs.len() / 2];
    let mut batched = Vec::with_capacity(3);
    let mut unbatched = Vec::with_capacity(3);
    for _ in 0..3 {
        for (batch, costs) in [(true, &mut batched), (false, &mut unbatched)] {
            dataplane.set_batched_reads(batch);
            let (wall0, cpu0) = (Instant::now(), thread_cpu_time());
            let check = dataplane
                .check_drift(true)
                .map_err(|why| RigError::Other(format!("the drift check did not run: {why}")))?;
            costs.push(DriftCost {
                wall: wall0.elapsed(),
                cpu: thread_cpu_time().saturating_sub(cpu0),
            });
            if !check.drift.is_empty() {
                return Err(RigError::Other(format!(
                    "{} entries drifted without anyone touching the maps (batched reads: \
                     {batch}); first: {:?}",
                    check.drift.len(),
                    check.drift.first()
                )));
            }
        }
    }
    dataplane.set_batched_reads(true);
    let (drift_check, drift_check_unbatched) = (median(batched), median(unbatched));
    let map_memlock = bpf_maps(std::process::id()).iter().map(|m| m.memlock).sum();
    Ok(EbpfResult {
        workload: w,
        full_snapshot,
        full_apply,
        change: Percentiles::of_durations(&totals),
        change_snapshot: Percentiles::of_durations(&snapshots),
        change_apply: Percentiles::of_durations(&applies),
        map_memlock,
        backends_capacity: capacity,
        drift_check,
        drift_check_unbatched,
        idle_resync,
    })
}

/// In-process iptables programming at one size.
#[derive(Debug, Clone)]
pub struct IptablesResult {
    pub workload: Workload,
    pub backend: String,
    pub full_snapshot: Duration,
    /// The generator alone for a full IPv4 sync (no kernel).
    pub full_generate: Duration,
    /// `IptablesDataplane::apply` (both families) of everything: generator + iptables-restore.
    pub full_apply: Duration,
    pub full_restore_bytes: usize,
    pub nat_rules: usize,
    /// One EndpointSlice change: store + snapshot update + partial sync of both families.
    pub change: Percentiles,
    /// The generator alone for the same partial sync.
    pub change_generate: Percentiles,
    pub change_restore_bytes: usize,
}

pub fn iptables(w: Workload, changes: usize, backend: IptablesBackend) -> Result<IptablesResult> {
    let netns = Netns::new("ipt")?;
    if let Some((program, args)) = backend.hint_command() {
        netns.exec(program, args)?;
    }
    let path = netns.path();
    // The namespace is entered by a thread of its own so that the rest of the benchmark stays
    // in its namespace; the thread's children (iptables-restore) inherit it.
    let worker = std::thread::spawn(move || -> Result<IptablesResult> {
        crate::netns::enter_netns(&path)?;
        iptables_in_current_netns(w, changes)
    });
    let result = worker
        .join()
        .map_err(|_| RigError::Other("the iptables benchmark thread panicked".into()))?;
    drop(netns);
    result
}

fn iptables_in_current_netns(w: Workload, changes: usize) -> Result<IptablesResult> {
    let config = IptablesConfig::default();
    let mut dataplane = IptablesDataplane::start(config.clone())
        .map_err(|e| RigError::Other(format!("starting the iptables dataplane: {e}")))?;
    let backend = format!("{:?}", proxy_kernel::iptables::detect::detect_backend());
    // The same generator context the dataplane built, for timing the generator alone.
    let rules = FamilyRules::new(
        &config,
        IpFamily::V4,
        None,
        &[],
        &HostFeatures {
            random_fully: true,
            ..HostFeatures::default()
        },
    );

    let mut store = store_for(w);
    let mut snapshot = Snapshot::default();
    let t0 = Instant::now();
    snapshot.update(store.objects(), HOSTNAME, None);
    let full_snapshot = t0.elapsed();

    let t1 = Instant::now();
    let full_ruleset = generate(
        &rules,
        snapshot.family(IpFamily::V4),
        SyncInput {
            changed_services: None,
            existing_nat_chains: None,
        },
    );
    let full_generate = t1.elapsed();

    let t2 = Instant::now();
    let reports = dataplane.apply(&snapshot, None);
    let full_apply = t2.elapsed();
    let mut nat_rules = 0;
    for report in reports {
        let report = report.map_err(|e| RigError::Other(format!("full iptables sync: {e}")))?;
        if report.family == IpFamily::V4 {
            nat_rules = report.nat_rules;
        }
    }

    let mut totals = Vec::with_capacity(changes);
    let mut generates = Vec::with_capacity(changes);
    let mut change_restore_bytes = 0;
    for k in 0..changes {
        let t0 = Instant::now();
        let changed = change(w, k, &mut store, &mut snapshot);
        let reports = dataplane.apply(&snapshot, Some(&changed));
        totals.push(t0.elapsed());
        for report in reports {
            let report = report.map_err(|e| RigError::Other(format!("change {k}: {e}")))?;
            if report.full {
                return Err(RigError::Other(format!(
                    "change {k} ran a full sync, not a partial one"
                )));
            }
        }
        let services: std::collections::BTreeSet<_> =
            changed.iter().map(|name| name.service.clone()).collect();
        let t1 = Instant::now();
        let ruleset = generate(
            &rules,
            snapshot.family(IpFamily::V4),
            SyncInput {
                changed_services: Some(&services),
                existing_nat_chains: None,
            },
        );
        generates.push(t1.elapsed());
        change_restore_bytes = ruleset.restore.len();
    }
    Ok(IptablesResult {
        workload: w,
        backend,
        full_snapshot,
        full_generate,
        full_apply,
        full_restore_bytes: full_ruleset.restore.len(),
        nat_rules,
        change: Percentiles::of_durations(&totals),
        change_generate: Percentiles::of_durations(&generates),
        change_restore_bytes,
    })
}
