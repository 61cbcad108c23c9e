//! The node endpoints of a running agent, queried over HTTP from inside the node's network
//! namespace: /healthz, /livez, /metrics, /proxyMode and a Service's health check node port.
//! Needs root.

use std::{net::SocketAddr, path::Path, time::Duration};

use proxy_tests::{
    http::Response,
    manifests::Endpoint,
    scenario::{CLUSTER_IP, Scenario, http_slice, pod_endpoint},
    service_scenarios::ServiceSpec,
    topology::Topology,
    wait::try_wait_until,
};

const HEALTH_CHECK_PORT: u16 = 30999;

/// One GET from inside the network namespace at `netns`.
fn get(netns: &Path, addr: SocketAddr, path: &str) -> anyhow::Result<Response> {
    Ok(proxy_tests::http::get(netns, addr, path)?)
}

fn setup(mode: &str, endpoints: &[Endpoint]) -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    s.manifests.write(
        "web-svc.yaml",
        &proxy_tests::scenario::health_checked_web_service_yaml(HEALTH_CHECK_PORT),
    )?;
    s.manifests.write(
        "web-slice.yaml",
        &http_slice("default", "web-1", "web", endpoints),
    )?;
    s.start_agent_in_mode(mode)?;
    s.wait_for_first_sync()?;
    let _ = CLUSTER_IP;
    Ok(s)
}

fn wait_for(netns: &Path, addr: SocketAddr, path: &str, status: u16) -> anyhow::Result<Response> {
    let mut last = None;
    try_wait_until(
        &format!("GET {addr}{path} → {status}"),
        Duration::from_secs(10),
        Duration::from_millis(200),
        || {
            let response = get(netns, addr, path);
            let done = matches!(&response, Ok(r) if r.status == status);
            last = Some(response);
            Ok(done)
        },
    )
    .map_err(|e| anyhow::anyhow!("{e}; last: {last:?}"))?;
    last.ok_or_else(|| anyhow::anyhow!("no response"))?
}

#[test]
fn health_metrics_and_proxy_mode_of_a_running_ebpf_agent() -> anyhow::Result<()> {
    let s = setup("ebpf", &[pod_endpoint(1), pod_endpoint(2)])?;
    let node = s.topo.node().path();
    let healthz: SocketAddr = "127.0.0.1:10256".parse()?;
    let metrics: SocketAddr = "127.0.0.1:10249".parse()?;

    let health = wait_for(&node, healthz, "/healthz", 200)?;
    eprintln!("/healthz: {} {}", health.status, health.body);
    assert!(
        health.head.contains("Content-Type: application/json"),
        "{}",
        health.head
    );
    assert!(
        health.head.contains("X-Content-Type-Options: nosniff"),
        "{}",
        health.head
    );
    assert!(
        health.body.starts_with("{\"lastUpdated\":\""),
        "{}",
        health.body
    );
    assert!(
        health
            .body
            .contains("\"nodeEligible\":true,\"healthy\":true"),
        "{}",
        health.body
    );
    let live = get(&node, healthz, "/livez")?;
    assert_eq!(live.status, 200);
    assert!(!live.body.contains("nodeEligible"), "{}", live.body);
    assert_eq!(get(&node, healthz, "/nothing")?.status, 404);

    let mode = get(&node, metrics, "/proxyMode")?;
    assert_eq!((mode.status, mode.body.trim()), (200, "ebpf"));
    // /healthz is 200 from the start (kube-proxy counts a family only once it synced), so the
    // sync histograms may still be empty here: wait for the first sync's samples.
    let mut exposition = get(&node, metrics, "/metrics")?;
    try_wait_until(
        "the first sync in /metrics",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            exposition = get(&node, metrics, "/metrics")
                .map_err(|e| proxy_tests::RigError::Other(e.to_string()))?;
            Ok(exposition
                .body
                .contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket"))
        },
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_proxy_healthz_total{code=\"200\"}",
        "kubeproxy_ebpf_datapath_events_total",
        "kubeproxy_sync_proxy_rules_service_changes_total",
    ] {
        assert!(
            exposition.body.contains(name),
            "{name} missing from /metrics"
        );
    }
    // The maps' fill levels follow what was programmed: the two pods are the only backends,
    // and the capacities are the `--bpf-map-*` defaults.
    for line in [
        "kubeproxy_ebpf_map_entries{map=\"KPR_BACKENDS4\"} 2",
        "kubeproxy_ebpf_map_entries{map=\"KPR_BACKENDS6\"} 0",
        "kubeproxy_ebpf_map_capacity{map=\"KPR_FRONTENDS4\"} 65536",
        "kubeproxy_ebpf_map_capacity{map=\"KPR_BACKEND_SLOTS\"} 262144",
    ] {
        assert!(
            exposition.body.lines().any(|l| l == line),
            "{line} missing from /metrics"
        );
    }
    let frontends = exposition
        .body
        .lines()
        .find_map(|l| l.strip_prefix("kubeproxy_ebpf_map_entries{map=\"KPR_FRONTENDS4\"} "))
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| anyhow::anyhow!("no KPR_FRONTENDS4 entries in /metrics"))?;
    assert!(frontends >= 1, "KPR_FRONTENDS4 holds {frontends} entries");
    eprintln!("/metrics: {} bytes", exposition.body.len());
    Ok(())
}

