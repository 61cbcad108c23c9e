//! The dashboard and alerts of `deploy/monitoring/`, tested with the tools an operator runs:
//! `promtool check rules` and `promtool test rules` (the alerts' unit tests, each alert firing
//! and staying quiet), then a real Prometheus (Debian's `prometheus`) in the node's network
//! namespace scraping a real agent every second while clients use its Services. Every panel's
//! query of the Grafana dashboard, evaluated by that Prometheus, returns the series the panel is
//! meant to show (and the eBPF-only or iptables-only panels nothing in the other mode); every
//! alert's expression is a query it accepts, and returns series exactly where this rig's
//! traffic is what the alert is about. Needs root (except the promtool test).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use proxy_tests::{
    client::{Attempt, Client},
    monitoring::{PanelQuery, dashboard_queries, deploy_monitoring_dir},
    prometheus::{Prometheus, Sample},
    scenario::{
        CLUSTER_IP, NODE_PORT, SERVICE_PORT, Scenario, ServiceSpec, cluster_addr, http_service,
        http_slice, is_pod, pod_endpoint, web_service_yaml,
    },
    topology::Topology,
    wait::try_wait_until,
};

const RULES: &str = "prometheus-rules.yaml";
const RULES_TESTS: &str = "prometheus-rules.test.yaml";
const DASHBOARD: &str = "grafana-dashboard.json";
const METRICS: &str = "127.0.0.1:10249";

/// `default/empty`: a ClusterIP Service without endpoints, which refuses its clients.
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
/// `default/local`: a NodePort Service with `externalTrafficPolicy: Local` whose only endpoint
/// is on another node, so this node drops its external clients.
const LOCAL_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const LOCAL_NODE_PORT: u16 = 30081;
/// How long a client waits before calling a connection dropped or refused.
const DROP_TIMEOUT: Duration = Duration::from_millis(700);
/// How long the test keeps sending traffic and asking Prometheus before it reports what is
/// still missing: Prometheus needs two scrapes after the traffic for a rate, a second apart.
const LIVE_TIMEOUT: Duration = Duration::from_secs(90);
/// Rounds of traffic and queries at least, so that what must stay empty is asked while traffic
/// flows, over several scrapes.
const MIN_ROUNDS: u32 = 5;
const ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

fn rules_yaml() -> anyhow::Result<serde_yaml::Value> {
    let path = deploy_monitoring_dir().join(RULES);
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    Ok(serde_yaml::from_str(&text)?)
}

/// Every alert of the rules file: its name and expression.
fn alerts() -> anyhow::Result<Vec<(String, String)>> {
    let rules = rules_yaml()?;
    let mut alerts = Vec::new();
    for group in rules["groups"].as_sequence().context("no groups")? {
        for rule in group["rules"]
            .as_sequence()
            .context("a group without rules")?
        {
            let name = rule["alert"]
                .as_str()
                .context("a rule that is not an alert")?;
            let expr = rule["expr"]
                .as_str()
                .with_context(|| format!("{name}: no expr"))?;
            alerts.push((name.to_owned(), expr.to_owned()));
        }
    }
    Ok(alerts)
}

fn promtool(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(deploy_monitoring_dir())
        .output()
        .context("running promtool (Debian package prometheus, `cargo xtask setup`)")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        output.status.success(),
        "promtool {} failed ({}):\n{text}",
        args.join(" "),
        output.status
    );
    Ok(text)
}

