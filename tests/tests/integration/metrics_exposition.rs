//! The metrics server of a running agent as scrapers see it: `/metrics` in the classic text
//! format by default and OpenMetrics when asked, both checked by Prometheus' own linter
//! (`promtool check metrics`, Debian's `prometheus` package); the nfacct-backed counters of the
//! iptables mode counting real packets (an INVALID forwarded packet, localhost NodePort
//! connections); `/configz`; probes answered while one address holds hundreds of half-sent
//! requests, and `/debug/drift` rate limited off the sync loop. Needs root.

use std::{
    collections::BTreeSet,
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
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
        proxy_tests::netns::enter_netns(&path)?;
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

/// The health port as pods reach it: the node's address on pod `i`'s veth.
fn health_from_pod(i: usize) -> SocketAddr {
    SocketAddr::from((Topology::pod_gateway(i), 10256))
}

/// The agent's per-peer connection cap (`http_servers::http::LIMITS.per_peer`).
const PER_PEER: usize = 32;
/// Its header-read timeout, plus what a loaded machine adds.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// `count` connections from pod `i` to the health port, each with a request head that never
/// ends (no blank line). They stay in the pod's namespace after the thread returns.
fn half_sent_requests(s: &Scenario, i: usize, count: usize) -> anyhow::Result<Vec<TcpStream>> {
    let target = health_from_pod(i);
    let streams = proxy_tests::netns::on_thread_in(&s.topo.pod(i)?.path(), move || {
        let mut streams = Vec::with_capacity(count);
        for _ in 0..count {
            let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2))?;
            // The server may already have closed a connection beyond the cap.
            let _ = stream.write_all(b"GET /livez HTTP/1.1\r\nHost: node\r\n");
            stream.set_nonblocking(true)?;
            streams.push(stream);
        }
        anyhow::Ok(streams)
    })??;
    Ok(streams)
}

