//! (agent upgrades that change a pinned map's layout): established connections keep
//! their state when the new agent finds a map in an older layout, and a map in a layout it does
//! not know is reported and rebuilt without a failed connection. Needs root.
//!
//! The older layouts are real ones: the foundation's `KPR_REVNAT4`, keyed by the socket cookie
//! alone with the service and the backend in the value (git history: the first commit's
//! `proxy-common/src/maps.rs`), which the agent registers as version 1 of the map, and
//! `KPR_CT` before its reply entries recorded the client's interface (version 1, a 48-byte
//! value), the one `KPR_CT` of both families (version 2), and `KPR_CT4`/`KPR_CT6` before their
//! values carried the flow's service id (version 1). The test builds them from the live
//! entries of the running datapath, as those agents would have written them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, SocketAddrV4};
use std::os::fd::{FromRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use aya::maps::{HashMap, IterableMap as _, Map, MapData};
use proxy_common::{
    Backend4, BackendEntry as _, CtKey, CtKey4, CtValue, CtValue4, RevNat4, RevNat4Key, map_names,
};
use proxy_dataplane_ebpf::PIN_DIR_NAME;
use proxy_dataplane_ebpf::attach::layout::{LAYOUTS, LayoutKey, LayoutRecord, v1, v2};
use proxy_tests::RigError;
use proxy_tests::client::{Attempt, Client, Mode, tally};
use proxy_tests::scenario::{Scenario, cluster_addr, is_pod, pod_endpoint};
use proxy_tests::service_scenarios::ServiceSpec;
use proxy_tests::takeover;
use proxy_tests::topology::Topology;
use proxy_tests::wait::try_wait_until;

const NODE_PORT: u16 = 30080;
/// Streams from outside through the NodePort (tc conntrack) and from a node process to the
/// ClusterIP (socket hooks: reverse NAT for getpeername).
const NODE_PORT_STREAMS: usize = 10;
const CLUSTER_IP_STREAMS: usize = 4;

fn node_port_addr() -> SocketAddr {
    SocketAddrV4::new(Topology::node_ext_ip(), NODE_PORT).into()
}

type Streams = Vec<std::thread::JoinHandle<proxy_tests::Result<Vec<Attempt>>>>;

/// The foundation's `KPR_REVNAT4` value (key: the socket cookie, a `u64`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RevNat4V1 {
    frontend_addr: u32,
    backend_addr: u32,
    frontend_port: u16,
    backend_port: u16,
    _pad: u32,
}

// SAFETY: `repr(C)` integers without implicit padding, valid for any bytes.
unsafe impl aya::Pod for RevNat4V1 {}

/// `default/web` as a NodePort Service on pods 1 and 2, served by an eBPF-mode agent.
fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    Ok(s)
}

fn pin_dir(s: &mut Scenario) -> anyhow::Result<PathBuf> {
    Ok(s.agent()?.bpf_root().join(PIN_DIR_NAME))
}

/// Opens the streams (each `exchanges` exchanges 100 ms apart on one connection) once both
/// paths answer; returns them and the two clients.
fn open_streams(s: &mut Scenario, exchanges: u32) -> anyhow::Result<(Streams, Client, Client)> {
    let outside = s.external_client();
    let node = s.cgroup_client();
    s.wait_for_datapath_with(&outside, node_port_addr(), "NodePort answered", is_pod)?;
    s.wait_for_datapath_with(&node, cluster_addr(), "ClusterIP answered", is_pod)?;
    let streams = (0..NODE_PORT_STREAMS + CLUSTER_IP_STREAMS)
        .map(|i| {
            let (client, target) = if i < NODE_PORT_STREAMS {
                (outside.clone(), node_port_addr())
            } else {
                (node.clone(), cluster_addr())
            };
            let client = client
                .mode(Mode::TcpStream)
                .interval(Duration::from_millis(100))
                .timeout(Duration::from_millis(1000));
            std::thread::spawn(move || client.run(target, exchanges))
        })
        .collect();
    // Every stream connected before the upgrade starts.
    s.wait_for_tcp_streams(NODE_PORT_STREAMS + CLUSTER_IP_STREAMS)?;
    Ok((streams, outside, node))
}

