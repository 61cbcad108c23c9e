//! [`EbpfDataplane`]: loads and attaches the programs, adopts or creates the pinned maps,
//! applies snapshots through the map writer, and drives our tc conntrack (purge, GC) and the
//! socket destroy of stale UDP sockets.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    net::SocketAddr,
    path::PathBuf,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, Map, MapData, PerCpuArray},
    programs::links::PinnedLink,
};
use aya_log::EbpfLogger;
use proxy_common::{
    AffinityKey, AffinityValue, CtKey, CtValue, PortFilter, ServiceName, StatIndex, map_names,
    program_names,
};
use tokio::{io::unix::AsyncFd, task::JoinHandle};
use tracing::{debug, info, warn};

use crate::{
    ApplyError, ApplySummary, DriftCheck, DriftNotChecked, MapWriteError, MapWriter,
    RemovedBackend, RepairReport,
    attach::layout::{self, Plan},
    attach::object,
    attach::pins::{PIN_DIR_NAME, attach_and_pin, links_pinned, prepare_pin_dir},
    attach::reuse::{self, LoadStamp},
    attach::tc::TcOptions,
    attach::tc::TcState,
    attach::tc_programs,
    attach::xdp::XdpState,
    conntrack::ct_maps::ConntrackMaps,
    conntrack::ct_worker::CtWorker,
    conntrack::kernel_nat,
    conntrack::reserved_ports,
    conntrack::tc_conntrack::{self, ConntrackPair, monotonic_ns},
    drift,
    drift::reader::{self, DriftFound, DriftJob, DriftReader, DriftStart, DriftStep, OrphanEntry},
    error::EbpfError,
    maps::map_sizes::{LruBudget, LruSizes},
    maps::map_writer::{CopyStep, RecordCopying},
    maps::port_filter::PortFilterMap,
    maps::service_maps::{BackendArrays, ServiceMaps, ignore_missing},
    maps::touched_keys::Touched,
    options::EbpfOptions,
    stats::read_stats,
};
use proxy_kernel::bpf::{
    bpffs, cgroup,
    features::{Feature, KernelFeatures},
    map_batch::{BatchReader, read_all, update_all},
    sockdiag::{self, DiagSocket},
};
use proxy_model::desired::{FrontendKey, IpFamily, Protocol, ServicePortName, Snapshot};
use proxy_model::traffic::FrontendKind;

fn count_repair(check: &mut DriftCheck, map: &'static str, result: Result<(), MapWriteError>) {
    match result {
        Ok(()) => *check.repair.repaired.entry(map).or_default() += 1,
        Err(error) => check.repair.errors.push((map, error)),
    }
}

/// The longest ICMP rate-limit interval the datapath takes (a day): its bucket of 6 intervals
/// must fit in 64 bits of nanoseconds.
const MAX_ICMP_RATELIMIT_NS: u64 = 86_400 * 1_000_000_000;

/// The kernel's ICMP rate limit sysctl at `path` (ms) in ns; its default (1 s) when unreadable.
fn icmp_ratelimit_ns(path: &str) -> u64 {
    let ms = std::fs::read_to_string(path)
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok())
        .unwrap_or(1000);
    ms.saturating_mul(1_000_000).min(MAX_ICMP_RATELIMIT_NS)
}

/// What the tc conntrack GC finished since the last request: rounds, and the entries the last
/// one left (`kubeproxy_ebpf_conntrack_gc_runs_total`, `kubeproxy_ebpf_conntrack_entries`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcProgress {
    pub rounds: u64,
    pub remaining: Option<usize>,
}

/// How long one step of a full pass in steps ([`EbpfDataplane::full_pass_step`]) goes on
/// applying service ports: about what a change that comes meanwhile waits for the loop. A
/// pass over 50k Services in one go holds the loop for tens of milliseconds.
pub const FULL_PASS_STEP: std::time::Duration = std::time::Duration::from_millis(1);

/// Frontends one step of the drift check's record copy takes ([`EbpfDataplane::drift_check_step`]):
/// the whole copy took 8–26 ms of the loop at 50k Services (a frontend each, with its ids and
/// ranges), so a step is well under a millisecond and a change waits for one at most.
pub const DRIFT_COPY_STEP: usize = 2048;

/// Service ports a step applies between two looks at the clock.
const FULL_PASS_CHUNK: usize = 32;

/// How long after a failed load of the IPv6 family programs the next sync tries again.
const IPV6_LOAD_RETRY: std::time::Duration = std::time::Duration::from_secs(30);

/// A full pass over every service port (the periodic resync) applied in steps by
/// [`EbpfDataplane::full_pass_step`], so that the agent's loop takes the changes that come
/// meanwhile between them; what the steps did is summed.
#[derive(Debug, Default)]
pub struct FullPass {
    /// The last service port (in name order) a step applied.
    after: Option<ServicePortName>,
    /// Applied with the first step: the changes of the sync that started the pass.
    first: Option<BTreeSet<ServicePortName>>,
    steps: usize,
    summary: ApplySummary,
    errors: Vec<ApplyError>,
    /// The steps' own time, summed (not the loop's between them).
    pub work: std::time::Duration,
}

