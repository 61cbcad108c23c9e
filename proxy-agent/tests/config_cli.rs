//! The built binary's configuration handling: `--write-config-to`, `--config`, and the exit
//! codes and messages for bad input. Nothing here needs root or loads BPF: every case exits
//! before the dataplane starts.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::atomic::{AtomicU32, Ordering},
};

const BIN: &str = env!("CARGO_BIN_EXE_proxy-agent");

/// A per-test temporary directory, removed when dropped (a failing test too).
struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[expect(
    clippy::unwrap_used,
    reason = "test helper: a failure is a failed test"
)]
fn temp_dir() -> TempDir {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "proxy-agent-cli-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}

#[expect(
    clippy::unwrap_used,
    reason = "test helper: a failure is a failed test"
)]
fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn write_config_to_round_trips() {
    let dir = temp_dir();
    let f = dir.join("f.yaml");
    let g = dir.join("g.yaml");
    let out = run(&["--write-config-to", f.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = run(&[
        "--config",
        f.to_str().unwrap(),
        "--write-config-to",
        g.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let f_text = std::fs::read_to_string(&f).unwrap();
    assert_eq!(f_text, std::fs::read_to_string(&g).unwrap());
    assert!(f_text.starts_with("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"));
    assert!(f_text.contains("\nmode: ebpf\n"));
    assert!(f_text.contains("\n  syncPeriod: 30s\n"));
}

#[test]
fn flags_land_in_the_written_file_and_override_it() {
    let dir = temp_dir();
    let f = dir.join("f.yaml");
    let g = dir.join("g.yaml");
    let out = run(&[
        "--write-config-to",
        f.to_str().unwrap(),
        "--iptables-sync-period",
        "1m",
        "--cluster-cidr",
        "10.244.0.0/16",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let f_text = std::fs::read_to_string(&f).unwrap();
    assert!(f_text.contains("\n  syncPeriod: 1m0s\n"), "{f_text}");
    assert!(
        f_text.contains("\nclusterCIDR: 10.244.0.0/16\n"),
        "{f_text}"
    );

    let out = run(&[
        "--config",
        f.to_str().unwrap(),
        "--iptables-sync-period",
        "2h",
        "--write-config-to",
        g.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let g_text = std::fs::read_to_string(&g).unwrap();
    assert!(g_text.contains("\n  syncPeriod: 2h0m0s\n"), "{g_text}");
    assert!(
        g_text.contains("\nclusterCIDR: 10.244.0.0/16\n"),
        "{g_text}"
    );
    assert!(
        stderr(&out).contains("iptables-sync-period"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn invalid_flags_exit_1_naming_every_problem() {
    let dir = temp_dir();
    let target = dir.join("never.yaml");
    let out = run(&[
        "--iptables-masquerade-bit",
        "32",
        "--oom-score-adj",
        "-2000",
        "--proxy-mode",
        "ipvs",
        "--write-config-to",
        target.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(
            "--iptables-masquerade-bit: iptables.masqueradeBit: invalid value \"32\": must be within the range [0, 31]"
        ),
        "{err}"
    );
    assert!(
        err.contains("--oom-score-adj: oomScoreAdj: invalid value \"-2000\""),
        "{err}"
    );
    assert!(
        err.contains(
            "--proxy-mode: mode: invalid value \"ipvs\": the ipvs proxy mode is not implemented"
        ),
        "{err}"
    );
    assert_eq!(err.lines().count(), 3, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        !target.exists(),
        "nothing is written when the configuration is invalid"
    );
}

#[test]
fn invalid_file_exits_1_naming_file_field_and_value() {
    let dir = temp_dir();
    let path = dir.join("bad.yaml");
    std::fs::write(
        &path,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         iptables:\n  syncPeriod: 1s\n  minSyncPeriod: 5s\nhealthzBindAddress: 1.2.3.4:99999\n",
    )
    .unwrap();
    let out = run(&["--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    let file = path.display().to_string();
    assert!(
        err.contains(&format!(
            "{file}: iptables.syncPeriod: invalid value \"1s\""
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "{file}: healthzBindAddress: invalid value \"99999\""
        )),
        "{err}"
    );
}

/// Upstream decodes a file with unknown fields leniently and logs the strict error.
#[test]
fn unknown_field_is_logged_and_the_file_used() {
    let dir = temp_dir();
    let path = dir.join("unknown.yaml");
    let out_path = dir.join("out.yaml");
    std::fs::write(
        &path,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         conntrack:\n  maxPerCPU: 4\noomScoreAdj: -500\n",
    )
    .unwrap();
    let out = run(&[
        "--config",
        path.to_str().unwrap(),
        "--write-config-to",
        out_path.to_str().unwrap(),
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("ERROR"), "{err}");
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("unknown field `maxPerCPU`"), "{err}");
    let written = std::fs::read_to_string(&out_path).unwrap();
    assert!(written.contains("oomScoreAdj: -500"), "{written}");
    assert!(!written.contains("maxPerCPU"), "{written}");
}

/// The flags a kube-proxy DaemonSet passes (the ones that made the agent exit 2) start it:
/// here with --init-only, which exits 0 after the privileged setup. Every conntrack value is
/// 0 ("leave the kernel's") so the test changes no sysctl of the host.
#[test]
fn kube_proxy_daemonset_flag_line_is_accepted() {
    let out = run(&[
        "--feature-gates=PreferSameTrafficDistribution=true,SomeAlphaGate=false",
        "--profiling=false",
        "--bind-address-hard-fail",
        "--log-flush-frequency=5s",
        "--init-only",
        "--v=2",
        "--oom-score-adj=0",
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0s",
        "--conntrack-tcp-timeout-close-wait=0s",
        "--hostname-override=node-a",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("System initialized and --init-only specified"),
        "{err}"
    );
    assert!(err.contains("SomeAlphaGate=false"), "{err}");
}

#[test]
fn missing_file_exits_1() {
    let out = run(&["--config", "/nonexistent/kube-proxy.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("/nonexistent/kube-proxy.yaml"));
}

#[test]
fn unknown_flag_is_a_usage_error() {
    let out = run(&["--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--no-such-flag"));
}

#[test]
fn help_lists_kube_proxy_flags_and_ours() {
    let out = run(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--config",
        "--write-config-to",
        "--cleanup",
        "--proxy-mode",
        "--iptables-masquerade-bit",
        "--conntrack-udp-timeout-stream",
        "--detect-local-mode",
        "--manifests",
        "--interfaces",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
}