/// Joins the streams and fails unless every one kept its one connection (`#1`), was answered
/// every time (0 resets, 0 stalls) and, for the ClusterIP ones, getpeername() showed the
/// ClusterIP throughout (the reverse NAT entry of the socket survived).
fn ensure_streams_kept(s: &Scenario, streams: Streams, upgrade: &str) -> anyhow::Result<()> {
    let mut broken = Vec::new();
    let mut wrong_peer = Vec::new();
    for (i, stream) in streams.into_iter().enumerate() {
        let attempts = stream
            .join()
            .map_err(|_| RigError::Other(format!("stream {i}: client thread panicked")))??;
        let counts = tally(&attempts);
        let kept = counts.len() == 1
            && attempts.iter().all(|a| {
                matches!(a, Attempt::Ok { .. }) && a.backend().is_some_and(|b| b.ends_with("#1"))
            });
        if !kept {
            broken.push((i, counts));
        }
        if i >= NODE_PORT_STREAMS {
            let peers: std::collections::BTreeSet<SocketAddr> = attempts
                .iter()
                .filter_map(|a| match a {
                    Attempt::Ok { peer, .. } => Some(*peer),
                    Attempt::Err(_) => None,
                })
                .collect();
            if peers.iter().any(|p| *p != cluster_addr()) {
                wrong_peer.push((i, peers));
            }
        }
    }
    eprintln!(
        "{upgrade}: {} of {} streams broken, ClusterIP streams with another peer: {wrong_peer:?}",
        broken.len(),
        NODE_PORT_STREAMS + CLUSTER_IP_STREAMS
    );
    s.ensure(broken.is_empty(), || {
        format!("{upgrade}: every stream keeps its one connection, answered throughout: broken {broken:?}")
    })?;
    s.ensure(wrong_peer.is_empty(), || {
        format!("{upgrade}: getpeername() shows the ClusterIP throughout: {wrong_peer:?}")
    })?;
    Ok(())
}

/// A new hash map of the given type from user space (`BPF_MAP_CREATE`): aya creates only
/// plain hash maps, and the foundation's reverse NAT map was an LRU one.
fn create_map(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
) -> anyhow::Result<OwnedFd> {
    const BPF_MAP_CREATE: libc::c_long = 0;
    // map_type, key_size, value_size, max_entries, map_flags; the rest of `union bpf_attr`
    // the kernel reads must be zero.
    let mut attr = [0u32; 16];
    attr[..4].copy_from_slice(&[map_type, key_size, value_size, max_entries]);
    // SAFETY: a zero-filled `bpf_attr` prefix for BPF_MAP_CREATE, without pointers.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_CREATE,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    if fd < 0 {
        anyhow::bail!("BPF_MAP_CREATE: {}", std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd)?;
    // SAFETY: the kernel just returned this fd and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An empty LRU hash map of `K` → `V` as large as `like` (an older agent's map).
fn older_lru<K: aya::Pod, V: aya::Pod>(like: &MapData) -> anyhow::Result<HashMap<MapData, K, V>> {
    const BPF_MAP_TYPE_LRU_HASH: u32 = 9;
    let fd = create_map(
        BPF_MAP_TYPE_LRU_HASH,
        std::mem::size_of::<K>() as u32,
        std::mem::size_of::<V>() as u32,
        like.info()?.max_entries(),
    )?;
    Ok(HashMap::try_from(Map::from_map_data(MapData::from_fd(
        fd,
    )?)?)?)
}

/// Pins `map` at `pin` in place of the map pinned there: bpffs renames over an existing pin,
/// and the running programs keep the map they reference.
fn pin_in_place(map: &MapData, pin: &Path) -> anyhow::Result<()> {
    // bpffs refuses names with a dot.
    let name = pin.file_name().and_then(|n| n.to_str()).unwrap_or("map");
    let staged = pin.with_file_name(format!("{name}_older"));
    map.pin(&staged)?;
    std::fs::rename(&staged, pin)?;
    Ok(())
}

/// The program each link pinned in `pin_dir` runs (`bpftool link show pinned`): pin name →
/// program id.
fn linked_programs(pin_dir: &Path) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut programs = BTreeMap::new();
    for entry in std::fs::read_dir(pin_dir)? {
        let path = entry?.path();
        let Some(name) = path
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| n.ends_with("_link"))
        else {
            continue;
        };
        let output = Command::new("bpftool")
            .args(["-j", "link", "show", "pinned"])
            .arg(&path)
            .output()?;
        anyhow::ensure!(
            output.status.success(),
            "bpftool link show pinned {}: {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        let link: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        if let Some(id) = link["prog_id"].as_u64() {
            programs.insert(name.to_owned(), id);
        }
    }
    Ok(programs)
}

