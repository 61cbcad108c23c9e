//! `proxy-agent inspect` against a running agent, from inside the node's network namespace:
//! the Service a test created shows up with its backends, in both modes. Needs root.

use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    path::Path,
    process::Command,
    time::Duration,
};

use anyhow::Context as _;
use proxy_tests::{
    agent::agent_binary,
    client::{Attempt, Mode},
    manifests::{Protocol, ServicePort, service_yaml},
    scenario::{SERVICE_PORT, Scenario, http_service, http_slice},
    wait::try_wait_until,
};

/// `default/empty`'s ClusterIP: a Service without endpoints.
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);

fn setup(mode: &str) -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    s.write_web_service(2)?;
    s.start_serving(mode, &[])?;
    Ok(s)
}

/// Runs `proxy-agent [--bpf-root R] inspect ARGS` in the network namespace at `netns`.
fn inspect(netns: &Path, bpf_root: Option<&Path>, args: &[&str]) -> anyhow::Result<String> {
    let mut command = Command::new("nsenter");
    command
        .arg(format!("--net={}", netns.display()))
        .arg(agent_binary()?);
    if let Some(root) = bpf_root {
        command.arg("--bpf-root").arg(root);
    }
    let output = command.arg("inspect").args(args).output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// Runs `proxy-agent PRE... inspect ARGS` in the network namespace at `netns`.
fn inspect_pre(netns: &Path, pre: &[&str], args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(agent_binary()?)
        .args(pre)
        .arg("inspect")
        .args(args)
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

fn web_rows(json: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let rows: Vec<serde_json::Value> = serde_json::from_str(json)?;
    Ok(rows
        .into_iter()
        .filter(|row| row["service"] == "default/web:http")
        .collect())
}

fn backends(row: &serde_json::Value) -> Vec<String> {
    let mut list: Vec<String> = row["backends"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| b.as_str().map(str::to_owned))
        .collect();
    list.sort();
    list
}

#[test]
fn inspect_shows_the_service_in_ebpf_mode() -> anyhow::Result<()> {
    let mut s = setup("ebpf")?;
    let netns = s.topo.node().path();
    let bpf_root = s.agent()?.bpf_root().to_path_buf();
    // The first sync leaves the names to a turn of the agent's own right after it: they are in
    // the pinned map (where `inspect` reads them) without asking the agent.
    let pin_dir = bpf_root.join(proxy_dataplane_ebpf::PIN_DIR_NAME);
    try_wait_until(
        "the service names in the pinned map",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || {
            let names = proxy_dataplane_ebpf::traffic::service_names(&pin_dir)
                .map_err(|e| proxy_tests::RigError::Other(e.to_string()))?;
            Ok(names.values().any(|name| name == "default/web:http"))
        },
    )?;
    let json = inspect(&netns, Some(&bpf_root), &["services", "--json"])?;
    let rows = web_rows(&json)?;
    eprintln!("inspect services (ebpf): {rows:#?}");
    let socket = rows
        .iter()
        .find(|r| r["path"] == "socket" && r["frontend"] == "10.96.0.10:80/TCP")
        .ok_or_else(|| anyhow::anyhow!("no socket-level frontend for default/web in {json}"))?;
    assert_eq!(backends(socket), ["10.244.1.2:8080", "10.244.2.2:8080"]);
    let table = inspect(&netns, Some(&bpf_root), &["services"])?;
    eprintln!("{table}");
    assert!(
        table.contains("default/web:http") && table.contains("10.244.2.2:8080"),
        "{table}"
    );
    // Typed values for machines: numbers are numbers, addresses and ports apart.
    assert_eq!(socket["address"], "10.96.0.10", "{socket}");
    assert_eq!(socket["port"], 80, "{socket}");
    assert_eq!(socket["protocol"], "TCP", "{socket}");
    let service_id = socket["service_id"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("service_id is not a number: {socket}"))?;
    // The metrics server names the same id, read from the pinned names when asked (what an
    // older `inspect` asks a running agent for).
    let agent = s.agent()?;
    let reply = proxy_tests::http::get(&netns, agent.metrics_address(), "/debug/ebpf/service-ids")?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let by_id: std::collections::BTreeMap<String, String> = serde_json::from_str(&reply.body)
        .with_context(|| format!("/debug/ebpf/service-ids: {}", reply.body))?;
    assert_eq!(
        by_id.get(&service_id.to_string()).map(String::as_str),
        Some("default/web:http"),
        "/debug/ebpf/service-ids: {by_id:?}"
    );
    let backends_json = inspect(&netns, Some(&bpf_root), &["backends", "-o", "json"])?;
    eprintln!("inspect backends: {backends_json}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&backends_json)?;
    let mut addresses: Vec<&str> = rows.iter().filter_map(|r| r["address"].as_str()).collect();
    addresses.sort_unstable();
    assert_eq!(addresses, ["10.244.1.2:8080", "10.244.2.2:8080"]);
    for row in &rows {
        assert!(row["backend"].is_u64(), "{row}");
        let used_by: Vec<u64> = row["used_by"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(serde_json::Value::as_u64)
            .collect();
        assert!(
            used_by.contains(&service_id),
            "{row} not used by #{service_id}"
        );
    }
    // Service names come from the pins, not from the agent: nothing listens at this metrics
    // address, and the frontends are still named.
    let named = inspect_pre(
        &netns,
        &[
            "--bpf-root",
            &bpf_root.to_string_lossy(),
            "--metrics-bind-address",
            "127.0.0.1:1",
        ],
        &["services", "-o", "json"],
    )?;
    assert!(
        !web_rows(&named)?.is_empty(),
        "without the agent's metrics server the frontends lost their names: {named}"
    );
    // A configuration that does not load does not stop inspect: it reads the pins all the same.
    let bad_config =
        std::env::temp_dir().join(format!("kpr-bad-config-{}.yaml", std::process::id()));
    std::fs::write(
        &bad_config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         mode: no-such-mode\n",
    )?;
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(agent_binary()?)
        .arg("--config")
        .arg(&bad_config)
        .arg("--bpf-root")
        .arg(&bpf_root)
        .args(["inspect", "services", "-o", "json"])
        .output();
    let _ = std::fs::remove_file(&bad_config);
    let output = output?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "inspect with a broken --config failed: {stderr}"
    );
    assert!(
        stderr.contains("inspect ignores the configuration") && stderr.contains("mode"),
        "the broken configuration is not named: {stderr}"
    );
    let rows = web_rows(&String::from_utf8(output.stdout)?)?;
    assert!(
        !rows.is_empty(),
        "inspect with a broken --config showed no default/web rows"
    );
    for what in ["affinity", "conntrack"] {
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&inspect(&netns, Some(&bpf_root), &[what, "--json"])?)?;
        eprintln!("inspect {what}: {} entries", rows.len());
    }
    let counters = inspect(&netns, Some(&bpf_root), &["counters"])?;
    eprintln!("{counters}");
    assert!(
        counters
            .lines()
            .any(|l| l.starts_with("translated") && !l.ends_with(" 0")),
        "{counters}"
    );
    Ok(())
}

/// iptables mode, against the agent's real rules: web with its endpoints, `default/empty`
/// without any — kube-proxy has no nat rule for it, only filter REJECTs, and it is listed all
/// the same — and no row for the jumps to KUBE-NODEPORTS, which are no Service.
#[test]
fn inspect_shows_the_service_in_iptables_mode() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    s.write_web_service(2)?;
    s.manifests.write(
        "empty-svc.yaml",
        &http_service("default", "empty", EMPTY_IP),
    )?;
    s.manifests.write(
        "empty-slice.yaml",
        &http_slice("default", "empty-1", "empty", &[]),
    )?;
    s.start_serving("iptables", &[])?;
    let netns = s.topo.node().path();
    // No pins under this bpf root: inspect reads the nat and filter tables.
    let empty_root = tempdir_path();
    let json = inspect(&netns, Some(&empty_root), &["services", "--json"])?;
    let rows = web_rows(&json)?;
    eprintln!("inspect services (iptables): {rows:#?}");
    let cluster_ip = rows
        .iter()
        .find(|r| r["frontend"] == "10.96.0.10:80/TCP")
        .ok_or_else(|| anyhow::anyhow!("no ClusterIP rule for default/web in {json}"))?;
    assert_eq!(backends(cluster_ip), ["10.244.1.2:8080", "10.244.2.2:8080"]);
    // Every row is a Service port: the jumps to KUBE-NODEPORTS are not listed.
    let all: Vec<serde_json::Value> = serde_json::from_str(&json)?;
    let phantoms: Vec<&serde_json::Value> = all
        .iter()
        .filter(|r| !r["service"].as_str().is_some_and(|name| name.contains('/')))
        .collect();
    assert!(
        phantoms.is_empty(),
        "rows that are no Service: {phantoms:#?}"
    );
    let empty: Vec<(&str, &str, usize)> = all
        .iter()
        .filter(|r| r["service"] == "default/empty:http")
        .map(|r| {
            (
                r["frontend"].as_str().unwrap_or_default(),
                r["path"].as_str().unwrap_or_default(),
                backends(r).len(),
            )
        })
        .collect();
    assert_eq!(
        empty,
        [("10.96.0.20:80/TCP", "REJECT", 0)],
        "default/empty, without endpoints, in {json}"
    );
    let table = inspect(&netns, Some(&empty_root), &["services"])?;
    let line = table
        .lines()
        .find(|l| l.starts_with("default/empty:http"))
        .unwrap_or_default();
    assert!(line.ends_with("(none: rejected)"), "{table}");
    Ok(())
}

fn tempdir_path() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kpr-inspect-none-{}", std::process::id()))
}

