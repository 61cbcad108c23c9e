//! `/metrics` and `/proxyMode` (reference §13, misc-vectors TestNoEndpointsMetric).

use std::{collections::BTreeSet, time::SystemTime};

use super::*;
use crate::http_servers::metrics::{
    IptablesTable, Metrics, network_programming_buckets, no_local_endpoints,
};
use proxy_common::StatIndex;
use proxy_model::desired::{IpFamily, ServicePortName};

/// `# TYPE` lines: family name → type.
fn types(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.to_owned()))
        .collect()
}

fn help(text: &str, family: &str) -> String {
    let prefix = format!("# HELP {family} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no HELP for {family}"))
        .to_owned()
}

fn has_sample(text: &str, sample: &str) -> bool {
    text.lines().any(|line| line.starts_with(sample))
}

/// Feeds every metric once, so every family has a series.
fn feed(metrics: &Metrics) {
    let now = SystemTime::now();
    for family in IpFamily::ALL {
        metrics.sync_queued(family, now);
        metrics.sync_succeeded(family, Duration::from_millis(3), now);
        metrics.network_programmed(family, &[now - Duration::from_secs(2)], now);
        metrics.set_no_local_endpoints(family, &Default::default(), None);
        metrics.conntrack_reconciled(family, Duration::from_millis(1), 2);
        if let Some(iptables) = metrics.iptables() {
            iptables.sync_duration(family, Duration::from_millis(3), true);
            iptables.sync_duration(family, Duration::from_millis(3), false);
            iptables.restore_failed(family, true);
            iptables.rules(family, IptablesTable::Filter, 4, 4);
            iptables.rules(family, IptablesTable::Nat, 40, 7);
        }
    }
    metrics.changes(3, 5, 1, 2);
    metrics.healthz_answered(axum::http::StatusCode::OK);
    metrics.livez_answered(axum::http::StatusCode::SERVICE_UNAVAILABLE);
    if let Some(iptables) = metrics.iptables() {
        iptables.read_nfacct_with(Box::new(|name| match name {
            "ct_state_invalid_dropped_pkts" => Ok(10),
            "localhost_nps_accepted_pkts" => Ok(20),
            other => Err(format!("no counter {other}")),
        }));
    }
    if let Some(ebpf) = metrics.ebpf() {
        ebpf.map_usage("frontends", 3, 65536);
        ebpf.datapath_counters(&[
            (StatIndex::Translated, 7),
            (StatIndex::RejectedNoBackends, 1),
            (StatIndex::TcSnatPortExhausted, 2),
        ]);
        ebpf.conntrack_entries(9);
        ebpf.conntrack_gc_run();
    }
}

/// (sample name as kube-proxy exposes it, type, labels, help without the `[ALPHA] ` prefix)
const BOTH_MODES: &[(&str, &str, &str, &str)] = &[
    (
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "histogram",
        "ip_family",
        "SyncProxyRules latency in seconds",
    ),
    (
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "gauge",
        "ip_family",
        "The last time proxy rules were successfully synced",
    ),
    (
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "gauge",
        "ip_family",
        "The last time a sync of proxy rules was queued",
    ),
    (
        "kubeproxy_network_programming_duration_seconds",
        "histogram",
        "ip_family",
        "In Cluster Network Programming Latency in seconds",
    ),
    (
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        "gauge",
        "",
        "Pending proxy rules Endpoint changes",
    ),
    (
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "counter",
        "",
        "Cumulative proxy rules Endpoint changes",
    ),
    (
        "kubeproxy_sync_proxy_rules_service_changes_pending",
        "gauge",
        "",
        "Pending proxy rules Service changes",
    ),
    (
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "counter",
        "",
        "Cumulative proxy rules Service changes",
    ),
    (
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        "gauge",
        "ip_family,traffic_policy",
        "Number of services with a Local traffic policy and no endpoints",
    ),
    (
        "kubeproxy_proxy_healthz_total",
        "counter",
        "code",
        "Cumulative proxy healthz HTTP status",
    ),
    (
        "kubeproxy_proxy_livez_total",
        "counter",
        "code",
        "Cumulative proxy livez HTTP status",
    ),
    (
        "kubeproxy_conntrack_reconciler_deleted_entries_total",
        "counter",
        "ip_family",
        "Cumulative conntrack flows deleted by conntrack reconciler",
    ),
    (
        "kubeproxy_conntrack_reconciler_sync_duration_seconds",
        "histogram",
        "ip_family",
        "ReconcileConntrackFlowsLatency latency in seconds",
    ),
];