impl FullPass {
    /// A pass whose first step also applies `changed`.
    pub fn new(changed: &BTreeSet<ServicePortName>) -> Self {
        Self {
            first: (!changed.is_empty()).then(|| changed.clone()),
            ..Self::default()
        }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> usize {
        self.steps
    }
}

/// A loaded and attached eBPF dataplane. Dropping it (or [`EbpfDataplane::shutdown`]) leaves
/// the datapath in place: links and maps stay pinned. [`cleanup`] removes them.
pub struct EbpfDataplane {
    pub(super) maps: ServiceMaps,
    /// `KPR_SERVICE_NAMES`: service id → `namespace/name:port`, for `inspect`.
    pub(super) names: HashMap<MapData, u32, ServiceName>,
    /// Every name in `names` was checked once (see [`EbpfDataplane::write_service_names`]).
    names_reconciled: bool,
    /// A restart on pinned maps: if the first sync is a full one that changes no frontend, the
    /// names stay as the previous agent wrote them beside the adopted frontends, and the first
    /// periodic pass checks them (see [`EbpfDataplane::apply`]).
    names_deferred: bool,
    /// The names a full sync left to [`EbpfDataplane::write_pending_names`], written a step
    /// at a time.
    names_pass: Option<NamesPass>,
    /// Whether a full sync before the names were ever checked leaves them to
    /// [`EbpfDataplane::write_pending_names`] ([`EbpfDataplane::write_names_later`]).
    names_later: bool,
    pub(super) stats: PerCpuArray<MapData, u64>,
    pub(super) map_writer: MapWriter,
    /// The map writer's limits, for a writer made anew (see `apply_service_maps`).
    writer_settings: WriterSettings,
    /// A first fill's batches were refused once: later fills (a writer that nothing fitted
    /// stays empty) go entry by entry from the start.
    fill_unbatched: bool,
    /// Frontend writes refused because a map was full, since start (a counter for metrics).
    pub(super) capacity_errors: u64,
    /// `max_entries` of the maps the map_writer fills, by pinned name.
    pub(super) capacities: BTreeMap<&'static str, u32>,
    pub(super) pin_dir: PathBuf,
    pub(super) cgroup_path: PathBuf,
    pub(super) links: Vec<PinnedLink>,
    pub(super) tc: TcState,
    pub(super) features: KernelFeatures,
    /// GC and purges of the tc conntrack off the sync loop; `None` if it could not start (both
    /// then run inline).
    pub(super) ct_worker: Option<CtWorker>,
    /// Worker GC rounds already counted in the metrics.
    pub(super) gc_rounds_reported: u64,
    pub(super) log_drain: Option<JoinHandle<()>>,
    /// Bumps the route generation on every route, rule, neighbour and link change; `None` if
    /// it could not start (logged).
    #[expect(dead_code, reason = "held for its drop, which stops the watch")]
    pub(super) route_watch: Option<proxy_kernel::node::RouteWatch>,
    /// Every map read of the drift check goes entry by entry (the benchmark's baseline).
    pub(super) entry_by_entry_reads: bool,
    /// Drift checks started since start: each check's number, which its record of written keys
    /// carries (see `drift_reader`).
    pub(super) drift_jobs: u64,
    /// Programs not attached yet: `start` found a service map it had to rebuild, so the first
    /// full apply fills it before the programs replace the previous agent's.
    pub(super) deferred: Option<DeferredAttach>,
    /// When loading the IPv6 family programs last failed, and why (see `load_ipv6_programs`).
    ipv6_load_failed: Option<(std::time::Instant, String)>,
    // Last: the object (programs, log map); the tc programs attach to new interfaces later.
    pub(super) ebpf: Ebpf,
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
    pub fn start(options: &EbpfOptions) -> Result<Self, EbpfError> {
        if object::IS_PLACEHOLDER {
            return Err(EbpfError::Placeholder);
        }
        let cgroup_path = match &options.cgroup_path {
            Some(path) => path.clone(),
            None => cgroup::cgroup2_mount()?,
        };
        let cgroup_dir = File::open(&cgroup_path).map_err(|source| EbpfError::OpenCgroup {
            path: cgroup_path.clone(),
            source,
        })?;

        let features = KernelFeatures::probe(&options.disabled_features);
        info!(
            features = %features.summary(),
            "kernel features probed (`proxy-agent inspect features` explains each)"
        );
        bpffs::ensure_mounted(&options.bpf_root)?;
        let pin_dir = options.bpf_root.join(PIN_DIR_NAME);
        // Random choice never uses the Maglev map; its bucket array (16 bytes per entry of
        // capacity, allocated up front even without preallocation) would be wasted.
        let maglev_capacity = if options.lb.maglev {
            options.lb.maglev_capacity
        } else {
            1
        };
        let mut plan = prepare_pin_dir(&pin_dir, maglev_capacity, options.conntrack_capacity)?;
        let mut lru = LruSizes::for_this_node(options.lru_budget);
        // Each family's map, as Cilium's `--bpf-ct-global-*-max` sizes each of its.
        if let Some(conntrack) = options.conntrack_capacity {
            lru.conntrack4 = conntrack;
            lru.conntrack6 = conntrack;
        }
        info!(
            conntrack4 = lru.conntrack4,
            conntrack6 = lru.conntrack6,
            revnat4 = lru.revnat4,
            revnat6 = lru.revnat6,
            affinity = lru.affinity,
            udp_sticky = lru.udp_sticky,
            mib = lru.bytes() / (1 << 20),
            sized_from = %match options.lru_budget {
                LruBudget::ConntrackTable(flows) => format!(
                    "conntrack table of {flows} flows (conntrack.maxPerCore × CPUs, at least conntrack.min)"
                ),
                LruBudget::MemoryShare(ratio) => format!(
                    "{} of MemTotal (--bpf-map-dynamic-size-ratio)",
                    ratio.get()
                ),
            },
            "preallocated LRU maps sized (pinned maps keep their size)"
        );
        // A rebuilt service map is filled by the first sync before this agent's programs
        // replace the previous agent's, which keep serving with their own maps meanwhile.
        let defer_attach = plan.rebuilds_service_state() && links_pinned(&pin_dir);
        let adopting = map_names::PINNED
            .iter()
            .any(|name| pin_dir.join(name).exists());

        let slots_capacity = options.backends_capacity;
        let backend_array_len = options.backends_capacity.saturating_add(1);
        let use_set_retval = u8::from(features.uses(Feature::SetRetval));
        let l4_csum_ipv6 = u8::from(features.uses(Feature::L4CsumIpv6));
        let coarse_clock = u8::from(features.uses(Feature::CoarseClock));
        let (icmp4, icmp6) = match options.icmp_ratelimit {
            Some(interval) => {
                let ns = u64::try_from(interval.as_nanos()).unwrap_or(MAX_ICMP_RATELIMIT_NS);
                (ns.min(MAX_ICMP_RATELIMIT_NS), ns.min(MAX_ICMP_RATELIMIT_NS))
            }
            None => (
                icmp_ratelimit_ns("/proc/sys/net/ipv4/icmp_ratelimit"),
                icmp_ratelimit_ns("/proc/sys/net/ipv6/icmp/ratelimit"),
            ),
        };
        let snat_min = u32::from(*options.snat_ports.start());
        let snat_count = u32::from(*options.snat_ports.end()).saturating_sub(snat_min) + 1;
        reserved_ports::reserve(&options.snat_ports);
        // Everything that changes the loaded instructions (the globals, BTF, the map sizes the
        // programs are relocated against) or where the reused links attach: pinned programs
        // loaded with other values are not reused (see `reuse`).
        let load_options = format!(
            "btf={} set_retval={use_set_retval} l4_csum_ipv6={l4_csum_ipv6} \
             coarse_clock={coarse_clock} icmp={icmp4}/{icmp6} \
             snat={snat_min}+{snat_count} frontends={} backends={} maglev={maglev_capacity} \
             lru={lru:?} cgroup={} tcx={} xdp={:?}",
            features.uses(Feature::Btf),
            options.frontends_capacity,
            options.backends_capacity,
            cgroup_path.display(),
            features.uses(Feature::Tcx),
            options.tc.xdp,
        );
        let stamp = reuse::kernel_release()
            .map(|release| LoadStamp::new(object::OBJECT, &release, &load_options));
        let decision = reuse::decide(
            reuse::read(&pin_dir).as_ref(),
            stamp.as_ref(),
            reuse::first_missing_pin(&pin_dir).as_deref(),
            plan.migrates() || !plan.rebuilt.is_empty(),
        );
        let reused = match decision {
            Ok(()) => match reuse::open(&pin_dir) {
                Ok(reused) => Some(reused),
                Err(error) => {
                    warn!(%error, "cannot reuse the pinned eBPF programs; loading them (the kernel verifies them)");
                    None
                }
            },
            Err(reason) => {
                info!(%reason, "loading the eBPF programs (the kernel verifies them)");
                None
            }
        };
        if reused.is_none() {
            // From here the pinned programs are replaced one by one: no stamp vouches for them
            // until `attach_all` has pinned every one of this load.
            reuse::invalidate(&pin_dir);
        }
        // Service ids run from 1 to the frontends' capacity (slot 0 is never counted). Always
        // this size: the counts cost one atomic add per connection, and a pinned array resized
        // would take a stamp-matched restart's programs' map from under them.
        let traffic_capacity = options.frontends_capacity.saturating_add(1);
        let mut loader = EbpfLoader::new();
        if !features.uses(Feature::Btf) {
            loader.btf(None);
        }
        loader
            .override_global("KPR_USE_SET_RETVAL", &use_set_retval, true)
            .override_global("KPR_L4_CSUM_IPV6", &l4_csum_ipv6, true)
            .override_global("KPR_USE_COARSE_CLOCK", &coarse_clock, true)
            .override_global("KPR_ICMP_RATELIMIT_NS4", &icmp4, true)
            .override_global("KPR_ICMP_RATELIMIT_NS6", &icmp6, true)
            .override_global("KPR_SNAT_PORT_MIN", &snat_min, true)
            .override_global("KPR_SNAT_PORT_COUNT", &snat_count, true);
        let mut ebpf = loader
            .default_map_pin_directory(&pin_dir)
            .map_max_entries(map_names::FRONTENDS4, options.frontends_capacity)
            .map_max_entries(map_names::FRONTENDS6, options.frontends_capacity)
            .map_max_entries(map_names::BACKEND_SLOTS, slots_capacity)
            .map_max_entries(map_names::AFFINITY_MATCH, slots_capacity)
            // Arrays indexed by backend id: ids 1..=capacity, index 0 unused.
            .map_max_entries(map_names::BACKENDS4, backend_array_len)
            .map_max_entries(map_names::BACKENDS6, backend_array_len)
            .map_max_entries(map_names::SOURCE_RANGES, options.frontends_capacity)
            .map_max_entries(map_names::MAGLEV, maglev_capacity)
            .map_max_entries(map_names::CT4, lru.conntrack4)
            .map_max_entries(map_names::CT6, lru.conntrack6)
            .map_max_entries(map_names::CT4_NEW, lru.conntrack4_new())
            .map_max_entries(map_names::CT6_NEW, lru.conntrack6_new())
            .map_max_entries(map_names::REVNAT4, lru.revnat4)
            .map_max_entries(map_names::REVNAT6, lru.revnat6)
            .map_max_entries(map_names::AFFINITY, lru.affinity)
            .map_max_entries(map_names::UDP_STICKY, lru.udp_sticky)
            .map_max_entries(map_names::SERVICE_NAMES, options.frontends_capacity)
            .map_max_entries(map_names::SERVICE_TRAFFIC, traffic_capacity)
            .map_max_entries(map_names::SERVICE_PACKETS, traffic_capacity)
            // Pairs of a frontend and an endpoint; as many as frontends: its bucket array is
            // what it costs while unused (16 bytes a slot), and the frontends' is the smaller.
            .map_max_entries(map_names::ENDPOINT_TRAFFIC, options.frontends_capacity)
            .load(object::OBJECT)?;
        let log_drain = match &reused {
            // The reused programs log into the ring buffer of the load that verified them,
            // which `aya-log` finds among a program's maps (one that never logs has none).
            Some(reused) => start_log_drain(
                reused
                    .programs
                    .ids
                    .values()
                    .map(|id| EbpfLogger::init_from_id(*id))
                    .find(Result::is_ok)
                    .unwrap_or(Err(aya_log::Error::ProgramNotFound)),
                |logger| logger.flush(),
            ),
            None => start_log_drain(EbpfLogger::init(&mut ebpf), |logger| logger.flush()),
        };
        layout::write_records(&pin_dir);
        plan.copy(&pin_dir, false);

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
            traffic: take_map(&mut ebpf, map_names::SERVICE_TRAFFIC)?,
            packets: take_map(&mut ebpf, map_names::SERVICE_PACKETS)?,
            endpoints: take_map(&mut ebpf, map_names::ENDPOINT_TRAFFIC)?,
            port_filter: Some(
                PortFilterMap::open(
                    ebpf.take_map(map_names::PORT_FILTER)
                        .ok_or(EbpfError::MissingMap(map_names::PORT_FILTER))?,
                )
                .map_err(EbpfError::PortFilter)?,
            ),
            touched: None,
            endpoint_keys: None,
            // Nothing was pinned: the counters were created empty with the maps.
            uncounted_from: (!adopting).then_some(1),
            staged: None,
        };
        let stats = take_map(&mut ebpf, map_names::STATS)?;
        let names = take_map(&mut ebpf, map_names::SERVICE_NAMES)?;
        // The affinity map is only used by the datapath; it stays in `ebpf` (taking and
        // dropping it would close its fd before the programs that reference it are loaded).
        for name in [
            map_names::AFFINITY,
            map_names::CT4,
            map_names::CT6,
            map_names::CT4_NEW,
            map_names::CT6_NEW,
        ] {
            if ebpf.map(name).is_none() {
                return Err(EbpfError::MissingMap(name));
            }
        }
        let mut tc = TcState::new(
            TcOptions {
                tcx: features.uses(Feature::Tcx),
                ..options.tc.clone()
            },
            take_map(&mut ebpf, map_names::NODE_ADDRS)?,
            take_map(&mut ebpf, map_names::NODE_CONFIG)?,
            take_map(&mut ebpf, map_names::SNAT_IFACES)?,
            XdpState::new(options.tc.xdp, &mut ebpf),
        );