/// Whether the server closed `stream` (EOF or reset; whatever it sent before is read).
fn closed(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// One GET that must answer 200 within 2 s; returns how long it took.
fn answered(netns: &Path, addr: SocketAddr, path: &str, what: &str) -> anyhow::Result<Duration> {
    let started = std::time::Instant::now();
    let reply = proxy_tests::http::get(netns, addr, path)
        .with_context(|| format!("{what}: {addr}{path} not answered"))?;
    let took = started.elapsed();
    ensure!(reply.status == 200, "{what}: {addr}{path}: {}", reply.head);
    ensure!(
        took < Duration::from_secs(2),
        "{what}: {addr}{path} took {took:?}"
    );
    Ok(took)
}

/// The security issue's attack: one address holds 400 half-sent requests to the health port.
/// Another pod's `/livez` and `/healthz`, a load balancer's `/healthz` from outside and the
/// metrics server are answered meanwhile; the attacker's connections beyond its cap are closed
/// at once and the others after the header-read timeout. Then `/debug/drift` hammered from the
/// node does not hold up a Service change, and the rate limit turns most requests away.
#[test]
fn probes_are_answered_while_one_address_holds_400_half_sent_requests() -> anyhow::Result<()> {
    // iptables first: the eBPF agent's verifier load then comes later than that of a test
    // started next to this one (the suite runs a test per core).
    for mode in ["iptables", "ebpf"] {
        proxy_tests::require_root();
        proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
        let mut s = Scenario::new(2)?;
        s.write_web_service(2)?;
        let client = s.start_serving(mode, &[])?;
        let node = s.topo.node().path();
        let pod2 = s.topo.pod(2)?.path();
        let ext = s.topo.ext().path();
        let lb_target = SocketAddr::from((Topology::node_ext_ip(), 10256));
        try_wait_until(
            "/healthz healthy",
            Duration::from_secs(10),
            Duration::from_millis(100),
            || {
                Ok(
                    proxy_tests::http::get(&pod2, health_from_pod(2), "/healthz")
                        .is_ok_and(|r| r.status == 200),
                )
            },
        )?;

        let opened_at = std::time::Instant::now();
        let mut held = half_sent_requests(&s, 1, 400)?;
        eprintln!(
            "[{mode}] 400 half-sent requests opened in {:?}",
            opened_at.elapsed()
        );
        for round in 0..5 {
            let took = [
                answered(&pod2, health_from_pod(2), "/livez", "another pod")?,
                answered(&pod2, health_from_pod(2), "/healthz", "another pod")?,
                answered(&ext, lb_target, "/healthz", "a load balancer")?,
                answered(&node, METRICS.parse()?, "/metrics", "a scraper")?,
                answered(&node, METRICS.parse()?, "/healthz", "the metrics server")?,
            ];
            eprintln!("[{mode}] round {round}: {took:?}");
        }
        // Beyond the cap the attacker's connections were closed at once (the cap's worth
        // are waiting for their head's end).
        let mut open: Vec<TcpStream> = held
            .drain(..)
            .filter_map(|mut c| (!closed(&mut c)).then_some(c))
            .collect();
        eprintln!(
            "[{mode}] {} of the attacker's connections open after {:?}",
            open.len(),
            opened_at.elapsed()
        );
        ensure!(
            open.len() <= PER_PEER,
            "[{mode}] {} connections of one address kept open",
            open.len()
        );
        // And those are closed by the header-read timeout.
        try_wait_until(
            "the half-sent requests closed",
            HEADER_READ_TIMEOUT + Duration::from_secs(10),
            Duration::from_millis(100),
            || {
                open.retain_mut(|c| !closed(c));
                Ok(open.is_empty())
            },
        )
        .with_context(|| format!("[{mode}] {} connections still open", open.len()))?;
        eprintln!("[{mode}] all closed after {:?}", opened_at.elapsed());
        // The attacker is served again like anyone (its slots were freed).
        answered(
            &s.topo.pod(1)?.path(),
            health_from_pod(1),
            "/livez",
            "the former attacker",
        )?;

        // `/debug/drift` in a tight loop while a Service is added: the change is programmed
        // promptly and most requests are turned away with 429.
        let api = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 30), 80);
        // iptables: a local address gives the node a route to the ClusterIP (nat OUTPUT
        // comes after the route lookup); it answers as `untranslated`, never as pod2.
        s.topo
            .add_decoy(std::net::IpAddr::V4(*api.ip()), api.port())?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop_hammer = std::sync::Arc::clone(&stop);
        let hammer_ns = node.clone();
        let hammer = std::thread::spawn(move || -> anyhow::Result<(usize, usize, Duration)> {
            let started = std::time::Instant::now();
            let (mut ok, mut limited) = (0, 0);
            while ok + limited < 50 || !stop_hammer.load(std::sync::atomic::Ordering::SeqCst) {
                let reply = proxy_tests::http::get(&hammer_ns, METRICS.parse()?, "/debug/drift")?;
                match reply.status {
                    200 => {
                        let report: serde_json::Value = serde_json::from_str(&reply.body)?;
                        ensure!(report["checked"] == true, "{}", reply.body);
                        ok += 1;
                    }
                    429 => {
                        ensure!(reply.header("Retry-After").is_some(), "{}", reply.head);
                        limited += 1;
                    }
                    other => bail!("/debug/drift: {other} {}", reply.body),
                }
                // Tight, but leaving the other tests' agents some of the machine.
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok((ok, limited, started.elapsed()))
        });
        s.manifests.write(
            "api-svc.yaml",
            &proxy_tests::scenario::http_service("default", "api", *api.ip()),
        )?;
        s.manifests.write(
            "api-slice.yaml",
            &proxy_tests::scenario::http_slice("default", "api-1", "api", &[pod_endpoint(2)]),
        )?;
        let written = std::time::Instant::now();
        let programmed = try_wait_until(
            "the new Service answered by pod2",
            Duration::from_secs(10),
            Duration::from_millis(100),
            || {
                Ok(client
                    .once(api.into())
                    .is_ok_and(|a| a.backend() == Some("pod2")))
            },
        );
        let after = written.elapsed();
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let (ok, limited, hammered) = hammer
            .join()
            .map_err(|_| anyhow::anyhow!("the /debug/drift thread panicked"))??;
        eprintln!(
            "[{mode}] Service programmed after {after:?} under /debug/drift: {ok} answered, \
             {limited} turned away in {hammered:?}"
        );
        programmed.with_context(|| format!("[{mode}] while /debug/drift was hammered"))?;
        ensure!(ok >= 1, "[{mode}] no /debug/drift answered");
        // The agent's burst of 5, then one check a second.
        let allowed = usize::try_from(hammered.as_secs()).unwrap_or(usize::MAX) + 5 + 1;
        ensure!(
            ok <= allowed && limited >= 1,
            "[{mode}] {ok} checks in {hammered:?}, {limited} turned away"
        );
    }
    Ok(())
}