const IPTABLES_ONLY: &[(&str, &str, &str, &str)] = &[
    (
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "histogram",
        "ip_family",
        "SyncProxyRules latency in seconds for full resyncs",
    ),
    (
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        "histogram",
        "ip_family",
        "SyncProxyRules latency in seconds for partial resyncs",
    ),
    (
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
        "counter",
        "ip_family",
        "Cumulative proxy iptables restore failures",
    ),
    (
        "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
        "counter",
        "ip_family",
        "Cumulative proxy iptables partial restore failures",
    ),
    (
        "kubeproxy_sync_proxy_rules_iptables_total",
        "gauge",
        "ip_family,table",
        "Total number of iptables rules owned by kube-proxy",
    ),
    (
        "kubeproxy_sync_proxy_rules_iptables_last",
        "gauge",
        "ip_family,table",
        "Number of iptables rules written by kube-proxy in last sync",
    ),
    (
        "kubeproxy_iptables_ct_state_invalid_dropped_packets_total",
        "counter",
        "",
        "packets dropped by iptables to work around conntrack problems",
    ),
    (
        "kubeproxy_iptables_localhost_nodeports_accepted_packets_total",
        "counter",
        "",
        "Number of packets accepted on nodeports of loopback interface",
    ),
];

const EBPF_ONLY: &[(&str, &str, &str)] = &[
    ("kubeproxy_ebpf_map_entries", "gauge", "map"),
    ("kubeproxy_ebpf_map_capacity", "gauge", "map"),
    (
        "kubeproxy_ebpf_datapath_events_total",
        "counter",
        "action,reason",
    ),
    ("kubeproxy_ebpf_conntrack_entries", "gauge", ""),
    ("kubeproxy_ebpf_conntrack_gc_runs_total", "counter", ""),
];

/// The OpenMetrics family name of a sample name (counters drop `_total`).
fn family_name<'a>(sample: &'a str, kind: &str) -> &'a str {
    if kind == "counter" {
        sample.strip_suffix("_total").expect("counter named _total")
    } else {
        sample
    }
}

/// The label names of the first sample of a family (`le` aside), sorted.
fn label_names(text: &str, sample: &str, kind: &str) -> String {
    let sample = if kind == "histogram" {
        format!("{sample}_count")
    } else {
        sample.to_owned()
    };
    let line = text
        .lines()
        .find(|line| {
            line.starts_with(&format!("{sample}{{")) || line.starts_with(&format!("{sample} "))
        })
        .unwrap_or_else(|| panic!("no sample {sample}"));
    let labels: BTreeSet<&str> = line
        .split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'))
        .map(|(labels, _)| {
            labels
                .split(',')
                .filter_map(|l| l.split_once('='))
                .map(|(n, _)| n)
                .collect()
        })
        .unwrap_or_default();
    labels.into_iter().collect::<Vec<_>>().join(",")
}

fn check(text: &str, table: &[(&str, &str, &str, &str)]) {
    let types = types(text);
    for &(sample, kind, labels, help_text) in table {
        let family = family_name(sample, kind);
        assert_eq!(
            types.get(family).map(String::as_str),
            Some(kind),
            "{sample}"
        );
        assert_eq!(
            help(text, family),
            format!("[ALPHA] {help_text}"),
            "{sample}"
        );
        assert_eq!(label_names(text, sample, kind), labels, "{sample}");
    }
}

