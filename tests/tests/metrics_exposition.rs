//! The metrics server of a running agent as scrapers see it: `/metrics` in the classic text
//! format by default and OpenMetrics when asked, both checked by Prometheus' own linter
//! (`promtool check metrics`, Debian's `prometheus` package); the nfacct-backed counters of the
//! iptables mode counting real packets (an INVALID forwarded packet, localhost NodePort
//! connections); `/configz`. Needs root.

use std::{
    collections::BTreeSet,
    io::Write as _,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    os::fd::AsRawFd as _,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};
use proxy_tests::{
    client::Attempt,
    http::{Response, get_with_headers},
    packet::{L4, build, l4_checksum},
    scenario::{Scenario, pod_endpoint},
    service_scenarios::{NODE_PORT, ServiceSpec},
    topology::Topology,
    wait::try_wait_until,
};

const METRICS: &str = "127.0.0.1:10249";
const OPENMETRICS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// One GET of the metrics server from inside the node's namespace.
fn request(netns: &Path, path: &str, headers: &[(&str, &str)]) -> anyhow::Result<Response> {
    Ok(get_with_headers(netns, METRICS.parse()?, path, headers)?)
}

/// A NodePort Service `default/web` with pods 1 and 2, the agent started in `mode`.
fn setup(mode: &str) -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    let args: &[&str] = if mode == "ebpf" {
        &["--interfaces", "vext"]
    } else {
        &[]
    };
    s.start_agent_with_args(mode, args)?;
    Ok(s)
}

/// Waits until the first sync is in `/metrics` (default format); returns that exposition.
fn synced_exposition(node: &Path, needle: &str) -> anyhow::Result<String> {
    let mut body = String::new();
    try_wait_until(
        &format!("{needle} in /metrics"),
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            body = request(node, "/metrics", &[])
                .map(|r| r.body)
                .unwrap_or_default();
            Ok(body.contains(needle))
        },
    )?;
    Ok(body)
}

/// `promtool check metrics` on `exposition`: its findings, one per line (exit 3 = findings).
fn promtool_findings(exposition: &str) -> anyhow::Result<Vec<String>> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("promtool (Debian package prometheus; `cargo xtask setup` installs it)")?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(exposition.as_bytes())?;
    let output = child.wait_with_output()?;
    let code = output.status.code().unwrap_or(-1);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        code == 0 || code == 3,
        "promtool failed (exit {code}): {text}"
    );
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect())
}

/// Gauges upstream named `_total` (kube-proxy's pkg/proxy/metrics/metrics.go declares them
/// with `NewGaugeVec`): promlint's "non-counter metrics should not have _total suffix" is a
/// finding on kube-proxy's own exposition too.
const UPSTREAM_GAUGES_NAMED_TOTAL: [&str; 2] = [
    "kubeproxy_sync_proxy_rules_iptables_total",
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
];

/// The findings upstream's names cause, and only those, are allowed. In OpenMetrics a
/// counter's `# HELP`/`# TYPE` name the family without `_total` while its samples carry it;
/// promtool 2.42 lints with the classic text parser, so every counter's `_total` samples have
/// "no help text" — exactly as for client_golang's OpenMetrics output of the same counters.
fn unexpected_findings(findings: &[String], exposition: &str, openmetrics: bool) -> Vec<String> {
    let counters: BTreeSet<&str> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    findings
        .iter()
        .filter(|finding| {
            let allowed_gauge = UPSTREAM_GAUGES_NAMED_TOTAL.iter().any(|name| {
                **finding == format!("{name} non-counter metrics should not have \"_total\" suffix")
            });
            let allowed_openmetrics_counter = openmetrics
                && finding
                    .strip_suffix(" no help text")
                    .and_then(|name| name.strip_suffix("_total"))
                    .is_some_and(|family| counters.contains(family));
            !(allowed_gauge || allowed_openmetrics_counter)
        })
        .cloned()
        .collect()
}

#[test]
fn promtool_accepts_both_expositions_in_both_modes() -> anyhow::Result<()> {
    for mode in ["ebpf", "iptables"] {
        let s = setup(mode)?;
        let node = s.topo.node().path();
        let text = synced_exposition(&node, "kubeproxy_sync_proxy_rules_duration_seconds_count")?;
        let reply = request(&node, "/metrics", &[("Accept", "text/plain;version=0.0.4")])?;
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.header("Content-Type"),
            Some("text/plain; version=0.0.4; charset=utf-8; escaping=underscores")
        );
        // A counter as client_golang writes it in the classic format.
        assert!(
            text.contains("# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter\nkubeproxy_sync_proxy_rules_service_changes_total "),
            "[{mode}] {text}"
        );
        let om = request(&node, "/metrics", &[("Accept", OPENMETRICS_ACCEPT)])?;
        assert_eq!(
            om.header("Content-Type"),
            Some(
                "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
            )
        );
        assert!(om.body.ends_with("# EOF\n"), "[{mode}] {}", om.body);
        for (name, body, openmetrics) in [("text", &text, false), ("OpenMetrics", &om.body, true)] {
            let findings = promtool_findings(body)?;
            eprintln!(
                "[{mode}] promtool on the {name} exposition ({} bytes): {} findings: {findings:?}",
                body.len(),
                findings.len()
            );
            let unexpected = unexpected_findings(&findings, body, openmetrics);
            ensure!(
                unexpected.is_empty(),
                "[{mode}] promtool findings on the {name} exposition not caused by upstream's names: {unexpected:?}\n{body}"
            );
        }
    }
    Ok(())
}

