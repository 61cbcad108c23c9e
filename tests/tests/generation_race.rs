//! Issue 17, no spurious refusals: a `connect()` racing a frontend's generation switch is
//! never refused while the Service has backends.
//!
//! The race: the connect hook reads the frontend (generation g), the agent switches the
//! frontend to generation g^1 and deletes g's slots, then the hook looks up its slot in g and
//! finds nothing. The hook reads the frontend once more and chooses from the new generation
//! (`proxy-ebpf/src/sock.rs`, `choose4`/`choose6`). The hook's two reads are a fraction of a
//! microsecond apart and the deletion is a syscall after the switch, so the race needs the
//! hook held up between its reads (an interrupt, the hypervisor taking the vCPU) exactly while
//! the writer switches and deletes: an agent, syncing at most every second, almost never
//! meets it. Here a writer switches the generation back and forth with the agent's update
//! order (idle generation's slots, frontend, old generation's slots) as fast as it can on one
//! CPU — but never twice during one hook run, the most the re-read promises to cope with —,
//! while a process in the hooks' cgroup connects a UDP socket (the connect hook runs, nothing
//! is sent) to the frontend as fast as it can on the other, millions of times: the few
//! hold-ups inside the hook that land on a switch are then enough. On a 2-vCPU VM, with the
//! re-read removed, each family saw 16 to 131 refusals in 5 s (six runs); with it, none.
//!
//! Needs root: namespaces, a private bpffs, a child cgroup.
#![expect(
    clippy::expect_used,
    reason = "test setup: a failed expectation is a failed test"
)]

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use aya::maps::{HashMap, MapData, PerCpuArray};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_agent::{
    dataplane::ebpf::{EbpfDataplane, EbpfOptions, LbOptions, PIN_DIR_NAME, TcOptions},
    desired::Snapshot,
    objects::{ObjectKey, Objects},
};
use proxy_common::{
    BackendSlotKey, Frontend4Key, Frontend6Key, FrontendValue, StatIndex, map_names, proto, scope,
};
use proxy_tests::{
    agent::TempBpfRoot,
    cgroup::ChildCgroup,
    connect_loop::{ConnectLoopReport, run_connect_loop},
    netns::Netns,
};

const NODE: &str = "node";
const CLUSTER_IP: &str = "10.96.0.40";
const CLUSTER_IP6: &str = "fd00:96::40";
const PORT: u16 = 53;
const BACKENDS: [&str; 2] = ["10.244.1.2", "10.244.1.3"];
const BACKENDS6: [&str; 2] = ["fd00:244:1::2", "fd00:244:1::3"];
/// The connect loop's bounds: whichever comes first.
const CONNECTS: u64 = 5_000_000;
const RACE_TIME: Duration = Duration::from_secs(5);
/// A bound on the writer, far above what it reaches in `RACE_TIME`.
const MAX_SWITCHES: u64 = 50_000_000;

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "default".into(),
        name: name.into(),
    }
}

/// The dual-stack ClusterIP Service `race`, UDP `PORT` → 5353, with `BACKENDS`/`BACKENDS6`.
fn snapshot() -> Snapshot {
    let service = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: race, namespace: default}}\n\
         spec: {{clusterIP: {CLUSTER_IP}, clusterIPs: [{CLUSTER_IP}, '{CLUSTER_IP6}'], \
         ipFamilies: [IPv4, IPv6], ipFamilyPolicy: RequireDualStack, \
         ports: [{{name: dns, port: {PORT}, protocol: UDP, targetPort: 5353}}]}}\n"
    );
    let service: Service = serde_yaml::from_str(&service).expect("service yaml");
    let slice = |family: &str, addrs: &[&str]| -> (ObjectKey, EndpointSlice) {
        let endpoints: Vec<String> = addrs
            .iter()
            .map(|a| {
                format!("{{addresses: ['{a}'], nodeName: {NODE}, conditions: {{ready: true}}}}")
            })
            .collect();
        let name = format!("race-{family}");
        let yaml = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: {name}, namespace: default, labels: {{kubernetes.io/service-name: race}}}}\n\
             addressType: {family}\nports: [{{name: dns, port: 5353, protocol: UDP}}]\n\
             endpoints: [{}]\n",
            endpoints.join(", ")
        );
        (key(&name), serde_yaml::from_str(&yaml).expect("slice yaml"))
    };
    let objects = Objects::new(
        BTreeMap::from([(key("race"), service)]),
        BTreeMap::from([slice("IPv4", &BACKENDS), slice("IPv6", &BACKENDS6)]),
        None,
    );
    let snapshot = Snapshot::compute(&objects, NODE);
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    assert!(errors.is_empty(), "snapshot errors: {errors:?}");
    snapshot
}