#[test]
fn ebpf_mode_exposes_the_common_and_ebpf_metrics() {
    let metrics = Metrics::new(ProxyMode::Ebpf);
    feed(&metrics);
    let text = metrics.encode();
    check(&text, BOTH_MODES);
    let types = types(&text);
    for (sample, kind, labels) in EBPF_ONLY {
        assert_eq!(
            types.get(family_name(sample, kind)).map(String::as_str),
            Some(*kind)
        );
        assert_eq!(label_names(&text, sample, kind), *labels, "{sample}");
    }
    for (sample, kind, _, _) in IPTABLES_ONLY {
        assert!(
            !types.contains_key(family_name(sample, kind)),
            "{sample} in ebpf mode"
        );
    }
    assert!(has_sample(
        &text,
        "kubeproxy_ebpf_datapath_events_total{reason=\"translated\",action=\"translated\"} 7"
    ));
    // Each reason carries what the datapath did, so drops are one selector away.
    assert!(has_sample(
        &text,
        "kubeproxy_ebpf_datapath_events_total{reason=\"rejected_no_backends\",action=\"rejected\"} 1"
    ));
    assert!(has_sample(
        &text,
        "kubeproxy_ebpf_datapath_events_total{reason=\"tc_snat_port_exhausted\",action=\"dropped\"} 2"
    ));
    assert!(has_sample(
        &text,
        "kubeproxy_ebpf_map_capacity{map=\"frontends\"} 65536"
    ));
    assert!(has_sample(
        &text,
        "kubeproxy_sync_proxy_rules_service_changes_total 3"
    ));
    assert!(has_sample(
        &text,
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending 2"
    ));
    assert!(has_sample(
        &text,
        "kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv6\"} 2"
    ));
    assert!(has_sample(
        &text,
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 0"
    ));
}

#[test]
fn iptables_mode_also_exposes_the_iptables_metrics() {
    let metrics = Metrics::new(ProxyMode::Iptables);
    feed(&metrics);
    let text = metrics.encode();
    check(&text, BOTH_MODES);
    check(&text, IPTABLES_ONLY);
    assert!(metrics.ebpf().is_none());
    assert!(has_sample(
        &text,
        "kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv6\",table=\"nat\"} 40"
    ));
    assert!(has_sample(
        &text,
        "kubeproxy_iptables_localhost_nodeports_accepted_packets_total 20"
    ));
}

/// component-base's `kubernetes_build_info` (beta from 1.36): one series at 1, with every label
/// upstream has, describing this build.
#[test]
fn build_info_is_served_in_both_modes_as_component_base_serves_it() {
    for mode in [ProxyMode::Ebpf, ProxyMode::Iptables] {
        let text = Metrics::new(mode).encode();
        assert_eq!(
            types(&text)
                .get("kubernetes_build_info")
                .map(String::as_str),
            Some("gauge")
        );
        assert!(
            help(&text, "kubernetes_build_info")
                .starts_with("[BETA] A metric with a constant '1' value")
        );
        let series: Vec<&str> = text
            .lines()
            .filter(|line| line.starts_with("kubernetes_build_info{"))
            .collect();
        assert_eq!(series.len(), 1, "{text}");
        let series = series[0];
        assert!(series.ends_with("} 1"), "{series}");
        for label in [
            "build_date=",
            "compiler=\"rustc\"",
            "git_commit=",
            "git_tree_state=",
            "go_version=",
            "platform=\"linux/",
        ] {
            assert!(series.contains(label), "{label} in {series}");
        }
        let version = format!("git_version=\"v{}\"", env!("CARGO_PKG_VERSION"));
        assert!(series.contains(&version), "{series}");
        assert!(series.contains(&format!("major=\"{}\"", env!("CARGO_PKG_VERSION_MAJOR"))));
    }
}

