//! BPF map memory that follows use. The agent's service hash maps are not
//! preallocated, so their kernel memory (`memlock` in the map fd's fdinfo, what `bpftool map
//! show` reports) grows with the Services written and not with the capacity (the backend
//! maps are arrays indexed by backend id: their length times a value, no more); the preallocated
//! LRU maps are sized from kube-proxy's conntrack table size by default, or from the node's
//! memory by `--bpf-map-dynamic-size-ratio` (a pinned map keeps its size across a restart with
//! another ratio, so its flows are kept). Needs root.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use proxy_common::map_names;
use proxy_tests::bench::sysinfo::{MapMemory, bpf_maps};
use proxy_tests::scenario::{Scenario, http_service, http_slice, is_pod, pod_endpoint};
use proxy_tests::wait::wait_until;

/// ClusterIP of extra Service `i` (`10.96.8.0/21`: up to 2048).
fn extra_ip(i: usize) -> Ipv4Addr {
    let i = u32::try_from(i).unwrap_or(0);
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 8, 0)) + i)
}

/// Writes Services `0..count` (one file: one manifests reload), each with pod 1 as endpoint.
fn write_services(s: &Scenario, count: usize) -> anyhow::Result<()> {
    let mut text = String::new();
    for i in 0..count {
        let name = format!("svc-{i}");
        text.push_str(&http_service("default", &name, extra_ip(i)));
        text.push_str("\n---\n");
        text.push_str(&http_slice(
            "default",
            &format!("{name}-1"),
            &name,
            &[pod_endpoint(1)],
        ));
        text.push_str("\n---\n");
    }
    s.manifests.write("extra.yaml", &text)?;
    Ok(())
}

/// The pinned map `name` of the agent under `root`: its id and `max_entries`.
fn pinned(root: &Path, name: &str) -> anyhow::Result<(u32, u32)> {
    let pin = root.join(proxy_dataplane_ebpf::PIN_DIR_NAME).join(name);
    let info = aya::maps::MapInfo::from_pin(&pin)?;
    Ok((info.id(), info.max_entries()))
}

/// `memlock` of the pinned map `name`, as the agent process holds it.
fn memlock(pid: u32, root: &Path, name: &str) -> anyhow::Result<u64> {
    let (id, _) = pinned(root, name)?;
    let maps: Vec<MapMemory> = bpf_maps(pid);
    maps.iter()
        .find(|m| m.id == u64::from(id))
        .map(|m| m.memlock)
        .ok_or_else(|| anyhow::anyhow!("the agent holds no fd of {name} (id {id})"))
}

/// 40 % of `ratio` × MemTotal in 152-byte IPv4 and 20 % in 200-byte IPv6 conntrack entries,
/// four fifths of each to the established flows' map (at least 65 536 entries) and the rest to
/// the unanswered flows' (a quarter of the former's entries): the sizing README documents for
/// `--bpf-map-dynamic-size-ratio`.
fn documented_conntrack_sizes(ratio: f64) -> anyhow::Result<(u32, u32)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no MemTotal in /proc/meminfo"))?;
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "a test-sized memory figure"
    )]
    let budget = ((kib * 1024) as f64 * ratio) as u64;
    Ok((
        u32::try_from(budget * 32 / 100 / 152)?.max(65_536),
        u32::try_from(budget * 16 / 100 / 200)?.max(65_536),
    ))
}

