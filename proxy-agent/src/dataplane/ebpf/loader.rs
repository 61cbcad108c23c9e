//! Loading the eBPF object, pinning its maps and links, re-adopting what a previous agent
//! pinned, and removing all of it on `--cleanup`.
//!
//! Everything lives under `<bpf-root>/kubeproxy-rs/`: one pin per map (aya reuses a pinned map
//! of the same name on load, so a restarted agent finds the state it left) and one pin per
//! cgroup link (`<program>_link`). A pinned link keeps its program attached after the agent
//! exits or is killed, so the datapath never depends on the agent process being alive. On
//! start the agent attaches freshly loaded programs next to the pinned ones, then renames the
//! new link pins over the old ones, which releases (detaches) the old links: for a moment both
//! programs run, which is harmless because the second sees an address the first already
//! translated (not a frontend) and lets it pass.

use std::{
    collections::BTreeSet,
    fs::File,
    io,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        HashMap, MapData, MapInfo, PerCpuArray,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{
        CgroupAttachMode, CgroupSockAddr, SchedClassifier, TestRun as _, TestRunOptions,
        links::{FdLink, PinnedLink},
    },
};
use aya_log::EbpfLogger;
use ipnet::IpNet;
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, BackendSlotKey, CtKey,
    CtValue, Frontend4Key, Frontend6Key, FrontendValue, MaglevBlock, MaglevKey, NodeAddrKey,
    NodeConfig, RevNat4, RevNat4Key, RevNat6, RevNat6Key, SourceRangeKey, StatIndex, map_names,
    program_names,
};
use tokio::{io::unix::AsyncFd, task::JoinHandle};
use tracing::{debug, info, warn};

use super::{
    ApplyError, ApplySummary, Drift, DriftCheck, DriftKind, MapOps, MapWriteError, Programmer,
    bpffs, cgroup, ct, drift, maglev, object, orphans,
    program::{
        BackendValue, FrontendMapKey, MapsContent, ip4_from_map, ip4_to_map, ip6_from_map,
        ip6_to_map,
    },
    sockdiag::{self, DiagSocket},
    stats::read_stats,
    tc::{TcOptions, TcState},
};
use crate::desired::{Protocol, ServicePortName, Snapshot};
use crate::node_services::metrics::EbpfMetrics;

/// One run of a tc program with `BPF_PROG_TEST_RUN` ([`EbpfDataplane::test_run_tc`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcTestRun {
    /// The program's return value (`TC_ACT_*`).
    pub action: i32,
    /// The packet after the program.
    pub packet: Vec<u8>,
}

/// Directory under `--bpf-root` that holds our pins.
pub const PIN_DIR_NAME: &str = "kubeproxy-rs";
/// Suffix of link pins: `<program>_link`. (bpffs refuses names with a dot: EPERM.)
pub(super) const LINK_SUFFIX: &str = "_link";

#[derive(Debug, Clone)]
pub struct EbpfOptions {
    /// cgroup2 directory to attach to; `None` means the cgroup2 mount point.
    pub cgroup_path: Option<PathBuf>,
    pub bpf_root: PathBuf,
    pub frontends_capacity: u32,
    pub backends_capacity: u32,
    /// `--lb-algorithm` and the Maglev table for external traffic.
    pub lb: LbOptions,
    /// Interfaces and node facts for the tc programs.
    pub tc: TcOptions,
}

/// `--lb-algorithm`, `--bpf-maglev-table-size`, `--bpf-map-maglev`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LbOptions {
    /// Maglev for new external (tc) flows; random otherwise (socket-level LB always is).
    pub maglev: bool,
    /// Slots of each external frontend's Maglev table: a prime (see `maglev`).
    pub maglev_table_size: u32,
    /// Capacity of `KPR_MAGLEV` in blocks of `MAGLEV_BLOCK_SLOTS` slots.
    pub maglev_capacity: u32,
}