/// The ClusterIP frontend's key in whichever family map holds it.
#[derive(Clone, Copy)]
enum FrontendKey {
    V4(Frontend4Key),
    V6(Frontend6Key),
}

impl FrontendKey {
    fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(a) => Self::V4(Frontend4Key {
                addr: u32::from_ne_bytes(a.octets()),
                port: PORT.to_be(),
                proto: proto::UDP,
                scope: scope::INTERNAL,
            }),
            IpAddr::V6(a) => {
                let o = a.octets();
                Self::V6(Frontend6Key {
                    addr: [0, 4, 8, 12]
                        .map(|i| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]])),
                    port: PORT.to_be(),
                    proto: proto::UDP,
                    scope: scope::INTERNAL,
                })
            }
        }
    }
}

/// The pinned maps a generation switch writes, and the hooks' counters.
struct Maps {
    frontends4: HashMap<MapData, Frontend4Key, FrontendValue>,
    frontends6: HashMap<MapData, Frontend6Key, FrontendValue>,
    slots: HashMap<MapData, BackendSlotKey, u32>,
    stats: PerCpuArray<MapData, u64>,
}

impl Maps {
    fn open(pin_dir: &Path) -> Self {
        let open = |name: &str| {
            aya::maps::Map::HashMap(MapData::from_pin(pin_dir.join(name)).expect("pinned map"))
        };
        Self {
            frontends4: open(map_names::FRONTENDS4).try_into().expect("frontends4"),
            frontends6: open(map_names::FRONTENDS6).try_into().expect("frontends6"),
            slots: open(map_names::BACKEND_SLOTS).try_into().expect("slots"),
            stats: aya::maps::Map::PerCpuArray(
                MapData::from_pin(pin_dir.join(map_names::STATS)).expect("pinned stats"),
            )
            .try_into()
            .expect("stats"),
        }
    }

    /// Connects the hook has translated, on all CPUs. The hook bumps the counter after its
    /// last map read, so a value past one read earlier means that every run under way then has
    /// finished (the connect loop is one thread; a refused run is followed by a translated one
    /// soon enough).
    fn translated(&self) -> u64 {
        self.stats
            .get(&(StatIndex::Translated as u32), 0)
            .expect("stats")
            .iter()
            .sum()
    }

    fn frontend(&self, key: FrontendKey) -> FrontendValue {
        match key {
            FrontendKey::V4(k) => self.frontends4.get(&k, 0),
            FrontendKey::V6(k) => self.frontends6.get(&k, 0),
        }
        .expect("the frontend the agent wrote")
    }

    fn put_frontend(&mut self, key: FrontendKey, value: FrontendValue) {
        match key {
            FrontendKey::V4(k) => self.frontends4.insert(k, value, 0),
            FrontendKey::V6(k) => self.frontends6.insert(k, value, 0),
        }
        .expect("frontend update");
    }
}

fn slot_key(value: &FrontendValue, slot: u16) -> BackendSlotKey {
    BackendSlotKey {
        service_id: value.service_id,
        slot,
        generation: value.generation,
        _pad: 0,
    }
}