/// Waits until the restarted agent's programs replaced the previous ones (the previous
/// programs answer until then): every link pinned before the restart (`before`) runs another
/// program, and the agent's first sync is reported — it attaches its programs and copies
/// what the previous ones wrote meanwhile before it reports that sync. Bounded by twice the
/// rig's bound for programming the datapath: this restart verifies every program anew and
/// creates the maps of the new layout, which took 15 s with four tests at once on a loaded
/// two-core machine (each step about four times its time on an idle one).
fn wait_for_new_programs(
    s: &mut Scenario,
    pin_dir: &Path,
    before: &BTreeMap<String, u64>,
) -> anyhow::Result<()> {
    let mut now = BTreeMap::new();
    try_wait_until(
        "the restarted agent's programs attached",
        2 * proxy_tests::scenario::DATAPATH_TIMEOUT,
        Duration::from_millis(50),
        || {
            if s.agent()?.syncs() == 0 {
                return Ok(false);
            }
            now = linked_programs(pin_dir).map_err(|e| RigError::Other(e.to_string()))?;
            Ok(before
                .iter()
                .all(|(pin, old)| now.get(pin).is_some_and(|new| new != old)))
        },
    )
    .map_err(|e| s.agent_error(format!("{e}; links before {before:?}, now {now:?}")))?;
    Ok(())
}

/// Replaces the pinned `KPR_REVNAT4` by one in the foundation's layout with the same entries,
/// and removes the layout records (the foundation agent kept none). Returns the entries' keys.
fn rewrite_revnat4_as_v1(pin_dir: &Path) -> anyhow::Result<Vec<RevNat4Key>> {
    let pin = pin_dir.join(map_names::REVNAT4);
    let current = HashMap::<MapData, RevNat4Key, RevNat4>::try_from(Map::from_map_data(
        MapData::from_pin(&pin)?,
    )?)?;
    let entries: Vec<(RevNat4Key, RevNat4)> = current.iter().collect::<Result<_, _>>()?;
    let mut old = older_lru::<u64, RevNat4V1>(current.map())?;
    for (key, value) in &entries {
        let v1 = RevNat4V1 {
            frontend_addr: value.addr,
            backend_addr: key.addr,
            frontend_port: value.port,
            backend_port: key.port,
            _pad: 0,
        };
        old.insert(key.cookie, v1, 0)?;
    }
    pin_in_place(old.map(), &pin)?;
    std::fs::remove_file(pin_dir.join(LAYOUTS))?;
    Ok(entries.into_iter().map(|(key, _)| key).collect())
}

/// The tc conntrack of both families in one map, as agents before `KPR_CT4`/`KPR_CT6` pinned
/// it (the agent's `layout::v1::CT`).
const ONE_CT_MAP: &str = "KPR_CT";

/// Puts the flows of the pinned `KPR_CT4` and `KPR_CT6` into one map pinned as `KPR_CT`, in
/// the layout of the last agent that had one (version 2: wide keys and values of both
/// families), and unpins the two maps and their layout records, as that agent left its pins.
/// The running programs keep the maps they reference. Returns the entries' keys.
fn rewrite_ct_as_one_map(pin_dir: &Path) -> anyhow::Result<Vec<CtKey>> {
    let open = |name: &str| -> anyhow::Result<Map> {
        Ok(Map::from_map_data(MapData::from_pin(pin_dir.join(name))?)?)
    };
    let v4 = HashMap::<MapData, CtKey4, CtValue4>::try_from(open(map_names::CT4)?)?;
    let v6 = HashMap::<MapData, CtKey, CtValue>::try_from(open(map_names::CT6)?)?;
    let mut entries: Vec<(CtKey, CtValue)> = v4
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| (k.widen(), v.widen()))
        .collect();
    entries.extend(v6.iter().filter_map(Result::ok));
    let mut old = older_lru::<CtKey, v1::CtValueV2>(v6.map())?;
    for (key, value) in &entries {
        old.insert(key, ct_v2(value), 0)?;
    }
    old.map().pin(pin_dir.join(ONE_CT_MAP))?;
    for name in [map_names::CT4, map_names::CT6] {
        std::fs::remove_file(pin_dir.join(name))?;
    }
    std::fs::remove_file(pin_dir.join(LAYOUTS))?;
    Ok(entries.into_iter().map(|(key, _)| key).collect())
}

/// A conntrack value as agents before the service id wrote it (`KPR_CT` version 2, `KPR_CT6`
/// version 1).
fn ct_v2(value: &CtValue) -> v1::CtValueV2 {
    v1::CtValueV2 {
        src: value.src,
        dst: value.dst,
        sport: value.sport,
        dport: value.dport,
        flags: value.flags,
        _pad: 0,
        out_mac: value.out_mac,
        out_ifindex: value.out_ifindex,
        last_seen_ns: value.last_seen_ns,
    }
}