        let writer_settings = {
            use crate::maps::map_writer::shares::{Entries, SharedMap};
            WriterSettings {
                maglev_table_size: options.lb.maglev.then_some(options.lb.maglev_table_size),
                capacity: Entries::default()
                    .with(SharedMap::Frontends, options.frontends_capacity.into())
                    .with(SharedMap::Slots, slots_capacity.into())
                    .with(SharedMap::Maglev, maglev_capacity.into())
                    .with(SharedMap::SourceRanges, options.frontends_capacity.into()),
                max_frontends_per_service: options.max_frontends_per_service,
                max_endpoints_per_service: options.max_endpoints_per_service,
                // An adopted pin keeps the length it was created with, whatever
                // `--bpf-map-backends` says now, and aya checks indices against the configured
                // one: ids stay below both.
                backend_id_limit: array_len(&maps.backends4)
                    .min(array_len(&maps.backends6))
                    .min(backend_array_len),
            }
        };
        let mut map_writer = if adopting {
            MapWriter::adopt(
                maps.content(&mut BatchReader::default(), BackendArrays::NamedBySlots),
                &mut maps,
            )
        } else {
            MapWriter::default()
        };
        writer_settings.configure(&mut map_writer);

        // Before the tc programs attach (and before the first sync gives them frontends): from
        // then on a UDP/SCTP packet without an entry would be a new flow of theirs.
        adopt_kernel_nat_flows(&mut ebpf);
        // The IPv6 family programs are about as much verifier work as the IPv4 ones: loaded at
        // the first IPv6 Service (`apply`), unless the node has IPv6 state already. A restart
        // that reuses the pinned programs finds in their slots whether a previous agent
        // loaded them; a load keeps them when the previous agent's maps hold IPv6 frontends
        // or flows, which its programs serve until this agent's replace them.
        let ipv6 = match &reused {
            Some(_) => tc_programs::ipv6_in_slots(&ebpf).unwrap_or(false),
            None => holds_ipv6_state(&maps, &mut ebpf),
        };
        tc.set_ipv6(ipv6);
        let (links, deferred) = if let Some(reused) = reused {
            info!(
                programs = ?reused.programs.ids,
                object = %stamp.as_ref().map(LoadStamp::object_short).unwrap_or_default(),
                "reused the pinned eBPF programs and their links: nothing loaded, no verifier"
            );
            tc.reuse_pinned(reused.programs);
            tc.refresh(&mut ebpf, &pin_dir, true);
            (reused.links, None)
        } else if defer_attach {
            info!(
                rebuilt = ?plan.rebuilt,
                "the previous agent's programs keep serving until the first sync has filled \
                 the rebuilt maps; this agent's are attached then"
            );
            (
                Vec::new(),
                Some(DeferredAttach {
                    cgroup_dir,
                    plan,
                    stamp,
                }),
            )
        } else {
            let links = attach_all(&mut ebpf, &mut tc, &cgroup_dir, &pin_dir, stamp.as_ref())?;
            plan.copy(&pin_dir, true);
            (links, None)
        };
        let ct_worker = match CtWorker::start(&pin_dir) {
            Ok(worker) => Some(worker),
            Err(error) => {
                warn!(%error, "cannot start the conntrack worker; GC and purges run in the sync loop");
                None
            }
        };
        let route_watch = crate::route_generation::watch(&pin_dir);
        info!(
            cgroup = %cgroup_path.display(),
            pins = %pin_dir.display(),
            adopted = adopting,
            tc_links = tc.link_count(),
            attached = deferred.is_none(),
            ipv6_programs = tc.ipv6(),
            "eBPF socket and tc programs loaded, maps pinned"
        );
        let capacities = BTreeMap::from([
            (map_names::FRONTENDS4, options.frontends_capacity),
            (map_names::FRONTENDS6, options.frontends_capacity),
            (map_names::BACKENDS4, options.backends_capacity),
            (map_names::BACKENDS6, options.backends_capacity),
            (map_names::BACKEND_SLOTS, slots_capacity),
            (map_names::SOURCE_RANGES, options.frontends_capacity),
            (map_names::MAGLEV, maglev_capacity),
        ]);
        Ok(Self {
            maps,
            names,
            stats,
            names_reconciled: false,
            names_deferred: adopting,
            names_pass: None,
            names_later: false,
            map_writer,
            writer_settings,
            fill_unbatched: false,
            capacity_errors: 0,
            capacities,
            pin_dir,
            cgroup_path,
            links,
            tc,
            features,
            ct_worker,
            gc_rounds_reported: 0,
            log_drain,
            route_watch,
            entry_by_entry_reads: false,
            drift_jobs: 0,
            deferred,
            ipv6_load_failed: None,
            ebpf,
        })
    }

