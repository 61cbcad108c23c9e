//! Bad input for the real agent binary. Manifests: a corpus of malformed documents is dropped
//! one file at a time into the folder of a RUNNING agent next to a valid Service; each must be
//! named in a warning (file/document/kind/name/field) while the agent keeps running and the
//! valid Service keeps answering. Configuration files and flags: each must exit non-zero with a
//! line naming the source, the field and the value. Figures go to stderr. The manifests part
//! needs root (namespaces, cgroups, BPF); the configuration part does not.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use proxy_tests::client::tally;
use proxy_tests::scenario::{
    CLUSTER_IP, DATAPATH_TIMEOUT, Scenario, cluster_addr, http_service, http_slice, is_pod,
    pod_endpoint,
};

/// One malformed input and what the agent must say about it.
struct Case {
    what: &'static str,
    file: String,
    content: Vec<u8>,
    /// Substrings that must all be in one log line (WARN, or `sync applied` for accepted input).
    expect: Vec<String>,
}

fn case(what: &'static str, file: &str, content: impl Into<Vec<u8>>, expect: &[&str]) -> Case {
    Case {
        what,
        // After `web-*.yaml` in name order, so a duplicate never shadows the valid Service.
        file: format!("zz-{file}.yaml"),
        content: content.into(),
        expect: expect.iter().map(|&e| e.to_owned()).collect(),
    }
}

/// A Service `name` on 10.96.2.<n> with the given spec lines (indented by two).
fn service(name: &str, n: u8, spec: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  \
         clusterIP: 10.96.2.{n}\n{spec}"
    )
}

