//! ClusterIP at the socket level, complete: IPv4 + IPv6 (dual-stack Service), TCP, connected
//! and unconnected UDP, session affinity, REJECT parity for UDP, hairpin, connected-UDP
//! recovery after a backend is removed, a SIGKILLed and restarted agent, and endpoint churn
//! under load. Real sockets in namespaces and a child cgroup; a decoy answers on every
//! ClusterIP so untranslated traffic is visible as `untranslated`. Needs root.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use proxy_dataplane_ebpf::GENERATION_GRACE;
use proxy_tests::client::{Attempt, Mode, Proto, tally};
use proxy_tests::manifests::{
    Protocol, ServicePort, SlicePort, endpoint_slice_yaml_family, service_yaml_with,
};
use proxy_tests::scenario::{
    BACKEND_PORT, CLUSTER_IP, CLUSTER_IP6, SERVICE_PORT, Scenario, cluster_addr, cluster_addr6,
    is_pod, pod_endpoint_family,
};
use proxy_tests::topology::{Place, Topology};

const NAMESPACE: &str = "default";
const SERVICE: &str = "svc";

fn setup(pods: usize, ipv6: bool) -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    Ok(Scenario::with_families(pods, ipv6)?)
}

/// The Service: ports `tcp` 80/TCP and `udp` 80/UDP → 8080, on the IPv4 ClusterIP (and the
/// IPv6 one when `ipv6`), with `pods` as endpoints in each family.
fn write_service(
    s: &Scenario,
    ipv6: bool,
    affinity: Option<u32>,
    pods: &[usize],
) -> anyhow::Result<()> {
    let mut ips: Vec<IpAddr> = vec![CLUSTER_IP.into()];
    if ipv6 {
        ips.push(CLUSTER_IP6.into());
    }
    let ports = [("tcp", Protocol::Tcp), ("udp", Protocol::Udp)];
    let service_ports: Vec<ServicePort> = ports
        .iter()
        .map(|(name, protocol)| ServicePort {
            name: (*name).into(),
            port: SERVICE_PORT,
            protocol: *protocol,
        })
        .collect();
    let slice_ports: Vec<SlicePort> = ports
        .iter()
        .map(|(name, protocol)| SlicePort {
            name: (*name).into(),
            port: BACKEND_PORT,
            protocol: *protocol,
        })
        .collect();
    // Slices first, so the Service never appears with an old endpoint set.
    for family_v6 in [false, true] {
        if family_v6 && !ipv6 {
            continue;
        }
        let endpoints: Vec<_> = pods
            .iter()
            .map(|&i| pod_endpoint_family(i, family_v6))
            .collect();
        let name = if family_v6 { "svc-v6" } else { "svc-v4" };
        s.manifests.write(
            &format!("{name}.yaml"),
            &endpoint_slice_yaml_family(
                NAMESPACE,
                name,
                SERVICE,
                &slice_ports,
                &endpoints,
                family_v6,
            ),
        )?;
    }
    s.manifests.write(
        "svc.yaml",
        &service_yaml_with(NAMESPACE, SERVICE, &ips, &service_ports, affinity),
    )?;
    Ok(())
}

fn pod_index(backend: &str) -> anyhow::Result<usize> {
    backend
        .trim_start_matches("pod")
        .parse()
        .with_context(|| format!("pod index of {backend}"))
}

/// The three ways a client uses a ClusterIP.
const WAYS: [(Proto, Mode, &str); 3] = [
    (Proto::Tcp, Mode::Connect, "TCP"),
    (Proto::Udp, Mode::Connect, "connected UDP"),
    (Proto::Udp, Mode::Sendto, "unconnected UDP"),
];