    /// Attaches the programs whose attach `start` deferred, then finishes the migration of
    /// older layouts (the previous programs no longer write the old maps). On failure the
    /// previous programs keep serving and the next apply tries again.
    fn attach_deferred(&mut self) {
        let Some(mut deferred) = self.deferred.take() else {
            return;
        };
        match attach_all(
            &mut self.ebpf,
            &mut self.tc,
            &deferred.cgroup_dir,
            &self.pin_dir,
            deferred.stamp.as_ref(),
        ) {
            Ok(links) => {
                self.links = links;
                deferred.plan.copy(&self.pin_dir, true);
                info!(
                    tc_links = self.tc.link_count(),
                    "eBPF socket and tc programs attached after the first sync"
                );
            }
            Err(error) => {
                warn!(%error, "cannot attach the eBPF programs; the previous agent's keep serving, retried at the next sync");
                self.deferred = Some(deferred);
            }
        }
    }

    /// The kernel's NATed flows into `KPR_CT` (see [`kernel_nat`]), the last time: the start
    /// does it before the tc programs attach, [`EbpfDataplane::adopt_kernel_nat_flows_before_frontends`]
    /// before the first sync, and this once the first sync has given the programs their
    /// frontends, so the other mode's rules start no flow any more. `flows`: what
    /// [`read_kernel_nat_flows`] found, read off the agent's loop after that sync.
    pub fn adopt_kernel_nat_flows(&mut self, flows: &KernelNatFlows) {
        match conntrack_maps(&mut self.ebpf) {
            Ok(mut ct) => {
                kernel_nat::write(&mut ct, &flows.0);
            }
            Err(error) => {
                warn!(%error, "tc conntrack: UDP/SCTP flows the kernel's conntrack NATs are not adopted")
            }
        }
        self.tc.kernel_flows_adopted();
    }

    /// The kernel's NATed flows into `KPR_CT` just before the first sync writes the frontends.
    /// Until then the other mode's rules start every new flow (the programs pass what no
    /// frontend claims), so the flows they started while the programs loaded — seconds of them
    /// — are all known before any new flow of the programs' own can take one of their tuples
    /// (see [`kernel_nat`]). What the rules start during this adoption and the sync is adopted
    /// after it.
    pub fn adopt_kernel_nat_flows_before_frontends(&mut self) {
        adopt_kernel_nat_flows(&mut self.ebpf);
    }

    /// Whether the tc programs and XDP count each Service's packets and bytes
    /// (`KPR_SERVICE_PACKETS`); from [`TcOptions::packet_counts_off`] at start. Takes effect at
    /// once.
    pub fn set_packet_counts(&mut self, on: bool) {
        self.tc.set_packet_counts(on);
    }

    /// The node settings (NodePort addresses, local-traffic detection, localhost NodePorts) the
    /// tc programs use from now on; written at the next [`EbpfDataplane::apply`].
    pub fn set_node(&mut self, settings: &proxy_kernel::node::NodeSettings) {
        self.tc.set_node(settings);
    }

    /// Switches translated external traffic between the fast path and the netfilter path at
    /// once: the node config's `FAST_PATH` flag, which the programs read per packet, and XDP
    /// (attached with `--bpf-xdp auto` only on the fast path) are rewritten now, not at the
    /// next sync, since a forwarding policy that just appeared must apply to the next packet.
    /// While the attach waits for the first full sync, that attach takes the new path.
    /// Flows established before keep their conntrack entries and continue on the new path.
    pub fn set_fast_path(&mut self, on: bool) {
        if self.tc.set_fast_path(on) && self.deferred.is_none() {
            self.tc.refresh(&mut self.ebpf, &self.pin_dir, false);
        }
    }

    /// Whether translated external traffic takes the fast path now.
    pub fn fast_path(&self) -> bool {
        self.tc.fast_path()
    }

