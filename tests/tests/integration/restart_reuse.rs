//! Restarting without the verifier (`proxy_dataplane_ebpf::attach::reuse`): an agent that
//! restarts on the same pins with the same object, kernel and load-relevant options opens the
//! pinned programs and adopts their links instead of loading them again, so the kernel's
//! program ids stay; a removed stamp or a changed option takes the full load (new programs).
//! A ClusterIP (socket hooks) and a NodePort (tc) answer from their pods throughout. Needs root.

use std::collections::BTreeMap;
use std::net::{SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use aya::programs::links::{FdLink, PinnedLink};
use proxy_dataplane_ebpf::PIN_DIR_NAME;
use proxy_dataplane_ebpf::attach::reuse::{STAMP, pinned_program_ids};
use proxy_tests::RigError;
use proxy_tests::client::{Attempt, Client, tally};
use proxy_tests::scenario::{Scenario, cluster_addr, pod_endpoint};
use proxy_tests::service_scenarios::ServiceSpec;
use proxy_tests::topology::Topology;
use proxy_tests::wait::try_wait_until;

const NODE_PORT: u16 = 30080;
const ARGS: [&str; 2] = ["--interfaces", "vext"];
const REUSED: &str = "reused the pinned eBPF programs";
const LOADING: &str = "loading the eBPF programs";

fn node_port_addr() -> SocketAddr {
    SocketAddrV4::new(Topology::node_ext_ip(), NODE_PORT).into()
}

/// Answered by one of the Service's two pods.
fn right_backend(attempt: &Attempt) -> bool {
    matches!(attempt.backend(), Some("pod1" | "pod2"))
}

/// New connections to `target` from `client` until `stop`.
fn keep_connecting(
    client: Client,
    target: SocketAddr,
    stop: &Arc<AtomicBool>,
) -> JoinHandle<proxy_tests::Result<Vec<Attempt>>> {
    let stop = Arc::clone(stop);
    let client = client
        .interval(Duration::from_millis(10))
        .timeout(Duration::from_millis(1000));
    std::thread::spawn(move || {
        let mut attempts = Vec::new();
        while !stop.load(Ordering::Relaxed) && attempts.len() < 20_000 {
            attempts.extend(client.run(target, 20)?);
        }
        Ok(attempts)
    })
}

fn joined(load: JoinHandle<proxy_tests::Result<Vec<Attempt>>>) -> anyhow::Result<Vec<Attempt>> {
    load.join()
        .map_err(|_| RigError::Other("load thread panicked".into()))?
        .map_err(Into::into)
}

fn occurrences(s: &mut Scenario, what: &str) -> anyhow::Result<usize> {
    Ok(s.agent()?.log_contents().matches(what).count())
}

/// Waits until the restarted agent has logged `what` once more than `before` times and
/// synced.
fn wait_for_start(s: &mut Scenario, what: &str, before: usize) -> anyhow::Result<()> {
    try_wait_until(
        "the restarted agent's start and first sync",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            let agent = s.agent()?;
            Ok(agent.log_contents().matches(what).count() > before && agent.syncs() >= 1)
        },
    )
    .map_err(|e| s.agent_error(format!("{e}: no `{what}` logged")))?;
    Ok(())
}

/// Both paths answer from the right pods, a few new connections each.
fn ensure_served(s: &mut Scenario, when: &str) -> anyhow::Result<()> {
    for (client, target) in [
        (s.cgroup_client(), cluster_addr()),
        (s.external_client(), node_port_addr()),
    ] {
        s.wait_for_datapath_with(&client, target, when, right_backend)?;
        let attempts = client.run(target, 10)?;
        s.ensure(attempts.iter().all(right_backend), || {
            format!(
                "{when}: {target} answers from pod1 or pod2: {:?}",
                tally(&attempts)
            )
        })?;
    }
    Ok(())
}

/// The last start's time from "starting proxy-agent" to the dataplane ready, for the log.
fn report_start(s: &mut Scenario, which: &str) -> anyhow::Result<()> {
    let log = s.agent()?.log_contents();
    let phases = proxy_tests::bench::agent_runs::StartPhases::of_log(&log);
    eprintln!(
        "{which}: dataplane ready after {:?}",
        phases.dataplane_ready
    );
    Ok(())
}

/// The kernel id of every link pinned under the agent's pin directory, by pin name.
fn link_ids(s: &mut Scenario) -> anyhow::Result<BTreeMap<String, u32>> {
    let pins = s.agent()?.bpf_root().join(PIN_DIR_NAME);
    let mut ids = BTreeMap::new();
    for entry in std::fs::read_dir(&pins)? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name.ends_with("_link") {
            let link = FdLink::from(PinnedLink::from_pin(&path)?);
            ids.insert(name.to_owned(), link.info()?.id());
        }
    }
    Ok(ids)
}