#[test]
fn dual_stack_tcp_and_udp_reach_only_selected_endpoints_and_show_the_service_address()
-> anyhow::Result<()> {
    let mut s = setup(4, true)?;
    // pod4 serves too but is not an endpoint: an answer from it would be a bug.
    write_service(&s, true, None, &[1, 2, 3])?;
    s.start_agent()?;
    for target in [cluster_addr(), cluster_addr6()] {
        s.wait_for_datapath(target, "answered by a pod", is_pod)?;
    }

    for target in [cluster_addr(), cluster_addr6()] {
        let ipv6 = target.is_ipv6();
        for (proto, mode, what) in WAYS {
            let client = s.cgroup_client().proto(proto).mode(mode);
            let attempts = client.run(target, 60)?;
            let counts = tally(&attempts);
            eprintln!("{what} to {target}: 60 attempts, answers: {counts:?}");
            for a in &attempts {
                let Attempt::Ok {
                    backend,
                    client,
                    peer,
                } = a
                else {
                    return Err(s.agent_error(format!("{what} {target}: {a:?}")).into());
                };
                s.ensure(["pod1", "pod2", "pod3"].contains(&backend.as_str()), || {
                    format!("{what} {target}: answer from {backend}; all: {counts:?}")
                })?;
                // getpeername() for connected sockets, recvfrom()'s source for sendto.
                s.ensure(*peer == target, || {
                    format!("{what} {target}: peer/source {peer}, expected the service address")
                })?;
                let i = pod_index(backend)?;
                s.ensure(client.ip() == Topology::pod_gateway_addr(i, ipv6), || {
                    format!("{what}: {backend} saw client {client}")
                })?;
            }
            s.ensure(counts.len() == 3, || {
                format!("{what} {target}: all three endpoints must be used: {counts:?}")
            })?;
        }
    }
    Ok(())
}

#[test]
fn session_affinity_holds_expires_and_can_be_switched_on_and_off() -> anyhow::Result<()> {
    const TIMEOUT_S: u32 = 2;
    let mut s = setup(3, false)?;
    write_service(&s, false, Some(TIMEOUT_S), &[1, 2, 3])?;
    s.start_agent()?;
    s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;

    // Holds: every connection of this client (its network namespace) goes to one backend.
    for (proto, mode, what) in WAYS {
        let attempts = s
            .cgroup_client()
            .proto(proto)
            .mode(mode)
            .run(cluster_addr(), 30)?;
        let counts = tally(&attempts);
        eprintln!("affinity on, {what}: 30 attempts, answers: {counts:?}");
        s.ensure(counts.len() == 1 && attempts.iter().all(is_pod), || {
            format!("{what}: affinity must keep one backend: {counts:?}")
        })?;
    }

    // Expires: after the timeout idle, a new choice is made (1 in 3 it is the same backend,
    // so allow several rounds; within a round it sticks again).
    let client = s.cgroup_client();
    let mut previous = tally(&client.run(cluster_addr(), 1)?);
    let mut changed_after = None;
    for round in 1..=8 {
        // The affinity timeout is the behaviour under test: only idle time lets it expire.
        thread::sleep(Duration::from_millis(u64::from(TIMEOUT_S) * 1000 + 600));
        let attempts = client.run(cluster_addr(), 5)?;
        let counts = tally(&attempts);
        eprintln!("after {TIMEOUT_S}s idle, round {round}: answers: {counts:?}");
        s.ensure(counts.len() == 1 && attempts.iter().all(is_pod), || {
            format!("round {round}: affinity must hold again after expiry: {counts:?}")
        })?;
        if counts.keys().ne(previous.keys()) {
            changed_after = Some(round);
            break;
        }
        previous = counts;
    }
    s.ensure(changed_after.is_some(), || {
        "the backend never changed after the affinity timeout in 8 rounds".into()
    })?;
    eprintln!("affinity expired: backend changed after round {changed_after:?}");

    // Off on the live Service: connections spread again.
    write_service(&s, false, None, &[1, 2, 3])?;
    s.wait_for_datapath(cluster_addr(), "spreading", |_| true)?;
    let started = Instant::now();
    loop {
        let counts = tally(&client.run(cluster_addr(), 30)?);
        if counts.len() > 1 || started.elapsed() > Duration::from_secs(10) {
            break;
        }
    }
    // A batch that straddled the switch can still be mostly sticky: judge a fresh one.
    let spread = tally(&client.run(cluster_addr(), 30)?);
    eprintln!("affinity switched off: 30 attempts, answers: {spread:?}");
    s.ensure(spread.len() == 3, || {
        format!("without affinity all backends must be used: {spread:?}")
    })?;

    // On again: sticks again.
    write_service(&s, false, Some(60), &[1, 2, 3])?;
    let started = Instant::now();
    let sticky = loop {
        thread::sleep(Duration::from_millis(300));
        let counts = tally(&client.run(cluster_addr(), 30)?);
        if counts.len() == 1 || started.elapsed() > Duration::from_secs(10) {
            break counts;
        }
    };
    eprintln!("affinity switched on again: 30 attempts, answers: {sticky:?}");
    s.ensure(sticky.len() == 1, || {
        format!("affinity switched on must stick: {sticky:?}")
    })?;
    Ok(())
}