    /// Makes the maps match `snapshot` for the service ports in `changed` (`None`: all of them),
    /// writing only entries that differ from what is programmed; then destroys connected UDP
    /// sockets still pinned to backends that were removed.
    pub fn apply(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> (ApplySummary, Vec<ApplyError>) {
        let ipv6_error = self.load_ipv6_programs(snapshot);
        // New interfaces (pods created since the last sync) get their tc program first.
        if self.deferred.is_none() {
            self.tc.refresh(&mut self.ebpf, &self.pin_dir, false);
        }
        let (summary, mut errors) = self.apply_service_maps(snapshot, changed);
        errors.extend(ipv6_error);
        if changed.is_none() {
            self.attach_deferred();
        }
        let summary = self.after_service_maps(summary, &errors);
        // A full pass that wrote nothing changed no service id: the names were checked by an
        // earlier one. Checking them is a lookup per id and a walk of the map (200k syscalls
        // at 50k Services, most of a periodic resync, which holds up the changes behind it).
        // After a restart, a first full sync that changed nothing found every frontend where
        // the previous agent left it, with the name it wrote beside it: reading every name
        // back (a third of that sync at 50k Services) waits for the first periodic pass, not
        // the agent's readiness. The names are only `inspect`'s.
        let names_deferred = std::mem::take(&mut self.names_deferred)
            && changed.is_none()
            && !summary.changed_frontends();
        if names_deferred {
            return (summary, errors);
        }
        if self.names_later && changed.is_none() && !self.names_reconciled {
            // A first fill's names (one 160-byte value per frontend: a fourth of a cold
            // start's first sync at 50k Services) come in a turn of their own right after it
            // (`write_pending_names`), so the datapath is ready without waiting for them.
            self.names_pass.get_or_insert_with(NamesPass::default);
        } else if changed.is_some() || summary.changed_frontends() || !self.names_reconciled {
            self.write_service_names(snapshot, changed);
        }
        (summary, errors)
    }

    /// What follows a write of the service maps: capacity errors counted, connected UDP
    /// sockets of removed backends destroyed, their tc conntrack entries purged (or queued).
    fn after_service_maps(
        &mut self,
        mut summary: ApplySummary,
        errors: &[ApplyError],
    ) -> ApplySummary {
        self.capacity_errors += errors.iter().filter(|e| e.is_capacity()).count() as u64;
        summary.udp_sockets_destroyed = self.destroy_stale_udp_sockets(&summary);
        let tracked =
            tc_conntrack::tracked(&summary.removed_backends, self.tc.host_namespace_only());
        match &self.ct_worker {
            Some(worker) if tc_conntrack::any_external(&tracked) => {
                worker.purge(tracked);
                summary.conntrack_purge_queued = true;
            }
            Some(_) => {}
            None => summary.conntrack_purged = self.purge_conntrack(&tracked),
        }
        summary
    }

    /// One step of a full pass in steps ([`FullPass`]): the next service ports in name order
    /// (with the pass's first step, the changes given to [`FullPass::new`]), applied as a sync
    /// for changes applies them, until [`FULL_PASS_STEP`] has passed. At the end of the
    /// service ports, what only a whole pass does (see [`EbpfDataplane::apply`] with `None`)
    /// and the pass's summed result; `None` until then.
    ///
    /// The changes synced between two steps are applied on their own: a step applies the
    /// snapshot as it is then, so each service port ends up compared once against the current
    /// desired state, as in a pass in one go.
    pub fn full_pass_step(
        &mut self,
        snapshot: &Snapshot,
        pass: &mut FullPass,
    ) -> Option<(ApplySummary, Vec<ApplyError>)> {
        let started = std::time::Instant::now();
        if pass.steps == 0 {
            pass.errors.extend(self.load_ipv6_programs(snapshot));
        }
        if pass.steps == 0 && self.deferred.is_none() {
            self.tc.refresh(&mut self.ebpf, &self.pin_dir, false);
        }
        pass.steps += 1;
        let done = loop {
            let mut names =
                self.map_writer
                    .full_pass_names(snapshot, pass.after.as_ref(), FULL_PASS_CHUNK);
            let last_chunk = names.len() < FULL_PASS_CHUNK;
            if let Some(last) = names.last() {
                pass.after = Some(last.clone());
            }
            let first = pass.first.take();
            if let Some(first) = &first {
                names.extend(first.iter().cloned());
            }
            let (summary, errors) = self.apply_service_maps(snapshot, Some(&names));
            let summary = self.after_service_maps(summary, &errors);
            // As a pass in one go: names only where frontends changed (and a sync's changes).
            if summary.changed_frontends() {
                self.write_service_names(snapshot, Some(&names));
            } else if let Some(first) = &first {
                self.write_service_names(snapshot, Some(first));
            }
            pass.summary.add(summary);
            pass.errors.extend(errors);
            if last_chunk {
                break true;
            }
            if started.elapsed() >= FULL_PASS_STEP {
                break false;
            }
        };
        if done {
            let wrote = pass.summary.changed_frontends();
            let (summary, errors) = self.map_writer.finish_full_pass(&mut self.maps, wrote);
            let summary = self.after_service_maps(summary, &errors);
            pass.summary.add(summary);
            pass.errors.extend(errors);
            self.attach_deferred();
            // The names of ids no frontend holds any more go with a whole pass that changed
            // frontends (a walk of the map), as with a pass in one go.
            if pass.summary.changed_frontends() || !self.names_reconciled {
                self.write_service_names(snapshot, None);
            }
        }
        pass.work += started.elapsed();
        debug!(
            step = pass.steps,
            done,
            elapsed_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
            "full pass step"
        );
        done.then(|| {
            (
                std::mem::take(&mut pass.summary),
                std::mem::take(&mut pass.errors),
            )
        })
    }

    /// From now on a full sync that would write every name (the first) leaves them to
    /// [`EbpfDataplane::write_pending_names`], which the caller runs right after it: the agent,
    /// whose readiness need not wait for them. Without it `apply` writes them itself.
    pub fn write_names_later(&mut self) {
        self.names_later = true;
    }

    /// Whether a full sync left the service names to [`EbpfDataplane::write_pending_names`].
    pub fn names_pending(&self) -> bool {
        self.names_pass.is_some()
    }

    /// One step of writing the names a full sync left (all of them, checked against the map,
    /// then the stale ones removed): what `inspect` and the traffic metrics read, nothing the
    /// datapath does. Steps of [`FULL_PASS_STEP`], as the periodic pass: at 50k Services the
    /// names take about 200 ms, which a change arriving meanwhile would wait for.
    pub fn write_pending_names(&mut self, snapshot: &Snapshot) {
        let Some(mut pass) = self.names_pass.take() else {
            return;
        };
        let started = std::time::Instant::now();
        let names_map = &self.names;
        let in_map = pass.in_map.get_or_insert_with(|| {
            let mut entries = Vec::new();
            read_all(
                names_map,
                &mut BatchReader::default(),
                map_names::SERVICE_NAMES,
                &mut entries,
            );
            entries.into_iter().collect()
        });
        let mut writes = Vec::new();
        let mut text = String::new();
        let done = loop {
            let ports: Vec<ServicePortName> = self
                .map_writer
                .owners_after(pass.after.as_ref())
                .take(FULL_PASS_CHUNK)
                .cloned()
                .collect();
            for name in &ports {
                name_writes(&self.map_writer, snapshot, name, &mut text, |id, value| {
                    pass.live.insert(id);
                    if in_map.get(&id) != Some(&value) {
                        writes.push((id, value));
                    }
                });
            }
            if let Err(error) = update_all(&mut self.names, &writes) {
                debug!(%error, written = writes.len(), "service names not written");
            }
            writes.clear();
            if ports.len() < FULL_PASS_CHUNK {
                break true;
            }
            pass.after = ports.last().cloned();
            if started.elapsed() >= FULL_PASS_STEP {
                break false;
            }
        };
        if !done {
            self.names_pass = Some(pass);
            return;
        }
        for id in in_map.keys().filter(|id| !pass.live.contains(id)) {
            let _ = self.names.remove(id);
        }
        self.names_reconciled = true;
    }

    /// Loads the IPv6 family programs when `snapshot` has the node's first IPv6 service port,
    /// before any of its frontends is written: its traffic through tc is translated from its
    /// first packet. A failed load is retried at a later sync, not before
    /// [`IPV6_LOAD_RETRY`] has passed (each try is the verifier's work again); the IPv6
    /// frontends are written meanwhile (the socket hooks serve them).
    fn load_ipv6_programs(&mut self, snapshot: &Snapshot) -> Option<ApplyError> {
        if self.tc.ipv6() || snapshot.v6.service_ports.is_empty() {
            return None;
        }
        let now = std::time::Instant::now();
        if let Some((failed_at, reason)) = &self.ipv6_load_failed
            && now.duration_since(*failed_at) < IPV6_LOAD_RETRY
        {
            return Some(ApplyError::Ipv6Programs {
                reason: reason.clone(),
            });
        }
        // Before the attach the previous agent's programs serve: the attach writes the slots.
        let write = self.deferred.is_none();
        match self.tc.load_ipv6(&mut self.ebpf, write) {
            Ok(()) => {
                self.ipv6_load_failed = None;
                None
            }
            Err(error) => {
                let reason = error.to_string();
                self.ipv6_load_failed = Some((now, reason.clone()));
                Some(ApplyError::Ipv6Programs { reason })
            }
        }
    }

    /// The service maps' part of [`EbpfDataplane::apply`] alone (no tc links, socket destroys,
    /// conntrack purge or names): what a test racing the map writer against the datapath
    /// drives, as fast as the writer itself goes.
    pub fn apply_service_maps(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> (ApplySummary, Vec<ApplyError>) {
        // A first fill (a cold start, rebuilt maps): none of the writer's entries are in the
        // maps, so every write is a new key, staged and written in large batches.
        if self.fill_unbatched || !self.map_writer.is_empty() {
            return self
                .map_writer
                .apply_snapshot(snapshot, changed, &mut self.maps);
        }
        self.maps.begin_staging();
        let applied = self
            .map_writer
            .apply_snapshot(snapshot, changed, &mut self.maps);
        let Err(error) = self.maps.finish_staging() else {
            return applied;
        };
        // The maps are empty again: the fill is written anew, write by write, which gives
        // each frontend's error to its own frontend.
        warn!(%error, "the first fill's batched map writes failed; writing it entry by entry");
        self.fill_unbatched = true;
        let mut writer = MapWriter::default();
        self.writer_settings.configure(&mut writer);
        self.map_writer = writer;
        self.map_writer
            .apply_snapshot(snapshot, changed, &mut self.maps)
    }

    /// When a generation taken out of use may be deleted (see
    /// [`super::map_writer::GENERATION_GRACE`]): the agent's loop calls
    /// [`EbpfDataplane::retire_generations`] then, sync or no sync.
    pub fn next_retirement(&self) -> Option<std::time::Instant> {
        self.map_writer.next_retirement()
    }

    /// Deletes the generations whose grace has passed. `true`: a sync now has work (a deferred
    /// frontend, or one that did not fit and may now).
    pub fn retire_generations(&mut self) -> bool {
        let retirement = self.map_writer.retire_expired(&mut self.maps);
        if retirement.deleted > 0 {
            debug!(
                deleted = retirement.deleted,
                "retired generations deleted after their grace"
            );
        }
        retirement.sync_needed
    }

    /// `KPR_SERVICE_NAMES` for `inspect`: the names of the service ports in `changed` (all with
    /// `None`, which also deletes the names of service ids no frontend holds). Best effort: a
    /// failed write only costs `inspect` a name (it shows `#<id>`).
    fn write_service_names(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) {
        // A full pass reads the map once and writes what differs in one batch: a lookup and a
        // write per id were a tenth of a cold start's map writes. Each name is formatted once
        // into one buffer: a string per frontend was a third of a restart's first apply.
        let in_map: Option<std::collections::HashMap<u32, ServiceName>> =
            changed.is_none().then(|| {
                let mut entries = Vec::new();
                read_all(
                    &self.names,
                    &mut BatchReader::default(),
                    map_names::SERVICE_NAMES,
                    &mut entries,
                );
                entries.into_iter().collect()
            });
        let ports: Vec<&ServicePortName> = match changed {
            Some(changed) => changed.iter().collect(),
            None => self.map_writer.owners().collect(),
        };
        let mut live = std::collections::HashSet::new();
        let mut writes = Vec::new();
        let mut text = String::new();
        for name in ports {
            name_writes(&self.map_writer, snapshot, name, &mut text, |id, value| {
                live.insert(id);
                let current = match &in_map {
                    Some(in_map) => in_map.get(&id).copied(),
                    None => self.names.get(&id, 0).ok(),
                };
                if current != Some(value) {
                    writes.push((id, value));
                }
            });
        }
        if let Err(error) = update_all(&mut self.names, &writes) {
            debug!(%error, written = writes.len(), "service names not written");
        }
        match in_map {
            Some(in_map) => {
                self.names_reconciled = true;
                // Every name is checked: a pass in steps has nothing left to do.
                self.names_pass = None;
                let stale: Vec<u32> = in_map.into_keys().filter(|id| !live.contains(id)).collect();
                for id in stale {
                    let _ = self.names.remove(&id);
                }
            }
            // Named by this sync: not stale for a pass in steps that read the map before.
            None => {
                if let Some(pass) = &mut self.names_pass {
                    pass.live.extend(live);
                }
            }
        }
    }

    /// Between syncs (the drift check's timer): every wanted tc attachment is checked in its
    /// hook and attached again when another tool detached it, as a sync does (the interfaces
    /// are listed again too). Returns the attachments as left, and those found detached since
    /// the last call (by this check or a sync). Nothing while the attach waits for the first
    /// full sync.
    pub fn check_attachments(&mut self) -> (Vec<crate::Attachment>, Vec<crate::Attachment>) {
        if self.deferred.is_none() {
            self.tc.refresh(&mut self.ebpf, &self.pin_dir, false);
        }
        (self.tc.attachments(), self.tc.take_reattached())
    }

    /// The pinned maps (`map_names::PINNED`) missing from the pin directory. The programs hold
    /// their maps whatever becomes of a pin, so a missing one breaks no traffic: it breaks the
    /// next start's adoption of the datapath (and `inspect`).
    pub fn missing_map_pins(&self) -> Vec<&'static str> {
        map_names::PINNED
            .iter()
            .copied()
            .filter(|name| !self.pin_dir.join(name).exists())
            .collect()
    }

    /// Compares every entry of the service maps with what the agent wrote (see `drift`) and,
    /// with `repair`, writes back what differs and deletes what the agent never wrote.
    /// Reads and compares in this thread; the agent's loop does both on another
    /// ([`Self::start_drift_check`]).
    pub fn check_drift(&mut self, repair: bool) -> Result<DriftCheck, DriftNotChecked> {
        let job = self.start_drift_check().map_err(|error| {
            warn!(%error, "cannot read the maps for the drift check");
            DriftNotChecked::Unreadable
        })?;
        // Nothing is written meanwhile: this thread is the only writer.
        let found = job.run();
        self.finish_drift_check(found, repair)
    }

    /// A drift check for another thread ([`DriftJob::run`]): descriptors of every map it
    /// compares and a copy of the map writer's record, taken in one go. From now until
    /// [`Self::finish_drift_check`] the service maps note the keys the agent writes (a check
    /// started before this one can no longer be finished).
    pub fn start_drift_check(&mut self) -> Result<DriftJob, EbpfError> {
        let mut start = self.begin_drift_check()?;
        loop {
            match self.drift_check_step_of(start, usize::MAX) {
                DriftStep::More(more) => start = more,
                DriftStep::Ready(job) => return Ok(job),
            }
        }
    }

    /// A drift check whose record is copied in steps ([`Self::drift_check_step`], one per
    /// loop turn), so that a change arriving meanwhile waits for one step, not the whole copy.
    /// The service maps note the keys the agent writes from now (before the first step: see
    /// `RecordCopying`) until [`Self::finish_drift_check`].
    pub fn begin_drift_check(&mut self) -> Result<DriftStart, EbpfError> {
        let started = std::time::Instant::now();
        let reader = self.drift_reader()?;
        self.drift_jobs += 1;
        let job = self.drift_jobs;
        self.maps.touched = Some(Touched::new(job));
        Ok(DriftStart {
            job,
            reader,
            copying: RecordCopying::default(),
            work: started.elapsed(),
        })
    }

    /// One step of the record's copy: [`DRIFT_COPY_STEP`] frontends, or the rest once they are
    /// all copied; the job once the copy is complete.
    pub fn drift_check_step(&mut self, start: DriftStart) -> DriftStep {
        self.drift_check_step_of(start, DRIFT_COPY_STEP)
    }

    fn drift_check_step_of(&mut self, mut start: DriftStart, frontends: usize) -> DriftStep {
        let started = std::time::Instant::now();
        let steps = start.copying.steps() + 1;
        let record = match self.map_writer.record_copy_step(start.copying, frontends) {
            CopyStep::More(copying) => {
                start.copying = copying;
                start.work += started.elapsed();
                return DriftStep::More(start);
            }
            CopyStep::Done(copy) => Some(copy),
            CopyStep::Damaged => None,
        };
        let work = start.work + started.elapsed();
        // The part of the check the loop does: what changes that come meanwhile wait for, a
        // step at a time.
        debug!(
            steps,
            work_us = u64::try_from(work.as_micros()).unwrap_or(u64::MAX),
            "drift check reading handed over"
        );
        DriftStep::Ready(DriftJob {
            job: start.job,
            reader: start.reader,
            record,
        })
    }

    /// The check [`Self::start_drift_check`] began will not be finished (its thread did not
    /// start, or failed): the service maps stop noting the keys the agent writes.
    pub fn abandon_drift_check(&mut self) {
        self.maps.touched = None;
    }

    fn drift_reader(&mut self) -> Result<DriftReader, EbpfError> {
        let data = |ebpf: &Ebpf, name: &'static str| -> Option<MapData> {
            let map: &Map = ebpf.map(name)?;
            let data = match map {
                Map::HashMap(data) | Map::LruHashMap(data) => data,
                _ => return None,
            };
            reader::reopen_data(data, name).ok()
        };
        let affinity = data(&self.ebpf, map_names::AFFINITY);
        let udp_sticky = data(&self.ebpf, map_names::UDP_STICKY);
        let conntrack = match (
            data(&self.ebpf, map_names::CT4),
            data(&self.ebpf, map_names::CT6),
        ) {
            (Some(v4), Some(v6)) => Some((v4, v6)),
            _ => None,
        };
        DriftReader::new(
            &self.maps,
            affinity,
            udp_sticky,
            conntrack,
            self.entry_by_entry_reads,
        )
    }

