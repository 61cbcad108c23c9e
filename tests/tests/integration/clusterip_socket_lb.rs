//! ClusterIP socket load balancing through the real agent: the eBPF connect hook on a child
//! cgroup must translate the ClusterIP to ready endpoints only. A decoy echo server answers
//! on the ClusterIP itself, so untranslated traffic shows up as `untranslated` rather than
//! as a failure — every negative assertion below is meaningful. Needs root.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use anyhow::Context;
use proxy_tests::client::{Attempt, tally};
use proxy_tests::manifests::Endpoint;
use proxy_tests::scenario::{
    SERVICE_PORT, Scenario, cluster_addr, http_service, is_pod, pod_endpoint,
};
use proxy_tests::topology::{DECOY_NAME, Topology};

const NAMESPACE: &str = "default";
const CONNECTIONS: u32 = 60;

fn setup(pods: usize) -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    Ok(Scenario::new(pods)?)
}

/// Starts the agent and waits until the ClusterIP is answered by a pod.
fn start_and_wait_for_pods(s: &mut Scenario) -> anyhow::Result<()> {
    s.start_agent()?;
    let first = s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;
    eprintln!("datapath ready, first answer: {first:?}");
    Ok(())
}

/// `CONNECTIONS` attempts from the cgroup to the ClusterIP; prints and returns the tally.
fn connect_many(
    s: &Scenario,
    label: &str,
) -> anyhow::Result<(Vec<Attempt>, BTreeMap<String, usize>)> {
    let attempts = s.cgroup_client().run(cluster_addr(), CONNECTIONS)?;
    let counts = tally(&attempts);
    eprintln!("{label}: answers: {counts:?}");
    Ok((attempts, counts))
}

#[test]
fn clusterip_tcp_reaches_only_ready_endpoints() -> anyhow::Result<()> {
    let mut s = setup(3)?;
    let not_ready = Endpoint {
        node_name: pod_endpoint(3).node_name,
        ..Endpoint::not_ready(Topology::pod_ip(3))
    };
    s.write_web(&[pod_endpoint(1), pod_endpoint(2), not_ready])?;
    start_and_wait_for_pods(&mut s)?;

    let (attempts, counts) = connect_many(&s, "pod1+pod2 ready, pod3 not ready")?;
    for a in &attempts {
        let Attempt::Ok {
            backend,
            client,
            peer,
        } = a
        else {
            return Err(s.agent_error(format!("attempt failed: {a:?}")).into());
        };
        s.ensure(backend == "pod1" || backend == "pod2", || {
            format!("answer from {backend}, expected only pod1/pod2 (all: {counts:?})")
        })?;
        s.ensure(*peer == cluster_addr(), || {
            format!(
                "getpeername() = {peer}, expected the ClusterIP {}",
                cluster_addr()
            )
        })?;
        let i: usize = backend
            .trim_start_matches("pod")
            .parse()
            .context("pod index")?;
        s.ensure(client.ip() == Topology::pod_gateway(i), || {
            format!(
                "{backend} saw client {client}, expected {}",
                Topology::pod_gateway(i)
            )
        })?;
    }
    s.ensure(
        counts.contains_key("pod1") && counts.contains_key("pod2"),
        || format!("both ready endpoints must be used: {counts:?}"),
    )?;
    Ok(())
}

#[test]
fn removed_endpoint_gets_no_new_connections() -> anyhow::Result<()> {
    let mut s = setup(3)?;
    s.write_web(&[pod_endpoint(1), pod_endpoint(2), pod_endpoint(3)])?;
    start_and_wait_for_pods(&mut s)?;

    let (_, before) = connect_many(&s, "before removing pod2")?;
    s.ensure(
        ["pod1", "pod2", "pod3"]
            .iter()
            .all(|p| before.contains_key(*p))
            && before.len() == 3,
        || format!("expected exactly pod1..pod3 before the update: {before:?}"),
    )?;

    s.write_web(&[pod_endpoint(1), pod_endpoint(3)])?;
    // Applied once a whole batch misses pod2; the batch after it must miss pod2 as well.
    let client = s.cgroup_client();
    s.wait_for_batch(&client, cluster_addr(), CONNECTIONS, "removing pod2", |a| {
        a.backend() != Some("pod2")
    })?;

    let (_, after) = connect_many(&s, "after removing pod2")?;
    s.ensure(
        after.contains_key("pod1") && after.contains_key("pod3") && after.len() == 2,
        || format!("expected exactly pod1 and pod3 after removing pod2: {after:?}"),
    )?;
    Ok(())
}