fn manifest_corpus() -> Vec<Case> {
    let port = "  ports: [{name: http, port: 80, protocol: TCP}]\n";
    let huge_annotation = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: huge\n  annotations:\n    big: {}\nspec: \
         {{clusterIP: 10.96.2.9, ports: [{{port: 80}}]}}\n",
        "x".repeat(5 << 20)
    );
    let big_annotation = huge_annotation.replace(&"x".repeat(5 << 20), &"x".repeat(300 << 10));
    let many_ports: String = (1..=10_000)
        .map(|p| format!("  - {{name: p{p}, port: {p}, protocol: TCP}}\n"))
        .collect();
    let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..9 {
        let refs = vec![format!("*a{}", i - 1); 10].join(", ");
        let _ = writeln!(bomb, "a{i}: &a{i} [{refs}]");
    }
    vec![
        case(
            "invalid clusterIP",
            "bad-ip",
            service("bad-ip", 1, port).replace("10.96.2.1", "10.96.0.300"),
            &["Service default/bad-ip", "10.96.0.300"],
        ),
        case(
            "invalid CIDR",
            "bad-cidr",
            service(
                "bad-cidr",
                2,
                &format!("  type: LoadBalancer\n  loadBalancerSourceRanges: [10.0.0.0/33]\n{port}"),
            ),
            &["Service default/bad-cidr", "invalid CIDR \"10.0.0.0/33\""],
        ),
        case(
            "port 70000",
            "port-70000",
            service("port-70000", 3, "  ports: [{name: http, port: 70000}]\n"),
            &[
                "Service default/port-70000",
                "spec.ports[0].port",
                "70000 is outside 1-65535",
            ],
        ),
        case(
            "port not a number",
            "port-text",
            service("port-text", 4, "  ports: [{name: http, port: eighty}]\n"),
            &[
                "zz-port-text.yaml: document 1: Service port-text:",
                "spec.ports[0].port: invalid i32 at line 6",
                "(value \"eighty\")",
            ],
        ),
        case(
            "protocol ICMP",
            "proto",
            service(
                "proto",
                5,
                "  ports: [{name: ping, port: 1, protocol: ICMP}]\n",
            ),
            &[
                "Service default/proto",
                "spec.ports[0].protocol",
                "\"ICMP\"",
            ],
        ),
        case(
            "5 MiB annotation",
            "huge-annotation",
            huge_annotation,
            &["zz-huge-annotation.yaml: file is larger than 4194304 bytes"],
        ),
        case(
            "300 KiB annotation",
            "big-annotation",
            big_annotation,
            &[
                "zz-big-annotation.yaml: document 1: Service huge: metadata.annotations:",
                "more than the API server's limit",
            ],
        ),
        case(
            "10k ports (valid: accepted)",
            "many-ports",
            service("many-ports", 10, &format!("  ports:\n{many_ports}")),
            // Each port is a socket-level frontend and an external (tc) ClusterIP frontend.
            &["sync applied", "written=20000"],
        ),
        case(
            "wrong kind",
            "deployment",
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\n",
            &["zz-deployment.yaml: document 1: apps/v1 Deployment app: not a kind the proxy reads"],
        ),
        case(
            "wrong apiVersion",
            "svc-v2",
            service("svc-v2", 11, port).replace("apiVersion: v1", "apiVersion: v2"),
            &["zz-svc-v2.yaml: document 1: v2 Service svc-v2: not a kind the proxy reads"],
        ),
        case(
            "unknown field",
            "unknown-field",
            service(
                "unknown-field",
                12,
                &format!("{port}  clusterIPz: 1.2.3.4\n"),
            ),
            &["Service unknown-field: unknown field `spec.clusterIPz`"],
        ),
        case(
            "duplicate key",
            "dup-key",
            service("dup-key", 13, &format!("{port}  clusterIP: 10.96.2.99\n")),
            &[
                "zz-dup-key.yaml: document 1: invalid YAML",
                "duplicate mapping key `clusterIP`",
            ],
        ),
        case(
            "non-UTF-8 bytes",
            "latin1",
            b"apiVersion: v1\nkind: Service\nmetadata: {name: caf\xe9}\n".to_vec(),
            &["zz-latin1.yaml: not UTF-8 text (invalid byte at offset 49)"],
        ),
        case(
            "deeply nested flow YAML",
            "deep",
            format!("a: {}{}\n", "[".repeat(100_000), "]".repeat(100_000)),
            &[
                "zz-deep.yaml: document 1: invalid YAML",
                "recursion limit exceeded at line 1",
            ],
        ),
        case(
            "deeply nested block YAML",
            "deep-block",
            (0..300)
                .map(|i| format!("{}a{i}:\n", " ".repeat(i)))
                .collect::<String>(),
            &[
                "zz-deep-block.yaml: document 1: invalid YAML",
                "too complex",
            ],
        ),
        case(
            "alias bomb",
            "bomb",
            bomb,
            &["zz-bomb.yaml: document 1: invalid YAML", "too complex"],
        ),
        case(
            "syntax error",
            "syntax",
            "apiVersion: v1\nkind: Service\nmetadata: [unclosed\n",
            &[
                "zz-syntax.yaml: document 1: invalid YAML",
                "unclosed bracket '[' at line 3",
            ],
        ),
        case(
            "control character",
            "control",
            "apiVersion: v1\nkind: Service\nmetadata: {name: \"a\u{1}b\"}\n",
            &["zz-control.yaml: document 1: invalid YAML"],
        ),
        case(
            "slice without a Service",
            "orphan-slice",
            http_slice("default", "orphan-1", "nobody", &[pod_endpoint(1)]),
            &[
                "zz-orphan-slice.yaml: document 1: EndpointSlice default/orphan-1: its Service \
                 default/nobody",
                "is not defined in the folder",
            ],
        ),
        case(
            "slice without service-name label",
            "unlabelled-slice",
            http_slice("default", "unlabelled-1", "web", &[pod_endpoint(1)])
                .replace("kubernetes.io/service-name", "example.com/not-the-label"),
            &[
                "EndpointSlice default/unlabelled-1: metadata.labels: no `kubernetes.io/service-name`",
            ],
        ),
        case(
            "slice with an invalid address",
            "bad-address",
            http_slice("default", "web-2", "web", &[pod_endpoint(2)])
                .replace("10.244.2.2", "10.244.2.999"),
            &["EndpointSlice default/web-2: endpoints[0]: invalid address \"10.244.2.999\""],
        ),
        case(
            "missing kind",
            "no-kind",
            "apiVersion: v1\nmetadata: {name: x}\n",
            &["zz-no-kind.yaml: document 1: missing or non-string field `kind`"],
        ),
        case(
            "duplicate Service",
            "dup-web",
            http_service("default", "web", CLUSTER_IP).replace("10.96.0.10", "10.96.2.20"),
            &[
                "zz-dup-web.yaml: document 1: Service default/web is already defined in",
                "web-svc.yaml",
            ],
        ),
        case(
            "List with a bad item",
            "list",
            "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Service, metadata: \
             {name: list-bad}, spec: {ports: [{port: 1e99}]}}\n",
            &["zz-list.yaml: document 1: items[0]: Service list-bad:"],
        ),
        case(
            "huge integer",
            "huge-int",
            service(
                "huge-int",
                14,
                "  ports: [{name: http, port: 99999999999999999999999}]\n",
            ),
            &["zz-huge-int.yaml: document 1: Service huge-int: spec.ports[0].port: invalid i32"],
        ),
    ]
}