    /// Finishes a check with what its thread found: the entries the agent wrote since it
    /// started are left out (see `drift_reader`), the node maps are compared with what `tc`
    /// last wrote, and with `repair` what differs is fixed. Cheap: the work was the thread's.
    /// A result is finished only under the record its check started (else `Superseded`).
    pub fn finish_drift_check(
        &mut self,
        found: DriftFound,
        repair: bool,
    ) -> Result<DriftCheck, DriftNotChecked> {
        let touched = self
            .maps
            .touched
            .take_if(|touched| touched.job() == found.job)
            .ok_or(DriftNotChecked::Superseded)?;
        let compared = found.compared.ok_or(DriftNotChecked::Damaged)?;
        let (compared, left_out) = compared.without(&touched);
        if left_out > 0 {
            debug!(
                left_out,
                keys = touched.len(),
                "entries written during the drift check left out of it"
            );
        }
        let mut check = DriftCheck {
            drift: Vec::with_capacity(compared.drift.len() + compared.orphans.len()),
            repair: RepairReport::default(),
            entries_compared: compared.entries_compared,
        };
        if repair {
            check.repair = drift::repair(
                compared.drift.iter().map(|keyed| &keyed.fix),
                &mut self.maps,
            );
        }
        check
            .drift
            .extend(compared.drift.into_iter().map(|keyed| keyed.drift));
        let node = self.tc.check_drift(repair, &mut check.repair);
        check.drift.extend(node);
        for orphan in compared.orphans {
            if repair {
                self.delete_orphan(&orphan.entry, &mut check);
            }
            check.drift.push(orphan.drift);
        }
        Ok(check)
    }