#[test]
fn no_endpoints_refuses_tcp_connected_udp_and_unconnected_udp() -> anyhow::Result<()> {
    let mut s = setup(1, true)?;
    write_service(&s, true, None, &[])?;
    s.start_agent()?;
    let refused = |a: &Attempt| *a == Attempt::Err("ECONNREFUSED".into());
    for target in [cluster_addr(), cluster_addr6()] {
        s.wait_for_datapath(target, "refusing", refused)?;
        for (proto, mode, what) in WAYS {
            let attempts = s.cgroup_client().proto(proto).mode(mode).run(target, 20)?;
            let counts = tally(&attempts);
            eprintln!("no endpoints, {what} to {target}: 20 attempts, results: {counts:?}");
            s.ensure(attempts.iter().all(refused), || {
                format!("{what} {target}: every attempt must be ECONNREFUSED: {counts:?}")
            })?;
        }
    }
    Ok(())
}

/// Kernel floor: without `bpf_set_retval` (kernels < 5.18, here forced off with
/// `--bpf-disable-feature set-retval`) the hooks still refuse, with the kernel's EPERM instead
/// of ECONNREFUSED — and the programs load: the helper call is skipped by a load-time constant.
#[test]
fn without_set_retval_no_endpoints_fails_with_eperm() -> anyhow::Result<()> {
    let mut s = setup(1, false)?;
    write_service(&s, false, None, &[])?;
    s.start_agent_with_args("ebpf", &["--bpf-disable-feature", "set-retval"])?;
    let eperm = |a: &Attempt| *a == Attempt::Err("EPERM".into());
    s.wait_for_datapath(cluster_addr(), "refusing with EPERM", eperm)?;
    for (proto, mode, what) in WAYS {
        let attempts = s
            .cgroup_client()
            .proto(proto)
            .mode(mode)
            .run(cluster_addr(), 5)?;
        let counts = tally(&attempts);
        eprintln!("no endpoints, no set_retval, {what}: {counts:?}");
        s.ensure(attempts.iter().all(eperm), || {
            format!("{what}: every attempt must be EPERM: {counts:?}")
        })?;
    }
    Ok(())
}

