//! ClusterIP through the real agent in `--proxy-mode iptables`: kube-proxy's rules, written with
//! iptables-restore into the node namespace, must DNAT to ready endpoints for every process in
//! that namespace (no cgroup involved) and REJECT connections to Services without endpoints.
//! The decoy echo server on the ClusterIP makes untranslated traffic visible. Needs root.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::process::Command;

use anyhow::Context;
use proxy_tests::client::{Attempt, tally};
use proxy_tests::manifests::Endpoint;
use proxy_tests::scenario::{
    CLUSTER_IP, SERVICE_PORT, Scenario, cluster_addr, http_service, is_pod, pod_endpoint,
};
use proxy_tests::topology::Topology;

const NAMESPACE: &str = "default";
const CONNECTIONS: u32 = 60;

fn setup(pods: usize) -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    Ok(Scenario::new(pods)?)
}

/// Whether the host's (not the test namespace's) mangle table has our canary chain.
fn host_has_canary() -> bool {
    Command::new("iptables-save")
        .args(["-t", "mangle"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(":KUBE-PROXY-CANARY"))
}

/// `iptables-save` of the node namespace.
fn node_rules(s: &Scenario) -> anyhow::Result<String> {
    let ns = s.topo.node().path();
    let output = Command::new("nsenter")
        .arg(format!("--net={}", ns.display()))
        .args(["--", "iptables-save"])
        .output()
        .context("running iptables-save in the node namespace")?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[test]
fn iptables_clusterip_reaches_only_ready_endpoints() -> anyhow::Result<()> {
    let host_canary_before = host_has_canary();
    let mut s = setup(3)?;
    let not_ready = Endpoint {
        node_name: pod_endpoint(3).node_name,
        ..Endpoint::not_ready(Topology::pod_ip(3))
    };
    s.write_web(&[pod_endpoint(1), pod_endpoint(2), not_ready])?;
    s.start_agent_in_mode("iptables")?;
    let first = s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;
    eprintln!("datapath ready, first answer: {first:?}");

    // Any process in the node namespace is translated: this client is in no special cgroup.
    let attempts = s.outside_client().run(cluster_addr(), CONNECTIONS)?;
    let counts = tally(&attempts);
    eprintln!("pod1+pod2 ready, pod3 not ready: answers: {counts:?}");
    for a in &attempts {
        let Attempt::Ok {
            backend, client, ..
        } = a
        else {
            return Err(s.agent_error(format!("attempt failed: {a:?}")).into());
        };
        s.ensure(backend == "pod1" || backend == "pod2", || {
            format!("answer from {backend}, expected only pod1/pod2 (all: {counts:?})")
        })?;
        // Not masqueraded (no cluster CIDR): the source stays the one the kernel picked for
        // the original destination, which the decoy makes a local address, so it is the
        // ClusterIP itself. Masquerading would have made it the node's address on the pod link.
        s.ensure(client.ip() == CLUSTER_IP, || {
            format!("{backend} saw client {client}, expected {CLUSTER_IP} (not masqueraded)")
        })?;
    }
    s.ensure(
        counts.contains_key("pod1") && counts.contains_key("pod2"),
        || format!("both ready endpoints must be used: {counts:?}"),
    )?;

    // Removing pod2 rewrites the service chains (a partial sync) and deletes pod2's SEP chain.
    s.write_web(&[pod_endpoint(1)])?;
    let start = std::time::Instant::now();
    loop {
        let attempts = s.outside_client().run(cluster_addr(), 20)?;
        if attempts.iter().all(|a| a.backend() == Some("pod1")) {
            break;
        }
        if start.elapsed() > proxy_tests::scenario::DATAPATH_TIMEOUT {
            return Err(s
                .agent_error(format!("pod2 still answers: {:?}", tally(&attempts)))
                .into());
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let rules = node_rules(&s)?;
    let sep_chains = rules
        .lines()
        .filter(|l| l.starts_with(":KUBE-SEP-"))
        .count();
    s.ensure(sep_chains == 1, || {
        format!("expected exactly one KUBE-SEP chain after removing pod2:\n{rules}")
    })?;
    s.ensure(
        rules.contains("-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp"),
        || format!("no ClusterIP rule in the node namespace:\n{rules}"),
    )?;
    s.ensure(host_has_canary() == host_canary_before, || {
        "the host's iptables changed: rules must only go into the node namespace".to_owned()
    })?;
    Ok(())
}

#[test]
fn iptables_service_without_endpoints_is_rejected() -> anyhow::Result<()> {
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
    s.start_agent_in_mode("iptables")?;

    // filter OUTPUT → KUBE-SERVICES → REJECT answers with ICMP port unreachable: ECONNREFUSED.
    let refused = |a: &Attempt| *a == Attempt::Err("ECONNREFUSED".into());
    for (target, case) in [(cluster_addr(), "empty slice"), (lonely, "no slice")] {
        s.wait_for_datapath(target, "refusing", refused)?;
        let attempts = s.outside_client().run(target, 20)?;
        let counts = tally(&attempts);
        eprintln!("{case} ({target}): answers: {counts:?}");
        s.ensure(attempts.iter().all(refused), || {
            format!("{case}: every attempt must be ECONNREFUSED: {counts:?}")
        })?;
    }
    let rules = node_rules(&s)?;
    s.ensure(
        rules.contains("--comment \"default/lonely:http has no endpoints\"")
            && rules.contains("-j REJECT"),
        || format!("no REJECT rule for lonely:\n{rules}"),
    )?;
    Ok(())
}