    /// With `false`, every map read of the drift check goes entry by entry (`get_next_key` +
    /// lookup, as before `BPF_MAP_LOOKUP_BATCH`): the benchmark measures both in one run.
    pub fn set_batched_reads(&mut self, batched: bool) {
        self.entry_by_entry_reads = !batched;
    }

    /// Deletes an orphan the drift check found (see `orphans`): an affinity or socket entry only
    /// if it still holds what was read (one the datapath rewrote since is left for the next
    /// check).
    fn delete_orphan(&mut self, orphan: &OrphanEntry, check: &mut DriftCheck) {
        match *orphan {
            OrphanEntry::Pinned {
                map: name,
                key,
                value,
            } => {
                let Some(map) = self.ebpf.map_mut(name) else {
                    return;
                };
                let Ok(mut map) = HashMap::<_, AffinityKey, AffinityValue>::try_from(map) else {
                    return;
                };
                if map.get(&key, 0).is_ok_and(|now| now == value) {
                    count_repair(check, name, ignore_missing(name, map.remove(&key)));
                }
            }
            OrphanEntry::Conntrack { key, .. } => {
                let Ok(mut ct) = conntrack_maps(&mut self.ebpf) else {
                    return;
                };
                let name = if key.family == proxy_common::family::V6 {
                    map_names::CT6
                } else {
                    map_names::CT4
                };
                count_repair(check, name, ignore_missing(name, ct.remove(&key)));
            }
        }
    }

    /// Deletes the tc conntrack entries of backends this apply removed (see `ct`), after the
    /// frontend switch: no new flow can pick them any more, so none is recreated.
    fn purge_conntrack(&mut self, removed: &[RemovedBackend]) -> usize {
        if !tc_conntrack::any_external(removed) {
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
        let report = tc_conntrack::purge(&mut map, removed);
        info!(
            removed_backends = removed.len(),
            scanned = report.scanned,
            deleted = report.deleted,
            elapsed_ms = started.elapsed().as_millis(),
            "tc conntrack entries of removed backends purged"
        );
        report.deleted
    }

    /// Hands a garbage collection round to the conntrack worker (runs one inline without a
    /// worker) and returns what GC finished since the last call, for the caller's metrics.
    /// Called every 30 s (`run/`).
    pub fn request_conntrack_gc(&mut self) -> Result<GcProgress, EbpfError> {
        let Some(worker) = &self.ct_worker else {
            let report = self.conntrack_gc()?;
            return Ok(GcProgress {
                rounds: 1,
                remaining: Some(report.remaining),
            });
        };
        worker.gc();
        let kept_ports = worker.take_ports();
        let reports = worker.reports();
        if let Some(mut kept_ports) = kept_ports {
            self.settle_port_filter(&mut kept_ports);
        }
        let progress = GcProgress {
            rounds: reports.gc_rounds.saturating_sub(self.gc_rounds_reported),
            remaining: reports.last_gc.map(|last| last.remaining),
        };
        self.gc_rounds_reported = reports.gc_rounds;
        Ok(progress)
    }

    /// Clears from the programs' port filter the ports that neither the maps' frontends and
    /// backends nor the conntrack entries a garbage collection round kept (`ct_ports`) used
    /// at this settle and the last one.
    fn settle_port_filter(&mut self, ct_ports: &mut PortFilter) {
        self.map_writer.ports_in_use(ct_ports);
        if let Some(filter) = &mut self.maps.port_filter {
            let cleared = filter.settle(ct_ports);
            if cleared > 0 {
                debug!(cleared, "ports no Service uses left the port filter");
            }
        }
    }

    /// The programs' port filter as they see it now.
    pub fn port_filter(&self) -> Option<PortFilter> {
        self.maps.port_filter.as_ref().map(PortFilterMap::value)
    }

    /// What the conntrack worker did so far (`None` without a worker).
    pub fn conntrack_worker_reports(&self) -> Option<crate::conntrack::ct_worker::WorkerReports> {
        self.ct_worker.as_ref().map(CtWorker::reports)
    }

    /// Garbage collection of the tc conntrack in this thread (see `tc_conntrack::gc_round`):
    /// deletes dead flows' entries.
    pub fn conntrack_gc(&mut self) -> Result<tc_conntrack::GcReport, EbpfError> {
        let started = std::time::Instant::now();
        let now = tc_conntrack::monotonic_ns().map_err(EbpfError::Clock)?;
        let mut maps = conntrack_pair(&mut self.ebpf)?;
        let mut kept_ports = Box::new(PortFilter::EMPTY);
        let report = tc_conntrack::gc_round(&mut maps, now, 4096, &mut kept_ports)
            .map_err(EbpfError::Conntrack)?;
        self.settle_port_filter(&mut kept_ports);
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

    /// The tc conntrack maps, borrowed from the object (they stay there: see `start`).
    pub(crate) fn conntrack_map(&mut self) -> Result<ConntrackMaps<&mut MapData>, EbpfError> {
        conntrack_maps(&mut self.ebpf)
    }

    /// Deletes every tc conntrack entry, so the next packet of any flow is a new flow that
    /// chooses its backend again. For tests (the agent itself only purges removed backends).
    pub fn clear_conntrack(&mut self) -> Result<usize, EbpfError> {
        let mut map = self.conntrack_map()?;
        let keys = map.keys();
        let mut deleted = 0;
        for key in keys {
            deleted += usize::from(map.remove(&key).is_ok());
        }
        Ok(deleted)
    }

    /// Every tc conntrack entry (a snapshot: the datapath keeps changing it). For tests and
    /// diagnostics.
    pub fn conntrack_entries(&mut self) -> Result<Vec<(CtKey, CtValue)>, EbpfError> {
        Ok(self.conntrack_map()?.entries())
    }

    /// Entries and capacity of each map the map_writer fills (`kubeproxy_ebpf_map_*`).
    pub fn map_usage(&self) -> Vec<(&'static str, u64, u64)> {
        self.map_writer
            .entries()
            .into_iter()
            .map(|(map, entries)| {
                let capacity = self.capacities.get(map).copied().unwrap_or(0);
                (map, entries, u64::from(capacity))
            })
            .collect()
    }

    /// Frontend writes refused because a map was full, counted since the agent started (each
    /// retry that fails again counts again): a counter for the metrics.
    pub fn capacity_errors(&self) -> u64 {
        self.capacity_errors
    }

    /// Service ports with at least one frontend that does not fit in the maps right now (not
    /// programmed, or still on its previous backend set): a gauge for the metrics and the log.
    pub fn unfit_service_ports(&self) -> BTreeSet<&ServicePortName> {
        self.map_writer.unfit().values().collect()
    }

    /// The probed kernel features and the choice made for each.
    pub fn features(&self) -> &KernelFeatures {
        &self.features
    }

    fn destroy_stale_udp_sockets(&self, summary: &ApplySummary) -> usize {
        if !self.features.uses(Feature::SocketDestroy) {
            return 0;
        }
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

    /// The agent's record of what is programmed.
    pub fn map_writer(&self) -> &MapWriter {
        &self.map_writer
    }

    /// The interfaces running the XDP program (`--bpf-xdp`): (name, ifindex).
    pub fn xdp_interfaces(&self) -> Vec<(String, u32)> {
        self.tc.xdp_interfaces()
    }

    /// Datapath counters summed over all CPUs (for logs and metrics).
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

/// The kernel's flows [`EbpfDataplane::adopt_kernel_nat_flows`] writes into the tc conntrack.
#[derive(Debug, Default)]
pub struct KernelNatFlows(Vec<(CtKey, CtValue)>);

/// Reads the kernel's conntrack for [`EbpfDataplane::adopt_kernel_nat_flows`]; it needs no map,
/// so it runs on any thread (a dump of a busy node's conntrack is milliseconds). Best effort,
/// like the adoption itself: a failed read is logged and adopts nothing.
pub fn read_kernel_nat_flows() -> KernelNatFlows {
    match monotonic_ns() {
        Ok(now) => KernelNatFlows(kernel_nat::read(now)),
        Err(error) => {
            warn!(%error, "no monotonic clock: UDP/SCTP flows the kernel's conntrack NATs are not adopted");
            KernelNatFlows::default()
        }
    }
}

/// See [`kernel_nat`]. Best effort, like the adoption itself.
fn adopt_kernel_nat_flows(ebpf: &mut Ebpf) {
    let now = match monotonic_ns() {
        Ok(now) => now,
        Err(error) => {
            warn!(%error, "no monotonic clock: UDP/SCTP flows the kernel's conntrack NATs are not adopted");
            return;
        }
    };
    match conntrack_maps(ebpf) {
        Ok(mut ct) => {
            kernel_nat::adopt(&mut ct, now);
        }
        Err(error) => {
            warn!(%error, "tc conntrack: UDP/SCTP flows the kernel's conntrack NATs are not adopted")
        }
    }
}

/// The object's two conntrack maps at once (`Ebpf::map_mut` lends one at a time).
fn conntrack_pair(ebpf: &mut Ebpf) -> Result<ConntrackPair<'_>, EbpfError> {
    let (mut v4, mut v6, mut new4, mut new6) = (None, None, None, None);
    for (name, map) in ebpf.maps_mut() {
        match name {
            map_names::CT4 => v4 = Some(map),
            map_names::CT6 => v6 = Some(map),
            map_names::CT4_NEW => new4 = Some(map),
            map_names::CT6_NEW => new6 = Some(map),
            _ => {}
        }
    }
    Ok(ConntrackPair {
        v4: v4.ok_or(EbpfError::MissingMap(map_names::CT4))?,
        v6: v6.ok_or(EbpfError::MissingMap(map_names::CT6))?,
        new4: new4.ok_or(EbpfError::MissingMap(map_names::CT4_NEW))?,
        new6: new6.ok_or(EbpfError::MissingMap(map_names::CT6_NEW))?,
    })
}

/// What a names pass in steps ([`EbpfDataplane::write_pending_names`]) keeps between them.
#[derive(Debug, Default)]
struct NamesPass {
    /// `KPR_SERVICE_NAMES` as the pass found it (read at its first step).
    in_map: Option<std::collections::HashMap<u32, ServiceName>>,
    /// The last service port written.
    after: Option<ServicePortName>,
    /// Ids named since the pass began (by it, or by a sync between its steps): not stale.
    live: std::collections::HashSet<u32>,
}

/// The name of each of `name`'s frontends (service id, value) to `each`; `text` is the
/// buffer the name is formatted into, once.
fn name_writes(
    map_writer: &MapWriter,
    snapshot: &Snapshot,
    name: &ServicePortName,
    text: &mut String,
    mut each: impl FnMut(u32, ServiceName),
) {
    text.clear();
    // Writing into a String cannot fail.
    let _ = std::fmt::Write::write_fmt(text, format_args!("{name}"));
    for (id, key) in map_writer.frontends_of(name) {
        let kind = frontend_kind(snapshot, name, &key);
        if let Some(value) = ServiceName::new(text, kind, name.protocol.number()) {
            each(id, value);
        }
    }
}

/// Whether a previous agent left IPv6 frontends or IPv6 tc conntrack entries (its own flows,
/// or the kernel's NATed flows the start just adopted) in the pinned maps.
fn holds_ipv6_state(maps: &ServiceMaps, ebpf: &mut Ebpf) -> bool {
    if maps.frontends6.keys().next().is_some() {
        return true;
    }
    match conntrack_maps(ebpf) {
        Ok(ct) => {
            ct.v6.keys().next().is_some()
                || ct.new6.is_some_and(|new6| new6.keys().next().is_some())
        }
        // Unreadable: loaded, as before the IPv6 programs could wait.
        Err(_) => true,
    }
}

fn conntrack_maps(ebpf: &mut Ebpf) -> Result<ConntrackMaps<&mut MapData>, EbpfError> {
    let pair = conntrack_pair(ebpf)?;
    ConntrackMaps::borrow(pair.v4, pair.v6, pair.new4, pair.new6)
}

/// What a deferred attach needs.
#[derive(Debug)]
pub(super) struct DeferredAttach {
    cgroup_dir: File,
    plan: Plan,
    /// Pinned once the programs are attached.
    stamp: Option<LoadStamp>,
}

/// Attaches the socket programs to the cgroup and the tc programs to the interfaces, each
/// replacing a previous agent's program without a gap; then pins `stamp`, which lets the next
/// start reuse the programs it pinned (see `reuse`).
fn attach_all(
    ebpf: &mut Ebpf,
    tc: &mut TcState,
    cgroup_dir: &File,
    pin_dir: &std::path::Path,
    stamp: Option<&LoadStamp>,
) -> Result<Vec<PinnedLink>, EbpfError> {
    let mut links = Vec::with_capacity(program_names::ALL.len());
    for name in program_names::ALL {
        links.push(attach_and_pin(ebpf, name, cgroup_dir, pin_dir)?);
        // Pinned for the next start (the link alone would keep it loaded, but only a pin
        // lets that start open it).
        if let Some(program) = ebpf.program_mut(name) {
            reuse::pin_loaded(pin_dir, name, |path| program.pin(path));
        }
    }
    tc.refresh(ebpf, pin_dir, true);
    if let Some(stamp) = stamp {
        reuse::write(pin_dir, stamp);
    }
    Ok(links)
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, EbpfError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(EbpfError::MissingMap(name))?;
    T::try_from(map).map_err(|source| EbpfError::Map { name, source })
}

/// Forwards aya-log records from the eBPF programs into `tracing` (through the `log` bridge).
/// `flush` reads the records (`EbpfLogger::flush`; a function so that the logger's type, which
/// names the `log` crate's trait, is only inferred).
fn start_log_drain<L>(
    logger: Result<L, aya_log::Error>,
    flush: fn(&mut L),
) -> Option<JoinHandle<()>>
where
    L: std::os::fd::AsRawFd + Send + 'static,
{
    let logger = match logger {
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
            flush(guard.get_inner_mut());
            guard.clear_ready();
        }
    }))
}