#[test]
fn service_map_memory_follows_the_services_written() -> anyhow::Result<()> {
    let mut s = Scenario::new(1)?;
    write_services(&s, 10)?;
    s.start_agent()?;
    let target = |i: usize| SocketAddr::from((extra_ip(i), 80));
    s.wait_for_datapath(target(9), "the 10th Service answered", is_pod)?;
    let root = s.agent()?.bpf_root().to_path_buf();
    let pid = s
        .agent()?
        .pid()
        .ok_or_else(|| anyhow::anyhow!("agent not running"))?;
    let watched = [
        map_names::FRONTENDS4,
        map_names::BACKEND_SLOTS,
        map_names::AFFINITY_MATCH,
    ];
    // The backend maps are arrays indexed by backend id: their element size times their
    // length, with no per-element overhead, from the start.
    let arrays = [(map_names::BACKENDS4, 8), (map_names::BACKENDS6, 24)];
    let arrays_small: Vec<u64> = arrays
        .iter()
        .map(|(name, _)| memlock(pid, &root, name))
        .collect::<anyhow::Result<_>>()?;
    let total: u64 = bpf_maps(pid).iter().map(|m| m.memlock).sum();
    println!(
        "all maps the agent holds, 10 Services: {} KiB",
        total / 1024
    );
    let small: Vec<u64> = watched
        .iter()
        .map(|name| memlock(pid, &root, name))
        .collect::<anyhow::Result<_>>()?;

    write_services(&s, 2000)?;
    s.wait_for_datapath_within(
        target(1999),
        "the 2000th Service answered",
        Duration::from_secs(60),
        is_pod,
    )?;
    let large: Vec<u64> = watched
        .iter()
        .map(|name| memlock(pid, &root, name))
        .collect::<anyhow::Result<_>>()?;

    for (((name, element), small), large) in arrays.iter().zip(&arrays_small).zip(
        arrays
            .iter()
            .map(|(name, _)| memlock(pid, &root, name))
            .collect::<anyhow::Result<Vec<u64>>>()?,
    ) {
        let (_, length) = pinned(&root, name)?;
        let values = u64::from(length) * element;
        println!("{name}: length {length}, memlock {small} B at 10 Services, {large} B at 2000");
        // The kernel's `struct bpf_array` and page rounding on top of the values.
        anyhow::ensure!(
            (values..=values + 64 * 1024).contains(small) && large == *small,
            "{name}: {small} B at 10 Services, {large} B at 2000, for {length} values of \
             {element} B"
        );
    }
    for ((name, small), large) in watched.iter().zip(&small).zip(&large) {
        let (_, capacity) = pinned(&root, name)?;
        // Preallocated, a map's memlock is its capacity in elements (≥ 56 bytes each) from
        // the start and never changes.
        let preallocated = u64::from(capacity) * 56;
        println!(
            "{name}: capacity {capacity}, memlock {small} B at 10 Services, {large} B at 2000"
        );
        anyhow::ensure!(
            *small < preallocated / 2,
            "{name}: {small} B with 10 Services, preallocated would be ≥ {preallocated} B"
        );
        // 1990 more frontends and slots: ≥ 1990 elements more. The backends are one pod's,
        // whatever the number of Services, and (service, backend) pairs are written for
        // session affinity only.
        let grows = [map_names::FRONTENDS4, map_names::BACKEND_SLOTS].contains(name);
        let more = if grows { 1990 * 56 } else { 0 };
        anyhow::ensure!(
            *large >= small + more,
            "{name}: {small} B at 10 Services, {large} B at 2000: memory did not follow the entries"
        );
    }
    Ok(())
}

/// The machine's online CPUs (`/sys/devices/system/cpu/online`, `0-3,6`), as kube-proxy's
/// detectNumCPU counts them.
fn online_cpus() -> anyhow::Result<u32> {
    let list = std::fs::read_to_string("/sys/devices/system/cpu/online")?;
    let mut count = 0;
    for part in list.trim().split(',') {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        count += last.parse::<u32>()? - first.parse::<u32>()? + 1;
    }
    Ok(count)
}

