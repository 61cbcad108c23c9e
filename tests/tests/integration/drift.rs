//! Drift detection and repair with a real agent: the test changes the pinned maps from outside
//! (corrupts, deletes and adds entries in the frontend, slot, backend, affinity match and
//! source range maps and in the node maps — the node config entry and the NodePort address
//! set; Maglev tables are covered by the unit tests — and adds orphans: an affinity entry of a
//! Service that does not exist, a UDP socket's entry and a UDP conntrack entry of a backend that
//! does not exist), `proxy-agent inspect drift` reports each change without repairing it, and the agent's periodic check repairs them within one period —
//! counted in `kubeproxy_ebpf_drift_repairs_total{map}` and logged — while traffic to a Service
//! the changes do not touch keeps flowing. A TCP conntrack entry of a backend that does not
//! exist (a draining flow) and a UDP one of a live backend are not orphans and survive the
//! repair. Needs root.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, lpm_trie::Key};
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend4, BackendSlotKey, CtKey, CtValue,
    Frontend4Key, FrontendValue, NodeAddrKey, NodeConfig, SLOT_BLOCK_SLOTS, SlotBlock, SnatAddrs,
    SourceRangeKey, family, map_names, proto, scope,
};
use proxy_dataplane_ebpf::{ConntrackMaps, PIN_DIR_NAME};
use proxy_tests::{
    agent::agent_binary,
    client::{Attempt, tally},
    manifests::Endpoint,
    scenario::{
        CLUSTER_IP, SERVICE_PORT, Scenario, cluster_addr, http_service, http_slice, pod_endpoint,
    },
};

/// The agent's check period in this test: short, so that "within one period" is quick to see.
const PERIOD: Duration = Duration::from_secs(4);
/// The Service the test leaves alone.
const API_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);

fn map_addr(addr: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(addr.octets())
}

fn open<K: aya::Pod, V: aya::Pod>(
    pin_dir: &Path,
    name: &str,
) -> anyhow::Result<HashMap<MapData, K, V>> {
    let data = MapData::from_pin(pin_dir.join(name))?;
    Ok(HashMap::try_from(Map::from_map_data(data)?)?)
}

fn frontend_key(addr: Ipv4Addr) -> Frontend4Key {
    Frontend4Key {
        addr: map_addr(addr),
        port: SERVICE_PORT.to_be(),
        proto: proto::TCP,
        scope: scope::INTERNAL,
    }
}