#[test]
fn buckets_are_kube_proxys() {
    let metrics = Metrics::new(ProxyMode::Ebpf);
    feed(&metrics);
    let text = metrics.encode();
    let bounds = |name: &str| -> Vec<String> {
        text.lines()
            .filter(|line| line.starts_with(&format!("{name}_bucket{{")) && line.contains("IPv4"))
            .filter_map(|line| {
                line.split("le=\"")
                    .nth(1)?
                    .split('"')
                    .next()
                    .map(str::to_owned)
            })
            .collect()
    };
    let sync: Vec<String> = (0..15)
        .map(|i| format!("{}", 0.001 * f64::from(1 << i)))
        .chain(["+Inf".to_owned()])
        .collect();
    assert_eq!(bounds("kubeproxy_sync_proxy_rules_duration_seconds"), sync);
    let programming = network_programming_buckets();
    assert_eq!(programming.len(), 81);
    assert_eq!(programming[..5], [0.0, 0.25, 0.5, 1.0, 2.0]);
    assert_eq!(programming[61..64], [59.0, 60.0, 65.0]);
    assert_eq!(
        programming[73..],
        [115.0, 120.0, 150.0, 180.0, 210.0, 240.0, 270.0, 300.0]
    );
    assert_eq!(
        bounds("kubeproxy_network_programming_duration_seconds").len(),
        82
    );
    // The 2 s observation falls in the (1, 2] bucket.
    assert!(
        has_sample(
            &text,
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"1.0\",ip_family=\"IPv4\"} 0"
        ) || has_sample(
            &text,
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"1\",ip_family=\"IPv4\"} 0"
        )
    );
}

/// misc-vectors TestNoEndpointsMetric, all seven cases.
#[test]
fn no_local_endpoints_vectors() {
    type Case = (
        &'static str,
        Option<&'static str>,
        Option<&'static str>,
        &'static [(&'static str, &'static str)],
        usize,
        usize,
    );
    let local = &[
        ("10.0.1.1", NODE),
        ("10.0.1.2", "node1"),
        ("10.0.1.3", "node2"),
    ];
    let remote = &[
        ("10.0.1.1", "node0"),
        ("10.0.1.2", "node1"),
        ("10.0.1.3", "node2"),
    ];
    let cases: &[Case] = &[
        (
            "internalTrafficPolicy is set and there are local endpoints",
            Some("Local"),
            None,
            local,
            0,
            0,
        ),
        (
            "externalTrafficPolicy is set and there are local endpoints",
            None,
            Some("Local"),
            local,
            0,
            0,
        ),
        (
            "both policies are set and there are local endpoints",
            Some("Local"),
            Some("Local"),
            local,
            0,
            0,
        ),
        (
            "internalTrafficPolicy is set and there are no local endpoints",
            Some("Local"),
            None,
            remote,
            1,
            0,
        ),
        (
            "externalTrafficPolicy is set and there are no local endpoints",
            None,
            Some("Local"),
            remote,
            0,
            1,
        ),
        (
            "both policies are set and there are no local endpoints",
            Some("Local"),
            Some("Local"),
            remote,
            1,
            1,
        ),
        (
            "both policies are set and there are no endpoints at all",
            Some("Local"),
            Some("Local"),
            &[],
            0,
            0,
        ),
    ];
    // Synced vector after vector, each time naming only the ports that changed.
    let rolling = Metrics::new(ProxyMode::Ebpf);
    let mut previous = Snapshot::default();
    rolling.set_no_local_endpoints(IpFamily::V4, &previous.v4, None);
    for &(name, itp, etp, endpoints, internal, external) in cases {
        let mut spec = String::from(
            "clusterIP: 172.30.1.1\n  ports:\n  - {port: 80, protocol: TCP, nodePort: 123}\n",
        );
        if let Some(itp) = itp {
            spec.push_str(&format!("  internalTrafficPolicy: {itp}\n"));
        }
        if let Some(etp) = etp {
            spec.push_str(&format!(
                "  type: NodePort\n  externalTrafficPolicy: {etp}\n"
            ));
        }
        let mut yaml = format!(
            "kind: Service\nmetadata: {{name: svc1, namespace: ns1}}\nspec:\n  {spec}---\nkind: EndpointSlice\nmetadata:\n  name: svc1-1\n  namespace: ns1\n  labels: {{kubernetes.io/service-name: svc1}}\naddressType: IPv4\nports:\n- {{name: \"\", port: 80, protocol: TCP}}\nendpoints:\n"
        );
        if endpoints.is_empty() {
            yaml = yaml.replace("endpoints:\n", "endpoints: []\n");
        }
        for (ip, node) in endpoints {
            yaml.push_str(&format!(
                "- {{addresses: [{ip}], nodeName: {node}, conditions: {{ready: true}}}}\n"
            ));
        }
        let counts = no_local_endpoints(&snapshot(&yaml).v4);
        assert_eq!(
            (counts.internal, counts.external),
            (internal, external),
            "{name}"
        );

        let metrics = Metrics::new(ProxyMode::Ebpf);
        let current = snapshot(&yaml);
        metrics.set_no_local_endpoints(IpFamily::V4, &current.v4, None);
        // The same count from a sync that names only the ports changed since the last vector's.
        let scope: BTreeSet<ServicePortName> = previous
            .v4
            .service_ports
            .keys()
            .chain(current.v4.service_ports.keys())
            .cloned()
            .collect();
        rolling.set_no_local_endpoints(IpFamily::V4, &current.v4, Some(&scope));
        for (which, text) in [("full", metrics.encode()), ("scoped", rolling.encode())] {
            for (policy, value) in [("internal", internal), ("external", external)] {
                let sample = format!(
                    "kubeproxy_sync_proxy_rules_no_local_endpoints_total{{ip_family=\"IPv4\",traffic_policy=\"{policy}\"}} {value}"
                );
                assert!(
                    has_sample(&text, &sample),
                    "{name} ({which}): {sample}\n{text}"
                );
            }
        }
        previous = current;
    }
}