/// Writes `content` atomically (hidden temp file + rename, as the README asks).
fn write_bytes(dir: &Path, file: &str, content: &[u8]) -> anyhow::Result<()> {
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, content)?;
    std::fs::rename(&tmp, dir.join(file))?;
    Ok(())
}

#[test]
fn malformed_manifests_are_named_while_the_running_agent_keeps_serving_the_valid_service()
-> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    s.write_web(&[pod_endpoint(1), pod_endpoint(2)])?;
    s.start_agent()?;
    s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;

    let corpus = manifest_corpus();
    let started = Instant::now();
    let mut outcomes = Vec::new();
    let mut connections = 0usize;
    let mut failed_connections = 0usize;
    for case in &corpus {
        let before = s.agent()?.log_contents().len();
        write_bytes(s.manifests.path(), &case.file, &case.content)?;
        let written_at = Instant::now();
        let deadline = written_at + DATAPATH_TIMEOUT;
        let line = loop {
            let log = s.agent()?.log_contents();
            let found = log
                .get(before..)
                .unwrap_or_default()
                .lines()
                .find(|l| case.expect.iter().all(|e| l.contains(e.as_str())))
                .map(str::to_owned);
            if let Some(line) = found {
                break line;
            }
            let running = s.agent()?.is_running();
            s.ensure(running && Instant::now() < deadline, || {
                format!(
                    "{}: no log line with {:?} within {DATAPATH_TIMEOUT:?} (agent running: {running})",
                    case.what, case.expect
                )
            })?;
            thread::sleep(Duration::from_millis(50));
        };
        let took = written_at.elapsed();
        let attempts = s.cgroup_client().run(cluster_addr(), 4)?;
        connections += attempts.len();
        failed_connections += attempts.iter().filter(|a| !is_pod(a)).count();
        s.ensure(attempts.iter().all(is_pod), || {
            format!(
                "{}: the valid Service stopped answering: {:?}",
                case.what,
                tally(&attempts)
            )
        })?;
        s.manifests.remove(&case.file)?;
        let level = if line.contains(" WARN ") {
            "warning"
        } else {
            "accepted"
        };
        let shown: String = line
            .split_once("proxy_agent")
            .map_or(line.as_str(), |(_, rest)| rest)
            .chars()
            .take(600)
            .collect();
        outcomes.push(format!(
            "  {:<34} {level} after {took:.1?}: proxy_agent{shown}",
            case.what
        ));
    }
    let running = s.agent()?.is_running();
    eprintln!(
        "manifest corpus: {} inputs tried in {:?}; agent running throughout: {running}; valid \
         Service: {connections} connections, {failed_connections} failed\n{}",
        corpus.len(),
        started.elapsed(),
        outcomes.join("\n")
    );
    s.ensure(running, || "the agent exited".into())?;
    Ok(())
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(proxy_tests::unique_name("bad-config"));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