/// `proxy-agent inspect drift --json` in the node's namespace.
fn inspect_drift(netns: &Path) -> anyhow::Result<serde_json::Value> {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(agent_binary()?)
        .args(["inspect", "drift", "--json"])
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect drift failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// (map, kind) of each reported entry, sorted.
fn drift_kinds(report: &serde_json::Value) -> Vec<(String, String)> {
    let mut kinds: Vec<(String, String)> = report["drift"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            (
                d["map"].as_str().unwrap_or_default().to_owned(),
                d["kind"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    kinds.sort();
    kinds
}

/// `kubeproxy_ebpf_drift_repairs_total` by map, scraped in the node's namespace.
fn repair_counters(netns: &Path) -> anyhow::Result<Vec<(String, u64)>> {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args([
            "curl",
            "-s",
            "--max-time",
            "5",
            "http://127.0.0.1:10249/metrics",
        ])
        .output()?;
    let text = String::from_utf8(output.stdout)?;
    Ok(text
        .lines()
        .filter_map(|line| line.strip_prefix("kubeproxy_ebpf_drift_repairs_total{map=\""))
        .filter_map(|rest| {
            let (map, value) = rest.split_once("\"} ")?;
            Some((map.to_owned(), value.trim().parse().ok()?))
        })
        .collect())
}

/// Corrupts, deletes and adds entries of `default/web`'s frontend; returns the backend id whose
/// address it corrupted.
fn tamper(pin_dir: &Path) -> anyhow::Result<u32> {
    let mut frontends: HashMap<_, Frontend4Key, FrontendValue> =
        open(pin_dir, map_names::FRONTENDS4)?;
    let web = frontends.get(&frontend_key(CLUSTER_IP), 0)?;
    anyhow::ensure!(web.backend_count == 2, "web: {web:?}");
    let mut slots: HashMap<_, BackendSlotKey, SlotBlock> = open(pin_dir, map_names::BACKEND_SLOTS)?;
    // The block holding slot `slot`.
    let block_of = |slot: u32| BackendSlotKey {
        service_id: web.service_id,
        block: (slot / SLOT_BLOCK_SLOTS) as u16,
        generation: web.generation,
        _pad: 0,
    };
    let first = slots.get(&block_of(0), 0)?.backend_ids[0];
    // Corrupt: the first backend now leads to a documentation address.
    let data = MapData::from_pin(pin_dir.join(map_names::BACKENDS4))?;
    let mut backends: Array<_, Backend4> = Array::try_from(Map::from_map_data(data)?)?;
    let mut backend = backends.get(&first, 0)?;
    backend.addr = map_addr(Ipv4Addr::new(192, 0, 2, 1));
    backends.set(first, backend, 0)?;
    // Delete: the block holding the second slot (web's two slots share one block, so the
    // frontend is left without slots until the repair).
    slots.remove(&block_of(1))?;
    // Add: a frontend nobody programmed, and an affinity match entry for a Service without
    // affinity.
    frontends.insert(frontend_key(Ipv4Addr::new(10, 96, 0, 99)), web, 0)?;
    let mut matches: HashMap<_, AffinityMatchKey, u8> = open(pin_dir, map_names::AFFINITY_MATCH)?;
    matches.insert(
        AffinityMatchKey {
            service_id: web.service_id,
            backend_id: first,
        },
        1,
        0,
    )?;
    // Add: a source range for a Service that has none.
    let data = MapData::from_pin(pin_dir.join(map_names::SOURCE_RANGES))?;
    let mut ranges: LpmTrie<_, SourceRangeKey, u8> = LpmTrie::try_from(Map::from_map_data(data)?)?;
    let range = SourceRangeKey {
        service_id: web.service_id,
        addr: [map_addr(Ipv4Addr::new(198, 51, 100, 0)), 0, 0, 0],
    };
    ranges.insert(&Key::new(32 + 24, range), 1, 0)?;
    tamper_node_and_orphans(pin_dir, web.service_id)?;
    Ok(first)
}

fn node_addr(addr: Ipv4Addr) -> NodeAddrKey {
    NodeAddrKey {
        addr: [map_addr(addr), 0, 0, 0],
        family: family::V4,
        _pad: [0; 3],
    }
}

/// A conntrack entry of a flow from the external client to `backend` through the ClusterIP.
fn ct_entry(protocol: u8, backend: Ipv4Addr) -> anyhow::Result<(CtKey, CtValue)> {
    let key = CtKey {
        src: [map_addr(Ipv4Addr::new(10, 10, 0, 2)), 0, 0, 0],
        dst: [map_addr(CLUSTER_IP), 0, 0, 0],
        sport: 40_000u16.to_be(),
        dport: SERVICE_PORT.to_be(),
        proto: protocol,
        family: family::V4,
        _pad: 0,
    };
    let value = CtValue {
        src: key.src,
        dst: [map_addr(backend), 0, 0, 0],
        sport: key.sport,
        dport: 8080u16.to_be(),
        // Fresh, so the agent's conntrack garbage collection leaves it alone.
        last_seen_ns: proxy_dataplane_ebpf::monotonic_ns()?,
        ..CtValue::default()
    };
    Ok((key, value))
}

const GONE_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 244, 99, 2);

/// The conntrack entries the test adds: (entry, whether it is an orphan).
fn ct_entries() -> anyhow::Result<Vec<((CtKey, CtValue), bool)>> {
    let mut udp_live = ct_entry(proto::UDP, proxy_tests::topology::Topology::pod_ip(1))?;
    let mut tcp_gone = ct_entry(proto::TCP, GONE_BACKEND)?;
    // Distinct client ports: one key per entry.
    udp_live.0.sport = 40_001u16.to_be();
    tcp_gone.0.sport = 40_002u16.to_be();
    Ok(vec![
        (ct_entry(proto::UDP, GONE_BACKEND)?, true),
        (udp_live, false),
        (tcp_gone, false),
    ])
}

/// The node maps (a NodePort address deleted, one added, the config's SNAT address corrupted,
/// an interface's SNAT addresses deleted) and orphans in the maps the datapath writes.
fn tamper_node_and_orphans(pin_dir: &Path, web_service: u32) -> anyhow::Result<()> {
    let mut addrs: HashMap<_, NodeAddrKey, u8> = open(pin_dir, map_names::NODE_ADDRS)?;
    match addrs.remove(&node_addr(proxy_tests::topology::Topology::node_ext_ip())) {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
        Err(e) => return Err(e.into()),
    }
    addrs.insert(node_addr(Ipv4Addr::new(203, 0, 113, 9)), 1, 0)?;
    let data = MapData::from_pin(pin_dir.join(map_names::NODE_CONFIG))?;
    let mut config: Array<_, NodeConfig> = Array::try_from(Map::from_map_data(data)?)?;
    let mut c = config.get(&0, 0)?;
    c.snat4 = map_addr(Ipv4Addr::new(192, 0, 2, 99));
    config.set(0, c, 0)?;
    let mut snat: HashMap<_, u32, SnatAddrs> = open(pin_dir, map_names::SNAT_IFACES)?;
    // One entry: each is a drift of its own.
    let uplink = snat
        .keys()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no interface's SNAT addresses to delete"))??;
    snat.remove(&uplink)?;

    let now = proxy_dataplane_ebpf::monotonic_ns()?;
    let mut affinity: HashMap<_, AffinityKey, AffinityValue> = open(pin_dir, map_names::AFFINITY)?;
    let gone_service = AffinityKey {
        client: 7,
        service_id: 0xdead,
        _pad: 0,
    };
    let value = |backend_id| AffinityValue {
        backend_id,
        _pad: 0,
        last_used_ns: now,
    };
    affinity.insert(gone_service, value(1), 0)?;
    let mut sticky: HashMap<_, AffinityKey, AffinityValue> = open(pin_dir, map_names::UDP_STICKY)?;
    let socket = AffinityKey {
        client: 8,
        service_id: web_service,
        _pad: 0,
    };
    sticky.insert(socket, value(0xbeef), 0)?;
    let mut ct = ConntrackMaps::open_pinned(pin_dir)?;
    for ((key, value), _) in ct_entries()? {
        ct.insert(&key, &value, 0)?;
    }
    Ok(())
}

fn expected_kinds() -> Vec<(String, String)> {
    let mut kinds: Vec<(String, String)> = [
        ("KPR_AFFINITY_MATCH", "extra"),
        ("KPR_BACKENDS4", "changed"),
        ("KPR_BACKEND_SLOTS", "missing"),
        ("KPR_FRONTENDS4", "extra"),
        ("KPR_SOURCE_RANGES", "extra"),
        ("KPR_NODE_ADDRS", "missing"),
        ("KPR_NODE_ADDRS", "extra"),
        ("KPR_NODE_CONFIG", "changed"),
        ("KPR_SNAT_IFACES", "missing"),
        ("KPR_AFFINITY", "orphan"),
        ("KPR_UDP_STICKY", "orphan"),
        ("KPR_CT4", "orphan"),
    ]
    .into_iter()
    .map(|(map, kind)| (map.to_owned(), kind.to_owned()))
    .collect();
    kinds.sort();
    kinds
}

#[test]
fn drifted_ebpf_maps_are_reported_and_repaired_within_one_period() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(3)?;
    s.write_web_service(2)?;
    s.manifests
        .write("api-svc.yaml", &http_service("default", "api", API_IP))?;
    let api_endpoints: Vec<Endpoint> = vec![pod_endpoint(3)];
    s.manifests.write(
        "api-slice.yaml",
        &http_slice("default", "api-1", "api", &api_endpoints),
    )?;
    let period = format!("{}s", PERIOD.as_secs());
    let client = s.start_serving("ebpf", &["--drift-check-period", &period])?;
    let api = SocketAddr::from((API_IP, SERVICE_PORT));
    s.wait_for_datapath(api, "api answered by pod3", |a| a.backend() == Some("pod3"))?;
    let netns = s.topo.node().path();
    let pin_dir = s.agent()?.bpf_root().join(PIN_DIR_NAME);

    let before = inspect_drift(&netns)?;
    assert_eq!(before["checked"], true, "{before}");
    assert_eq!(drift_kinds(&before), [], "{before}");

    // Traffic to the untouched Service for the whole tamper → report → repair window.
    let api_client = client.clone().interval(Duration::from_millis(100));
    let api_traffic = thread::spawn(move || api_client.run(api, 120));

    // The agent's check may run between the tampering and the looks below (then a look is
    // empty because it was already repaired): try again, a bounded number of times. An attempt
    // counts when the report, a second look and the table all show the drift, so a look that
    // repaired anything would fail every attempt.
    let mut reported = None;
    for _ in 0..3 {
        tamper(&pin_dir)?;
        let tampered_at = Instant::now();
        let report = inspect_drift(&netns)?;
        eprintln!("inspect drift after tampering: {report:#}");
        if drift_kinds(&report) == expected_kinds() {
            // Reporting repairs nothing: a second look sees the same (in the table for people).
            let again = drift_kinds(&inspect_drift(&netns)?);
            let table = Command::new("nsenter")
                .arg(format!("--net={}", netns.display()))
                .arg(agent_binary()?)
                .args(["inspect", "drift"])
                .output()?;
            let table = String::from_utf8(table.stdout)?;
            eprintln!("{table}");
            if again == expected_kinds()
                && table.contains("KPR_BACKENDS4")
                && table.contains("192.0.2.1:8080")
            {
                reported = Some((report, tampered_at));
                break;
            }
            eprintln!("a second look found {again:?}: the agent's check ran in between");
        } else {
            assert!(
                tampered_at.elapsed() < PERIOD,
                "inspect drift did not report the tampering: {report:#}"
            );
        }
        // The agent's check ran in between: once its repair is complete, the next check is a
        // whole period away, the best moment to tamper again.
        proxy_tests::wait::try_wait_until(
            "the raced repair complete",
            PERIOD + Duration::from_secs(2),
            Duration::from_millis(200),
            || {
                Ok(drift_kinds(
                    &inspect_drift(&netns)
                        .map_err(|e| proxy_tests::RigError::Other(e.to_string()))?,
                )
                .is_empty())
            },
        )?;
    }
    let (report, tampered_at) =
        reported.ok_or_else(|| anyhow::anyhow!("every attempt raced with a repair"))?;
    let changed = report["drift"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["map"] == "KPR_BACKENDS4")
        .ok_or_else(|| anyhow::anyhow!("no backend entry in {report}"))?;
    assert_eq!(changed["found"], "192.0.2.1:8080", "{changed}");

    // Repaired within one period (plus the time the check itself takes).
    let mut repaired_after = None;
    while tampered_at.elapsed() < PERIOD + Duration::from_secs(2) {
        if drift_kinds(&inspect_drift(&netns)?).is_empty() {
            repaired_after = Some(tampered_at.elapsed());
            break;
        }
        thread::sleep(Duration::from_millis(200));
    }
    let repaired_after = repaired_after.ok_or_else(|| {
        anyhow::anyhow!(
            "not repaired within one period; agent log:\n{}",
            log_tail(&mut s)
        )
    })?;
    eprintln!("repaired {repaired_after:?} after tampering");

    let counters = repair_counters(&netns)?;
    eprintln!("repair counters: {counters:?}");
    for (map, _) in expected_kinds() {
        assert!(
            counters.iter().any(|(m, v)| *m == map && *v >= 1),
            "{map} not counted: {counters:?}"
        );
    }
    // What the operator is shown of the drift: the repair of the changed backend entry in
    // /metrics, by map.
    let backends_repaired = counters
        .iter()
        .find(|(map, _)| map == "KPR_BACKENDS4")
        .map_or(0, |(_, repaired)| *repaired);
    assert!(
        backends_repaired >= 1,
        "the changed KPR_BACKENDS4 entry is not counted as repaired: {counters:?}"
    );

    // The tampered Service is whole again: both pods, nothing at the corrupted address.
    let attempts = client.run(cluster_addr(), 40)?;
    let seen = tally(&attempts);
    eprintln!("web after repair: {seen:?}");
    assert_eq!(
        seen.keys().map(String::as_str).collect::<Vec<_>>(),
        ["pod1", "pod2"],
        "{seen:?}"
    );

    // Only the orphan left conntrack: the draining TCP flow and the live UDP flow stayed.
    let ct = ConntrackMaps::open_pinned(&pin_dir)?;
    for ((key, _), orphan) in ct_entries()? {
        assert_eq!(
            ct.get(&key).is_some(),
            !orphan,
            "conntrack entry {key:?} (orphan: {orphan})"
        );
    }

    let api_attempts = api_traffic
        .join()
        .map_err(|_| anyhow::anyhow!("traffic thread panicked"))??;
    let failed: Vec<&Attempt> = api_attempts
        .iter()
        .filter(|a| a.backend() != Some("pod3"))
        .collect();
    assert!(
        failed.is_empty(),
        "the untouched Service was disturbed: {failed:?}"
    );
    Ok(())
}

fn log_tail(s: &mut Scenario) -> String {
    s.agent().map(|a| a.log_tail(40)).unwrap_or_default()
}

/// Splits a saved rule into arguments; `"…"` is one argument without its quotes.
fn split_quoted(rule: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = rule.trim();
    while !rest.is_empty() {
        if let Some(quoted) = rest.strip_prefix('"') {
            let (word, after) = quoted.split_once('"').unwrap_or((quoted, ""));
            out.push(word.to_owned());
            rest = after.trim_start();
        } else {
            let (word, after) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push(word.to_owned());
            rest = after.trim_start();
        }
    }
    out
}

/// Runs `command args` in the node's namespace; fails on a non-zero exit.
fn in_node(netns: &Path, command: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(command)
        .args(args)
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "{command} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// `kubeproxy_iptables_drift_repairs_total` by table (IPv4), scraped in the node's namespace.
fn iptables_repair_counters(netns: &Path) -> anyhow::Result<Vec<(String, u64)>> {
    let text = in_node(
        netns,
        "curl",
        &["-s", "--max-time", "5", "http://127.0.0.1:10249/metrics"],
    )?;
    Ok(text
        .lines()
        .filter_map(|line| {
            line.strip_prefix("kubeproxy_iptables_drift_repairs_total{ip_family=\"IPv4\",table=\"")
        })
        .filter_map(|rest| {
            let (table, value) = rest.split_once("\"} ")?;
            Some((table.to_owned(), value.trim().parse().ok()?))
        })
        .collect())
}

/// (kind, chain) of each reported entry, sorted.
fn chain_kinds(report: &serde_json::Value) -> Vec<(String, String)> {
    let mut kinds: Vec<(String, String)> = report["drift"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            (
                d["kind"].as_str().unwrap_or_default().to_owned(),
                d["entry"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    kinds.sort();
    kinds
}

#[test]
fn drifted_iptables_rules_are_reported_and_repaired_within_one_period() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(3)?;
    s.write_web_service(2)?;
    s.manifests
        .write("api-svc.yaml", &http_service("default", "api", API_IP))?;
    let api_endpoints: Vec<Endpoint> = vec![pod_endpoint(3)];
    s.manifests.write(
        "api-slice.yaml",
        &http_slice("default", "api-1", "api", &api_endpoints),
    )?;
    // A local address gives the node a route to the ClusterIP (nat OUTPUT comes after the
    // route lookup); it answers as `untranslated` if the rules ever let a packet through.
    s.topo
        .add_decoy(std::net::IpAddr::V4(API_IP), SERVICE_PORT)?;
    let period = format!("{}s", PERIOD.as_secs());
    // A Service with ClientIP affinity: its chain has `-m recent` rules to tamper with.
    s.manifests.write(
        "sticky-svc.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: sticky, namespace: default}\nspec:\n  \
         clusterIP: 10.96.0.40\n  ports:\n  - {name: http, port: 80, targetPort: 8080, \
         protocol: TCP}\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: \
         {timeoutSeconds: 600}}\n",
    )?;
    s.manifests.write(
        "sticky-slice.yaml",
        &http_slice("default", "sticky-1", "sticky", &[pod_endpoint(1)]),
    )?;
    let client = s.start_serving("iptables", &["--drift-check-period", &period])?;
    let api = SocketAddr::from((API_IP, SERVICE_PORT));
    let netns = s.topo.node().path();
    let probe = client.clone();
    proxy_tests::wait::wait_until(
        "api answered by pod3",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || probe.once(api).is_ok_and(|a| a.backend() == Some("pod3")),
    )?;

    // The live ruleset as iptables-save prints it is no drift (no false alarm from its
    // normalisation), before any tampering.
    let before = inspect_drift(&netns)?;
    assert_eq!(before["checked"], true, "{before}");
    assert_eq!(chain_kinds(&before), [], "{before}");

    let nat = in_node(&netns, "iptables-save", &["-t", "nat"])?;
    let web_chain = nat
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES") && l.contains("-d 10.96.0.10/32"))
        .find_map(|l| l.split("-j ").nth(1))
        .map(|chain| chain.trim().to_owned())
        .ok_or_else(|| anyhow::anyhow!("no KUBE-SERVICES rule for web in\n{nat}"))?;
    anyhow::ensure!(web_chain.starts_with("KUBE-SVC-"), "{web_chain}");
    let sticky_chain = nat
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES") && l.contains("-d 10.96.0.40/32"))
        .find_map(|l| l.split("-j ").nth(1))
        .map(|chain| chain.trim().to_owned())
        .ok_or_else(|| anyhow::anyhow!("no KUBE-SERVICES rule for sticky in\n{nat}"))?;
    // Its rules as saved: 1 is the `recent --rcheck` jump, 2 the jump with the endpoint's
    // comment. The tampering below changes only a timeout and a comment.
    let sticky_rules: Vec<String> = nat
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("-A {sticky_chain} ")))
        .map(str::to_owned)
        .collect();
    let [recent_rule, comment_rule] = &sticky_rules[..] else {
        anyhow::bail!("{sticky_chain}: {sticky_rules:?}");
    };
    anyhow::ensure!(
        recent_rule.contains("--seconds 600") && comment_rule.contains("-> 10.244.1.2:8080"),
        "{sticky_rules:?}"
    );
    let shorter_affinity = split_quoted(&recent_rule.replace("--seconds 600", "--seconds 5"));
    let other_comment = split_quoted(&comment_rule.replace("-> 10.244.1.2:8080", "-> elsewhere"));

    let api_client = client.clone().interval(Duration::from_millis(100));
    let api_traffic = thread::spawn(move || api_client.run(api, 120));

    // Delete a rule of web's service chain, add one to KUBE-SERVICES, add a chain under our
    // names, flush the canary, change a mark, a `recent` timeout and a comment.
    let tamper = |netns: &Path| -> anyhow::Result<Instant> {
        in_node(netns, "iptables", &["-t", "nat", "-D", &web_chain, "1"])?;
        in_node(
            netns,
            "iptables",
            &[
                "-t",
                "nat",
                "-I",
                "KUBE-SERVICES",
                "1",
                "-d",
                "10.96.0.99/32",
                "-p",
                "tcp",
                "--dport",
                "80",
                "-j",
                &web_chain,
            ],
        )?;
        in_node(
            netns,
            "iptables",
            &["-t", "nat", "-N", "KUBE-SEP-DRIFTTEST"],
        )?;
        in_node(
            netns,
            "iptables",
            &["-t", "mangle", "-X", "KUBE-PROXY-CANARY"],
        )?;
        // Outside what decides a packet's DNAT: a mark, a `recent` timeout, a comment.
        in_node(
            netns,
            "iptables",
            &[
                "-t",
                "nat",
                "-R",
                "KUBE-MARK-MASQ",
                "1",
                "-j",
                "MARK",
                "--or-mark",
                "0x8000",
            ],
        )?;
        for (index, rule) in [("1", &shorter_affinity), ("2", &other_comment)] {
            let mut args = vec!["-t", "nat", "-R", sticky_chain.as_str(), index];
            args.extend(rule.iter().map(String::as_str));
            in_node(netns, "iptables", &args)?;
        }
        Ok(Instant::now())
    };
    let expected: Vec<(String, String)> = [
        ("changed", "KUBE-SERVICES"),
        ("changed", web_chain.as_str()),
        ("changed", "KUBE-MARK-MASQ"),
        ("changed", sticky_chain.as_str()),
        ("extra", "KUBE-SEP-DRIFTTEST"),
        ("missing", "KUBE-PROXY-CANARY"),
    ]
    .into_iter()
    .map(|(kind, chain)| (kind.to_owned(), chain.to_owned()))
    .collect();
    let mut sorted_expected = expected.clone();
    sorted_expected.sort();

    let tampered_at = tamper(&netns)?;
    let report = inspect_drift(&netns)?;
    eprintln!("inspect drift after tampering: {report:#}");
    // The agent's own check may come first (then the report is already empty): only a report
    // within the period is meaningful, and then it must list exactly the tampering.
    anyhow::ensure!(
        chain_kinds(&report) == sorted_expected || tampered_at.elapsed() >= PERIOD,
        "inspect drift did not report the tampering: {report:#}"
    );
    anyhow::ensure!(
        chain_kinds(&report) == sorted_expected,
        "the agent repaired before inspect drift could look; rerun"
    );
    // The table for people (README's example), naming the tampered timeout.
    let table = in_node(
        &netns,
        &agent_binary()?.to_string_lossy(),
        &["inspect", "drift"],
    )?;
    eprintln!("{table}");
    assert!(table.contains("--seconds 5"), "{table}");

    let mut repaired_after = None;
    while tampered_at.elapsed() < PERIOD + Duration::from_secs(3) {
        if chain_kinds(&inspect_drift(&netns)?).is_empty() {
            repaired_after = Some(tampered_at.elapsed());
            break;
        }
        thread::sleep(Duration::from_millis(200));
    }
    let repaired_after = repaired_after.ok_or_else(|| {
        anyhow::anyhow!(
            "not repaired within one period; agent log:\n{}",
            log_tail(&mut s)
        )
    })?;
    eprintln!("repaired {repaired_after:?} after tampering");
    let counters = iptables_repair_counters(&netns)?;
    eprintln!("repair counters: {counters:?}");
    for table in ["mangle", "nat"] {
        assert!(
            counters.iter().any(|(t, v)| t == table && *v >= 1),
            "{table} not counted: {counters:?}"
        );
    }
    let nat = in_node(&netns, "iptables-save", &["-t", "nat"])?;
    assert!(!nat.contains("10.96.0.99"), "the added rule survived");
    assert!(
        !nat.contains("--seconds 5 ") && !nat.contains("elsewhere") && !nat.contains("0x8000"),
        "a tampered timeout, comment or mark survived:\n{nat}"
    );
    assert!(
        !nat.contains("KUBE-SEP-DRIFTTEST"),
        "the added chain survived"
    );

    let seen = tally(&client.run(cluster_addr(), 40)?);
    eprintln!("web after repair: {seen:?}");
    assert_eq!(
        seen.keys().map(String::as_str).collect::<Vec<_>>(),
        ["pod1", "pod2"],
        "{seen:?}"
    );
    let api_attempts = api_traffic
        .join()
        .map_err(|_| anyhow::anyhow!("traffic thread panicked"))??;
    let failed: Vec<&Attempt> = api_attempts
        .iter()
        .filter(|a| a.backend() != Some("pod3"))
        .collect();
    assert!(
        failed.is_empty(),
        "the untouched Service was disturbed: {failed:?}"
    );
    Ok(())
}

/// What the `/debug/drift` flood got: answers with their reports, requests turned away, and
/// requests not answered within the client's timeout (a request waits for the check in flight
/// and then its own, which on a loaded machine may take longer).
#[derive(Debug, Default)]
struct Flood {
    answered: Vec<serde_json::Value>,
    limited: usize,
    slow: usize,
}

/// Requests `/debug/drift` in a tight loop from the node until `stop` (and at least 50 times).
fn flood_debug_drift(
    netns: std::path::PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> thread::JoinHandle<anyhow::Result<Flood>> {
    thread::spawn(move || {
        let metrics: SocketAddr = "127.0.0.1:10249".parse()?;
        let mut flood = Flood::default();
        while flood.answered.len() + flood.limited + flood.slow < 50
            || !stop.load(std::sync::atomic::Ordering::SeqCst)
        {
            let reply = match proxy_tests::http::get(&netns, metrics, "/debug/drift") {
                Ok(reply) => reply,
                Err(proxy_tests::RigError::Io { source, .. })
                    if matches!(
                        source.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    flood.slow += 1;
                    continue;
                }
                Err(error) => return Err(error.into()),
            };
            match reply.status {
                200 => flood.answered.push(serde_json::from_str(&reply.body)?),
                429 => {
                    anyhow::ensure!(reply.header("Retry-After").is_some(), "{}", reply.head);
                    flood.limited += 1;
                }
                other => anyhow::bail!("/debug/drift: {other} {}", reply.body),
            }
            // Tight, but leaving the other tests' agents some of the machine.
            thread::sleep(Duration::from_millis(5));
        }
        Ok(flood)
    })
}

/// Services `bulk1` … `bulk150` besides `api`: a check (every map entry read, or every rule
/// listed) then takes long enough to overlap syncs, and flipping one after the other makes
/// each sync write another frontend (one frontend switches at most once per generation grace).
const BULK: u8 = 150;

fn bulk_services() -> String {
    (1..=BULK)
        .map(|i| http_service("default", &format!("bulk{i}"), Ipv4Addr::new(10, 96, 2, i)))
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// `bulk{i}`'s EndpointSlice, with pod `pod` as its endpoint.
fn write_bulk_slice(s: &Scenario, i: u8, pod: usize) -> anyhow::Result<()> {
    let name = format!("bulk{i}");
    s.manifests.write(
        &format!("{name}-slice.yaml"),
        &http_slice("default", &format!("{name}-1"), &name, &[pod_endpoint(pod)]),
    )?;
    Ok(())
}

/// The drift checks run off the sync loop and never take the loop's own writes for drift:
/// `/debug/drift` requested in a tight loop and the periodic check every second, while `api`'s
/// endpoint flips between pod2 and pod3 — first every 20 ms, each time with another bulk
/// Service's endpoint, so that syncs land in the middle of checks, then flip by flip. Every flip is programmed (connections answered by the new
/// backend); no answered check reports drift and nothing is repaired (eBPF leaves out the
/// entries it wrote during a check, iptables discards a check of rules it restored meanwhile);
/// the requests beyond the rate limit get 429. Both modes.
#[test]
fn drift_checks_under_a_request_flood_neither_hold_up_nor_misjudge_endpoint_changes()
-> anyhow::Result<()> {
    for mode in ["iptables", "ebpf"] {
        proxy_tests::require_root();
        proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
        let mut s = Scenario::new(3)?;
        s.write_web_service(1)?;
        s.manifests.write("bulk.yaml", &bulk_services())?;
        for i in 1..=BULK {
            write_bulk_slice(&s, i, 1)?;
        }
        s.manifests
            .write("api-svc.yaml", &http_service("default", "api", API_IP))?;
        s.manifests.write(
            "api-slice.yaml",
            &http_slice("default", "api-1", "api", &[pod_endpoint(3)]),
        )?;
        // iptables: a local address gives the node a route to the ClusterIP (nat OUTPUT comes
        // after the route lookup); it answers as `untranslated`, never as a pod.
        s.topo
            .add_decoy(std::net::IpAddr::V4(API_IP), SERVICE_PORT)?;
        // iptables: a sync for every change, as the eBPF mode does.
        s.start_serving(
            mode,
            &[
                "--drift-check-period",
                "1s",
                "--iptables-min-sync-period",
                "0s",
            ],
        )?;
        let api = SocketAddr::from((API_IP, SERVICE_PORT));
        s.wait_for_datapath(api, "api answered by pod3", |a| a.backend() == Some("pod3"))?;
        let netns = s.topo.node().path();

        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flood = flood_debug_drift(netns.clone(), std::sync::Arc::clone(&stop));
        for flip in 0..2 * usize::from(BULK) {
            let pod = 2 + flip % 2;
            s.manifests.write(
                "api-slice.yaml",
                &http_slice("default", "api-1", "api", &[pod_endpoint(pod)]),
            )?;
            let bulk = u8::try_from(flip % usize::from(BULK) + 1)?;
            write_bulk_slice(&s, bulk, 1 + flip / usize::from(BULK))?;
            // Pacing of the change generator: changes while the flood reads.
            thread::sleep(Duration::from_millis(20));
        }
        let mut flipped = Ok(());
        for flip in 0..6 {
            let pod = if flip % 2 == 0 { 2 } else { 3 };
            let name = format!("pod{pod}");
            s.manifests.write(
                "api-slice.yaml",
                &http_slice("default", "api-1", "api", &[pod_endpoint(pod)]),
            )?;
            let what = format!("[{mode}] flip {flip}: api answered by {name}");
            if let Err(error) = s.wait_for_datapath(api, &what, |a| a.backend() == Some(&name)) {
                flipped = Err(error);
                break;
            }
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let flood = flood
            .join()
            .map_err(|_| anyhow::anyhow!("the /debug/drift thread panicked"))??;
        eprintln!(
            "[{mode}] {} checks answered, {} turned away, {} not answered in time",
            flood.answered.len(),
            flood.limited,
            flood.slow
        );
        flipped?;
        anyhow::ensure!(
            !flood.answered.is_empty() && flood.limited >= 1,
            "[{mode}] {} answered, {} turned away",
            flood.answered.len(),
            flood.limited
        );
        let mut checked = 0;
        for report in &flood.answered {
            anyhow::ensure!(
                report["drift"].as_array().is_some_and(Vec::is_empty),
                "[{mode}] a check reported the agent's own writes as drift: {report:#}"
            );
            if report["checked"] == true {
                checked += 1;
            } else {
                // iptables only, when the rules were restored during the check and its retry.
                anyhow::ensure!(
                    mode == "iptables"
                        && report["note"]
                            .as_str()
                            .is_some_and(|note| note.contains("written during the check")),
                    "[{mode}] {report:#}"
                );
            }
        }
        anyhow::ensure!(checked >= 1, "[{mode}] no check compared anything");
        let repaired = if mode == "ebpf" {
            repair_counters(&netns)?
        } else {
            iptables_repair_counters(&netns)?
        };
        anyhow::ensure!(
            repaired.iter().all(|(_, count)| *count == 0),
            "[{mode}] the periodic check repaired the agent's own writes: {repaired:?}"
        );
        // Nothing was held back: the last state is what the datapath does.
        let seen = tally(&s.cgroup_client().run(api, 10)?);
        anyhow::ensure!(
            seen.keys().map(String::as_str).collect::<Vec<_>>() == ["pod3"],
            "[{mode}] {seen:?}"
        );
    }
    Ok(())
}