fn program_ids(s: &mut Scenario) -> anyhow::Result<BTreeMap<String, u32>> {
    Ok(pinned_program_ids(s.agent()?.bpf_root()))
}

#[test]
fn a_restart_on_the_same_object_reuses_the_pinned_programs_and_a_changed_one_loads()
-> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    s.start_agent_with_args("ebpf", &ARGS)?;
    ensure_served(&mut s, "first start")?;
    report_start(&mut s, "first start (full load)")?;
    let first = program_ids(&mut s)?;
    for name in [
        "kpr_connect4",
        "kpr_sendmsg4",
        "kpr_tc_external",
        "kpr_tc_egress",
    ] {
        s.ensure(first.contains_key(name), || {
            format!("the first start pins {name}: {first:?}")
        })?;
    }
    let reuses = occurrences(&mut s, REUSED)?;
    s.ensure(reuses == 0, || "a first start has nothing to reuse".into())?;
    let first_links = link_ids(&mut s)?;
    s.ensure(
        first_links.contains_key("kpr_connect4_link")
            && first_links
                .keys()
                .any(|pin| pin.starts_with("kpr_tc_external_if")),
        || format!("cgroup and tc links pinned: {first_links:?}"),
    )?;

    // Same object, kernel and options: the pinned programs and links are reused.
    let stop = Arc::new(AtomicBool::new(false));
    let cluster = keep_connecting(s.cgroup_client(), cluster_addr(), &stop);
    let node_port = keep_connecting(s.external_client(), node_port_addr(), &stop);
    // Pacing, not a settle: the connections run for a while before the restart they span.
    std::thread::sleep(Duration::from_millis(300));
    s.agent()?.stop()?;
    s.agent()?.restart()?;
    wait_for_start(&mut s, REUSED, 0)?;
    report_start(&mut s, "restart reusing the pinned programs")?;
    // Pacing: the connections run on after the restart, against the adopted datapath.
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for (what, load) in [("ClusterIP", cluster), ("NodePort", node_port)] {
        let attempts = joined(load)?;
        let wrong = attempts.iter().filter(|a| !right_backend(a)).count();
        eprintln!(
            "{what} across a reusing restart: {} connections, {wrong} failed or wrong: {:?}",
            attempts.len(),
            tally(&attempts)
        );
        s.ensure(attempts.len() >= 20 && wrong == 0, || {
            format!(
                "{what}: every connection across the restart answered by pod1 or pod2: {:?}",
                tally(&attempts)
            )
        })?;
    }
    let reused = program_ids(&mut s)?;
    s.ensure(reused == first, || {
        format!("a reusing restart keeps the kernel's programs: {first:?} → {reused:?}")
    })?;
    let links = link_ids(&mut s)?;
    s.ensure(links == first_links, || {
        format!("a reusing restart adopts the pinned links: {first_links:?} → {links:?}")
    })?;
    ensure_served(&mut s, "after a reusing restart")?;

    // No stamp (as after an interrupted full load): the programs are loaded anew.
    s.agent()?.stop()?;
    let pins = s.agent()?.bpf_root().join(PIN_DIR_NAME);
    std::fs::remove_file(pins.join(STAMP))?;
    let loads = occurrences(&mut s, LOADING)?;
    s.agent()?.restart()?;
    wait_for_start(&mut s, LOADING, loads)?;
    report_start(&mut s, "restart without a stamp (full load)")?;
    let log = s.agent()?.log_contents();
    s.ensure(log.contains("no stamp of the pinned programs"), || {
        "the full load says why".into()
    })?;
    ensure_served(&mut s, "after a load without a stamp")?;
    let loaded = program_ids(&mut s)?;
    s.ensure(
        first
            .iter()
            .all(|(name, id)| loaded.get(name).is_some_and(|new| new != id)),
        || format!("a load pins new programs: {first:?} → {loaded:?}"),
    )?;

    // A changed load-relevant option (the SNAT range is a global of the programs): loaded.
    s.agent()?.stop()?;
    let loads = occurrences(&mut s, LOADING)?;
    s.agent()?.restart_with_args(&[
        "--interfaces",
        "vext",
        "--bpf-snat-port-range",
        "61000-65535",
    ])?;
    wait_for_start(&mut s, LOADING, loads)?;
    let log = s.agent()?.log_contents();
    s.ensure(log.contains("a load-relevant option changed"), || {
        "the full load says which part differs".into()
    })?;
    ensure_served(&mut s, "after a load with another option")?;
    let changed = program_ids(&mut s)?;
    s.ensure(
        loaded
            .iter()
            .all(|(name, id)| changed.get(name).is_some_and(|new| new != id)),
        || format!("another option loads new programs: {loaded:?} → {changed:?}"),
    )?;
    let reuses = occurrences(&mut s, REUSED)?;
    s.ensure(reuses == 1, || {
        "only the restart with the same options reused the pins".into()
    })?;
    Ok(())
}
