//! No spurious refusals: a `connect()` racing a frontend's generation switch is
//! never refused while the Service has backends.
//!
//! The race: the connect hook reads the frontend (generation g), the agent switches the
//! frontend to generation g^1, then the hook looks up its slot in g. Were g's slots deleted at
//! the switch, the hook would find nothing: it reads the frontend once more and chooses from the
//! new generation (`proxy-ebpf/src/sock.rs`, `choose`), but a hook held up across two
//! switches (the second deletes g^1's slots), or a tc program (which cannot re-read), would
//! still fail. So the map writer deletes a switched-out generation only after
//! `GENERATION_GRACE`, and never switches a frontend again before then (the idle generation is
//! the retired one). The hook's two reads are a fraction of a microsecond apart, so the race
//! needs the hook held up between them (an interrupt, the hypervisor taking the vCPU) exactly
//! while the writer switches: an agent, syncing at most every second, almost never meets it.
//! Here the agent's own map writer (`EbpfDataplane::apply_service_maps`, in-process) is asked to
//! flip the Service between two backend sets as fast as it can on one CPU, while a process in
//! the hooks' cgroup connects a UDP socket (the connect hook runs, nothing is sent) to the
//! frontend as fast as it can on the other, millions of times. With the grace the writer only
//! switches once per grace and defers the rest; with old generations deleted at the switch (and
//! the re-read removed) it switches tens of thousands of times and the few hold-ups inside the
//! hook that land on a switch are enough for refusals.
//!
//! Needs root: namespaces, a private bpffs, a child cgroup.
#![expect(
    clippy::expect_used,
    reason = "test setup: a failed expectation is a failed test"
)]

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_common::StatIndex;
use proxy_dataplane_ebpf::EbpfDataplane;
use proxy_model::{
    desired::{ServicePortName, Snapshot},
    objects::{ObjectKey, Objects},
};
use proxy_tests::{
    connect_loop::{ConnectLoopReport, run_connect_loop},
    in_process::{InProcess, on_netns_thread},
    netns::Netns,
};

const NODE: &str = "node";
const CLUSTER_IP: &str = "10.96.0.40";
const CLUSTER_IP6: &str = "fd00:96::40";
const PORT: u16 = 53;
/// The writer flips between the first two backends and all three: the Service always has
/// backends, and every switch changes the slot count and adds or drops a backend.
const BACKENDS: [&str; 3] = ["10.244.1.2", "10.244.1.3", "10.244.1.4"];
const BACKENDS6: [&str; 3] = ["fd00:244:1::2", "fd00:244:1::3", "fd00:244:1::4"];
/// The connect loop's bounds: whichever comes first. Without the grace (and without the hook's
/// re-read) the agent's writer, slower per switch than raw map writes, gets one to a few
/// refusals per 5 s on a 2-vCPU VM: 10 s makes a run without them unlikely.
const CONNECTS: u64 = 50_000_000;
const RACE_TIME: Duration = Duration::from_secs(10);
/// A bound on the writer, far above what it reaches in `RACE_TIME`.
const MAX_APPLIES: u64 = 50_000_000;

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "default".into(),
        name: name.into(),
    }
}