impl Default for LbOptions {
    fn default() -> Self {
        LbOptions {
            maglev: false,
            maglev_table_size: maglev::DEFAULT_TABLE_SIZE,
            maglev_capacity: proxy_common::default_sizes::MAGLEV,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "this proxy-agent was built with PROXY_EBPF_PLACEHOLDER=1 for checking only and has no \
         eBPF object; build it with `cargo xtask build-ebpf` and `cargo build -p proxy-agent`"
    )]
    Placeholder,
    #[error(transparent)]
    Bpffs(#[from] bpffs::BpffsError),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("--cgroup-path {path}: cannot open: {source}")]
    OpenCgroup { path: PathBuf, source: io::Error },
    #[error("{path}: cannot prepare pin directory: {source}")]
    PinDir { path: PathBuf, source: io::Error },
    #[error("loading the eBPF object failed: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("eBPF object has no map {0}")]
    MissingMap(&'static str),
    #[error("eBPF object has no program {0}")]
    MissingProgram(&'static str),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("program {name}: link: {source}")]
    Link {
        name: &'static str,
        source: aya::programs::links::LinkError,
    },
    #[error("program {name}: pinning its link: {source}")]
    Pin {
        name: &'static str,
        source: aya::pin::PinError,
    },
    #[error("reading the monotonic clock: {0}")]
    Clock(nix::Error),
}

fn count_repair(check: &mut DriftCheck, map: &'static str, result: Result<(), MapWriteError>) {
    match result {
        Ok(()) => *check.repair.repaired.entry(map).or_default() += 1,
        Err(error) => check.repair.errors.push((map, error)),
    }
}

/// The service maps as typed handles.
struct ServiceMaps {
    frontends4: HashMap<MapData, Frontend4Key, FrontendValue>,
    frontends6: HashMap<MapData, Frontend6Key, FrontendValue>,
    slots: HashMap<MapData, BackendSlotKey, u32>,
    backends4: HashMap<MapData, u32, Backend4>,
    backends6: HashMap<MapData, u32, Backend6>,
    affinity_match: HashMap<MapData, AffinityMatchKey, u8>,
    revnat4: HashMap<MapData, RevNat4Key, RevNat4>,
    revnat6: HashMap<MapData, RevNat6Key, RevNat6>,
    source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    maglev: HashMap<MapData, MaglevKey, MaglevBlock>,
}

/// The LPM key of a frontend's source range: 32 bits of service id, then the prefix.
fn source_range_key(service_id: u32, range: IpNet) -> Key<SourceRangeKey> {
    let (addr, bits) = match range.trunc() {
        IpNet::V4(net) => ([ip4_to_map(net.network()), 0, 0, 0], net.prefix_len()),
        IpNet::V6(net) => (ip6_to_map(net.network()), net.prefix_len()),
    };
    Key::new(32 + u32::from(bits), SourceRangeKey { service_id, addr })
}

fn source_range_of(key: &Key<SourceRangeKey>, v6: bool) -> Option<(u32, IpNet)> {
    let data = key.data();
    let bits = u8::try_from(key.prefix_len().checked_sub(32)?).ok()?;
    let net = if v6 {
        IpNet::new(IpAddr::V6(ip6_from_map(data.addr)), bits).ok()?
    } else {
        IpNet::new(IpAddr::V4(ip4_from_map(data.addr[0])), bits).ok()?
    };
    Some((data.service_id, net))
}

impl MapOps for ServiceMaps {
    fn put_frontend(
        &mut self,
        key: FrontendMapKey,
        value: FrontendValue,
    ) -> Result<(), MapWriteError> {
        match key {
            FrontendMapKey::V4(key) => self
                .frontends4
                .insert(key, value, 0)
                .map_err(|e| map_error(map_names::FRONTENDS4, e)),
            FrontendMapKey::V6(key) => self
                .frontends6
                .insert(key, value, 0)
                .map_err(|e| map_error(map_names::FRONTENDS6, e)),
        }
    }
    fn delete_frontend(&mut self, key: FrontendMapKey) -> Result<(), MapWriteError> {
        match key {
            FrontendMapKey::V4(key) => {
                ignore_missing(map_names::FRONTENDS4, self.frontends4.remove(&key))
            }
            FrontendMapKey::V6(key) => {
                ignore_missing(map_names::FRONTENDS6, self.frontends6.remove(&key))
            }
        }
    }
    fn put_slot(&mut self, key: BackendSlotKey, backend_id: u32) -> Result<(), MapWriteError> {
        self.slots
            .insert(key, backend_id, 0)
            .map_err(|e| map_error(map_names::BACKEND_SLOTS, e))
    }
    fn delete_slot(&mut self, key: BackendSlotKey) -> Result<(), MapWriteError> {
        ignore_missing(map_names::BACKEND_SLOTS, self.slots.remove(&key))
    }
    fn put_backend(&mut self, id: u32, backend: BackendValue) -> Result<(), MapWriteError> {
        match backend {
            BackendValue::V4(b) => self
                .backends4
                .insert(id, b, 0)
                .map_err(|e| map_error(map_names::BACKENDS4, e)),
            BackendValue::V6(b) => self
                .backends6
                .insert(id, b, 0)
                .map_err(|e| map_error(map_names::BACKENDS6, e)),
        }
    }
    fn delete_backend(&mut self, id: u32, backend: BackendValue) -> Result<(), MapWriteError> {
        match backend {
            BackendValue::V4(_) => ignore_missing(map_names::BACKENDS4, self.backends4.remove(&id)),
            BackendValue::V6(_) => ignore_missing(map_names::BACKENDS6, self.backends6.remove(&id)),
        }
    }
    fn put_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError> {
        self.affinity_match
            .insert(key, 1, 0)
            .map_err(|e| map_error(map_names::AFFINITY_MATCH, e))
    }
    fn delete_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError> {
        ignore_missing(map_names::AFFINITY_MATCH, self.affinity_match.remove(&key))
    }
    fn put_source_range(&mut self, service_id: u32, range: IpNet) -> Result<(), MapWriteError> {
        self.source_ranges
            .insert(&source_range_key(service_id, range), 1, 0)
            .map_err(|e| map_error(map_names::SOURCE_RANGES, e))
    }
    fn delete_source_range(&mut self, service_id: u32, range: IpNet) -> Result<(), MapWriteError> {
        ignore_missing(
            map_names::SOURCE_RANGES,
            self.source_ranges
                .remove(&source_range_key(service_id, range)),
        )
    }
    fn put_maglev(&mut self, key: MaglevKey, block: MaglevBlock) -> Result<(), MapWriteError> {
        self.maglev
            .insert(key, block, 0)
            .map_err(|e| map_error(map_names::MAGLEV, e))
    }
    fn delete_maglev(&mut self, key: MaglevKey) -> Result<(), MapWriteError> {
        ignore_missing(map_names::MAGLEV, self.maglev.remove(&key))
    }
}

impl ServiceMaps {
    /// Everything in the service maps, for [`Programmer::adopt`]. Iteration errors (an entry
    /// deleted under us) skip that entry.
    fn content(&self) -> MapsContent {
        let mut content = MapsContent::default();
        content.frontends.extend(
            self.frontends4
                .iter()
                .flatten()
                .map(|(k, v)| (FrontendMapKey::V4(k), v)),
        );
        content.frontends.extend(
            self.frontends6
                .iter()
                .flatten()
                .map(|(k, v)| (FrontendMapKey::V6(k), v)),
        );
        content.slots.extend(self.slots.iter().flatten());
        content.maglev.extend(self.maglev.iter().flatten());
        content.backends.extend(
            self.backends4
                .iter()
                .flatten()
                .map(|(id, b)| (id, BackendValue::V4(b))),
        );
        content.backends.extend(
            self.backends6
                .iter()
                .flatten()
                .map(|(id, b)| (id, BackendValue::V6(b))),
        );
        content
            .affinity_matches
            .extend(self.affinity_match.keys().flatten());
        // The family is not in the key: a range belongs to a frontend of one family, so the
        // frontend's service id tells which reading is right.
        let v6_services: BTreeSet<u32> = content
            .frontends
            .iter()
            .filter(|(key, _)| matches!(key, FrontendMapKey::V6(_)))
            .map(|(_, value)| value.service_id)
            .collect();
        for key in self.source_ranges.keys().flatten() {
            let v6 = v6_services.contains(&key.data().service_id);
            if let Some(range) = source_range_of(&key, v6) {
                content.source_ranges.insert(range);
            }
        }
        content
    }

    /// Whether our datapath translated `socket` to its destination through `frontend`.
    fn translated_via(&self, socket: &DiagSocket, frontend: SocketAddr) -> bool {
        let destination = socket.destination;
        match (destination.ip(), frontend.ip()) {
            (IpAddr::V4(backend), IpAddr::V4(service)) => {
                let key = RevNat4Key {
                    cookie: socket.cookie,
                    addr: ip4_to_map(backend),
                    port: destination.port().to_be(),
                    _pad: 0,
                };
                self.revnat4.get(&key, 0).is_ok_and(|revnat| {
                    revnat.addr == ip4_to_map(service) && revnat.port == frontend.port().to_be()
                })
            }
            (IpAddr::V6(backend), IpAddr::V6(service)) => {
                let key = RevNat6Key {
                    cookie: socket.cookie,
                    addr: ip6_to_map(backend),
                    port: destination.port().to_be(),
                    _pad: [0; 3],
                };
                self.revnat6.get(&key, 0).is_ok_and(|revnat| {
                    revnat.addr == ip6_to_map(service) && revnat.port == frontend.port().to_be()
                })
            }
            _ => false,
        }
    }
}

/// A hash map refuses a new key with E2BIG when it holds `max_entries` already.
fn map_error(map: &'static str, error: aya::maps::MapError) -> MapWriteError {
    match &error {
        aya::maps::MapError::SyscallError(syscall)
            if syscall.io_error.raw_os_error() == Some(libc::E2BIG) =>
        {
            MapWriteError::Full(map)
        }
        _ => MapWriteError::Other(format!("map {map}: {error}")),
    }
}

fn ignore_missing(
    map: &'static str,
    result: Result<(), aya::maps::MapError>,
) -> Result<(), MapWriteError> {
    match result {
        Err(aya::maps::MapError::KeyNotFound) | Ok(()) => Ok(()),
        Err(error) => Err(map_error(map, error)),
    }
}

/// A loaded and attached eBPF dataplane. Dropping it (or [`EbpfDataplane::shutdown`]) leaves
/// the datapath in place: links and maps stay pinned. [`cleanup`] removes them.
pub struct EbpfDataplane {
    maps: ServiceMaps,
    stats: PerCpuArray<MapData, u64>,
    programmer: Programmer,
    /// Frontend writes refused because a map was full, since start (a counter for metrics).
    capacity_errors: u64,
    pin_dir: PathBuf,
    cgroup_path: PathBuf,
    links: Vec<PinnedLink>,
    tc: TcState,
    log_drain: Option<JoinHandle<()>>,
    // Last: the object (programs, log map); the tc programs attach to new interfaces later.
    ebpf: Ebpf,
}

impl std::fmt::Debug for EbpfDataplane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EbpfDataplane")
            .field("pin_dir", &self.pin_dir)
            .field("cgroup_path", &self.cgroup_path)
            .finish_non_exhaustive()
    }
}

impl EbpfDataplane {
    /// Loads the programs, re-adopts or creates the pinned maps, and attaches to the cgroup
    /// (replacing the links of a previous run without a gap). Must run inside a tokio runtime
    /// (the eBPF log drain is a task).
    pub fn start(options: &EbpfOptions) -> Result<Self, LoadError> {
        if object::IS_PLACEHOLDER {
            return Err(LoadError::Placeholder);
        }
        let cgroup_path = match &options.cgroup_path {
            Some(path) => path.clone(),
            None => cgroup::cgroup2_mount()?,
        };
        let cgroup_dir = File::open(&cgroup_path).map_err(|source| LoadError::OpenCgroup {
            path: cgroup_path.clone(),
            source,
        })?;

        bpffs::ensure_mounted(&options.bpf_root)?;
        let pin_dir = options.bpf_root.join(PIN_DIR_NAME);
        // Random choice never uses the Maglev map; its bucket array (16 bytes per entry of
        // capacity, allocated up front even without preallocation) would be wasted.
        let maglev_capacity = if options.lb.maglev {
            options.lb.maglev_capacity
        } else {
            1
        };
        prepare_pin_dir(&pin_dir, maglev_capacity)?;
        let adopting = map_names::PINNED
            .iter()
            .any(|name| pin_dir.join(name).exists());

        let slots_capacity = options.backends_capacity;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&pin_dir)
            .map_max_entries(map_names::FRONTENDS4, options.frontends_capacity)
            .map_max_entries(map_names::FRONTENDS6, options.frontends_capacity)
            .map_max_entries(map_names::BACKEND_SLOTS, slots_capacity)
            .map_max_entries(map_names::AFFINITY_MATCH, slots_capacity)
            .map_max_entries(map_names::BACKENDS4, options.backends_capacity)
            .map_max_entries(map_names::BACKENDS6, options.backends_capacity)
            .map_max_entries(map_names::SOURCE_RANGES, options.frontends_capacity)
            .map_max_entries(map_names::MAGLEV, maglev_capacity)
            .load(object::OBJECT)?;
        let log_drain = start_log_drain(&mut ebpf);