#[test]
fn hairpin_a_pod_reaches_itself_through_the_service() -> anyhow::Result<()> {
    let mut s = setup(2, true)?;
    write_service(&s, true, None, &[1])?;
    s.start_agent()?;
    s.wait_for_datapath(cluster_addr(), "answered by pod1", |a| {
        a.backend() == Some("pod1")
    })?;
    let pod1 = s.pod_client(1)?;
    for target in [cluster_addr(), cluster_addr6()] {
        let own = Topology::pod_addr(1, target.is_ipv6());
        for (proto, mode, what) in WAYS {
            let attempts = pod1.clone().proto(proto).mode(mode).run(target, 10)?;
            let counts = tally(&attempts);
            eprintln!("hairpin from pod1, {what} to {target}: 10 attempts, answers: {counts:?}");
            for a in &attempts {
                let ok = matches!(a, Attempt::Ok { backend, client, peer }
                    if backend == "pod1" && client.ip() == own && *peer == target);
                s.ensure(ok, || {
                    format!("{what} {target}: pod1 must reach itself from {own}: {a:?}")
                })?;
            }
        }
    }
    Ok(())
}

#[test]
fn connected_udp_client_recovers_within_a_second_after_its_backend_is_removed() -> anyhow::Result<()>
{
    let mut s = setup(3, false)?;
    write_service(&s, false, None, &[1])?;
    s.start_agent()?;
    s.wait_for_datapath(cluster_addr(), "answered by pod1", |a| {
        a.backend() == Some("pod1")
    })?;

    // One connected UDP socket, a request every 50 ms, replaced only after an error.
    let client = s
        .cgroup_client()
        .mode(Mode::Stream)
        .timeout(Duration::from_millis(300))
        .interval(Duration::from_millis(50));
    let spawned = Instant::now();
    let stream = thread::spawn(move || client.run_timed(cluster_addr(), 80));
    // The socket is talking to pod1 before pod1 is removed.
    s.wait_for_udp_flows(&[Place::Node], 1)?;
    // pod1 keeps running: without the fix the socket would keep talking to it.
    write_service(&s, false, None, &[2, 3])?;
    let updated_ms = spawned.elapsed().as_millis() as u64;
    let attempts = stream
        .join()
        .map_err(|_| anyhow::anyhow!("client thread panicked"))??;

    let last_pod1 = attempts
        .iter()
        .filter(|(a, _)| a.backend() == Some("pod1"))
        .map(|(_, at)| *at)
        .max()
        .unwrap_or_default();
    let first_live = attempts
        .iter()
        .find(|(a, _)| matches!(a.backend(), Some("pod2" | "pod3")))
        .map(|(_, at)| *at);
    let errors: Vec<_> = attempts
        .iter()
        .filter_map(|(a, at)| match a {
            Attempt::Err(reason) => Some(format!("{reason}@{at}ms")),
            Attempt::Ok { .. } => None,
        })
        .collect();
    eprintln!(
        "connected UDP stream: {} requests, answers: {:?}; endpoints updated at ~{updated_ms} ms, \
         last answer from pod1 at {last_pod1} ms, first from pod2/pod3 at {first_live:?} ms, \
         errors: {errors:?}",
        attempts.len(),
        tally(&attempts.iter().map(|(a, _)| a.clone()).collect::<Vec<_>>())
    );
    s.ensure(last_pod1 < updated_ms + 1000, || {
        format!(
            "the socket still used the removed pod1 at {last_pod1} ms (update ~{updated_ms} ms)"
        )
    })?;
    s.ensure(first_live.is_some_and(|at| at < updated_ms + 1000), || {
        format!("no answer from a live backend within 1 s of the update: {first_live:?}")
    })?;
    Ok(())
}

/// Collects a background client's results.
fn join(
    handle: thread::JoinHandle<proxy_tests::Result<Vec<(Attempt, u64)>>>,
) -> anyhow::Result<Vec<(Attempt, u64)>> {
    Ok(handle
        .join()
        .map_err(|_| anyhow::anyhow!("client thread panicked"))??)
}