/// An IPv4 conntrack value as agents before the service id wrote it (`KPR_CT4` version 1).
fn ct4_v1(value: &CtValue4) -> v1::CtValue4V1 {
    v1::CtValue4V1 {
        src: value.src,
        dst: value.dst,
        sport: value.sport,
        dport: value.dport,
        flags: value.flags,
        _pad: 0,
        out_mac: value.out_mac,
        out_ifindex: value.out_ifindex,
        last_seen_ns: value.last_seen_ns,
    }
}

/// Replaces the map pinned as `name` (keys `K`, values `V`) by one with the same entries in an
/// older value layout (`convert`), which the running programs do not reference, and records it
/// in `KPR_LAYOUTS` as `version`, as the agent that pinned that layout did. Returns the keys.
fn rewrite_values<K: aya::Pod, V: aya::Pod, O: aya::Pod>(
    pin_dir: &Path,
    name: &str,
    version: u32,
    convert: fn(&V) -> O,
) -> anyhow::Result<Vec<K>> {
    let pin = pin_dir.join(name);
    let current =
        HashMap::<MapData, K, V>::try_from(Map::from_map_data(MapData::from_pin(&pin)?)?)?;
    let entries: Vec<(K, V)> = current.iter().filter_map(Result::ok).collect();
    let mut old = older_lru::<K, O>(current.map())?;
    for (key, value) in &entries {
        old.insert(key, convert(value), 0)?;
    }
    pin_in_place(old.map(), &pin)?;
    let mut layouts = HashMap::<MapData, LayoutKey, LayoutRecord>::try_from(Map::from_map_data(
        MapData::from_pin(pin_dir.join(LAYOUTS))?,
    )?)?;
    let key = LayoutKey::new(name).ok_or_else(|| anyhow::anyhow!("name {name} too long"))?;
    let record = LayoutRecord {
        version,
        key_size: std::mem::size_of::<K>() as u32,
        value_size: std::mem::size_of::<O>() as u32,
        _pad: 0,
    };
    layouts.insert(key, record, 0)?;
    Ok(entries.into_iter().map(|(key, _)| key).collect())
}

/// The layout record of `name` in the pinned `KPR_LAYOUTS`.
fn record(pin_dir: &Path, name: &str) -> anyhow::Result<Option<LayoutRecord>> {
    let map = HashMap::<MapData, LayoutKey, LayoutRecord>::try_from(Map::from_map_data(
        MapData::from_pin(pin_dir.join(LAYOUTS))?,
    )?)?;
    let key = LayoutKey::new(name).ok_or_else(|| anyhow::anyhow!("name {name} too long"))?;
    Ok(map.get(&key, 0).ok())
}

/// The scenario (`proxy_tests::takeover`: 200 TCP streams and 50 UDP flows over every
/// kind of frontend in both families, new connections all along) runs while the agent stops,
/// its `KPR_REVNAT4` is turned into the foundation's layout (same entries) and a new agent
/// starts on those pins: it migrates the entries, so the IPv4 ClusterIP streams' getpeername()
/// keeps showing the ClusterIP (with the map started empty it shows the backend: the figures'
/// "wrong peer"), and every figure is 0.
#[test]
fn established_connections_keep_their_state_across_an_upgrade_from_an_older_map_layout()
-> anyhow::Result<()> {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = takeover::setup()?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    takeover::wait_served(&mut s)?;
    let pins = pin_dir(&mut s)?;
    let traffic = takeover::start_traffic(&s)?;
    s.agent()?.stop()?;
    let keys = rewrite_revnat4_as_v1(&pins)?;
    let entries = keys.len();
    // The node's and the pod's IPv4 ClusterIP streams and flows: one entry per socket.
    s.ensure(
        entries >= 2 * (takeover::TCP_PER_PATH + takeover::UDP_PER_PATH),
        || format!("the ClusterIP sockets' reverse NAT entries are in the map: {entries}"),
    )?;
    let links = linked_programs(&pins)?;
    s.agent()?.restart()?;
    // The previous programs answer until the new agent's replace them: wait for that (the
    // second copy runs right after).
    wait_for_new_programs(&mut s, &pins, &links)?;
    let (running, all) = traffic.running();
    s.ensure(running == all, || {
        format!(
            "the upgrade must complete while the traffic runs: only {running} of {all} still ran"
        )
    })?;
    ensure_revnat4_migrated(&s, &pins, &keys)?;
    let transition = "upgrade with a map-layout change";
    let figures = traffic.finish(transition)?;
    takeover::report(&s, transition, &figures)?;
    let recorded = record(&pins, map_names::REVNAT4)?;
    s.ensure(
        recorded.is_some_and(|r| r.version == 2 && r.key_size == 16),
        || format!("KPR_REVNAT4 is recorded in its current layout: {recorded:?}"),
    )?;
    Ok(())
}