#[test]
fn promtool_checks_the_rules_and_their_unit_tests_pass() -> anyhow::Result<()> {
    let alerts = alerts()?;
    let checked = promtool(&["check", "rules", RULES])?;
    eprintln!("{checked}");
    ensure!(
        checked.contains(&format!("SUCCESS: {} rules found", alerts.len())),
        "promtool did not find the file's {} alerts: {checked}",
        alerts.len()
    );
    let tested = promtool(&["test", "rules", RULES_TESTS])?;
    eprintln!("{tested}");
    ensure!(tested.contains("SUCCESS"), "{tested}");

    // Each alert has a case where the unit tests expect it to fire and one where they expect
    // it quiet (an evaluation with no expected alerts): a rule that never fires, or always
    // does, fails its own tests.
    let path = deploy_monitoring_dir().join(RULES_TESTS);
    let tests: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&path)?)?;
    let mut fires = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for test in tests["tests"].as_sequence().context("no tests")? {
        for case in test["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = case["alertname"]
                .as_str()
                .context("a case without alertname")?;
            let expected = case["exp_alerts"].as_sequence().map_or(0, Vec::len);
            if expected == 0 {
                quiet.insert(name.to_owned());
            } else {
                fires.insert(name.to_owned());
            }
        }
    }
    let names: BTreeSet<String> = alerts.into_iter().map(|(name, _)| name).collect();
    let never_fired: Vec<_> = names.difference(&fires).collect();
    let never_quiet: Vec<_> = names.difference(&quiet).collect();
    ensure!(
        never_fired.is_empty() && never_quiet.is_empty(),
        "alerts without a unit test that fires them: {never_fired:?}; without one that keeps them quiet: {never_quiet:?}"
    );
    Ok(())
}

/// What one panel of the dashboard is meant to show.
struct Panel {
    title: &'static str,
    /// Labels every series it returns carries.
    labels: &'static [&'static str],
    /// The modes whose metrics it reads; in the other mode it returns nothing.
    modes: &'static [&'static str],
    /// Series that must be there with a value above 0, each given by some of its labels (a
    /// value `10.244.1.2` also matches `10.244.1.2:8080`).
    positive: &'static [&'static [(&'static str, &'static str)]],
}

const BOTH: &[&str] = &["ebpf", "iptables"];
const EBPF: &[&str] = &["ebpf"];
const IPTABLES: &[&str] = &["iptables"];
const SERVICE: &[&str] = &["namespace", "name", "port", "protocol"];
const SERVICE_FRONTEND: &[&str] = &["namespace", "name", "port", "protocol", "frontend"];

const PANELS: &[Panel] = &[
    Panel {
        title: "Sync rate",
        labels: &["instance", "ip_family"],
        modes: BOTH,
        positive: &[&[("ip_family", "IPv4")]],
    },
    Panel {
        title: "Sync latency",
        labels: &["instance", "ip_family"],
        modes: BOTH,
        positive: &[&[("ip_family", "IPv4")]],
    },
    Panel {
        title: "Time since the last successful sync",
        labels: &["instance", "ip_family"],
        modes: BOTH,
        positive: &[],
    },
    Panel {
        title: "Network programming latency",
        labels: &["instance", "ip_family"],
        modes: BOTH,
        positive: &[&[("ip_family", "IPv4")]],
    },
    Panel {
        title: "Pending changes",
        labels: &["instance"],
        modes: BOTH,
        positive: &[],
    },
    Panel {
        title: "Datapath events by reason (eBPF)",
        labels: &["reason"],
        modes: EBPF,
        positive: &[&[("reason", "translated")], &[("reason", "tc_translated")]],
    },
    Panel {
        title: "BPF map fill (eBPF)",
        labels: &["map"],
        modes: EBPF,
        positive: &[],
    },
    Panel {
        title: "iptables rules (iptables mode)",
        labels: &["ip_family", "table"],
        modes: IPTABLES,
        positive: &[&[("ip_family", "IPv4"), ("table", "nat")]],
    },
    Panel {
        title: "Service new connections (top 10)",
        labels: SERVICE,
        modes: BOTH,
        positive: &[&[
            ("namespace", "default"),
            ("name", "web"),
            ("port", "http"),
            ("protocol", "TCP"),
        ]],
    },
    Panel {
        title: "Datapath drops by reason (eBPF)",
        labels: &["reason", "action"],
        modes: EBPF,
        // `empty`'s refusals at the socket hook, `local`'s drops of outside clients at tc.
        positive: &[
            &[("reason", "rejected_no_backends"), ("action", "rejected")],
            &[
                ("reason", "tc_dropped_no_local_endpoints"),
                ("action", "dropped"),
            ],
        ],
    },
    Panel {
        title: "Service rejected connections (no endpoints)",
        labels: SERVICE_FRONTEND,
        modes: BOTH,
        positive: &[&[("name", "empty"), ("frontend", "cluster_ip")]],
    },
    Panel {
        title: "Service dropped connections",
        labels: &[
            "namespace",
            "name",
            "port",
            "protocol",
            "frontend",
            "reason",
        ],
        modes: BOTH,
        positive: &[&[
            ("name", "local"),
            ("frontend", "node_port"),
            ("reason", "no_local_endpoints"),
        ]],
    },
    Panel {
        title: "Endpoint balance: new connections per endpoint",
        labels: &["namespace", "name", "port", "endpoint"],
        modes: BOTH,
        positive: &[
            &[("name", "web"), ("endpoint", "10.244.1.2")],
            &[("name", "web"), ("endpoint", "10.244.2.2")],
        ],
    },
    Panel {
        title: "Service throughput by direction (eBPF)",
        labels: &[
            "namespace",
            "name",
            "port",
            "protocol",
            "frontend",
            "direction",
        ],
        modes: EBPF,
        // `web`'s NodePort connections from outside cross the tc programs both ways; its
        // ClusterIP connections are translated at the socket and have no packets.
        positive: &[
            &[
                ("name", "web"),
                ("frontend", "node_port"),
                ("direction", "forward"),
            ],
            &[
                ("name", "web"),
                ("frontend", "node_port"),
                ("direction", "reply"),
            ],
        ],
    },
];