/// A frontend's kind as `KPR_SERVICE_NAMES` records it (0 when the snapshot no longer has its
/// port: the next write of its names has it again).
fn frontend_kind(snapshot: &Snapshot, name: &ServicePortName, key: &FrontendKey) -> u8 {
    // A keyed lookup: a scan of the Service's ports per frontend is quadratic in a Service
    // with thousands of ports.
    snapshot
        .family(IpFamily::of(&key.addr))
        .service_ports
        .get(name)
        .map_or(0, |port| FrontendKind::of(port, key).code())
}

/// The map writer's limits from the options and the maps (see [`MapWriter`]'s setters).
#[derive(Debug)]
struct WriterSettings {
    maglev_table_size: Option<u32>,
    capacity: crate::maps::map_writer::shares::Entries,
    max_frontends_per_service: u32,
    max_endpoints_per_service: u32,
    backend_id_limit: u32,
}

impl WriterSettings {
    fn configure(&self, writer: &mut MapWriter) {
        // The Maglev table size first: the shares' Maglev unit follows it.
        writer.set_maglev_table_size(self.maglev_table_size);
        writer.set_shares(self.capacity, self.max_frontends_per_service);
        writer.set_max_endpoints_per_service(self.max_endpoints_per_service);
        writer.set_backend_id_limit(self.backend_id_limit);
    }
}

/// The length of an array map as the kernel has it (aya's `len` is the object's definition,
/// which a reused pin need not match); `u32::MAX` (no bound of its own) when it cannot be read.
fn array_len<V: aya::Pod>(array: &aya::maps::Array<aya::maps::MapData, V>) -> u32 {
    use aya::maps::IterableMap as _;
    match array.map().info() {
        Ok(info) => info.max_entries(),
        Err(error) => {
            warn!(%error, "cannot read an array map's length; assuming the configured one");
            u32::MAX
        }
    }
}