#[test]
fn service_without_endpoints_refuses_connections() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    // Case 1: web has a slice with zero endpoints. Case 2: lonely (10.96.0.11) has no slice.
    let lonely_ip = Ipv4Addr::new(10, 96, 0, 11);
    let lonely: SocketAddr = SocketAddrV4::new(lonely_ip, SERVICE_PORT).into();
    s.topo.add_decoy(lonely_ip, SERVICE_PORT)?;
    s.write_web(&[])?;
    s.manifests.write(
        "lonely-svc.yaml",
        &http_service(NAMESPACE, "lonely", lonely_ip),
    )?;
    s.start_agent()?;

    let refused = |a: &Attempt| *a == Attempt::Err("ECONNREFUSED".into());
    for (target, case) in [(cluster_addr(), "empty slice"), (lonely, "no slice")] {
        s.wait_for_datapath(target, "refusing", refused)?;
        let attempts = s.cgroup_client().run(target, 20)?;
        let counts = tally(&attempts);
        eprintln!("{case} ({target}): answers: {counts:?}");
        s.ensure(attempts.iter().all(refused), || {
            format!("{case}: every attempt must be ECONNREFUSED: {counts:?}")
        })?;
    }
    Ok(())
}

#[test]
fn process_outside_cgroup_is_not_translated() -> anyhow::Result<()> {
    let mut s = setup(2)?;
    s.write_web(&[pod_endpoint(1), pod_endpoint(2)])?;
    start_and_wait_for_pods(&mut s)?;

    let outside = s.outside_client().run(cluster_addr(), 20)?;
    let outside_counts = tally(&outside);
    eprintln!("outside the cgroup: answers: {outside_counts:?}");
    s.ensure(
        outside.iter().all(|a| a.backend() == Some(DECOY_NAME)),
        || format!("a process outside the cgroup must not be translated: {outside_counts:?}"),
    )?;

    let (inside, inside_counts) = connect_many(&s, "inside the cgroup")?;
    s.ensure(inside.iter().all(is_pod), || {
        format!("a process inside the cgroup must reach pods: {inside_counts:?}")
    })?;
    Ok(())
}

#[test]
fn agent_sigint_leaves_translation_and_cleanup_removes_it() -> anyhow::Result<()> {
    let mut s = setup(2)?;
    s.write_web(&[pod_endpoint(1), pod_endpoint(2)])?;
    start_and_wait_for_pods(&mut s)?;

    // The SNAT port range is reserved from the node namespace's ephemeral ports while the
    // datapath is in place and released by --cleanup.
    let reserved = |s: &Scenario| {
        s.topo
            .node()
            .exec("cat", &["/proc/sys/net/ipv4/ip_local_reserved_ports"])
            .map(|text| text.trim().to_owned())
    };
    let running = reserved(&s)?;
    let status = s.agent()?.stop()?;
    eprintln!("agent exit status after SIGINT: {status}");
    s.ensure(status.success(), || format!("agent exited with {status}"))?;
    let stopped = reserved(&s)?;

    // The pinned links keep the programs attached and the pinned maps keep the state.
    let (attempts, counts) = connect_many(&s, "after SIGINT (datapath left in place)")?;
    s.ensure(attempts.iter().all(is_pod), || {
        format!("after SIGINT translation must go on: {counts:?}")
    })?;

    let status = s.agent()?.run_cleanup()?;
    eprintln!("proxy-agent --cleanup exit status: {status}");
    s.ensure(status.success(), || {
        format!("--cleanup exited with {status}")
    })?;
    let (attempts, counts) = connect_many(&s, "after --cleanup")?;
    s.ensure(
        attempts.iter().all(|a| a.backend() == Some(DECOY_NAME)),
        || format!("after --cleanup nothing may be translated any more: {counts:?}"),
    )?;
    let cleaned = reserved(&s)?;
    eprintln!(
        "ip_local_reserved_ports: running {running:?}, after SIGINT {stopped:?}, after \
         --cleanup {cleaned:?}"
    );
    s.ensure(running == "49152-65535" && stopped == running, || {
        format!("SNAT ports reserved while the datapath is in place: {running:?}, {stopped:?}")
    })?;
    s.ensure(cleaned.is_empty(), || {
        format!("--cleanup releases the SNAT ports: {cleaned:?}")
    })?;
    Ok(())
}