/// `inspect features` shows what the kernel has, what these flags would use, and
/// what the running agent reports using (`kubeproxy_ebpf_kernel_feature`): an agent with TCX
/// and socket destroy forced off reports both off, the rest on.
#[test]
fn inspect_features_shows_the_kernel_and_the_running_agents_choice() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(1)?;
    s.write_web_service(1)?;
    s.start_serving("ebpf", &["--bpf-disable-feature", "tcx,socket-destroy"])?;
    let netns = s.topo.node().path();
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&inspect(&netns, None, &["features", "--json"])?)?;
    let row = |name: &str| {
        rows.iter()
            .find(|r| r["feature"] == name)
            .cloned()
            .unwrap_or_default()
    };
    for (feature, agent) in [
        ("tcx", false),
        ("set-retval", true),
        ("socket-destroy", false),
        ("btf", true),
    ] {
        let r = row(feature);
        // This kernel has every feature; inspect without flags would use each.
        anyhow::ensure!(
            r["kernel"] == true && r["used"] == true && r["agent"] == agent,
            "{feature}: {r}"
        );
    }
    // The agent's flags go before the subcommand, as for `--bpf-root`.
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(agent_binary()?)
        .args(["--bpf-disable-feature", "tcx", "inspect", "features"])
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8(output.stdout)?;
    let tcx_line = table
        .lines()
        .find(|l| l.starts_with("tcx"))
        .unwrap_or_default();
    anyhow::ensure!(
        tcx_line.contains("legacy clsact tc filters") && table.starts_with("FEATURE"),
        "{table}"
    );
    Ok(())
}