/// The single-stack ClusterIP Service `race` on `cluster_ip`, UDP `PORT` → 5353, with
/// `backends`.
fn snapshot(cluster_ip: &str, backends: &[&str]) -> Snapshot {
    let (family, policy) = if cluster_ip.contains(':') {
        ("IPv6", "IPv6")
    } else {
        ("IPv4", "IPv4")
    };
    let service = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: race, namespace: default}}\n\
         spec: {{clusterIP: '{cluster_ip}', clusterIPs: ['{cluster_ip}'], \
         ipFamilies: [{policy}], ipFamilyPolicy: SingleStack, \
         ports: [{{name: dns, port: {PORT}, protocol: UDP, targetPort: 5353}}]}}\n"
    );
    let service: Service = serde_yaml::from_str(&service).expect("service yaml");
    let endpoints: Vec<String> = backends
        .iter()
        .map(|a| format!("{{addresses: ['{a}'], nodeName: {NODE}, conditions: {{ready: true}}}}"))
        .collect();
    let yaml = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: race-{family}, namespace: default, labels: {{kubernetes.io/service-name: race}}}}\n\
         addressType: {family}\nports: [{{name: dns, port: 5353, protocol: UDP}}]\n\
         endpoints: [{}]\n",
        endpoints.join(", ")
    );
    let slice: EndpointSlice = serde_yaml::from_str(&yaml).expect("slice yaml");
    let objects = Objects::new(
        BTreeMap::from([(key("race"), service.into())]),
        BTreeMap::from([(key(&format!("race-{family}")), slice.into())]),
        None,
    );
    let snapshot = Snapshot::compute(&objects, NODE);
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    assert!(errors.is_empty(), "snapshot errors: {errors:?}");
    snapshot
}

fn service_port() -> ServicePortName {
    ServicePortName {
        service: key("race"),
        port: "dns".into(),
        protocol: proxy_model::desired::Protocol::Udp,
    }
}

/// What the writer did.
#[derive(Debug, Default)]
struct Writes {
    /// Applies asked of the map writer.
    applies: u64,
    /// Applies that reached their backend set (both frontends switched): after each the writer
    /// asks for the other set.
    switches: u64,
    /// Frontend switches the map writer deferred (the previous generation in its grace).
    deferred: u64,
}

/// Flips the Service between `sets` through the agent's map writer as fast as it can, until
/// `stop` (or `MAX_APPLIES`). An apply the writer defers is asked again at once: the writer
/// never waits for anything of its own.
fn switch_generations(
    dataplane: &mut EbpfDataplane,
    sets: &[Snapshot; 2],
    stop: &AtomicBool,
) -> Writes {
    let changed = BTreeSet::from([service_port()]);
    let mut writes = Writes::default();
    // `sets[0]` is programmed.
    let mut next = 1;
    while writes.applies < MAX_APPLIES && !stop.load(Ordering::Relaxed) {
        let (summary, errors) = dataplane.apply_service_maps(&sets[next], Some(&changed));
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        writes.applies += 1;
        writes.deferred += summary.frontends_deferred as u64;
        if summary.frontends_deferred == 0 {
            writes.switches += 1;
            next ^= 1;
        }
    }
    writes
}

/// The node namespace (backends routed through `lo`) with the agent's dataplane loaded (pins
/// in a private bpffs, hooks on a child cgroup) and the `race` Service applied.
struct Node {
    // Drop order: the dataplane's fds, then the bpffs (pins), cgroup and namespace.
    dataplane: EbpfDataplane,
    parts: InProcess,
    netns: PathBuf,
}