/// Switches `key`'s generation back and forth until `stop` (or `MAX_SWITCHES`), in the
/// agent's order (`MapWriter`): the idle generation's slots, then the frontend in one update,
/// then the old generation's slots deleted. The backends stay: only the generation moves, so
/// the Service has its backends throughout. Returns the number of switches.
///
/// Before the next switch the writer waits until the connect hook run that was under way
/// during this one has finished (the connect loop is one thread: one run at a time). The hook
/// reads the frontend again once, which is enough when switches are further apart than a hook
/// run, as the agent's are (one per sync); a writer that switched twice while a stalled hook
/// waited would ask more than the design promises. The wait costs next to nothing: the hook
/// runs about once a microsecond unless stalled, and a stall is exactly when the race is on.
fn switch_generations(mut maps: Maps, key: FrontendKey, stop: &AtomicBool) -> u64 {
    let mut live = maps.frontend(key);
    let ids: Vec<u32> = (0..live.backend_count)
        .map(|slot| maps.slots.get(&slot_key(&live, slot), 0).expect("slot"))
        .collect();
    let mut switches = 0;
    while switches < MAX_SWITCHES && !stop.load(Ordering::Relaxed) {
        let next = FrontendValue {
            generation: live.generation ^ 1,
            ..live
        };
        for (slot, id) in (0..).zip(&ids) {
            maps.slots
                .insert(slot_key(&next, slot), id, 0)
                .expect("slot write");
        }
        maps.put_frontend(key, next);
        // Read after the switch: a run under way then bumps the counters past this value when
        // it ends, and runs are sequential.
        let translated = maps.translated();
        for slot in 0..live.backend_count {
            maps.slots
                .remove(&slot_key(&live, slot))
                .expect("slot delete");
        }
        live = next;
        switches += 1;
        // Bounded by `stop`: the loop ends when the connect loop does.
        while maps.translated() == translated {
            if stop.load(Ordering::Relaxed) {
                return switches;
            }
        }
    }
    switches
}

/// The node namespace (backends routed through `lo`) with the agent's dataplane loaded (pins
/// in a private bpffs, hooks on a child cgroup) and the `race` Service applied.
struct Node {
    // Drop order: the dataplane's fds, then the bpffs (pins), cgroup and namespace.
    dataplane: EbpfDataplane,
    _runtime: tokio::runtime::Runtime,
    bpf: TempBpfRoot,
    cgroup: ChildCgroup,
    netns: PathBuf,
}