        let mut maps = ServiceMaps {
            frontends4: take_map(&mut ebpf, map_names::FRONTENDS4)?,
            frontends6: take_map(&mut ebpf, map_names::FRONTENDS6)?,
            slots: take_map(&mut ebpf, map_names::BACKEND_SLOTS)?,
            backends4: take_map(&mut ebpf, map_names::BACKENDS4)?,
            backends6: take_map(&mut ebpf, map_names::BACKENDS6)?,
            affinity_match: take_map(&mut ebpf, map_names::AFFINITY_MATCH)?,
            revnat4: take_map(&mut ebpf, map_names::REVNAT4)?,
            revnat6: take_map(&mut ebpf, map_names::REVNAT6)?,
            source_ranges: take_map(&mut ebpf, map_names::SOURCE_RANGES)?,
            maglev: take_map(&mut ebpf, map_names::MAGLEV)?,
        };
        let stats = take_map(&mut ebpf, map_names::STATS)?;
        // The affinity map is only used by the datapath; it stays in `ebpf` (taking and
        // dropping it would close its fd before the programs that reference it are loaded).
        for name in [map_names::AFFINITY, map_names::CT] {
            if ebpf.map(name).is_none() {
                return Err(LoadError::MissingMap(name));
            }
        }
        let mut tc = TcState::new(
            options.tc.clone(),
            take_map(&mut ebpf, map_names::NODE_ADDRS)?,
            take_map(&mut ebpf, map_names::NODE_CONFIG)?,
        );