/// The alerts whose expression this rig's traffic makes true (before their `for:`), by the
/// series it returns; every other alert's expression returns nothing here.
const ALERTS_THE_RIG_TRIGGERS: &[(&str, &[(&str, &str)])] = &[
    (
        "KubeProxyServiceRejectingConnections",
        &[("namespace", "default"), ("name", "empty")],
    ),
    (
        "KubeProxyServiceDroppingNoLocalEndpoints",
        &[("name", "local"), ("frontend", "node_port")],
    ),
];

fn matches(sample: &Sample, want: &[(&str, &str)]) -> bool {
    want.iter().all(|(label, value)| {
        sample.labels.get(*label).is_some_and(|have| {
            have == value
                || have
                    .strip_prefix(value)
                    .is_some_and(|rest| rest.starts_with(':'))
        })
    })
}

/// The counters each round of [`send_traffic`] grows, as the agent exports them: every round
/// makes 10 connections through web's ClusterIP (from the node) and 10 through its NodePort
/// (from outside), each answered, and 3 refused ones to `empty`'s ClusterIP.
fn counter_values(exposition: &str) -> Vec<f64> {
    [
        (
            "kubeproxy_rs_service_new_connections_total",
            ["name=\"web\"", "frontend=\"cluster_ip\""],
        ),
        (
            "kubeproxy_rs_service_new_connections_total",
            ["name=\"web\"", "frontend=\"node_port\""],
        ),
        (
            "kubeproxy_rs_service_rejected_total",
            ["name=\"empty\"", "frontend=\"cluster_ip\""],
        ),
    ]
    .iter()
    .map(|(name, labels)| proxy_tests::http::metric_sum(exposition, name, labels))
    .collect()
}

fn describe(samples: &[Sample]) -> String {
    let shown: Vec<String> = samples
        .iter()
        .take(8)
        .map(|s| format!("{:?} = {:?}", s.labels, s.value))
        .collect();
    format!("{} series [{}]", samples.len(), shown.join("; "))
}