#[test]
fn lru_maps_are_sized_from_the_conntrack_table_kube_proxy_would_set() -> anyhow::Result<()> {
    let mut s = Scenario::new(1)?;
    write_services(&s, 1)?;
    s.start_agent_with_args(
        "ebpf",
        &[
            "--conntrack-max-per-core",
            "24000",
            "--conntrack-min",
            "1000",
        ],
    )?;
    let target = SocketAddr::from((extra_ip(0), 80));
    s.wait_for_datapath(target, "the Service answered", is_pod)?;
    let root = s.agent()?.bpf_root().to_path_buf();
    // kube-proxy's getConntrackMax: maxPerCore × CPUs, at least min; the maps share it two
    // to one between IPv4 and IPv6 (docs/map-memory.md), the unanswered flows' maps a quarter
    // of each, the socket maps an eighth of it and at least 16384.
    let table = (24_000 * online_cpus()?).max(1000);
    let expected = (
        (table * 2 / 3).max(4096),
        (table / 3).max(4096),
        (table / 8).max(16_384),
    );
    let sizes = (
        pinned(&root, map_names::CT4)?.1,
        pinned(&root, map_names::CT6)?.1,
        pinned(&root, map_names::REVNAT6)?.1,
    );
    anyhow::ensure!(
        sizes == expected,
        "(IPv4 conntrack, IPv6 conntrack, IPv6 reverse NAT) of {sizes:?} entries, {expected:?} \
         documented for a conntrack table of {table}"
    );
    let unanswered = pinned(&root, map_names::CT4_NEW)?.1;
    anyhow::ensure!(
        unanswered == expected.0 / 4,
        "IPv4 unanswered flows' map of {unanswered} entries, a quarter of {} documented",
        expected.0
    );
    Ok(())
}

#[test]
fn lru_maps_are_sized_from_the_nodes_memory_and_keep_their_size_across_restarts()
-> anyhow::Result<()> {
    let mut s = Scenario::new(1)?;
    write_services(&s, 1)?;
    let ratio = 0.002;
    s.start_agent_with_args(
        "ebpf",
        &["--bpf-map-dynamic-size-ratio", &ratio.to_string()],
    )?;
    let target = SocketAddr::from((extra_ip(0), 80));
    s.wait_for_datapath(target, "the Service answered", is_pod)?;
    let root = s.agent()?.bpf_root().to_path_buf();
    let conntrack = (
        pinned(&root, map_names::CT4)?.1,
        pinned(&root, map_names::CT6)?.1,
    );
    let expected = documented_conntrack_sizes(ratio)?;
    anyhow::ensure!(
        conntrack == expected,
        "conntrack maps (IPv4, IPv6) of {conntrack:?} entries, {expected:?} documented for ratio {ratio}"
    );
    let unanswered = (
        pinned(&root, map_names::CT4_NEW)?.1,
        pinned(&root, map_names::CT6_NEW)?.1,
    );
    anyhow::ensure!(
        unanswered == (expected.0 / 4, expected.1 / 4),
        "unanswered flows' maps (IPv4, IPv6) of {unanswered:?} entries, a quarter of {expected:?} documented"
    );
    let (revnat_id, revnat) = pinned(&root, map_names::REVNAT4)?;
    anyhow::ensure!(revnat >= 16_384, "reverse NAT map of {revnat} entries");

    // Another ratio on the same pins: the maps (and the flows in them) are kept as they are.
    s.agent()?.stop()?;
    s.agent()?
        .restart_with_args(&["--bpf-map-dynamic-size-ratio", "0.0005"])?;
    wait_until(
        "the restarted agent's first sync",
        proxy_tests::scenario::DATAPATH_TIMEOUT,
        Duration::from_millis(100),
        || s.agent_ref().is_some_and(|a| a.syncs() > 0),
    )?;
    s.wait_for_datapath(target, "the Service answered after the restart", is_pod)?;
    let conntrack_after = (
        pinned(&root, map_names::CT4)?.1,
        pinned(&root, map_names::CT6)?.1,
    );
    let (revnat_id_after, _) = pinned(&root, map_names::REVNAT4)?;
    anyhow::ensure!(
        conntrack_after == conntrack && revnat_id_after == revnat_id,
        "pinned maps replaced by a new ratio: conntrack {conntrack:?} → {conntrack_after:?}, \
         reverse NAT map id {revnat_id} → {revnat_id_after}"
    );
    Ok(())
}