        let mut programmer = if adopting {
            Programmer::adopt(maps.content(), &mut maps)
        } else {
            Programmer::default()
        };
        programmer.set_maglev_table_size(options.lb.maglev.then_some(options.lb.maglev_table_size));

        let mut links = Vec::with_capacity(program_names::ALL.len());
        for name in program_names::ALL {
            links.push(attach_and_pin(&mut ebpf, name, &cgroup_dir, &pin_dir)?);
        }
        tc.refresh(&mut ebpf, &pin_dir, true);
        info!(
            cgroup = %cgroup_path.display(),
            pins = %pin_dir.display(),
            adopted = adopting,
            tc_links = tc.link_count(),
            "eBPF socket and tc programs attached and pinned"
        );
        Ok(Self {
            maps,
            stats,
            programmer,
            capacity_errors: 0,
            pin_dir,
            cgroup_path,
            links,
            tc,
            log_drain,
            ebpf,
        })
    }

    /// The node settings (NodePort addresses, local-traffic detection, localhost NodePorts) the
    /// tc programs use from now on; written at the next [`EbpfDataplane::apply`].
    pub fn set_node(&mut self, settings: &crate::node::NodeSettings) {
        self.tc.set_node(settings);
    }

    /// Makes the maps match `snapshot` for the service ports in `changed` (`None`: all of them),
    /// writing only entries that differ from what is programmed; then destroys connected UDP
    /// sockets still pinned to backends that were removed.
    pub fn apply(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> (ApplySummary, Vec<ApplyError>) {
        // New interfaces (pods created since the last sync) get their tc program first.
        self.tc.refresh(&mut self.ebpf, &self.pin_dir, false);
        let (mut summary, errors) =
            self.programmer
                .apply_snapshot(snapshot, changed, &mut self.maps);
        self.capacity_errors += errors.iter().filter(|e| e.is_capacity()).count() as u64;
        summary.udp_sockets_destroyed = self.destroy_stale_udp_sockets(&summary);
        summary.conntrack_purged = self.purge_conntrack(&summary);
        (summary, errors)
    }

    /// Compares every entry of the service maps with what the agent wrote (see `drift`) and,
    /// with `repair`, writes back what differs and deletes what the agent never wrote. `None`
    /// while an adopted frontend is known to be damaged (the next full sync rewrites it).
    pub fn check_drift(&mut self, repair: bool) -> Option<DriftCheck> {
        let expected = self.programmer.expected_content()?;
        let found = self.maps.content();
        let mut check = drift::check(&expected, &found, repair, &mut self.maps);
        let node = self.tc.check_drift(repair, &mut check.repair);
        check.drift.extend(node);
        let orphans = self.check_orphans(&expected, repair, &mut check);
        check.drift.extend(orphans);
        Some(check)
    }

    /// Affinity, UDP-socket and conntrack entries of Services or backends that are gone (see
    /// `orphans`); with `repair`, deleted (each re-read first: an entry the datapath rewrote
    /// since the walk is left for the next check).
    fn check_orphans(
        &mut self,
        expected: &MapsContent,
        repair: bool,
        check: &mut DriftCheck,
    ) -> Vec<Drift> {
        let live = orphans::Live::of(expected);
        let mut out = Vec::new();
        for name in [map_names::AFFINITY, map_names::UDP_STICKY] {
            let Some(map) = self.ebpf.map_mut(name) else {
                continue;
            };
            let Ok(mut map) = HashMap::<_, AffinityKey, AffinityValue>::try_from(map) else {
                continue;
            };
            let entries: Vec<(AffinityKey, AffinityValue)> =
                map.iter().filter_map(Result::ok).collect();
            check.entries_compared += entries.len();
            for (key, value) in entries {
                let Some(why) = orphans::pinned_orphan(&live, &key, &value) else {
                    continue;
                };
                out.push(Drift {
                    map: name,
                    kind: DriftKind::Orphan,
                    entry: format!("client {} service {}", key.client, key.service_id),
                    expected: None,
                    found: Some(why),
                });
                if repair && map.get(&key, 0).is_ok_and(|now| now == value) {
                    count_repair(check, name, ignore_missing(name, map.remove(&key)));
                }
            }
        }
        let Ok(mut ct) = self.conntrack_map() else {
            return out;
        };
        let entries = ct::entries(&ct);
        check.entries_compared += entries.len();
        for (key, value) in entries {
            let Some(why) = orphans::ct_orphan(&live, &key, &value) else {
                continue;
            };
            out.push(Drift {
                map: map_names::CT,
                kind: DriftKind::Orphan,
                entry: orphans::describe_ct(&key),
                expected: None,
                found: Some(why),
            });
            if repair {
                count_repair(
                    check,
                    map_names::CT,
                    ignore_missing(map_names::CT, ct.remove(&key)),
                );
            }
        }
        out
    }

    /// Deletes the tc conntrack entries of backends this apply removed (see `ct`), after the
    /// frontend switch: no new flow can pick them any more, so none is recreated.
    fn purge_conntrack(&mut self, summary: &ApplySummary) -> usize {
        if !ct::any_external(&summary.removed_backends) {
            return 0;
        }
        let started = std::time::Instant::now();
        let mut map = match self.conntrack_map() {
            Ok(map) => map,
            Err(error) => {
                warn!(%error, "cannot open the tc conntrack map; stale entries age out instead");
                return 0;
            }
        };
        let report = ct::purge(&mut map, &summary.removed_backends);
        info!(
            removed_backends = summary.removed_backends.len(),
            scanned = report.scanned,
            deleted = report.deleted,
            elapsed_ms = started.elapsed().as_millis(),
            "tc conntrack entries of removed backends purged"
        );
        report.deleted
    }

    /// Garbage collection of the tc conntrack (see `ct::gc`): deletes dead flows' entries,
    /// and counts the run and the entries left in `metrics`. Called every 30 s (`run.rs`).
    pub fn conntrack_gc(
        &mut self,
        metrics: Option<&EbpfMetrics>,
    ) -> Result<ct::GcReport, LoadError> {
        let started = std::time::Instant::now();
        let now = ct::monotonic_ns().map_err(LoadError::Clock)?;
        let mut map = self.conntrack_map()?;
        let report = ct::gc(&mut map, now);
        if let Some(metrics) = metrics {
            metrics.conntrack_gc_run();
            metrics.conntrack_entries(u64::try_from(report.remaining).unwrap_or(u64::MAX));
        }
        if report.deleted_forward + report.deleted_reply > 0 {
            info!(
                scanned = report.scanned,
                deleted_forward = report.deleted_forward,
                deleted_reply = report.deleted_reply,
                remaining = report.remaining,
                elapsed_ms = started.elapsed().as_millis(),
                "tc conntrack garbage collected"
            );
        } else {
            debug!(
                scanned = report.scanned,
                elapsed_ms = started.elapsed().as_millis(),
                "tc conntrack garbage collection: nothing expired"
            );
        }
        Ok(report)
    }

    /// The tc conntrack map, borrowed from the object (it stays there: see `start`).
    fn conntrack_map(&mut self) -> Result<HashMap<&mut MapData, CtKey, CtValue>, LoadError> {
        let map = self
            .ebpf
            .map_mut(map_names::CT)
            .ok_or(LoadError::MissingMap(map_names::CT))?;
        HashMap::try_from(map).map_err(|source| LoadError::Map {
            name: map_names::CT,
            source,
        })
    }

    /// Deletes every tc conntrack entry, so the next packet of any flow is a new flow that
    /// chooses its backend again. For tests (the agent itself only purges removed backends).
    pub fn clear_conntrack(&mut self) -> Result<usize, LoadError> {
        let mut map = self.conntrack_map()?;
        let keys: Vec<CtKey> = map.keys().flatten().collect();
        let mut deleted = 0;
        for key in keys {
            deleted += usize::from(map.remove(&key).is_ok());
        }
        Ok(deleted)
    }

    /// Every tc conntrack entry (a snapshot: the datapath keeps changing it). For tests and
    /// diagnostics.
    pub fn conntrack_entries(&mut self) -> Result<Vec<(CtKey, CtValue)>, LoadError> {
        Ok(ct::entries(&self.conntrack_map()?))
    }

    /// Runs the tc program `program` once on `packet` with `BPF_PROG_TEST_RUN`, as if it had
    /// arrived on interface `ifindex` (0: the namespace's loopback), against the live maps.
    /// For tests: the kernel builds an skb from the bytes, runs the program and returns its
    /// action and the packet as the program left it; a redirect is reported
    /// (`TC_ACT_REDIRECT`), not performed.
    pub fn test_run_tc(
        &mut self,
        program: &'static str,
        packet: &[u8],
        ifindex: u32,
    ) -> Result<TcTestRun, LoadError> {
        self.test_run_tc_timed(program, packet, ifindex, 1)
            .map(|(run, _)| run)
    }

    /// [`Self::test_run_tc`] with the kernel's `repeat`, also returning the mean time of one
    /// run as the kernel measured it (for the benchmarks). The kernel runs the program
    /// `repeat` times on the same skb, so every run after the first sees the packet as the
    /// previous run left it: only a packet the program does not rewrite is measured `repeat`
    /// times as given.
    pub fn test_run_tc_timed(
        &mut self,
        program: &'static str,
        packet: &[u8],
        ifindex: u32,
        repeat: u32,
    ) -> Result<(TcTestRun, std::time::Duration), LoadError> {
        let program_error = |source| LoadError::Program {
            name: program,
            source,
        };
        let classifier: &mut SchedClassifier = self
            .ebpf
            .program_mut(program)
            .ok_or(LoadError::MissingProgram(program))?
            .try_into()
            .map_err(program_error)?;
        if classifier.fd().is_err() {
            classifier.load().map_err(program_error)?;
        }
        // A partial `struct __sk_buff`: the kernel copies what is given and requires the rest
        // zero. `ingress_ifindex` (offset 36) is what the programs read; `ifindex` (offset 40)
        // makes that interface the skb's device, so fib lookups start from it.
        let mut ctx = [0u8; 44];
        ctx[36..40].copy_from_slice(&ifindex.to_ne_bytes());
        ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
        // Room for growth: a reject may turn a short packet into a longer ICMP error.
        let mut out = vec![0u8; packet.len().max(128) + 256];
        let result = classifier
            .test_run(TestRunOptions {
                data_in: Some(packet),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                repeat: repeat.max(1),
                ..TestRunOptions::default()
            })
            .map_err(program_error)?;
        out.truncate(result.data_size_out as usize);
        Ok((
            TcTestRun {
                action: result.return_value as i32,
                packet: out,
            },
            result.duration,
        ))
    }

    /// Frontend writes refused because a map was full, counted since the agent started (each
    /// retry that fails again counts again): a counter for the metrics.
    pub fn capacity_errors(&self) -> u64 {
        self.capacity_errors
    }

    /// Service ports with at least one frontend that does not fit in the maps right now (not
    /// programmed, or still on its previous backend set): a gauge for the metrics and the log.
    pub fn unfit_service_ports(&self) -> BTreeSet<&ServicePortName> {
        self.programmer.unfit().values().collect()
    }

    fn destroy_stale_udp_sockets(&self, summary: &ApplySummary) -> usize {
        let removed: Vec<_> = summary
            .removed_backends
            .iter()
            .filter(|r| r.frontend.protocol == Protocol::Udp)
            .collect();
        if removed.is_empty() {
            return 0;
        }
        let backends: BTreeSet<SocketAddr> = removed.iter().map(|r| r.backend).collect();
        let translated = |socket: &DiagSocket| {
            removed.iter().any(|r| {
                r.backend == socket.destination
                    && self
                        .maps
                        .translated_via(socket, SocketAddr::new(r.frontend.addr, r.frontend.port))
            })
        };
        match sockdiag::destroy_udp_sockets(&self.cgroup_path, &backends, &translated) {
            Ok(report) => {
                info!(
                    removed_backends = backends.len(),
                    namespaces = report.namespaces,
                    candidates = report.candidates,
                    destroyed = report.destroyed,
                    "connected UDP sockets to removed backends destroyed"
                );
                report.destroyed
            }
            Err(error) => {
                warn!(%error, "cannot destroy connected UDP sockets of removed backends");
                0
            }
        }
    }

    /// Datapath counters summed over all CPUs (for logs and metrics).
    /// The agent's record of what is programmed.
    pub fn programmer(&self) -> &Programmer {
        &self.programmer
    }

    pub fn stats(&self) -> Vec<(StatIndex, u64)> {
        read_stats(&self.stats)
    }

    /// Stops managing the datapath and leaves it running: links and maps stay pinned, so
    /// traffic keeps being translated with the last programmed state until the next agent
    /// adopts it (or `--cleanup` removes it).
    pub fn shutdown(self) {
        for (index, value) in read_stats(&self.stats) {
            info!(counter = index.name(), value, "datapath counter");
        }
        if let Some(task) = &self.log_drain {
            task.abort();
        }
        info!(
            cgroup = %self.cgroup_path.display(),
            pins = %self.pin_dir.display(),
            links = self.links.len(),
            "leaving the eBPF datapath in place"
        );
        // Dropping closes our fds only; the pins keep links, programs and maps alive.
    }
}

/// `--cleanup`: removes every link pin (which detaches the programs) and map pin under
/// `<bpf_root>/kubeproxy-rs/`, then the directory. Returns how many pins it removed.
pub fn cleanup(bpf_root: &Path) -> Result<usize, LoadError> {
    let pin_dir = bpf_root.join(PIN_DIR_NAME);
    let to_error = |source| LoadError::PinDir {
        path: pin_dir.clone(),
        source,
    };
    let entries = match std::fs::read_dir(&pin_dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            info!(dir = %pin_dir.display(), "nothing to clean up");
            return Ok(0);
        }
        Err(error) => return Err(to_error(error)),
    };
    let mut pins: Vec<PathBuf> = entries
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(to_error)?;
    // Links first, so no program runs against a map that is going away.
    pins.sort_by_key(|path| !path.to_string_lossy().ends_with(LINK_SUFFIX));
    for pin in &pins {
        std::fs::remove_file(pin).map_err(to_error)?;
        debug!(pin = %pin.display(), "removed");
    }
    std::fs::remove_dir(&pin_dir).map_err(to_error)?;
    info!(dir = %pin_dir.display(), pins = pins.len(), "removed every pin and link");
    Ok(pins.len())
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, LoadError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(LoadError::MissingMap(name))?;
    T::try_from(map).map_err(|source| LoadError::Map { name, source })
}