/// The count `inspect counters` (table) shows for `reason`, with the action it names.
fn counter(table: &str, reason: &str) -> anyhow::Result<(String, u64)> {
    let line = table
        .lines()
        .find(|line| line.split_whitespace().next() == Some(reason))
        .ok_or_else(|| anyhow::anyhow!("no {reason} in {table}"))?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    match fields[..] {
        [_, action, value] => Ok((action.to_owned(), value.parse()?)),
        _ => anyhow::bail!("{line:?}: not REASON ACTION COUNT"),
    }
}

/// A drop reason read from a real agent, end to end: three connections and two unconnected
/// UDP datagrams from the node to `default/empty` (a ClusterIP Service, TCP 80 and UDP 53,
/// without endpoints; a local address answers on 80, were the connection not refused) are
/// refused by the socket hooks. `inspect counters --drops` (the pinned counters) shows exactly
/// three more `rejected_no_backends` and two more `sendmsg_rejected_no_backends`, action
/// `rejected`, and no translated or other reason; the JSON rows carry the action too; and the
/// agent's metrics endpoint, after the next sync, shows
/// `kubeproxy_ebpf_datapath_events_total{reason="rejected_no_backends",action="rejected"}` 3.
#[test]
fn inspect_and_metrics_show_a_drop_reason_with_its_action() -> anyhow::Result<()> {
    const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(1)?;
    s.write_web_service(1)?;
    s.topo.add_decoy(EMPTY_IP, SERVICE_PORT)?;
    let ports = [
        ServicePort {
            name: "http".into(),
            port: SERVICE_PORT,
            protocol: Protocol::Tcp,
        },
        ServicePort {
            name: "dns".into(),
            port: 53,
            protocol: Protocol::Udp,
        },
    ];
    s.manifests.write(
        "empty-svc.yaml",
        &service_yaml("default", "empty", EMPTY_IP, &ports),
    )?;
    s.manifests.write(
        "empty-slice.yaml",
        &http_slice("default", "empty-1", "empty", &[]),
    )?;
    let client = s.start_serving("ebpf", &[])?;
    let netns = s.topo.node().path();
    let bpf_root = s.agent()?.bpf_root().to_path_buf();

    let before = inspect(&netns, Some(&bpf_root), &["counters", "--drops"])?;
    let (action, refused_before) = counter(&before, "rejected_no_backends")?;
    assert_eq!(action, "rejected", "{before}");
    let (_, sendmsg_before) = counter(&before, "sendmsg_rejected_no_backends")?;
    let empty = SocketAddr::from(SocketAddrV4::new(EMPTY_IP, SERVICE_PORT));
    let attempts = client
        .clone()
        .timeout(Duration::from_secs(2))
        .run(empty, 3)?;
    assert!(
        attempts
            .iter()
            .all(|a| *a == Attempt::Err("ECONNREFUSED".into())),
        "default/empty refuses: {attempts:?}"
    );
    let dns = SocketAddr::from(SocketAddrV4::new(EMPTY_IP, 53));
    let attempts = client
        .clone()
        .mode(Mode::Sendto)
        .timeout(Duration::from_secs(2))
        .run(dns, 2)?;
    assert!(
        attempts
            .iter()
            .all(|a| *a == Attempt::Err("ECONNREFUSED".into())),
        "default/empty refuses datagrams: {attempts:?}"
    );
    let after = inspect(&netns, Some(&bpf_root), &["counters", "--drops"])?;
    eprintln!("{after}");
    assert_eq!(
        counter(&after, "rejected_no_backends")?,
        ("rejected".to_owned(), refused_before + 3),
        "{after}"
    );
    assert_eq!(
        counter(&after, "sendmsg_rejected_no_backends")?,
        ("rejected".to_owned(), sendmsg_before + 2),
        "{after}"
    );
    // Only drops, rejects and untranslated passes, with a header line.
    for line in after.lines().skip(1).filter(|line| !line.trim().is_empty()) {
        let action = line.split_whitespace().nth(1).unwrap_or_default();
        assert!(
            ["dropped", "rejected", "passed_untranslated"].contains(&action),
            "{line:?} in --drops"
        );
    }
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&inspect(&netns, Some(&bpf_root), &["counters", "--json"])?)?;
    let row = rows
        .iter()
        .find(|r| r["counter"] == "rejected_no_backends")
        .ok_or_else(|| anyhow::anyhow!("no rejected_no_backends row"))?;
    assert_eq!(row["action"], "rejected", "{row}");
    assert!(
        rows.iter()
            .any(|r| r["counter"] == "translated" && r["action"] == "translated"),
        "without --drops every reason"
    );

    // The metric follows the counters at each sync: a change to the manifests makes one.
    let agent = s.agent()?;
    let syncs = agent.syncs();
    s.manifests.write(
        "empty-slice.yaml",
        &http_slice("default", "empty-2", "empty", &[]),
    )?;
    let agent = s.agent()?;
    try_wait_until(
        "a sync after the refused connections",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || Ok(agent.syncs() > syncs),
    )
    .with_context(|| agent.log_tail(30))?;
    let refused = proxy_tests::http::metric_sum(
        &agent.metrics()?,
        "kubeproxy_ebpf_datapath_events_total",
        &["reason=\"rejected_no_backends\"", "action=\"rejected\""],
    );
    assert_eq!(
        refused,
        (refused_before + 3) as f64,
        "{}",
        agent.log_tail(30)
    );
    Ok(())
}