/// Fails unless the pinned `KPR_REVNAT4` (the current layout) holds every entry `keys` of the
/// older layout: the agent copied them all (nothing deletes reverse NAT entries).
fn ensure_revnat4_migrated(
    s: &Scenario,
    pin_dir: &Path,
    keys: &[RevNat4Key],
) -> anyhow::Result<()> {
    let map = HashMap::<MapData, RevNat4Key, RevNat4>::try_from(Map::from_map_data(
        MapData::from_pin(pin_dir.join(map_names::REVNAT4))?,
    )?)?;
    let present: BTreeSet<RevNat4Key> = map.keys().filter_map(Result::ok).collect();
    let missing = keys.iter().filter(|k| !present.contains(k)).count();
    s.ensure(missing == 0, || {
        format!(
            "the agent copies every entry of KPR_REVNAT4's older layout: {missing} of {} missing",
            keys.len()
        )
    })?;
    Ok(())
}

/// Fails unless the pinned `KPR_CT4` and `KPR_CT6` hold at least `at_least` of the entries
/// `keys` of the one conntrack map (the flows that ended meanwhile may be collected).
fn ensure_ct_migrated(
    s: &Scenario,
    pin_dir: &Path,
    keys: &[CtKey],
    at_least: usize,
) -> anyhow::Result<()> {
    let open = |name: &str| -> anyhow::Result<Map> {
        Ok(Map::from_map_data(MapData::from_pin(pin_dir.join(name))?)?)
    };
    let v4 = HashMap::<MapData, CtKey4, CtValue4>::try_from(open(map_names::CT4)?)?;
    let v6 = HashMap::<MapData, CtKey, CtValue>::try_from(open(map_names::CT6)?)?;
    let mut present: BTreeSet<CtKey> = v4
        .keys()
        .filter_map(Result::ok)
        .map(|k| k.widen())
        .collect();
    present.extend(v6.keys().filter_map(Result::ok));
    let copied = keys.iter().filter(|k| present.contains(k)).count();
    s.ensure(copied >= at_least, || {
        format!(
            "the agent copies the one conntrack map's entries by family: {copied} of {} there, \
             at least {at_least} expected",
            keys.len()
        )
    })?;
    Ok(())
}

/// The one conntrack map of both families (`KPR_CT`, layout version 2) that agents before the
/// per-family maps pinned, left without layout records: this agent recognises it by its sizes,
/// copies every entry into `KPR_CT4` or `KPR_CT6` by family before its programs replace the
/// running ones (and again after), unpins it, and the external streams through the NodePort
/// keep their connection and backend; both maps are recorded in their layout afterwards.
#[test]
fn external_flows_keep_their_conntrack_when_it_splits_by_family() -> anyhow::Result<()> {
    let mut s = setup()?;
    let pins = pin_dir(&mut s)?;
    let (streams, _, _) = open_streams(&mut s, 40)?;
    s.agent()?.stop()?;
    let keys = rewrite_ct_as_one_map(&pins)?;
    let flows = keys.len();
    // Each NodePort stream is SNATed: forward, reply and two egress entries.
    s.ensure(flows >= 2 * NODE_PORT_STREAMS, || {
        format!("the NodePort streams' conntrack entries are in the map: {flows}")
    })?;
    let links = linked_programs(&pins)?;
    s.agent()?.restart()?;
    wait_for_new_programs(&mut s, &pins, &links)?;
    ensure_ct_migrated(&s, &pins, &keys, 2 * NODE_PORT_STREAMS)?;
    ensure_streams_kept(&s, streams, "conntrack split by family")?;
    s.ensure(!pins.join(ONE_CT_MAP).exists(), || {
        "the one conntrack map is unpinned once migrated".to_owned()
    })?;
    ensure_ct_recorded_as_current(&s, &pins)?;
    // The streams' IPv4 flows went into the IPv4 map.
    let narrow = HashMap::<MapData, CtKey4, CtValue4>::try_from(Map::from_map_data(
        MapData::from_pin(pins.join(map_names::CT4))?,
    )?)?;
    let v4_entries = narrow.iter().filter_map(Result::ok).count();
    s.ensure(v4_entries >= 2 * NODE_PORT_STREAMS, || {
        format!("the IPv4 streams' entries are in KPR_CT4: {v4_entries}")
    })?;
    Ok(())
}