/// Runs `f` on a thread inside a fresh node namespace with the dataplane started.
fn with_node<R: Send + 'static>(f: impl FnOnce(&mut Node) -> R + Send + 'static) -> R {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let ns = Netns::new("genrace").expect("netns");
    // A connected UDP socket needs a route to its (translated) destination: the backends'
    // prefixes on `lo`. Nothing is sent.
    ns.ip(&["addr", "add", "10.244.1.1/24", "dev", "lo"])
        .expect("addr");
    ns.ip(&[
        "-6",
        "addr",
        "add",
        "fd00:244:1::1/64",
        "dev",
        "lo",
        "nodad",
    ])
    .expect("addr6");
    let path = ns.path();
    let result = std::thread::spawn(move || {
        let file = std::fs::File::open(&path).expect("open netns");
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let _entered = runtime.enter();
        let bpf = TempBpfRoot::new().expect("bpf root");
        let cgroup = ChildCgroup::new().expect("cgroup");
        let options = EbpfOptions {
            cgroup_path: Some(cgroup.path().to_path_buf()),
            bpf_root: PathBuf::from(bpf.path()),
            frontends_capacity: 64,
            backends_capacity: 64,
            conntrack_capacity: Some(proxy_common::default_sizes::CT),
            dynamic_size_ratio: proxy_agent::dataplane::ebpf::map_sizes::DEFAULT_DYNAMIC_SIZE_RATIO,
            lb: LbOptions::default(),
            tc: TcOptions::default(),
            disabled_features: Default::default(),
            icmp_ratelimit: None,
            snat_ports: proxy_agent::dataplane::ebpf::reserved_ports::DEFAULT_RANGE,
        };
        let mut dataplane = EbpfDataplane::start(&options).expect("dataplane");
        let (summary, errors) = dataplane.apply(&snapshot(), None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        // Per family the socket hooks' frontend and the tc programs' one.
        assert_eq!(summary.frontends_written, 4, "{summary:?}");
        let mut node = Node {
            dataplane,
            _runtime: runtime,
            bpf,
            cgroup,
            netns: path,
        };
        f(&mut node)
    })
    .join()
    .expect("test thread");
    drop(ns);
    result
}

fn stat(node: &Node, index: StatIndex) -> u64 {
    node.dataplane
        .stats()
        .into_iter()
        .find(|(i, _)| *i == index)
        .map_or(0, |(_, n)| n)
}

/// Connects to `cluster_ip` for `RACE_TIME` while the writer switches its frontend's
/// generation; returns the loop's report and the number of switches.
fn race(node: &mut Node, cluster_ip: &str) -> (ConnectLoopReport, u64) {
    let ip: IpAddr = cluster_ip.parse().expect("ip");
    let target = SocketAddr::new(ip, PORT);
    let key = FrontendKey::of(ip);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(cpus >= 2, "the race needs two CPUs, found {cpus}");

    // Translated before the race: the Service is programmed and the hook is on the cgroup.
    let before = stat(node, StatIndex::Translated);
    let warmup = run_connect_loop(&node.netns, node.cgroup.path(), target, 10, RACE_TIME, None)
        .expect("connect loop");
    assert_eq!((warmup.connects, warmup.refused, warmup.other), (10, 0, 0));
    assert_eq!(stat(node, StatIndex::Translated) - before, 10);

    let maps = Maps::open(&node.bpf.path().join(PIN_DIR_NAME));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            // The writer and the connects on different CPUs: on one CPU the connect hook
            // (which the kernel does not preempt) would never see a switch mid-choice.
            proxy_tests::bench::client::pin(0, 1).expect("pin the writer");
            switch_generations(maps, key, &stop)
        })
    };
    let before = stat(node, StatIndex::Translated);
    let started = Instant::now();
    let report = run_connect_loop(
        &node.netns,
        node.cgroup.path(),
        target,
        CONNECTS,
        RACE_TIME,
        Some(0),
    );
    stop.store(true, Ordering::Relaxed);
    let switches = writer.join().expect("writer thread");
    let report = report.expect("connect loop");
    let translated = stat(node, StatIndex::Translated) - before;
    eprintln!(
        "{cluster_ip}: {} connects ({} refused, {} other errors, first {}), {translated} \
         translated, {switches} generation switches in {:?}",
        report.connects,
        report.refused,
        report.other,
        report.first_other,
        started.elapsed()
    );
    assert_eq!(report.other, 0, "unexpected errors: {report:?}");
    assert_eq!(
        translated,
        report.connects - report.refused,
        "every connect that was not refused was translated"
    );
    (report, switches)
}

/// The race was run in earnest: many connects, many switches (each switch is a window in
/// which a connect that read the old generation finds its slot gone), and no refusal.
fn assert_never_refused(report: &ConnectLoopReport, switches: u64) {
    assert!(
        report.connects >= 100_000,
        "too few connects to race: {report:?}"
    );
    assert!(switches >= 10_000, "too few switches to race: {switches}");
    assert_eq!(
        report.refused, 0,
        "connects refused while the Service had backends: {report:?}, {switches} switches"
    );
}

#[test]
fn ipv4_connects_racing_generation_switches_are_never_refused() {
    let (report, switches) = with_node(|node| race(node, CLUSTER_IP));
    assert_never_refused(&report, switches);
}

#[test]
fn ipv6_connects_racing_generation_switches_are_never_refused() {
    let (report, switches) = with_node(|node| race(node, CLUSTER_IP6));
    assert_never_refused(&report, switches);
}