#[test]
fn datapath_counters_follow_the_cumulative_readings() {
    let metrics = Metrics::new(ProxyMode::Ebpf);
    let ebpf = metrics.ebpf().unwrap();
    ebpf.datapath_counters(&[(StatIndex::Translated, 5)]);
    ebpf.datapath_counters(&[(StatIndex::Translated, 8)]);
    assert!(has_sample(
        &metrics.encode(),
        "kubeproxy_ebpf_datapath_events_total{reason=\"translated\",action=\"translated\"} 8"
    ));
    // The maps were recreated: counting restarts from the new reading.
    ebpf.datapath_counters(&[(StatIndex::Translated, 2)]);
    assert!(has_sample(
        &metrics.encode(),
        "kubeproxy_ebpf_datapath_events_total{reason=\"translated\",action=\"translated\"} 10"
    ));
}

#[tokio::test]
async fn metrics_server_serves_metrics_proxy_mode_and_healthz() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let addr = services.metrics_addr().unwrap();
    services.synced(
        &[IpFamily::V4],
        &Snapshot::default(),
        None,
        Duration::from_millis(2),
    );

    let reply = get(addr, "/proxyMode").await;
    assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
    assert_eq!(
        reply.header("Content-Type"),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(reply.header("X-Content-Type-Options"), Some("nosniff"));
    assert_eq!(reply.body, "ebpf");

    // promhttp: the classic text format unless OpenMetrics is asked for.
    for accept in [None, Some("text/plain;version=0.0.4")] {
        let headers: Vec<(&str, &str)> = accept.map(|a| ("Accept", a)).into_iter().collect();
        let reply = request_with(addr, "GET", "/metrics", &headers, "").await;
        assert_eq!(reply.status(), 200);
        assert_eq!(
            reply.header("Content-Type"),
            Some("text/plain; version=0.0.4; charset=utf-8; escaping=underscores"),
            "{accept:?}"
        );
        assert!(
            reply
                .body
                .contains("# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter\nkubeproxy_sync_proxy_rules_service_changes_total 0\n"),
            "{}",
            reply.body
        );
        assert!(
            reply.body.contains(
                "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1\n"
            )
        );
        assert!(!reply.body.contains("# EOF"));
    }
    let reply = request_with(
        addr,
        "GET",
        "/metrics",
        &[(
            "Accept",
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
        )],
        "",
    )
    .await;
    assert_eq!(
        reply.header("Content-Type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores")
    );
    assert!(
        reply
            .body
            .contains("# TYPE kubeproxy_sync_proxy_rules_service_changes counter\nkubeproxy_sync_proxy_rules_service_changes_total 0\n")
    );
    assert!(reply.body.ends_with("# EOF\n"));

    let reply = get(addr, "/healthz").await;
    assert_eq!((reply.status(), reply.body.as_str()), (200, "ok"));
    assert_eq!(get(addr, "/nope").await.status(), 404);

    let (iptables, _clock) = start(ProxyMode::Iptables);
    assert_eq!(
        get(iptables.metrics_addr().unwrap(), "/proxyMode")
            .await
            .body,
        "iptables"
    );
}