/// Fails unless `KPR_CT4` and `KPR_CT6` are recorded in this build's layout (version 3: values
/// with the flow's service id and its kept next hop).
fn ensure_ct_recorded_as_current(s: &Scenario, pins: &Path) -> anyhow::Result<()> {
    for (name, key_size, value_size) in [(map_names::CT4, 16, 64), (map_names::CT6, 40, 88)] {
        let recorded = record(pins, name)?;
        s.ensure(
            recorded.is_some_and(|r| {
                r.version == 3 && r.key_size == key_size && r.value_size == value_size
            }),
            || format!("{name} is recorded in its current layout: {recorded:?}"),
        )?;
    }
    Ok(())
}

/// The per-family conntrack maps of the agent before their values carried the flow's service
/// id (`KPR_CT4`, `KPR_CT6` and their handshake maps in version 1, recorded as such): this
/// agent copies every entry into maps of its own layout (service id 0: the flow's packets are
/// not counted) before its programs replace the running ones, and the external streams through
/// the NodePort keep their connection and backend.
#[test]
fn external_flows_keep_their_conntrack_when_its_values_gain_the_service_id() -> anyhow::Result<()> {
    let mut s = setup()?;
    let pins = pin_dir(&mut s)?;
    let (streams, _, _) = open_streams(&mut s, 40)?;
    s.agent()?.stop()?;
    let mut keys: Vec<CtKey> = rewrite_values(&pins, map_names::CT4, 1, ct4_v1)?
        .into_iter()
        .map(|key: CtKey4| key.widen())
        .collect();
    keys.extend(rewrite_values::<CtKey, CtValue, _>(
        &pins,
        map_names::CT6,
        1,
        ct_v2,
    )?);
    rewrite_values::<CtKey4, CtValue4, _>(&pins, map_names::CT4_NEW, 1, ct4_v1)?;
    rewrite_values::<CtKey, CtValue, _>(&pins, map_names::CT6_NEW, 1, ct_v2)?;
    let flows = keys.len();
    // Each NodePort stream is SNATed: forward, reply and two egress entries.
    s.ensure(flows >= 2 * NODE_PORT_STREAMS, || {
        format!("the NodePort streams' conntrack entries are in the maps: {flows}")
    })?;
    let links = linked_programs(&pins)?;
    s.agent()?.restart()?;
    wait_for_new_programs(&mut s, &pins, &links)?;
    ensure_ct_migrated(&s, &pins, &keys, 2 * NODE_PORT_STREAMS)?;
    ensure_streams_kept(&s, streams, "conntrack values with the service id")?;
    ensure_ct_recorded_as_current(&s, &pins)?;
    Ok(())
}

/// The per-family conntrack maps of the agent before their values kept the next hop
/// (version 2, recorded as such): this agent copies every entry into maps of its own layout
/// (no next hop kept: each flow's next packet looks it up) before its programs replace the
/// running ones, and the external streams through the NodePort keep their connection and
/// backend.
#[test]
fn external_flows_keep_their_conntrack_when_its_values_gain_the_next_hop() -> anyhow::Result<()> {
    let mut s = setup()?;
    let pins = pin_dir(&mut s)?;
    let (streams, _, _) = open_streams(&mut s, 40)?;
    s.agent()?.stop()?;
    let mut keys: Vec<CtKey> = rewrite_values(&pins, map_names::CT4, 2, ct4_v2)?
        .into_iter()
        .map(|key: CtKey4| key.widen())
        .collect();
    keys.extend(rewrite_values::<CtKey, CtValue, _>(
        &pins,
        map_names::CT6,
        2,
        ct6_v2,
    )?);
    rewrite_values::<CtKey4, CtValue4, _>(&pins, map_names::CT4_NEW, 2, ct4_v2)?;
    rewrite_values::<CtKey, CtValue, _>(&pins, map_names::CT6_NEW, 2, ct6_v2)?;
    s.ensure(keys.len() >= 2 * NODE_PORT_STREAMS, || {
        format!(
            "the NodePort streams' conntrack entries are in the maps: {}",
            keys.len()
        )
    })?;
    let links = linked_programs(&pins)?;
    s.agent()?.restart()?;
    wait_for_new_programs(&mut s, &pins, &links)?;
    ensure_ct_migrated(&s, &pins, &keys, 2 * NODE_PORT_STREAMS)?;
    ensure_streams_kept(&s, streams, "conntrack values with the next hop")?;
    ensure_ct_recorded_as_current(&s, &pins)?;
    Ok(())
}