#[test]
fn agent_sigkill_and_restart_in_the_middle_of_traffic_fails_no_connection() -> anyhow::Result<()> {
    let mut s = setup(3, false)?;
    write_service(&s, false, None, &[1, 2, 3])?;
    s.start_agent()?;
    s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;

    let tcp = s.cgroup_client().interval(Duration::from_millis(5));
    let udp = s
        .cgroup_client()
        .mode(Mode::Sendto)
        .interval(Duration::from_millis(5));
    let spawned = Instant::now();
    let tcp = thread::spawn(move || tcp.run_timed(cluster_addr(), 400));
    let udp = thread::spawn(move || udp.run_timed(cluster_addr(), 400));
    // Pacing, not a settle: the load runs for a while before the outage it must span.
    thread::sleep(Duration::from_millis(700));
    let pin_dir = s
        .agent()?
        .bpf_root()
        .join(proxy_dataplane_ebpf::PIN_DIR_NAME);
    let frontends_before = frontends(&pin_dir)?;
    s.agent()?.kill()?;
    let killed_ms = spawned.elapsed().as_millis() as u64;
    // The outage itself: no agent for this long is what the connections must get through.
    thread::sleep(Duration::from_millis(500));
    s.agent()?.restart()?;
    let restarted_ms = spawned.elapsed().as_millis() as u64;
    eprintln!("agent SIGKILLed at ~{killed_ms} ms, restarted at ~{restarted_ms} ms");
    let (tcp, udp) = (join(tcp)?, join(udp)?);

    for (what, attempts) in [("TCP", &tcp), ("unconnected UDP", &udp)] {
        // Attempts made while no agent was running, or while the new one was starting.
        let while_down = attempts
            .iter()
            .filter(|(_, at)| (killed_ms..restarted_ms + 300).contains(at))
            .count();
        let attempts: Vec<Attempt> = attempts.iter().map(|(a, _)| a.clone()).collect();
        let counts = tally(&attempts);
        let failures = attempts.iter().filter(|a| !is_pod(a)).count();
        eprintln!(
            "{what} across SIGKILL + restart: {} attempts ({while_down} while the agent was \
             down or starting), {failures} failed or untranslated, answers: {counts:?}",
            attempts.len()
        );
        s.ensure(while_down > 0, || {
            format!("{what}: the load must overlap the restart")
        })?;
        s.ensure(failures == 0, || {
            format!("{what}: no attempt may fail across a restart: {counts:?}")
        })?;
    }
    // The restarted agent adopted the maps: its first (full) sync claimed every frontend
    // without a write, so each keeps its generation. Then it still applies updates.
    proxy_tests::wait::wait_until(
        "the restarted agent's first sync",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || s.agent().is_ok_and(|a| a.syncs() >= 1),
    )?;
    let frontends_after = frontends(&pin_dir)?;
    s.ensure(
        !frontends_before.is_empty() && frontends_after == frontends_before,
        || {
            format!(
                "the restarted agent rewrote the frontends instead of adopting them: \
                 {frontends_before:?} → {frontends_after:?}"
            )
        },
    )?;
    write_service(&s, false, None, &[1, 2])?;
    let batch = s.wait_for_batch(
        &s.cgroup_client(),
        cluster_addr(),
        40,
        "pod3 removed after the restart",
        |a| matches!(a.backend(), Some("pod1" | "pod2")),
    )?;
    let counts = tally(&batch);
    eprintln!("after the restart, pod3 removed: answers: {counts:?}");
    s.ensure(
        counts.keys().map(String::as_str).eq(["pod1", "pod2"]),
        || format!("the restarted agent must apply updates: {counts:?}"),
    )?;
    Ok(())
}

/// The pinned IPv4 frontends map, sorted by key.
fn frontends(
    pin_dir: &std::path::Path,
) -> anyhow::Result<Vec<(proxy_common::Frontend4Key, proxy_common::FrontendValue)>> {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_common::{Frontend4Key, FrontendValue, map_names};
    let data = MapData::from_pin(pin_dir.join(map_names::FRONTENDS4))?;
    let map: HashMap<MapData, Frontend4Key, FrontendValue> =
        HashMap::try_from(Map::from_map_data(data)?)?;
    let mut entries = map.iter().collect::<Result<Vec<_>, _>>()?;
    entries.sort_by_key(|(key, _)| *key);
    Ok(entries)
}