#[test]
fn health_check_node_port_follows_local_endpoints() -> anyhow::Result<()> {
    let mut s = setup("ebpf", &[pod_endpoint(1), pod_endpoint(2)])?;
    let node = s.topo.node().path();
    let port: SocketAddr = format!("{}:{HEALTH_CHECK_PORT}", Topology::node_ext_ip()).parse()?;
    let healthy = wait_for(&node, port, "/", 200)?;
    eprintln!(
        "health check node port with 2 local endpoints: {}",
        healthy.body
    );
    assert!(
        healthy.body.contains("\"localEndpoints\": 2"),
        "{}",
        healthy.body
    );
    assert!(
        healthy.head.contains("X-Load-Balancing-Endpoint-Weight: 2"),
        "{}",
        healthy.head
    );

    let remote = |i| Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(Topology::pod_ip(i))
    };
    s.manifests.write(
        "web-slice.yaml",
        &http_slice("default", "web-1", "web", &[remote(1), remote(2)]),
    )?;
    let unhealthy = wait_for(&node, port, "/anything", 503)?;
    eprintln!(
        "health check node port without local endpoints: {}",
        unhealthy.body
    );
    assert!(
        unhealthy.body.contains("\"localEndpoints\": 0"),
        "{}",
        unhealthy.body
    );
    s.agent()?;
    Ok(())
}

#[test]
fn proxy_mode_reports_iptables() -> anyhow::Result<()> {
    let s = setup("iptables", &[pod_endpoint(1)])?;
    let node = s.topo.node().path();
    let mode = wait_for(&node, "127.0.0.1:10249".parse()?, "/proxyMode", 200)?;
    assert_eq!(mode.body.trim(), "iptables");
    // The rule counts appear with the first sync.
    let metrics: SocketAddr = "127.0.0.1:10249".parse()?;
    try_wait_until(
        "iptables rule counts in /metrics",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || {
            Ok(get(&node, metrics, "/metrics").is_ok_and(|r| {
                r.body
                    .contains("kubeproxy_sync_proxy_rules_iptables_total{")
            }))
        },
    )?;
    let exposition = get(&node, metrics, "/metrics")?;
    let nat_rules = exposition
        .body
        .lines()
        .find(|l| l.starts_with("kubeproxy_sync_proxy_rules_iptables_total{") && l.contains("nat"));
    eprintln!("{nat_rules:?}");
    assert!(nat_rules.is_some(), "no nat rule count in /metrics");
    // iptables mode's datapath object: the mode, healthy, no eBPF fields.
    let health = wait_for(&node, "127.0.0.1:10256".parse()?, "/healthz", 200)?;
    let body: serde_json::Value = serde_json::from_str(&health.body)?;
    assert_eq!(body["datapath"]["mode"], "iptables", "{}", health.body);
    assert_eq!(body["datapath"]["healthy"], true, "{}", health.body);
    assert!(
        body["datapath"].get("selfTest").is_none(),
        "{}",
        health.body
    );
    Ok(())
}

/// A Service that does not fit in the eBPF maps is not the node's failure: the syncs succeed
/// (everything else is programmed) and /healthz and /livez stay 200, while the log names what
/// did not fit. (kube-proxy has no such limit to meet; a failed iptables-restore, a real node
/// fault, does turn it unhealthy, as a failed map write does here.)
#[test]
fn ebpf_service_ports_that_do_not_fit_leave_the_proxy_healthy() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    let spec = ServiceSpec {
        type_: "LoadBalancer",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1)])?;
    // One frontend slot: the ClusterIP, NodePorts and load-balancer IP cannot all fit.
    s.start_agent_with_args(
        "ebpf",
        &["--bpf-map-frontends", "1", "--iptables-sync-period", "1s"],
    )?;
    // Beyond the health timeout (2 × the sync period) of successful syncs.
    proxy_tests::wait::wait_until(
        "four successful syncs",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || s.agent_ref().is_some_and(|agent| agent.syncs() >= 4),
    )?;
    let node = s.topo.node().path();
    let healthz: SocketAddr = "127.0.0.1:10256".parse()?;
    let reply = get(&node, healthz, "/healthz")?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("\"healthy\":true"), "{}", reply.body);
    assert_eq!(get(&node, healthz, "/livez")?.status, 200);
    let log = s.agent()?.log_contents();
    assert!(
        log.contains("service ports that do not fit in the eBPF maps")
            && log.contains("default/web:http"),
        "the log names what did not fit"
    );
    Ok(())
}

/// The value of a sample line `name{labels} value` in an exposition.
/// Waits until the agent has programmed every change it was given and has nothing queued.
fn wait_settled(s: &Scenario) -> anyhow::Result<()> {
    proxy_tests::wait::wait_until(
        "the agent settled",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || s.agent_ref().is_some_and(|agent| agent.settled()),
    )
    .map_err(|e| s.agent_error(e.to_string()))?;
    Ok(())
}