#[test]
fn bad_configuration_files_and_flags_exit_non_zero_naming_source_field_and_value()
-> anyhow::Result<()> {
    let bin = proxy_tests::agent::agent_binary()?;
    let dir = TempDir::new()?;
    let written = dir.0.join("written.yaml");
    let deep = format!(
        "{HEADER}featureGates: {}{}\n",
        "{a: ".repeat(50_000),
        "}".repeat(50_000)
    );
    let mut bomb = String::from(HEADER);
    bomb.push_str("x0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..9 {
        let refs = vec![format!("*a{}", i - 1); 10].join(", ");
        let _ = writeln!(bomb, "x{i}: &a{i} [{refs}]");
    }
    // (what, file content or None, flags, expected exit code, substrings of one stderr line)
    let files: Vec<(&str, Vec<u8>, &[&str])> = vec![
        // Unknown fields alone are decoded leniently (upstream's loadConfig); with a bad value
        // left after dropping them, the strict error is reported, as upstream's
        // "failed lenient decoding".
        (
            "unknown field and a bad value",
            format!("{HEADER}bogus: 1\noomScoreAdj: lots\n").into(),
            &["failed lenient decoding", "unknown field `bogus`"],
        ),
        (
            "nested unknown field and a bad value",
            format!("{HEADER}iptables: {{bogus: 1, syncPeriod: abc}}\n").into(),
            &["failed lenient decoding", "iptables: unknown field `bogus`"],
        ),
        (
            "wrong apiVersion",
            "apiVersion: v1\nkind: KubeProxyConfiguration\n".into(),
            &["apiVersion \"v1\"", "expected apiVersion"],
        ),
        (
            "masqueradeBit 32",
            format!("{HEADER}iptables: {{masqueradeBit: 32}}\n").into(),
            &["iptables.masqueradeBit: invalid value \"32\""],
        ),
        (
            "duplicate key",
            format!("{HEADER}mode: ebpf\nmode: iptables\n").into(),
            &["duplicate mapping key `mode`"],
        ),
        (
            "non-UTF-8",
            [HEADER.as_bytes(), b"hostnameOverride: caf\xe9\n"].concat(),
            &["not UTF-8 text"],
        ),
        (
            "deep nesting",
            deep.into(),
            &["invalid YAML", "too complex", "Depth"],
        ),
        (
            "alias bomb (refused at the replay limit)",
            bomb.into(),
            &["invalid YAML", "too complex", "replayed_events"],
        ),
        (
            "2 MiB file",
            format!("{HEADER}#{}\n", "x".repeat(2 << 20)).into(),
            &["larger than 1048576 bytes"],
        ),
        (
            "syncPeriod not a duration",
            format!("{HEADER}iptables: {{syncPeriod: abc}}\n").into(),
            &["iptables.syncPeriod: invalid duration \"abc\""],
        ),
        (
            "clusterCIDR /33",
            format!("{HEADER}clusterCIDR: 10.0.0.0/33\n").into(),
            &["clusterCIDR: invalid value \"10.0.0.0/33\""],
        ),
        (
            "metricsBindAddress port 70000",
            format!("{HEADER}metricsBindAddress: 1.2.3.4:70000\n").into(),
            &["metricsBindAddress: invalid value \"70000\": must be a valid port"],
        ),
        (
            "a list, not a mapping",
            "- a\n- b\n".into(),
            &["invalid type: sequence"],
        ),
        (
            "YAML syntax error",
            format!("{HEADER}mode: ebpf\n iptables: {{\n").into(),
            &["mapping values are not allowed in this context at line 4"],
        ),
    ];
    let flags: Vec<(&str, Vec<&str>, i32, &[&str])> = vec![
        (
            "--proxy-mode ipvs",
            vec!["--proxy-mode", "ipvs"],
            1,
            &["--proxy-mode: mode: invalid value \"ipvs\""],
        ),
        (
            "masquerade bit 99",
            vec!["--iptables-masquerade-bit", "99"],
            1,
            &["--iptables-masquerade-bit", "\"99\""],
        ),
        (
            "cluster CIDR text",
            vec!["--cluster-cidr", "nonsense"],
            1,
            &["--cluster-cidr", "\"nonsense\""],
        ),
        (
            "metrics port 99999",
            vec!["--metrics-bind-address", "1.2.3.4:99999"],
            1,
            &["--metrics-bind-address", "\"99999\""],
        ),
        (
            "oom-score-adj 5000",
            vec!["--oom-score-adj", "5000"],
            1,
            &["--oom-score-adj", "\"5000\""],
        ),
        (
            "negative sync period",
            vec!["--iptables-sync-period", "-1s"],
            1,
            &["--iptables-sync-period", "\"-1s\""],
        ),
        (
            "map size text",
            vec!["--bpf-map-frontends", "abc"],
            1,
            &["--bpf-map-frontends", "\"abc\""],
        ),
        (
            "map size 0",
            vec!["--bpf-map-frontends", "0"],
            1,
            &["--bpf-map-frontends", "\"0\""],
        ),
        (
            "negative conntrack min",
            vec!["--conntrack-min", "-5"],
            1,
            &["--conntrack-min", "\"-5\""],
        ),
        (
            "nodeport CIDR 300.0.0.0/8",
            vec!["--nodeport-addresses", "300.0.0.0/8"],
            1,
            &["--nodeport-addresses", "\"300.0.0.0/8\""],
        ),
        (
            "healthz address text",
            vec!["--healthz-bind-address", "nonsense"],
            1,
            &["--healthz-bind-address", "\"nonsense\""],
        ),
        (
            "unknown flag",
            vec!["--no-such-flag"],
            2,
            &["unexpected argument '--no-such-flag'"],
        ),
    ];

    let mut outcomes = Vec::new();
    let mut check =
        |what: &str, args: Vec<String>, code: i32, expect: &[&str]| -> anyhow::Result<()> {
            let output = Command::new(&bin)
                .args(&args)
                .env_remove("RUST_LOG")
                .output()?;
            let stderr = String::from_utf8_lossy(&output.stderr);
            let line = stderr
                .lines()
                .find(|l| expect.iter().all(|e| l.contains(e)));
            anyhow::ensure!(
                output.status.code() == Some(code) && line.is_some(),
                "{what}: expected exit {code} and a line with {expect:?}; got {} and:\n{stderr}",
                output.status
            );
            anyhow::ensure!(!written.exists(), "{what}: the configuration was accepted");
            let line: String = line.unwrap_or_default().chars().take(160).collect();
            outcomes.push(format!("  {what:<30} exit {code}: {line}"));
            Ok(())
        };
    let written_arg = written.to_string_lossy().into_owned();
    for (index, (what, content, expect)) in files.iter().enumerate() {
        let path = dir.0.join(format!("config-{index}.yaml"));
        std::fs::write(&path, content)?;
        let path = path.to_string_lossy().into_owned();
        // Every line names the file.
        let mut expect = expect.to_vec();
        expect.push(&path);
        let args = vec![
            "--config".into(),
            path.clone(),
            "--write-config-to".into(),
            written_arg.clone(),
        ];
        check(what, args, 1, &expect)?;
    }
    let missing = dir.0.join("missing.yaml").to_string_lossy().into_owned();
    check(
        "missing file",
        vec![
            "--config".into(),
            missing.clone(),
            "--write-config-to".into(),
            written_arg.clone(),
        ],
        1,
        &["cannot read the configuration file", &missing],
    )?;
    for (what, args, code, expect) in &flags {
        let mut args: Vec<String> = args.iter().map(|&a| a.to_owned()).collect();
        args.extend(["--write-config-to".into(), written_arg.clone()]);
        check(what, args, *code, expect)?;
    }
    let nowhere = dir.0.join("no-such-dir").to_string_lossy().into_owned();
    check(
        "--manifests not a directory",
        vec![
            "--manifests".into(),
            nowhere.clone(),
            "--hostname-override".into(),
            "n".into(),
        ],
        1,
        &["--manifests", &nowhere, "not a directory"],
    )?;
    eprintln!(
        "configuration corpus: {} inputs tried ({} files, {} flag sets), all refused with exit \
         1 (2 for usage) and a line naming the problem:\n{}",
        outcomes.len(),
        files.len() + 1,
        flags.len() + 1,
        outcomes.join("\n")
    );
    Ok(())
}