/// The value of an unlabelled sample in a classic-text exposition.
fn sample(exposition: &str, name: &str) -> Option<u64> {
    exposition.lines().find_map(|line| {
        line.strip_prefix(name)?
            .strip_prefix(' ')?
            .parse::<f64>()
            .ok()
            .map(|v| v as u64)
    })
}

const INVALID: &str = "kubeproxy_iptables_ct_state_invalid_dropped_packets_total";
const LOCALHOST: &str = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total";

/// Sends `count` TCP segments with SYN|FIN — a flag combination conntrack marks INVALID — from
/// pod 1 to the external client, through the node's FORWARD chain.
fn send_invalid_segments(s: &Scenario, count: u16) -> anyhow::Result<()> {
    let path = s.topo.pod(1)?.path();
    let src = SocketAddr::from(SocketAddrV4::new(Topology::pod_ip(1), 40_001));
    let dst = SocketAddr::from(SocketAddrV4::new(Topology::ext_ip(), 9));
    let mut segment = build(src, dst, L4::TcpSyn, &[])[14 + 20..].to_vec();
    segment[13] = 0x03; // SYN|FIN
    segment[16..18].fill(0);
    let checksum = l4_checksum(src.ip(), dst.ip(), 6, &segment);
    segment[16..18].copy_from_slice(&checksum.to_be_bytes());
    std::thread::spawn(move || -> anyhow::Result<()> {
        proxy_tests::helper::enter_netns(&path)?;
        let fd = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Inet,
            nix::sys::socket::SockType::Raw,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            nix::sys::socket::SockProtocol::Tcp,
        )?;
        let to = nix::sys::socket::SockaddrIn::from(SocketAddrV4::new(Topology::ext_ip(), 0));
        for _ in 0..count {
            nix::sys::socket::sendto(
                fd.as_raw_fd(),
                &segment,
                &to,
                nix::sys::socket::MsgFlags::empty(),
            )?;
        }
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("sender thread panicked"))?
}

#[test]
fn nfacct_counters_count_invalid_packets_and_localhost_node_port_connections() -> anyhow::Result<()>
{
    let mut s = setup("iptables")?;
    let node = s.topo.node().path();
    // The nfacct counters are readable from the start; the rules come with the first sync.
    let text = synced_exposition(&node, "kubeproxy_sync_proxy_rules_iptables_total{")?;
    // The rules carry the matches exactly as upstream writes them.
    // (iptables-save prints `--nfacct-name  NAME` with two spaces: the extension's quirk.)
    let rules = s
        .topo
        .node()
        .exec("iptables-save", &[])?
        .replace("--nfacct-name  ", "--nfacct-name ");
    for rule in [
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP",
        "--dport 30080 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-",
    ] {
        ensure!(rules.contains(rule), "no {rule:?} in\n{rules}");
    }
    let invalid_before = sample(&text, INVALID).context("no invalid counter")?;
    let localhost_before = sample(&text, LOCALHOST).context("no localhost counter")?;

    const INVALID_PACKETS: u16 = 3;
    send_invalid_segments(&s, INVALID_PACKETS)?;
    let client = s.outside_client();
    let localhost = SocketAddr::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, NODE_PORT));
    const CONNECTIONS: u32 = 4;
    let attempts = client.run(localhost, CONNECTIONS)?;
    if !attempts.iter().all(|a| matches!(a, Attempt::Ok { .. })) {
        bail!(
            "localhost NodePort connections failed: {attempts:?}\n{}",
            s.agent()?.log_tail(40)
        );
    }
    // The nat rule sees a connection's first packet only: one count per connection.
    let mut after = String::new();
    try_wait_until(
        "the counters in /metrics",
        Duration::from_secs(5),
        Duration::from_millis(100),
        || {
            after = request(&node, "/metrics", &[])
                .map(|r| r.body)
                .unwrap_or_default();
            Ok(sample(&after, INVALID) == Some(invalid_before + u64::from(INVALID_PACKETS))
                && sample(&after, LOCALHOST) == Some(localhost_before + u64::from(CONNECTIONS)))
        },
    )
    .map_err(|e| {
        anyhow::anyhow!(
            "{e}: invalid {invalid_before} → {:?} (+{INVALID_PACKETS} expected), localhost {localhost_before} → {:?} (+{CONNECTIONS} expected)",
            sample(&after, INVALID),
            sample(&after, LOCALHOST)
        )
    })?;
    eprintln!(
        "nfacct: invalid {invalid_before} → {:?}, localhost NodePort {localhost_before} → {:?}",
        sample(&after, INVALID),
        sample(&after, LOCALHOST)
    );
    Ok(())
}

#[test]
fn configz_is_the_effective_configuration() -> anyhow::Result<()> {
    let s = setup("iptables")?;
    let node = s.topo.node().path();
    synced_exposition(&node, "kubeproxy_sync_proxy_rules_duration_seconds_count")?;
    let reply = request(&node, "/configz", &[])?;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("Content-Type"), Some("application/json"));
    let json: serde_json::Value = serde_json::from_str(&reply.body)?;
    let config = &json["kubeproxy.config.k8s.io"];
    assert_eq!(config["Mode"], "iptables", "{}", reply.body);
    assert_eq!(config["MetricsBindAddress"], METRICS);
    assert_eq!(config["IPTables"]["MasqueradeBit"], 14);
    Ok(())
}