#[test]
fn nfacct_counters_are_read_at_each_scrape_and_absent_without_nfacct() {
    let metrics = Metrics::new(ProxyMode::Iptables);
    // No reader (nfacct not set up): upstream's collector emits nothing.
    assert!(!metrics.encode_text().contains("nfacct"));
    assert!(!metrics.encode_text().contains("ct_state_invalid"));
    let packets = Arc::new(std::sync::atomic::AtomicU64::new(3));
    let source = Arc::clone(&packets);
    metrics
        .iptables()
        .unwrap()
        .read_nfacct_with(Box::new(move |name| match name {
            "ct_state_invalid_dropped_pkts" => {
                Ok(source.load(std::sync::atomic::Ordering::Relaxed))
            }
            _ => Err("no such object".to_owned()),
        }));
    let text = metrics.encode_text();
    assert!(text.contains(
        "# HELP kubeproxy_iptables_ct_state_invalid_dropped_packets_total [ALPHA] packets dropped by iptables to work around conntrack problems\n\
         # TYPE kubeproxy_iptables_ct_state_invalid_dropped_packets_total counter\n\
         kubeproxy_iptables_ct_state_invalid_dropped_packets_total 3\n"
    ), "{text}");
    // The counter that cannot be read is left out, not shown as 0.
    assert!(!text.contains("localhost_nodeports"), "{text}");
    // The kernel's value as it is now, not an increase since the last scrape.
    packets.store(5, std::sync::atomic::Ordering::Relaxed);
    assert!(
        metrics
            .encode()
            .contains("kubeproxy_iptables_ct_state_invalid_dropped_packets_total 5\n")
    );
}

#[tokio::test]
async fn configz_and_debug_flags_v_as_kube_proxys_metrics_server() {
    let (services, _clock) = start(ProxyMode::Iptables);
    let addr = services.metrics_addr().unwrap();
    // Before the agent sets it: component-base's configz with nothing registered.
    assert_eq!(get(addr, "/configz").await.body, "{}");
    let loaded =
        proxy_model::config::load(&<proxy_model::cli::Args as clap::Parser>::parse_from([
            "proxy-agent",
            "--proxy-mode",
            "iptables",
            "--cluster-cidr",
            "10.0.0.0/8,fd00::/48",
            "--iptables-masquerade-bit",
            "13",
        ]))
        .unwrap();
    services
        .metrics()
        .set_debug(loaded.config.configz.clone(), false);
    let reply = get(addr, "/configz").await;
    assert_eq!(reply.status(), 200);
    assert_eq!(reply.header("Content-Type"), Some("application/json"));
    let json: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    let config = &json["kubeproxy.config.k8s.io"];
    assert_eq!(json.as_object().unwrap().len(), 1);
    assert_eq!(config["Mode"], "iptables");
    assert_eq!(config["IPTables"]["MasqueradeBit"], 13);
    assert_eq!(config["IPTables"]["LocalhostNodePorts"], true);
    assert_eq!(config["Linux"]["Conntrack"]["MaxPerCore"], 32768);
    assert_eq!(
        config["Linux"]["Conntrack"]["TCPEstablishedTimeout"],
        "24h0m0s"
    );
    assert_eq!(config["Linux"]["OOMScoreAdj"], -999);
    assert_eq!(config["SyncPeriod"], "30s");
    assert_eq!(config["MinSyncPeriod"], "1s");
    assert_eq!(config["ConfigSyncPeriod"], "15m0s");
    assert_eq!(config["HealthzBindAddress"], "0.0.0.0:10256");
    assert_eq!(config["ClientConnection"]["QPS"], 5);
    assert_eq!(
        config["DetectLocal"]["ClusterCIDRs"],
        serde_json::json!(["10.0.0.0/8", "fd00::/48"])
    );
    assert_eq!(config["NodePortAddresses"], serde_json::Value::Null);
    assert_eq!(config["Logging"]["verbosity"], 0);

    // Without --profiling upstream does not install /debug/flags.
    let reply = request_with(addr, "PUT", "/debug/flags/v", &[], "3").await;
    assert_eq!(reply.status(), 404);
    services.metrics().set_debug(loaded.config.configz, true);
    let reply = request_with(addr, "PUT", "/debug/flags/v", &[], "3").await;
    assert_eq!(reply.status(), 200);
    assert_eq!(reply.header("Content-Type"), Some("text/plain"));
    assert_eq!(reply.body, "successfully set klog.logging.verbosity to 3\n");
    assert_eq!(proxy_model::logging::verbosity(), 3);
    let reply = request_with(addr, "PUT", "/debug/flags/v", &[], "x").await;
    assert_eq!(reply.status(), 400);
    assert_eq!(
        reply.body,
        "failed set klog.logging.verbosity x: strconv.ParseInt: parsing \"x\": invalid syntax\n"
    );
    assert_eq!(proxy_model::logging::verbosity(), 3);
    let reply = get(addr, "/debug/flags/v").await;
    assert_eq!(
        (reply.status(), reply.body.as_str()),
        (406, "unsupported http method\n")
    );
    let index = get(addr, "/debug/flags").await;
    assert_eq!(index.status(), 200);
    assert!(index.body.contains("<tr>v<br>"), "{}", index.body);
    assert_eq!(get(addr, "/debug/flags/other").await.body, index.body);
    proxy_model::logging::set_verbosity("0").unwrap();
}