/// Runs `f` on a thread inside a fresh node namespace with the dataplane started and `first`
/// applied.
fn with_node<R: Send + 'static>(
    first: Snapshot,
    f: impl FnOnce(&mut Node) -> R + Send + 'static,
) -> R {
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
    let result = on_netns_thread(path.clone(), move |parts| {
        let options = parts.small_dataplane_options(64);
        let mut dataplane = EbpfDataplane::start(&options).expect("dataplane");
        let (summary, errors) = dataplane.apply(&first, None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        // The socket hooks' frontend and the tc programs' one.
        assert_eq!(summary.frontends_written, 2, "{summary:?}");
        let mut node = Node {
            dataplane,
            parts,
            netns: path,
        };
        f(&mut node)
    })
    .expect("node thread");
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

/// Connects to `cluster_ip` for `RACE_TIME` while the writer flips the Service between its
/// two backend sets (`sets[0]` is programmed); returns the loop's report and what the writer
/// did.
fn race(node: &mut Node, cluster_ip: &str, sets: &[Snapshot; 2]) -> (ConnectLoopReport, Writes) {
    let ip: IpAddr = cluster_ip.parse().expect("ip");
    let target = SocketAddr::new(ip, PORT);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(cpus >= 2, "the race needs two CPUs, found {cpus}");

    // Translated before the race: the Service is programmed and the hook is on the cgroup.
    let before = stat(node, StatIndex::Translated);
    let warmup = run_connect_loop(
        &node.netns,
        node.parts.cgroup.path(),
        target,
        10,
        RACE_TIME,
        None,
    )
    .expect("connect loop");
    assert_eq!((warmup.connects, warmup.refused, warmup.other), (10, 0, 0));
    assert_eq!(stat(node, StatIndex::Translated) - before, 10);

    let stop = Arc::new(AtomicBool::new(false));
    let connects = {
        let stop = Arc::clone(&stop);
        let (netns, cgroup) = (node.netns.clone(), node.parts.cgroup.path().to_path_buf());
        std::thread::spawn(move || {
            let report = run_connect_loop(&netns, &cgroup, target, CONNECTS, RACE_TIME, Some(0));
            stop.store(true, Ordering::Relaxed);
            report
        })
    };
    let before = stat(node, StatIndex::Translated);
    let started = Instant::now();
    // The writer (this thread, which holds the dataplane) and the connects on different CPUs:
    // on one CPU the connect hook (which the kernel does not preempt) would never see a switch
    // mid-choice.
    proxy_tests::cpu::pin(0, 1).expect("pin the writer");
    let writes = switch_generations(&mut node.dataplane, sets, &stop);
    let report = connects
        .join()
        .expect("connect loop thread")
        .expect("connect loop");
    let translated = stat(node, StatIndex::Translated) - before;
    eprintln!(
        "{cluster_ip}: {} connects ({} refused, {} other errors, first {}), {translated} \
         translated; writer: {} applies, {} switches, {} frontend switches deferred, in {:?}",
        report.connects,
        report.refused,
        report.other,
        report.first_other,
        writes.applies,
        writes.switches,
        writes.deferred,
        started.elapsed()
    );
    assert_eq!(report.other, 0, "unexpected errors: {report:?}");
    assert_eq!(
        translated,
        report.connects - report.refused,
        "every connect that was not refused was translated"
    );
    (report, writes)
}

/// No refusal, and the race was run in earnest: many connects, and a writer that asked for a
/// switch tens of thousands of times (each switch it is granted is a window in which a connect
/// that read the old generation looks up its slots) and got them whenever the grace allowed.
fn assert_never_refused(report: &ConnectLoopReport, writes: &Writes) {
    assert_eq!(
        report.refused, 0,
        "connects refused while the Service had backends: {report:?}, {writes:?}"
    );
    assert!(
        report.connects >= 100_000,
        "too few connects to race: {report:?}"
    );
    assert!(
        writes.applies >= 10_000,
        "too few switches asked to race: {writes:?}"
    );
    // The first switch is granted at once; the next ones each after a grace.
    assert!(writes.switches >= 2, "switches never granted: {writes:?}");
}

/// One race at a time: both pin their writer and connect loop to the same two CPUs.
static RACE: Mutex<()> = Mutex::new(());

fn race_family(cluster_ip: &'static str, backends: &[&str; 3]) {
    // A race that failed still leaves the lock usable for the other.
    let _one_at_a_time = RACE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let sets = [
        snapshot(cluster_ip, &backends[..2]),
        snapshot(cluster_ip, backends),
    ];
    let first = snapshot(cluster_ip, &backends[..2]);
    let (report, writes) = with_node(first, move |node| race(node, cluster_ip, &sets));
    assert_never_refused(&report, &writes);
}

#[test]
fn ipv4_connects_racing_generation_switches_are_never_refused() {
    race_family(CLUSTER_IP, &BACKENDS);
}

#[test]
fn ipv6_connects_racing_generation_switches_are_never_refused() {
    race_family(CLUSTER_IP6, &BACKENDS6);
}