/// An IPv4 conntrack value as agents before the kept next hop wrote it (`KPR_CT4` version 2).
fn ct4_v2(value: &CtValue4) -> v2::CtValue4 {
    v2::CtValue4 {
        src: value.src,
        dst: value.dst,
        sport: value.sport,
        dport: value.dport,
        flags: value.flags,
        _pad: 0,
        out_mac: value.out_mac,
        out_ifindex: value.out_ifindex,
        last_seen_ns: value.last_seen_ns,
        service_id: value.service_id,
        _pad2: 0,
    }
}

/// The same for `KPR_CT6` version 2.
fn ct6_v2(value: &CtValue) -> v2::CtValue {
    v2::CtValue {
        src: value.src,
        dst: value.dst,
        sport: value.sport,
        dport: value.dport,
        flags: value.flags,
        _pad: 0,
        out_mac: value.out_mac,
        out_ifindex: value.out_ifindex,
        last_seen_ns: value.last_seen_ns,
        service_id: value.service_id,
        _pad2: 0,
    }
}

/// A newer agent's `KPR_FRONTENDS4` (its record says version 99) found by this agent: it says so
/// (map, version, sizes, what that costs), rebuilds the map, and keeps the previous programs
/// serving until its first sync has filled it, so that no new connection fails across the
/// restart, established streams keep their connection, and the map is recorded in this
/// agent's version afterwards.
#[test]
fn a_map_in_an_unknown_layout_is_reported_and_rebuilt_without_a_failed_connection()
-> anyhow::Result<()> {
    let mut s = setup()?;
    let pins = pin_dir(&mut s)?;
    let (streams, _outside, node) = open_streams(&mut s, 80)?;
    let frontends =
        || aya::maps::MapInfo::from_pin(pins.join(map_names::FRONTENDS4)).map(|m| m.id());
    let mut newer_map = 0;
    let attempts = restart_under_load(&mut s, &node, &pins, || {
        let layouts = HashMap::<MapData, LayoutKey, LayoutRecord>::try_from(Map::from_map_data(
            MapData::from_pin(pins.join(LAYOUTS))?,
        )?)?;
        let mut layouts = layouts;
        let key = LayoutKey::new(map_names::FRONTENDS4).ok_or_else(|| anyhow::anyhow!("name"))?;
        let mut newer = layouts.get(&key, 0)?;
        newer.version = 99;
        layouts.insert(key, newer, 0)?;
        newer_map = frontends()?;
        Ok(())
    })?;
    // Rebuilt: the pin holds another map than the one in the unknown layout.
    let rebuilt = frontends()?;
    s.ensure(rebuilt != newer_map, || {
        format!("KPR_FRONTENDS4 in an unknown layout must be rebuilt: still map {rebuilt}")
    })?;
    ensure_none_failed(&s, &attempts, "unknown layout")?;
    ensure_streams_kept(&s, streams, "rebuild of an unknown layout")?;
    let recorded = record(&pins, map_names::FRONTENDS4)?;
    s.ensure(recorded.is_some_and(|r| r.version == 1), || {
        format!("KPR_FRONTENDS4 is recorded in this agent's version: {recorded:?}")
    })?;
    Ok(())
}