/// Loads and attaches one program, pins its link under a temporary name and renames that over
/// the previous run's pin, which releases the previous link (and so detaches the old program)
/// only once the new one is attached.
fn attach_and_pin(
    ebpf: &mut Ebpf,
    name: &'static str,
    cgroup: &File,
    pin_dir: &Path,
) -> Result<PinnedLink, LoadError> {
    let program_error = |source| LoadError::Program { name, source };
    let program: &mut CgroupSockAddr = ebpf
        .program_mut(name)
        .ok_or(LoadError::MissingProgram(name))?
        .try_into()
        .map_err(program_error)?;
    program.load().map_err(program_error)?;
    // cgroup links are always multi-attach; other modes give EINVAL with bpf_link_create.
    let link_id = program
        .attach(cgroup, CgroupAttachMode::Single)
        .map_err(program_error)?;
    let link = program.take_link(link_id).map_err(program_error)?;
    let link = FdLink::try_from(link).map_err(|source| LoadError::Link { name, source })?;
    let link = pin_replacing(link, name, &pin_dir.join(format!("{name}{LINK_SUFFIX}")))?;
    debug!(program = name, "attached and pinned");
    Ok(link)
}

/// Pins `link` under a temporary name and renames that over `final_pin`, which releases a
/// previous run's link there (detaching its program) only once the new one is attached.
pub(super) fn pin_replacing(
    link: FdLink,
    name: &'static str,
    final_pin: &Path,
) -> Result<PinnedLink, LoadError> {
    let final_pin = final_pin.to_path_buf();
    let new_pin = final_pin.with_file_name(format!(
        "{}_new",
        final_pin
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    // A crash between pin and rename leaves the temporary pin: remove it first.
    remove_if_present(&new_pin).map_err(|source| LoadError::PinDir {
        path: new_pin.clone(),
        source,
    })?;
    link.pin(&new_pin)
        .map_err(|source| LoadError::Pin { name, source })?;
    // bpffs supports rename over an existing pin; the replaced pin was the old link's last
    // reference (the old agent is gone), so the kernel detaches it now.
    std::fs::rename(&new_pin, &final_pin).map_err(|source| LoadError::PinDir {
        path: final_pin.clone(),
        source,
    })?;
    PinnedLink::from_pin(&final_pin).map_err(|source| LoadError::Link { name, source })
}

pub(super) fn remove_if_present(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
        _ => Ok(()),
    }
}

/// Mode of the pin directory: whoever can open a pin can read or rewrite the service maps or
/// detach the programs, so only root may even list it (the pins themselves are 0600, bpffs'
/// default).
pub const PIN_DIR_MODE: u32 = 0o700;

/// Creates the pin directory (mode [`PIN_DIR_MODE`], also enforced on an existing one). Pins
/// of maps whose layout differs from this build's (an older agent's) are removed: adopting
/// them would misread every entry, so that one start begins from an empty map instead.
///
/// The Maglev map is also replaced when its capacity differs from `maglev_capacity`
/// (`--lb-algorithm` or `--bpf-map-maglev` changed): aya would reuse the pin as it is. Its
/// tables are then rebuilt by the first apply; until then the datapath's fallback for a
/// missing table entry is random choice.
fn prepare_pin_dir(pin_dir: &Path, maglev_capacity: u32) -> Result<(), LoadError> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    let to_error = |source| LoadError::PinDir {
        path: pin_dir.to_owned(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(PIN_DIR_MODE)
        .create(pin_dir)
        .map_err(to_error)?;
    // The umask may have narrowed the mode further (harmless), and a directory made by an
    // older agent or by hand may be wider: set it exactly.
    std::fs::set_permissions(pin_dir, std::fs::Permissions::from_mode(PIN_DIR_MODE))
        .map_err(to_error)?;
    for (name, key_size, value_size) in expected_layouts() {
        let pin = pin_dir.join(name);
        if !pin.exists() {
            continue;
        }
        let compatible = MapInfo::from_pin(&pin)
            .is_ok_and(|info| info.key_size() == key_size && info.value_size() == value_size);
        if !compatible {
            warn!(pin = %pin.display(), "pinned map has another layout; starting it empty");
            remove_if_present(&pin).map_err(to_error)?;
        }
    }
    let pin = pin_dir.join(map_names::MAGLEV);
    if pin.exists()
        && !MapInfo::from_pin(&pin).is_ok_and(|info| info.max_entries() == maglev_capacity)
    {
        info!(pin = %pin.display(), capacity = maglev_capacity, "Maglev map resized; its tables are rebuilt");
        remove_if_present(&pin).map_err(to_error)?;
    }
    Ok(())
}

/// (map, key size, value size) as this build declares them.
fn expected_layouts() -> [(&'static str, u32, u32); 15] {
    fn size<T>() -> u32 {
        std::mem::size_of::<T>() as u32
    }
    [
        (
            map_names::FRONTENDS4,
            size::<Frontend4Key>(),
            size::<FrontendValue>(),
        ),
        (
            map_names::FRONTENDS6,
            size::<Frontend6Key>(),
            size::<FrontendValue>(),
        ),
        (
            map_names::BACKEND_SLOTS,
            size::<BackendSlotKey>(),
            size::<u32>(),
        ),
        (map_names::BACKENDS4, size::<u32>(), size::<Backend4>()),
        (map_names::BACKENDS6, size::<u32>(), size::<Backend6>()),
        (map_names::REVNAT4, size::<RevNat4Key>(), size::<RevNat4>()),
        (map_names::REVNAT6, size::<RevNat6Key>(), size::<RevNat6>()),
        (
            map_names::AFFINITY,
            size::<AffinityKey>(),
            size::<AffinityValue>(),
        ),
        (
            map_names::AFFINITY_MATCH,
            size::<AffinityMatchKey>(),
            size::<u8>(),
        ),
        (map_names::STATS, size::<u32>(), size::<u64>()),
        (map_names::CT, size::<CtKey>(), size::<CtValue>()),
        (
            map_names::SOURCE_RANGES,
            size::<u32>() + size::<SourceRangeKey>(),
            size::<u8>(),
        ),
        (map_names::NODE_ADDRS, size::<NodeAddrKey>(), size::<u8>()),
        (map_names::NODE_CONFIG, size::<u32>(), size::<NodeConfig>()),
        (
            map_names::MAGLEV,
            size::<MaglevKey>(),
            size::<MaglevBlock>(),
        ),
    ]
}

/// Forwards aya-log records from the eBPF programs into `tracing` (through the `log` bridge).
fn start_log_drain(ebpf: &mut Ebpf) -> Option<JoinHandle<()>> {
    let logger = match EbpfLogger::init(ebpf) {
        Ok(logger) => logger,
        Err(error) => {
            warn!(%error, "eBPF log forwarding unavailable");
            return None;
        }
    };
    // SAFETY: the logger owns its ring buffer fd and keeps returning that same open fd until it
    // is dropped, which only happens together with the AsyncFd.
    let registered =
        unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) };
    let mut logger = match registered {
        Ok(logger) => logger,
        Err(error) => {
            warn!(%error, "eBPF log forwarding unavailable");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        loop {
            let Ok(mut guard) = logger.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    }))
}