/// What is wrong with `samples` as `panel`'s answer in `mode`; `None` when it is right.
fn panel_problem(panel: &Panel, mode: &str, samples: &[Sample]) -> Option<String> {
    if !panel.modes.contains(&mode) {
        return (!samples.is_empty()).then(|| {
            format!(
                "shows {mode}-mode series it is not about: {}",
                describe(samples)
            )
        });
    }
    if samples.is_empty() {
        return Some("no series".into());
    }
    for sample in samples {
        let missing: Vec<&&str> = panel
            .labels
            .iter()
            .filter(|label| !sample.labels.contains_key(**label))
            .collect();
        if !missing.is_empty() {
            return Some(format!("series without {missing:?}: {}", describe(samples)));
        }
    }
    for want in panel.positive {
        let found = samples
            .iter()
            .any(|s| matches(s, want) && s.value.is_some_and(|v| v > 0.0));
        if !found {
            return Some(format!("no series {want:?} above 0: {}", describe(samples)));
        }
    }
    None
}

fn alert_problem(name: &str, samples: &[Sample]) -> Option<String> {
    match ALERTS_THE_RIG_TRIGGERS
        .iter()
        .find(|(alert, _)| *alert == name)
    {
        Some((_, want)) => (!samples.iter().any(|s| matches(s, want))).then(|| {
            format!(
                "the rig's traffic should make it true for {want:?}: {}",
                describe(samples)
            )
        }),
        None => {
            (!samples.is_empty()).then(|| format!("true in a healthy rig: {}", describe(samples)))
        }
    }
}

/// A Service of type NodePort like `default/web`, named `local`, on [`LOCAL_IP`] and
/// [`LOCAL_NODE_PORT`], with `externalTrafficPolicy: Local`.
fn local_service_yaml() -> String {
    let spec = ServiceSpec {
        type_: "NodePort",
        external_traffic_policy_local: true,
        ..ServiceSpec::default()
    };
    web_service_yaml(&spec)
        .replace("name: web,", "name: local,")
        .replace(&CLUSTER_IP.to_string(), &LOCAL_IP.to_string())
        .replace(
            &format!("nodePort: {NODE_PORT}"),
            &format!("nodePort: {LOCAL_NODE_PORT}"),
        )
}

/// `default/web`'s slice with pods 1 and 2, stamped with the EndpointSlice controller's
/// trigger time (now), from which the agent measures network programming latency.
fn web_slice_with_trigger_time() -> String {
    let now = k8s_openapi::jiff::Timestamp::now();
    http_slice(
        "default",
        "web-1",
        "web",
        &[pod_endpoint(1), pod_endpoint(2)],
    )
    .replacen(
        "metadata:\n",
        &format!("metadata:\n  annotations:\n    {ANNOTATION}: \"{now}\"\n"),
        1,
    )
}

/// One round of the traffic the panels show: connections to `default/web` through its
/// ClusterIP and its NodePort (both pods answer), to `default/empty` (refused) and to
/// `default/local`'s NodePort (dropped).
fn send_traffic(internal: &Client, external: &Client) -> anyhow::Result<()> {
    let node_port = SocketAddr::from(SocketAddrV4::new(Topology::node_ext_ip(), NODE_PORT));
    for (client, target) in [(internal, cluster_addr()), (external, node_port)] {
        let attempts = client.run(target, 10)?;
        ensure!(
            attempts.iter().all(is_pod),
            "{target}: every connection answered by a pod: {attempts:?}"
        );
    }
    let empty = SocketAddr::from(SocketAddrV4::new(EMPTY_IP, SERVICE_PORT));
    let attempts = internal.clone().timeout(DROP_TIMEOUT).run(empty, 3)?;
    ensure!(
        attempts
            .iter()
            .all(|a| *a == Attempt::Err("ECONNREFUSED".into())),
        "default/empty refuses: {attempts:?}"
    );
    let local = SocketAddr::from(SocketAddrV4::new(Topology::node_ext_ip(), LOCAL_NODE_PORT));
    let attempts = external.clone().timeout(DROP_TIMEOUT).run(local, 2)?;
    ensure!(
        attempts
            .iter()
            .all(|a| *a == Attempt::Err("TIMEOUT".into())),
        "default/local's NodePort drops outside clients: {attempts:?}"
    );
    Ok(())
}