/// Stops the agent while new connections to the ClusterIP (socket hooks: the frontend map
/// decides) run from `node`, calls `between` on the stopped agent's pins, restarts it and waits
/// for its programs; returns the connections, which spanned the whole restart.
fn restart_under_load(
    s: &mut Scenario,
    node: &Client,
    pins: &Path,
    between: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<Attempt>> {
    let load = node
        .clone()
        .interval(Duration::from_millis(10))
        .timeout(Duration::from_millis(1000));
    // Batches until told to stop, so that they span the restart however long it takes on a
    // loaded machine.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = std::sync::Arc::clone(&stop);
    let load = std::thread::spawn(move || -> proxy_tests::Result<Vec<Attempt>> {
        let mut attempts = Vec::new();
        while !stopped.load(std::sync::atomic::Ordering::Relaxed) && attempts.len() < 10_000 {
            attempts.extend(load.run(cluster_addr(), 30)?);
        }
        Ok(attempts)
    });
    // Pacing, not a settle: the load runs for a while before the restart it must span.
    std::thread::sleep(Duration::from_millis(300));
    s.agent()?.stop()?;
    let changed = between();
    let restarted = changed.and_then(|()| {
        let links = linked_programs(pins)?;
        s.agent()?.restart()?;
        wait_for_new_programs(s, pins, &links)?;
        s.ensure(!load.is_finished(), || {
            "the new connections must run across the whole restart".into()
        })?;
        Ok(())
    });
    // Stopped in any case: the thread ends within a batch.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let attempts = load
        .join()
        .map_err(|_| RigError::Other("load thread panicked".into()))??;
    restarted?;
    Ok(attempts)
}

fn ensure_none_failed(s: &Scenario, attempts: &[Attempt], what: &str) -> anyhow::Result<()> {
    let failed: Vec<&Attempt> = attempts.iter().filter(|a| !is_pod(a)).collect();
    eprintln!(
        "{what}: {} new connections across the restart, {} failed: {:?}",
        attempts.len(),
        failed.len(),
        tally(attempts)
    );
    s.ensure(failed.is_empty(), || {
        format!(
            "{what}: no new connection fails across the restart: {:?}",
            tally(attempts)
        )
    })?;
    Ok(())
}

/// The previous agent's `KPR_BACKENDS4`, a hash map of backend id → backend (layout version 1,
/// the same key and value sizes as today's array): the new agent rebuilds it as an array with
/// the service maps that share its ids, fills them from the Services and only then replaces
/// the previous programs, so no new connection fails; the array holds the backends afterwards
/// and is recorded as version 2.
#[test]
fn backends_in_the_previous_hash_layout_become_an_array_without_a_failed_connection()
-> anyhow::Result<()> {
    const BPF_MAP_TYPE_HASH: u32 = 1;
    let mut s = setup()?;
    let pins = pin_dir(&mut s)?;
    let (streams, _outside, node) = open_streams(&mut s, 80)?;
    let backends = pins.join(map_names::BACKENDS4);
    let mut written = Vec::new();
    let attempts = restart_under_load(&mut s, &node, &pins, || {
        let array = aya::maps::Array::<MapData, Backend4>::try_from(Map::from_map_data(
            MapData::from_pin(&backends)?,
        )?)?;
        written = (0..)
            .zip(array.iter())
            .filter_map(|(id, b)| Some((id, b.ok()?)))
            .filter(|(_, b)| b.in_use())
            .collect();
        let fd = create_map(
            BPF_MAP_TYPE_HASH,
            4,
            std::mem::size_of::<Backend4>() as u32,
            array.len(),
        )?;
        let mut hash = HashMap::<MapData, u32, Backend4>::try_from(Map::from_map_data(
            MapData::from_fd(fd)?,
        )?)?;
        for (id, backend) in &written {
            hash.insert(id, backend, 0)?;
        }
        pin_in_place(hash.map(), &backends)?;
        let mut layouts = HashMap::<MapData, LayoutKey, LayoutRecord>::try_from(
            Map::from_map_data(MapData::from_pin(pins.join(LAYOUTS))?)?,
        )?;
        let key = LayoutKey::new(map_names::BACKENDS4).ok_or_else(|| anyhow::anyhow!("name"))?;
        let mut previous = layouts.get(&key, 0)?;
        previous.version = 1;
        layouts.insert(key, previous, 0)?;
        Ok(())
    })?;
    s.ensure(written.len() == 2, || {
        format!("web's two backends were in the array: {written:?}")
    })?;
    ensure_none_failed(&s, &attempts, "backends from a hash map to an array")?;
    ensure_streams_kept(&s, streams, "backends from a hash map to an array")?;
    let info = aya::maps::MapInfo::from_pin(&backends)?;
    s.ensure(
        info.map_type().ok() == Some(aya::maps::MapType::Array),
        || format!("KPR_BACKENDS4 is an array again: {:?}", info.map_type()),
    )?;
    let array = aya::maps::Array::<MapData, Backend4>::try_from(Map::from_map_data(
        MapData::from_pin(&backends)?,
    )?)?;
    let mut now: Vec<Backend4> = array.iter().flatten().filter(|b| b.in_use()).collect();
    let mut before: Vec<Backend4> = written.iter().map(|(_, b)| *b).collect();
    now.sort();
    before.sort();
    s.ensure(now == before, || {
        format!("the array holds web's backends: {now:?}, before {before:?}")
    })?;
    let recorded = record(&pins, map_names::BACKENDS4)?;
    s.ensure(recorded.is_some_and(|r| r.version == 2), || {
        format!("KPR_BACKENDS4 is recorded as the array's version: {recorded:?}")
    })?;
    Ok(())
}