/// Successful syncs of the running agent (its sync duration histogram).
fn syncs(s: &mut Scenario) -> anyhow::Result<u64> {
    Ok(s.agent()?.syncs())
}

#[test]
fn endpoint_churn_under_load_never_reaches_a_removed_endpoint() -> anyhow::Result<()> {
    let mut s = setup(4, false)?;
    let sets: [&[usize]; 8] = [
        &[1, 2, 3],
        &[2, 3, 4],
        &[1, 3, 4],
        &[4],
        &[1, 2],
        &[2, 3, 4],
        &[1],
        &[1, 2, 3, 4],
    ];
    write_service(&s, false, None, sets[0])?;
    s.start_agent()?;
    s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;

    // Updates further apart than the map writer's generation grace: a Service's backend set
    // switches at most once per grace (a change within it is deferred until it ends, see
    // `tests/generation_race.rs`), and here each update must take effect at its own sync. 800
    // attempts cover the 7 updates.
    let spacing = GENERATION_GRACE + Duration::from_millis(250);
    let client = s.cgroup_client().interval(Duration::from_millis(12));
    let spawned = Instant::now();
    let load = thread::spawn(move || client.run_timed(cluster_addr(), 800));
    // (written at, applied at, set) in ms since the client was spawned.
    let mut updates: Vec<(u64, u64, BTreeSet<usize>)> =
        vec![(0, 0, sets[0].iter().copied().collect())];
    for set in &sets[1..] {
        // The spacing is the behaviour under test: each update must come after the previous
        // one's generation grace.
        thread::sleep(spacing);
        let before = syncs(&mut s)?;
        let written = spawned.elapsed().as_millis() as u64;
        write_service(&s, false, None, set)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while syncs(&mut s)? <= before && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        let applied = spawned.elapsed().as_millis() as u64;
        updates.push((written, applied, set.iter().copied().collect()));
    }
    let attempts = join(load)?;

    // An attempt that started after update k was applied and before update k+1 was written
    // may only use set k; while k+1 is being applied, set k or k+1. The client's clock starts
    // a little after `spawned`, so its times are early: keep 100 ms of slack at the start of
    // each write window.
    let mut to_removed = Vec::new();
    let mut failures = Vec::new();
    let mut per_backend: BTreeMap<String, usize> = BTreeMap::new();
    for (attempt, at) in &attempts {
        *per_backend.entry(attempt.label()).or_default() += 1;
        let Some(backend) = attempt.backend() else {
            failures.push(format!("{attempt:?}@{at}ms"));
            continue;
        };
        let Ok(pod) = pod_index(backend) else {
            failures.push(format!("{backend}@{at}ms"));
            continue;
        };
        let Some(k) = updates.iter().rposition(|(_, applied, _)| applied <= at) else {
            continue;
        };
        let mut allowed = updates[k].2.clone();
        if let Some((next_written, _, next)) = updates.get(k + 1)
            && *at + 100 >= *next_written
        {
            allowed.extend(next);
        }
        if !allowed.contains(&pod) {
            to_removed.push(format!("pod{pod}@{at}ms (update {k})"));
        }
    }
    eprintln!(
        "churn: {} updates under load, {} connections, {} failed, {} to a removed endpoint; \
         per backend: {per_backend:?}; update (written, applied) ms: {:?}",
        updates.len() - 1,
        attempts.len(),
        failures.len(),
        to_removed.len(),
        updates.iter().map(|(w, a, _)| (*w, *a)).collect::<Vec<_>>()
    );
    s.ensure(failures.is_empty(), || {
        format!("failed connections: {failures:?}")
    })?;
    s.ensure(to_removed.is_empty(), || {
        format!("connections to removed endpoints after the update was applied: {to_removed:?}")
    })?;
    Ok(())
}