fn live(mode: &str) -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let dashboard = std::fs::read_to_string(deploy_monitoring_dir().join(DASHBOARD))?;
    let queries = dashboard_queries(&dashboard)?;
    let alerts = alerts()?;
    // Every panel has its expectation here and every expectation its panel: a panel added to
    // the dashboard is tested, and a renamed one is noticed.
    let titles: BTreeSet<&str> = queries.iter().map(|q| q.panel.as_str()).collect();
    let expected: BTreeSet<&str> = PANELS.iter().map(|p| p.title).collect();
    ensure!(
        titles == expected,
        "dashboard panels {titles:?} != the test's {expected:?}"
    );
    for (alert, _) in ALERTS_THE_RIG_TRIGGERS {
        ensure!(
            alerts.iter().any(|(name, _)| name == alert),
            "no alert {alert}"
        );
    }

    let mut s = Scenario::new(2)?;
    let web = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&web, &[pod_endpoint(1)])?;
    // A local address answering for `empty`'s ClusterIP: routable from the node, and it would
    // answer were the connection not refused.
    s.topo.add_decoy(EMPTY_IP, SERVICE_PORT)?;
    s.manifests.write(
        "empty-svc.yaml",
        &http_service("default", "empty", EMPTY_IP),
    )?;
    s.manifests.write(
        "empty-slice.yaml",
        &http_slice("default", "empty-1", "empty", &[]),
    )?;
    s.manifests.write("local-svc.yaml", &local_service_yaml())?;
    let elsewhere = proxy_tests::manifests::Endpoint {
        node_name: Some("other-node".into()),
        ..proxy_tests::manifests::Endpoint::ready(Topology::pod_ip(1))
    };
    s.manifests.write(
        "local-slice.yaml",
        &http_slice("default", "local-1", "local", &[elsewhere]),
    )?;
    // Per-endpoint counters are off by default (one series per endpoint).
    let internal = s.start_serving(mode, &["--service-traffic-endpoints"])?;
    let external = s.external_client();
    let prometheus = Prometheus::start(s.topo.node(), METRICS.parse()?, &[])?;

    // Two scrapes before the change, so that the sync it causes is an increase Prometheus sees.
    try_wait_until(
        "Prometheus' first scrapes of the agent",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let samples = prometheus.query("count_over_time(up[1m]) >= 2")?;
            Ok(!samples.is_empty())
        },
    )
    .with_context(|| prometheus.log())?;

    // pod2 joins with a trigger time after the agent's start: one network programming
    // observation when the agent has programmed it.
    let before = s.agent()?.syncs();
    s.manifests
        .write("web-slice.yaml", &web_slice_with_trigger_time())?;
    let agent = s.agent()?;
    try_wait_until(
        "the sync that adds pod2",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || Ok(agent.syncs() > before),
    )
    .with_context(|| agent.log_tail(30))?;
    let programmed = proxy_tests::http::metric_sum(
        &agent.metrics()?,
        "kubeproxy_network_programming_duration_seconds_count",
        &["ip_family=\"IPv4\""],
    );
    ensure!(
        programmed >= 1.0,
        "the agent observed no network programming latency for pod2's slice: {}",
        agent.log_tail(30)
    );

    // A panel or alert that must show series passes once it has shown them (a sync's rate
    // over the window falls back to 0 a minute after the sync); one that must stay empty is
    // checked in every round, and fails at its first series.
    // What the counters hold before the rounds (the readiness probes' connections): the agent
    // reads them every 3 s, and pod2's sync is done.
    std::thread::sleep(Duration::from_secs(4));
    let before = counter_values(&agent.metrics()?);
    let deadline = Instant::now() + LIVE_TIMEOUT;
    let mut rounds = 0;
    let mut tally = Tally::default();
    loop {
        send_traffic(&internal, &external)?;
        rounds += 1;
        for query in &queries {
            let panel = PANELS
                .iter()
                .find(|p| p.title == query.panel)
                .context("a panel without expectation")?;
            let every_round = !panel.modes.contains(&mode);
            if !every_round && tally.shown.contains(&key(query)) {
                continue;
            }
            let samples = prometheus
                .query(&query.promql)
                .with_context(|| format!("panel {:?} {}", query.panel, query.ref_id))?;
            let problem = panel_problem(panel, mode, &samples)
                .map(|problem| format!("{problem}\n    {}", query.promql));
            tally.record(key(query), every_round, problem);
        }
        for (name, expr) in &alerts {
            let what = format!("alert {name}");
            let every_round = !ALERTS_THE_RIG_TRIGGERS
                .iter()
                .any(|(alert, _)| alert == name);
            if !every_round && tally.shown.contains(&what) {
                continue;
            }
            let samples = prometheus
                .query(expr)
                .with_context(|| format!("alert {name}"))?;
            tally.record(what, every_round, alert_problem(name, &samples));
        }
        if (tally.not_yet.is_empty() && rounds >= MIN_ROUNDS) || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    // The counters count exactly what was sent: every round made 10 connections through
    // web's ClusterIP (from the node) and 10 through its NodePort (from outside), each
    // answered, and 3 refused ones to `empty`'s ClusterIP — nothing else, not the datapath
    // self-test's probe of the NodePort (eBPF) that runs with every drift check. Read a little
    // after the last round: the agent reads its counters every few seconds.
    let sent = [10 * rounds, 10 * rounds, 3 * rounds];
    let mut counted = Vec::new();
    let exact = try_wait_until(
        "per-Service counters grown by the connections sent",
        Duration::from_secs(20),
        Duration::from_millis(500),
        || {
            counted = counter_values(&agent.metrics()?)
                .iter()
                .zip(&before)
                .map(|(now, then)| now - then)
                .collect();
            Ok(counted
                .iter()
                .zip(&sent)
                .all(|(have, want)| *have == f64::from(*want)))
        },
    );
    if exact.is_err() {
        bail!("[{mode}] after {rounds} rounds: counted {counted:?}, sent {sent:?}");
    }
    let mut problems = tally.not_yet;
    problems.extend(tally.wrongly_shown);
    eprintln!(
        "[{mode}] {} panel queries and {} alerts evaluated after {rounds} rounds of traffic",
        queries.len(),
        alerts.len()
    );
    if !problems.is_empty() {
        let list: Vec<String> = problems
            .iter()
            .map(|(what, problem)| format!("  {what}: {problem}"))
            .collect();
        bail!(
            "[{mode}] {} of the dashboard's queries and alerts are not as meant:\n{}\n\
             (Prometheus log tail: {})",
            problems.len(),
            list.join("\n"),
            prometheus
                .log()
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    Ok(())
}

/// The checks of one live run: what has shown its series, what has not yet (and its last
/// problem), and what showed series it must not.
#[derive(Default)]
struct Tally {
    shown: BTreeSet<String>,
    not_yet: BTreeMap<String, String>,
    wrongly_shown: BTreeMap<String, String>,
}

impl Tally {
    /// `problem` of the check `what` in this round; `every_round`: the check is that nothing
    /// is shown.
    fn record(&mut self, what: String, every_round: bool, problem: Option<String>) {
        match problem {
            Some(problem) if every_round => {
                self.wrongly_shown.entry(what).or_insert(problem);
            }
            Some(problem) => {
                self.not_yet.insert(what, problem);
            }
            None if !every_round => {
                self.not_yet.remove(&what);
                self.shown.insert(what);
            }
            None => {}
        }
    }
}

fn key(query: &PanelQuery) -> String {
    format!("panel {:?} {}", query.panel, query.ref_id)
}

#[test]
fn every_panel_and_alert_against_a_live_prometheus_ebpf() -> anyhow::Result<()> {
    live("ebpf")
}

#[test]
fn every_panel_and_alert_against_a_live_prometheus_iptables() -> anyhow::Result<()> {
    live("iptables")
}