fn sample(body: &str, prefix: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Upstream's syncProxyRules observes each sync once, in the full or the partial histogram
/// by what the restore was: the first sync is full, an endpoint change is partial.
#[test]
fn iptables_syncs_are_observed_once_as_full_or_partial() -> anyhow::Result<()> {
    let s = setup("iptables", &[pod_endpoint(1)])?;
    let node = s.topo.node().path();
    let metrics: SocketAddr = "127.0.0.1:10249".parse()?;
    const FULL: &str = "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}";
    const PARTIAL: &str =
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}";
    let mut body = String::new();
    try_wait_until(
        "the first sync in /metrics",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || {
            let Ok(reply) = get(&node, metrics, "/metrics") else {
                return Ok(false);
            };
            body = reply.body;
            Ok(sample(&body, FULL).is_some())
        },
    )?;
    assert_eq!(sample(&body, FULL), Some(1.0), "{body}");
    assert_eq!(sample(&body, PARTIAL).unwrap_or(0.0), 0.0, "{body}");

    // A second Service (its syncs are partial), then a change of the first one only.
    s.manifests.write(
        "other-svc.yaml",
        &proxy_tests::scenario::http_service(
            "default",
            "other",
            std::net::Ipv4Addr::new(10, 96, 0, 77),
        ),
    )?;
    s.manifests.write(
        "other-slice.yaml",
        &http_slice("default", "other-1", "other", &[pod_endpoint(2)]),
    )?;
    try_wait_until(
        "a partial sync in /metrics",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || {
            let Ok(reply) = get(&node, metrics, "/metrics") else {
                return Ok(false);
            };
            body = reply.body;
            Ok(sample(&body, PARTIAL).is_some_and(|n| n >= 1.0))
        },
    )?;
    // The two writes may cost two syncs: count from when both are programmed and nothing is
    // queued.
    let other_endpoint = format!(
        "default/other:http -> {}:{}",
        Topology::pod_ip(2),
        proxy_tests::scenario::BACKEND_PORT
    );
    try_wait_until(
        "the other Service's endpoint in the nat table",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            Ok(s.topo
                .node()
                .exec("iptables-save", &["-t", "nat"])?
                .contains(&other_endpoint))
        },
    )?;
    wait_settled(&s)?;
    let before = sample(&get(&node, metrics, "/metrics")?.body, PARTIAL).unwrap_or(0.0);
    s.manifests.write(
        "web-slice.yaml",
        &http_slice(
            "default",
            "web-1",
            "web",
            &[pod_endpoint(1), pod_endpoint(2)],
        ),
    )?;
    try_wait_until(
        "another partial sync in /metrics",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || {
            let Ok(reply) = get(&node, metrics, "/metrics") else {
                return Ok(false);
            };
            body = reply.body;
            Ok(sample(&body, PARTIAL).is_some_and(|n| n > before))
        },
    )?;
    // A sync the change wrongly queued behind this one would be done too.
    wait_settled(&s)?;
    body = get(&node, metrics, "/metrics")?.body;
    assert_eq!(sample(&body, FULL), Some(1.0), "{body}");
    assert_eq!(sample(&body, PARTIAL), Some(before + 1.0), "{body}");
    // sync_proxy_rules_iptables_last is this sync's restore input: a partial sync writes
    // fewer nat rules than the table holds.
    let total = sample(
        &body,
        "kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv4\",table=\"nat\"}",
    );
    let last = sample(
        &body,
        "kubeproxy_sync_proxy_rules_iptables_last{ip_family=\"IPv4\",table=\"nat\"}",
    );
    assert!(
        matches!((total, last), (Some(t), Some(l)) if l > 0.0 && l < t),
        "nat total {total:?}, last {last:?}"
    );
    Ok(())
}

/// `--bind-address-hard-fail`: a health server port that is taken is fatal (upstream sends
/// the serve error to errCh), instead of the usual retry every 5 s.
#[test]
fn bind_address_hard_fail_exits_when_the_port_is_taken() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(1)?;
    s.write_web_service(1)?;
    // Something in the node namespace already listens on the health port.
    s.topo
        .add_decoy(std::net::Ipv4Addr::new(127, 0, 0, 1), 10256)?;
    s.start_agent_with_args(
        "iptables",
        &[
            "--bind-address-hard-fail",
            "--healthz-bind-address",
            "127.0.0.1:10256",
        ],
    )?;
    let mut exited = None;
    try_wait_until(
        "the agent exits",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            exited = s.agent()?.exit_status();
            Ok(exited.is_some())
        },
    )?;
    let log = s.agent()?.log_contents();
    assert!(exited.is_some_and(|status| !status.success()), "{exited:?}");
    assert!(
        log.contains("--healthz-bind-address 127.0.0.1:10256: cannot bind"),
        "{log}"
    );
    Ok(())
}