/// `/debug/drift` runs a burst of checks, then one a second, one at a time; the others are
/// told when to come back (429, `Retry-After`) and never reach the agent's loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_drift_is_rate_limited() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::http_servers::metrics::{DRIFT_REQUEST_BURST, DRIFT_REQUEST_INTERVAL};

    let (services, _clock) = start(ProxyMode::Ebpf);
    let addr = services.metrics_addr().unwrap();
    let (requests, mut rx) = tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<String>>(4);
    services.metrics().serve_drift_requests(requests);
    let checks = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&checks);
    // A loop whose first check lasts until the test lets it end (a timed check could end
    // before the second request arrives on a loaded machine), the others 200 ms.
    let release = Arc::new(tokio::sync::Notify::new());
    let released = Arc::clone(&release);
    tokio::spawn(async move {
        while let Some(reply) = rx.recv().await {
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                released.notified().await;
            } else {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let _ = reply.send("{\"checked\":true}".to_owned());
        }
    });
    // While a check runs, another request is turned away.
    let first = tokio::spawn(get(addr, "/debug/drift"));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while checks.load(Ordering::SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the first check never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let during = get(addr, "/debug/drift").await;
    assert_eq!(during.status(), 429);
    release.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.body, "{\"checked\":true}");
    // Back to back: the burst, then about one a second.
    let started = std::time::Instant::now();
    let (mut answered, mut turned_away) = (1, 0);
    for _ in 0..20 {
        let reply = get(addr, "/debug/drift").await;
        match reply.status() {
            200 => answered += 1,
            429 => {
                turned_away += 1;
                let wait: u64 = reply
                    .header("Retry-After")
                    .expect("Retry-After")
                    .parse()
                    .expect("seconds");
                assert!(
                    (1..=DRIFT_REQUEST_INTERVAL.as_secs()).contains(&wait),
                    "{wait}"
                );
            }
            other => panic!("{other}: {}", reply.body),
        }
    }
    let refilled = started.elapsed().as_secs_f64() / DRIFT_REQUEST_INTERVAL.as_secs_f64();
    assert!(
        f64::from(answered) <= f64::from(DRIFT_REQUEST_BURST) + refilled + 1.0,
        "{answered} checks in {:?}",
        started.elapsed()
    );
    assert!(answered >= DRIFT_REQUEST_BURST, "{answered}");
    assert!(turned_away >= 1);
    assert_eq!(checks.load(Ordering::SeqCst), answered as usize);
    // After the interval a check runs again.
    tokio::time::sleep(DRIFT_REQUEST_INTERVAL).await;
    assert_eq!(get(addr, "/debug/drift").await.status(), 200);
}
