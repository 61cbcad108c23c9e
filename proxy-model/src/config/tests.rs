use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use clap::Parser as _;

use super::*;

/// A file in a per-test temporary directory, removed with it when dropped (a failing test
/// too).
struct TempFile {
    dir: PathBuf,
    path: PathBuf,
}

impl std::ops::Deref for TempFile {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn temp_file(name: &str, text: &str) -> TempFile {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "proxy-agent-config-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let file = TempFile { dir, path };
    std::fs::write(&file.path, text).unwrap();
    file
}

fn args(list: &[&str]) -> Args {
    Args::try_parse_from(std::iter::once("proxy-agent").chain(list.iter().copied())).unwrap()
}

fn load_args(list: &[&str]) -> Result<Loaded, ConfigError> {
    load(&args(list))
}

fn problems(list: &[&str]) -> Vec<String> {
    match load_args(list) {
        Ok(_) => panic!("{list:?} should be rejected"),
        Err(error) => error.lines(),
    }
}

const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn defaults_are_upstreams() {
    let loaded = load_args(&[]).unwrap();
    let c = loaded.config;
    // pkg/proxy/apis/config/v1alpha1/defaults.go, except the mode (ours).
    assert_eq!(c.mode, ProxyMode::Ebpf);
    assert_eq!(c.hostname_override, None);
    assert_eq!(c.bind_address, IpAddr::from([0, 0, 0, 0]));
    assert_eq!(
        c.healthz_bind_address,
        Some("0.0.0.0:10256".parse().unwrap())
    );
    assert_eq!(
        c.metrics_bind_address,
        Some("127.0.0.1:10249".parse().unwrap())
    );
    assert!(!c.bind_address_hard_fail);
    assert!(!c.enable_profiling);
    assert_eq!(c.client_connection.kubeconfig, None);
    assert_eq!(
        c.client_connection.content_type,
        "application/vnd.kubernetes.protobuf"
    );
    assert_eq!(c.client_connection.qps, 5.0);
    assert_eq!(c.client_connection.burst, 10);
    assert_eq!(c.master, None);
    assert_eq!(c.sync_period, secs(30));
    assert_eq!(c.min_sync_period, secs(1));
    assert!(!c.masquerade_all);
    assert_eq!(c.iptables.masquerade_bit, 14);
    assert!(c.iptables.localhost_node_ports);
    assert_eq!(c.conntrack.max_per_core, 32 * 1024);
    assert_eq!(c.conntrack.min, 128 * 1024);
    assert_eq!(c.conntrack.tcp_established_timeout, secs(24 * 3600));
    assert_eq!(c.conntrack.tcp_close_wait_timeout, secs(3600));
    assert!(!c.conntrack.tcp_be_liberal);
    assert_eq!(c.conntrack.udp_timeout, Duration::ZERO);
    assert_eq!(c.conntrack.udp_stream_timeout, Duration::ZERO);
    assert_eq!(c.detect_local, DetectLocal::ClusterCidr);
    assert!(c.cluster_cidrs.is_empty());
    assert_eq!(c.node_port_addresses, NodePortAddresses::All);
    assert_eq!(c.oom_score_adj, -999);
    assert_eq!(c.config_sync_period, secs(15 * 60));
    assert!(c.feature_gates.is_empty());
    assert_eq!(c.verbosity, 0);
    assert!(!c.cleanup);
    assert_eq!(c.ebpf, EbpfConfig::default());
    assert_eq!(c.ebpf.bpf_root, PathBuf::from("/sys/fs/bpf"));
    assert_eq!(c.ebpf.lb_algorithm, LbAlgorithm::Random);
    assert_eq!(c.ebpf.maglev_table_size, 1021);

    let d = loaded.document;
    assert_eq!(d.ipvs.sync_period.to_string(), "30s");
    assert_eq!(d.nftables.sync_period.to_string(), "30s");
    assert_eq!(d.nftables.min_sync_period.to_string(), "1s");
    assert_eq!(d.nftables.masquerade_bit, Some(14));
    assert_eq!(d.logging.format, "text");
    assert_eq!(d.logging.flush_frequency.duration().to_string(), "5s");
    assert_eq!(d.detect_local_mode, "ClusterCIDR");
    assert_eq!(d.port_range, "");
    assert_eq!(d.node_port_addresses, None);
}

#[test]
fn an_empty_file_gets_the_same_defaults() {
    let path = temp_file("empty.yaml", HEADER);
    let from_file = load_args(&["--config", path.to_str().unwrap()]).unwrap();
    let bare = load_args(&[]).unwrap();
    assert_eq!(from_file.config, bare.config);
    assert_eq!(from_file.document, bare.document);
}

/// A file that sets everything to a non-default value.
const FILE: &str = "bindAddress: 10.0.0.5
healthzBindAddress: 10.0.0.5:1111
metricsBindAddress: 10.0.0.5
clusterCIDR: 10.244.0.0/16
hostnameOverride: File-Node
mode: iptables
nodePortAddresses: [10.0.0.0/8]
oomScoreAdj: -500
configSyncPeriod: 1m
clientConnection:
  kubeconfig: /etc/file.kubeconfig
  qps: 7
  burst: 8
  contentType: application/json
iptables:
  masqueradeAll: true
  masqueradeBit: 5
  localhostNodePorts: false
  syncPeriod: 10s
  minSyncPeriod: 2s
conntrack:
  maxPerCore: 1
  min: 2
  tcpEstablishedTimeout: 3s
  tcpCloseWaitTimeout: 4s
  tcpBeLiberal: true
  udpTimeout: 5s
  udpStreamTimeout: 6s
detectLocalMode: NodeCIDR
logging:
  verbosity: 3
";

#[test]
fn the_file_is_read() {
    let path = temp_file("full.yaml", &format!("{HEADER}{FILE}"));
    let c = load_args(&["--config", path.to_str().unwrap()])
        .unwrap()
        .config;
    assert_eq!(c.mode, ProxyMode::Iptables);
    assert_eq!(c.bind_address, IpAddr::from([10, 0, 0, 5]));
    assert_eq!(
        c.healthz_bind_address,
        Some("10.0.0.5:1111".parse().unwrap())
    );
    // A bare IP gets the default port (AppendPortIfNeeded).
    assert_eq!(
        c.metrics_bind_address,
        Some("10.0.0.5:10249".parse().unwrap())
    );
    assert_eq!(
        c.cluster_cidrs,
        vec!["10.244.0.0/16".parse::<IpNet>().unwrap()]
    );
    assert_eq!(c.hostname_override.as_deref(), Some("file-node"));
    assert_eq!(
        c.node_port_addresses,
        NodePortAddresses::Cidrs(vec!["10.0.0.0/8".parse().unwrap()])
    );
    assert_eq!(c.oom_score_adj, -500);
    assert_eq!(c.config_sync_period, secs(60));
    assert_eq!(
        c.client_connection.kubeconfig,
        Some(PathBuf::from("/etc/file.kubeconfig"))
    );
    assert_eq!(c.client_connection.qps, 7.0);
    assert_eq!(c.client_connection.burst, 8);
    assert_eq!(c.client_connection.content_type, "application/json");
    assert!(c.masquerade_all);
    assert_eq!(c.iptables.masquerade_bit, 5);
    assert!(!c.iptables.localhost_node_ports);
    assert_eq!(c.sync_period, secs(10));
    assert_eq!(c.min_sync_period, secs(2));
    assert_eq!(
        c.conntrack,
        Conntrack {
            max_per_core: 1,
            min: 2,
            tcp_established_timeout: secs(3),
            tcp_close_wait_timeout: secs(4),
            tcp_be_liberal: true,
            udp_timeout: secs(5),
            udp_stream_timeout: secs(6),
        }
    );
    assert_eq!(c.detect_local, DetectLocal::NodeCidr);
    assert_eq!(c.verbosity, 3);
}

#[test]
fn every_flag_overrides_the_file() {
    let path = temp_file("full.yaml", &format!("{HEADER}{FILE}"));
    let config = path.to_str().unwrap();
    type Check = fn(&Config) -> bool;
    let cases: &[(&[&str], Check)] = &[
        (&["--proxy-mode", "ebpf"], |c| c.mode == ProxyMode::Ebpf),
        (&["--proxy-mode", ""], |c| c.mode == ProxyMode::Ebpf),
        (&["--hostname-override", " Flag-Node "], |c| {
            c.hostname_override.as_deref() == Some("flag-node")
        }),
        (&["--bind-address", "fd00::7"], |c| {
            c.bind_address == "fd00::7".parse::<IpAddr>().unwrap()
        }),
        (&["--cluster-cidr", "10.1.0.0/16,fd00:1::/64"], |c| {
            c.cluster_cidrs
                == vec![
                    "10.1.0.0/16".parse::<IpNet>().unwrap(),
                    "fd00:1::/64".parse().unwrap(),
                ]
        }),
        (&["--nodeport-addresses", "primary"], |c| {
            c.node_port_addresses == NodePortAddresses::Primary(Vec::new())
        }),
        // kube-proxy 1.37: keywords in any combination with each other and with CIDRs.
        (&["--nodeport-addresses", "primary,10.0.0.0/8"], |c| {
            c.node_port_addresses == NodePortAddresses::Primary(vec!["10.0.0.0/8".parse().unwrap()])
        }),
        (&["--nodeport-addresses", "primary,localhost"], |c| {
            c.node_port_addresses
                == NodePortAddresses::Primary(vec![
                    "127.0.0.0/8".parse().unwrap(),
                    "::1/128".parse().unwrap(),
                ])
        }),
        (
            &["--nodeport-addresses", "localhost,all,192.168.0.0/16"],
            |c| {
                c.node_port_addresses
                    == NodePortAddresses::Cidrs(vec![
                        "127.0.0.0/8".parse().unwrap(),
                        "::1/128".parse().unwrap(),
                        "0.0.0.0/0".parse().unwrap(),
                        "::/0".parse().unwrap(),
                        "192.168.0.0/16".parse().unwrap(),
                    ])
            },
        ),
        (&["--nodeport-addresses", "192.168.0.0/16,fd00::/8"], |c| {
            c.node_port_addresses
                == NodePortAddresses::Cidrs(vec![
                    "192.168.0.0/16".parse().unwrap(),
                    "fd00::/8".parse().unwrap(),
                ])
        }),
        (&["--nodeport-addresses", ""], |c| {
            c.node_port_addresses == NodePortAddresses::All
        }),
        (&["--masquerade-all=false"], |c| !c.masquerade_all),
        (&["--iptables-masquerade-bit", "31"], |c| {
            c.iptables.masquerade_bit == 31
        }),
        (&["--iptables-localhost-nodeports"], |c| {
            c.iptables.localhost_node_ports
        }),
        (&["--iptables-sync-period", "1m30s"], |c| {
            c.sync_period == secs(90)
        }),
        // Upstream applies flags after the defaults, so 0 sticks (the file's 0s would not).
        (&["--iptables-min-sync-period", "0"], |c| {
            c.min_sync_period == Duration::ZERO
        }),
        (&["--conntrack-max-per-core", "0"], |c| {
            c.conntrack.max_per_core == 0
        }),
        (&["--conntrack-min", "99"], |c| c.conntrack.min == 99),
        (&["--conntrack-tcp-timeout-established", "2h"], |c| {
            c.conntrack.tcp_established_timeout == secs(7200)
        }),
        (&["--conntrack-tcp-timeout-close-wait", "90s"], |c| {
            c.conntrack.tcp_close_wait_timeout == secs(90)
        }),
        (&["--conntrack-tcp-be-liberal=f"], |c| {
            !c.conntrack.tcp_be_liberal
        }),
        (&["--conntrack-udp-timeout", "30s"], |c| {
            c.conntrack.udp_timeout == secs(30)
        }),
        (&["--conntrack-udp-timeout-stream", "2m"], |c| {
            c.conntrack.udp_stream_timeout == secs(120)
        }),
        (&["--healthz-bind-address", "127.0.0.1"], |c| {
            c.healthz_bind_address == Some("127.0.0.1:10256".parse().unwrap())
        }),
        (&["--healthz-bind-address", ""], |c| {
            c.healthz_bind_address.is_none()
        }),
        (&["--metrics-bind-address", "[::1]:9999"], |c| {
            c.metrics_bind_address == Some("[::1]:9999".parse::<SocketAddr>().unwrap())
        }),
        (&["--oom-score-adj", "-1000"], |c| c.oom_score_adj == -1000),
        (&["--kubeconfig", "/flag.kubeconfig"], |c| {
            c.client_connection.kubeconfig == Some(PathBuf::from("/flag.kubeconfig"))
        }),
        (&["--master", "https://10.0.0.1:6443"], |c| {
            c.master.as_deref() == Some("https://10.0.0.1:6443")
        }),
        (&["--kube-api-qps", "50"], |c| {
            c.client_connection.qps == 50.0
        }),
        (&["--kube-api-burst", "100"], |c| {
            c.client_connection.burst == 100
        }),
        (&["--kube-api-content-type", "application/json"], |c| {
            c.client_connection.content_type == "application/json"
        }),
        (&["--config-sync-period", "5m"], |c| {
            c.config_sync_period == secs(300)
        }),
        (&["--detect-local-mode", "ClusterCIDR"], |c| {
            c.detect_local == DetectLocal::ClusterCidr
        }),
        (
            &[
                "--detect-local-mode",
                "BridgeInterface",
                "--pod-bridge-interface",
                "cbr0",
            ],
            |c| c.detect_local == DetectLocal::BridgeInterface("cbr0".to_owned()),
        ),
        (
            &[
                "--detect-local-mode",
                "InterfaceNamePrefix",
                "--pod-interface-name-prefix",
                "veth",
            ],
            |c| c.detect_local == DetectLocal::InterfaceNamePrefix("veth".to_owned()),
        ),
        (&["-v", "5"], |c| c.verbosity == 5),
        (&["-v"], |c| c.verbosity == 2),
        (&["-v4"], |c| c.verbosity == 4),
        (&["--v=0"], |c| c.verbosity == 0),
        (&["--cleanup"], |c| c.cleanup),
        (&["--manifests", "/m"], |c| {
            c.ebpf.manifests == Some(PathBuf::from("/m"))
        }),
        (&["--cgroup-path", "/cg"], |c| {
            c.ebpf.cgroup_path == Some(PathBuf::from("/cg"))
        }),
        (&["--bpf-root", "/b"], |c| {
            c.ebpf.bpf_root.as_path() == std::path::Path::new("/b")
        }),
        (&["--bpf-map-frontends", "100"], |c| {
            c.ebpf.map_frontends == 100
        }),
        (&["--bpf-map-backends", "200"], |c| {
            c.ebpf.map_backends == 200
        }),
        (&["--bpf-max-frontends-per-service", "64"], |c| {
            c.ebpf.max_frontends_per_service == 64
        }),
        (&["--bpf-max-endpoints-per-service", "500"], |c| {
            c.ebpf.max_endpoints_per_service == 500
        }),
        (&["--bpf-map-conntrack", "4096"], |c| {
            c.ebpf.map_conntrack == Some(4096)
        }),
        (&["--bpf-map-dynamic-size-ratio", "0.01"], |c| {
            c.ebpf.map_dynamic_size_ratio.map(|r| r.get()) == Some(0.01)
        }),
        (&["--bpf-snat-port-range", "61000-65535"], |c| {
            c.ebpf.snat_ports == (61_000..=65_535)
        }),
        (
            &["--interfaces", "eth0,eth1", "--interfaces", "bond0"],
            |c| c.ebpf.interfaces == ["eth0", "eth1", "bond0"],
        ),
        (&["--lb-algorithm", "maglev"], |c| {
            c.ebpf.lb_algorithm == LbAlgorithm::Maglev
        }),
        (&["--lb-algorithm", "random"], |c| {
            c.ebpf.lb_algorithm == LbAlgorithm::Random
        }),
        (&["--bpf-maglev-table-size", "16381"], |c| {
            c.ebpf.maglev_table_size == 16381
        }),
        (&["--bpf-map-maglev", "5000"], |c| c.ebpf.map_maglev == 5000),
        (&["--bpf-socket-lb-host-namespace-only"], |c| {
            c.ebpf.socket_lb_host_namespace_only
        }),
        (
            &[
                "--bpf-disable-feature",
                "tcx,socket-destroy",
                "--bpf-disable-feature",
                "btf",
            ],
            |c| {
                use crate::config::kernel_features::Feature;
                c.ebpf.disabled_features
                    == [Feature::Tcx, Feature::SocketDestroy, Feature::Btf]
                        .into_iter()
                        .collect()
            },
        ),
    ];
    for (flags, check) in cases {
        let mut list = vec!["--config", config];
        list.extend_from_slice(flags);
        let loaded = load_args(&list).unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        assert!(check(&loaded.config), "{flags:?}: {:#?}", loaded.config);
    }
}

#[test]
fn overriding_flags_are_reported() {
    let path = temp_file("full.yaml", &format!("{HEADER}{FILE}"));
    let loaded = load_args(&[
        "--config",
        path.to_str().unwrap(),
        "--iptables-masquerade-bit",
        "3",
        "--proxy-mode",
        "ebpf",
    ])
    .unwrap();
    assert_eq!(loaded.overridden, ["iptables-masquerade-bit", "proxy-mode"]);
    assert_eq!(loaded.document.iptables.masquerade_bit, Some(3));
    assert!(
        load_args(&["--proxy-mode", "ebpf"])
            .unwrap()
            .overridden
            .is_empty()
    );
}

/// options.go loadConfig: a strict decoding error (unknown fields) sends kube-proxy to the
/// lenient decoder, which drops them; the strict error is logged and the file used.
#[test]
fn unknown_fields_are_decoded_leniently_and_logged() {
    for (text, name) in [
        ("masqueradeBit: 3\n", "masqueradeBit"),
        ("iptables:\n  masqueradeBits: 3\n", "masqueradeBits"),
        ("conntrack:\n  maxPerCPU: 3\n", "maxPerCPU"),
        (
            "logging:\n  options:\n    text:\n      colour: true\n",
            "colour",
        ),
        (
            "logging:\n  vmodule:\n  - filePattern: x\n    verbosity: 2\n    extra: 1\n",
            "extra",
        ),
    ] {
        let path = temp_file(
            "unknown.yaml",
            &format!("{HEADER}{text}oomScoreAdj: -500\nfutureField: {{a: 1}}\n"),
        );
        let loaded = load_args(&["--config", path.to_str().unwrap()])
            .unwrap_or_else(|e| panic!("{text:?}: {:?}", e.lines()));
        // The known fields are read.
        assert_eq!(loaded.config.oom_score_adj, -500, "{text:?}");
        let Some(Notice::Error(message)) = loaded.notices.first() else {
            panic!("no error logged for {text:?}: {:?}", loaded.notices);
        };
        assert!(message.contains("lenient decoding"), "{message}");
        assert!(message.contains(path.to_str().unwrap()), "{message}");
        assert!(
            message.contains(&format!("unknown field `{name}`")),
            "{message}"
        );
    }
}

/// Lenient decoding does not excuse a value of the wrong type, nor a wrong kind.
#[test]
fn lenient_decoding_still_rejects_bad_values() {
    for text in [
        "futureField: 1\noomScoreAdj: lots\n",
        "futureField: 1\nkind: KubeletConfiguration\n",
    ] {
        let path = temp_file("bad.yaml", &format!("{HEADER}{text}"));
        assert!(load_args(&["--config", path.to_str().unwrap()]).is_err());
    }
}

/// kube-proxy 1.37's `KubeProxyIPVS` gate (IPVS mode behind it, deprecated) is taken as
/// upstream takes it, on or off, with component-base's warning for a deprecated gate; without
/// an IPVS mode here it changes nothing and is listed with the other gates that have no effect.
#[test]
fn the_kube_proxy_ipvs_gate_of_1_37_is_accepted() {
    for value in ["true", "false"] {
        let loaded = load_args(&[&format!("--feature-gates=KubeProxyIPVS={value}")])
            .unwrap_or_else(|e| panic!("{:?}", e.lines()));
        assert_eq!(
            loaded.config.feature_gates,
            BTreeMap::from([("KubeProxyIPVS".to_owned(), value == "true")])
        );
        assert!(!super::features::APPLIED.contains(&"KubeProxyIPVS"));
        let warning = format!(
            "Setting deprecated feature gate KubeProxyIPVS={value}. It will be removed in a \
             future release."
        );
        assert!(
            loaded.notices.contains(&Notice::Warn(warning)),
            "{:?}",
            loaded.notices
        );
    }
}

/// 1.36's `AllowServiceExternalIPs` (deprecated with `spec.externalIPs`) is applied, and
/// setting it is warned about as upstream does.
#[test]
fn the_external_ips_gate_of_1_36_is_applied_and_warned_about() {
    let loaded = load_args(&["--feature-gates=AllowServiceExternalIPs=false"])
        .unwrap_or_else(|e| panic!("{:?}", e.lines()));
    assert_eq!(
        loaded.config.feature_gates,
        BTreeMap::from([("AllowServiceExternalIPs".to_owned(), false)])
    );
    assert!(
        loaded.notices.contains(&Notice::Warn(
            "Setting deprecated feature gate AllowServiceExternalIPs=false. It will be removed \
             in a future release."
                .to_owned()
        )),
        "{:?}",
        loaded.notices
    );
    assert!(
        loaded.notices.contains(&Notice::Info(
            "feature gates applied: AllowServiceExternalIPs=false".to_owned()
        )),
        "{:?}",
        loaded.notices
    );
}

/// kube-proxy 1.37's help for `--metrics-bind-address`: an empty value is the default, not
/// "off" (upstream's defaulting runs after the flags).
#[test]
fn an_empty_metrics_bind_address_is_the_default() {
    for (args, expected) in [
        (&["--metrics-bind-address", ""][..], "127.0.0.1:10249"),
        (&["--metrics-bind-address="][..], "127.0.0.1:10249"),
    ] {
        let loaded = load_args(args).unwrap_or_else(|e| panic!("{:?}", e.lines()));
        assert_eq!(
            loaded.config.metrics_bind_address,
            Some(expected.parse().unwrap()),
            "{args:?}"
        );
    }
}

/// Every flag of `kube-proxy --help` (1.35, Linux) is accepted with pflag's syntax.
#[test]
fn every_kube_proxy_1_35_flag_is_accepted() {
    let loaded = load_args(&[
        "--bind-address-hard-fail",
        "--profiling=false",
        "--feature-gates=PreferSameTrafficDistribution=false,SomeAlphaGate=true",
        "--init-only",
        "--log-flush-frequency=7s",
        "--show-hidden-metrics-for-version=1.34",
        "--ipvs-sync-period=30s",
        "--ipvs-min-sync-period=0s",
        "--ipvs-scheduler=rr",
        "--ipvs-exclude-cidrs=10.0.0.0/8,192.168.0.0/16",
        "--ipvs-strict-arp",
        "--ipvs-tcp-timeout=0s",
        "--ipvs-tcpfin-timeout=0s",
        "--ipvs-udp-timeout=0s",
        "--vmodule=proxier*=4",
        "--log-text-split-stream=false",
        "--log-text-info-buffer-size=0",
        "--log-json-split-stream=false",
        "--log-json-info-buffer-size=0",
        "--healthz-port=10256",
        "--metrics-port=10249",
        "--logging-format=text",
        "--v=2",
    ])
    .unwrap_or_else(|e| panic!("{:?}", e.lines()));
    let c = &loaded.config;
    assert!(c.bind_address_hard_fail);
    assert!(!c.enable_profiling);
    assert!(c.init_only);
    assert_eq!(
        c.feature_gates,
        BTreeMap::from([
            ("PreferSameTrafficDistribution".to_owned(), false),
            ("SomeAlphaGate".to_owned(), true),
        ])
    );
    let d = &loaded.document;
    assert_eq!(
        d.logging.flush_frequency.duration(),
        "7s".parse::<GoDuration>().unwrap()
    );
    assert_eq!(d.show_hidden_metrics_for_version, "1.34");
    assert_eq!(d.ipvs.scheduler, "rr");
    assert!(d.ipvs.strict_arp);
    assert_eq!(d.logging.vmodule.len(), 1);
    // The applied gate is logged as applied; the rest in one warning.
    let text: Vec<String> = loaded.notices.iter().map(|n| format!("{n:?}")).collect();
    assert!(
        text.iter()
            .any(|n| n.starts_with("Info") && n.contains("PreferSameTrafficDistribution=false")),
        "{text:?}"
    );
    assert_eq!(
        text.iter()
            .filter(|n| n.contains("SomeAlphaGate=true"))
            .count(),
        1,
        "{text:?}"
    );
}

#[test]
fn bad_values_of_the_new_flags_name_the_flag() {
    let lines = problems(&[
        "--feature-gates=NoValue",
        "--profiling=maybe",
        "--init-only=2",
        "--log-flush-frequency=soon",
        "--ipvs-sync-period=x",
        "--healthz-port=70000",
        "--vmodule=a",
    ]);
    for flag in [
        "--feature-gates",
        "--profiling",
        "--init-only",
        "--log-flush-frequency",
        "--ipvs-sync-period",
        "--healthz-port",
        "--vmodule",
    ] {
        assert!(
            lines.iter().any(|l| l.starts_with(&format!("{flag}: "))),
            "{flag}: {lines:?}"
        );
    }
}

/// addressFromDeprecatedFlags: without --config, `--healthz-port=0` disables the server and
/// another port replaces the default one of a bare `--*-bind-address` IP.
#[test]
fn deprecated_port_flags_as_upstream() {
    let c = load_args(&[
        "--healthz-port=0",
        "--metrics-bind-address=127.0.0.2",
        "--metrics-port=9999",
    ])
    .unwrap()
    .config;
    assert_eq!(c.healthz_bind_address, None);
    assert_eq!(
        c.metrics_bind_address,
        Some("127.0.0.2:9999".parse().unwrap())
    );
    // With --config they are ignored, as upstream.
    let path = temp_file("c.yaml", HEADER);
    let c = load_args(&["--config", path.to_str().unwrap(), "--healthz-port=0"])
        .unwrap()
        .config;
    assert_eq!(
        c.healthz_bind_address,
        Some("0.0.0.0:10256".parse().unwrap())
    );
}

#[test]
fn wrong_kind_or_version_is_rejected() {
    for text in [
        "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
        "kind: KubeProxyConfiguration\n",
        "",
    ] {
        let path = temp_file("kind.yaml", text);
        let lines = problems(&["--config", path.to_str().unwrap()]);
        assert!(lines[0].contains("expected apiVersion"), "{lines:?}");
    }
}

#[test]
fn json_input_works() {
    let path = temp_file(
        "config.json",
        r#"{
  "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
  "kind": "KubeProxyConfiguration",
  "mode": "ebpf",
  "clusterCIDR": "10.244.0.0/16,fd00:10:244::/56",
  "iptables": {"masqueradeBit": 9, "syncPeriod": "1m0s", "minSyncPeriod": "500ms"},
  "conntrack": {"maxPerCore": null, "tcpCloseWaitTimeout": "1h0m0s"},
  "nodePortAddresses": ["primary"]
}"#,
    );
    let c = load_args(&["--config", path.to_str().unwrap()])
        .unwrap()
        .config;
    assert_eq!(c.iptables.masquerade_bit, 9);
    assert_eq!(c.sync_period, secs(60));
    assert_eq!(c.min_sync_period, Duration::from_millis(500));
    assert_eq!(c.conntrack.max_per_core, 32768);
    assert_eq!(c.cluster_cidrs.len(), 2);
    assert_eq!(
        c.node_port_addresses,
        NodePortAddresses::Primary(Vec::new())
    );
}

/// What kubeadm puts in the kube-proxy ConfigMap: zero values and nulls everywhere.
#[test]
fn kubeadm_style_file_with_nulls_is_accepted() {
    let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: \"\"
  burst: 0
  contentType: \"\"
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: \"\"
  interfaceNamePrefix: \"\"
detectLocalMode: \"\"
enableProfiling: false
healthzBindAddress: \"\"
hostnameOverride: \"\"
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: \"\"
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: \"0\"
    text:
      infoBufferSize: \"0\"
  verbosity: 0
metricsBindAddress: \"\"
mode: \"\"
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: \"\"
showHiddenMetricsForVersion: \"\"
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: \"\"
  rootHnsEndpointName: \"\"
  sourceVip: \"\"
";
    let path = temp_file("kubeadm.yaml", text);
    let loaded = load_args(&["--config", path.to_str().unwrap()]).unwrap();
    let bare = load_args(&[
        "--cluster-cidr",
        "10.244.0.0/16",
        "--kubeconfig",
        "/var/lib/kube-proxy/kubeconfig.conf",
    ])
    .unwrap();
    assert_eq!(loaded.config, bare.config);
}

#[test]
fn written_configuration_round_trips() {
    // Defaults, and a configuration with many flags, both round-trip through the file.
    for flags in [
        &[][..],
        &[
            "--cluster-cidr",
            "10.244.0.0/16,fd00::/56",
            "--nodeport-addresses",
            "10.0.0.0/8",
            "--iptables-sync-period",
            "45s",
            "--conntrack-udp-timeout",
            "250ms",
            "--hostname-override",
            "node-a",
            "-v",
            "4",
            "--proxy-mode",
            "iptables",
        ][..],
    ] {
        let first = load_args(flags).unwrap();
        let f = to_yaml(&first.document).unwrap();
        let path = temp_file("written.yaml", &f);
        let second = load_args(&["--config", path.to_str().unwrap()]).unwrap();
        let g = to_yaml(&second.document).unwrap();
        assert_eq!(f, g);
        // A written file names the mode, so it no longer falls back to iptables by itself.
        assert!(!second.config.mode_defaulted);
        let first_config = Config {
            mode_defaulted: false,
            ..first.config
        };
        assert_eq!(first_config, second.config);
    }
}

#[test]
fn written_durations_use_go_format() {
    let yaml = to_yaml(&load_args(&[]).unwrap().document).unwrap();
    for line in [
        "  syncPeriod: 30s",
        "  minSyncPeriod: 1s",
        "  tcpEstablishedTimeout: 24h0m0s",
        "  tcpCloseWaitTimeout: 1h0m0s",
        "configSyncPeriod: 15m0s",
        "  udpTimeout: 0s",
        "  qps: 5",
        "mode: ebpf",
        "kind: KubeProxyConfiguration",
    ] {
        assert!(
            yaml.lines().any(|l| l == line),
            "{line:?} missing in\n{yaml}"
        );
    }
}

#[test]
fn every_invalid_value_is_reported_with_source_field_and_value() {
    // (flags, file body) → expected (source, field, value) in one of the lines.
    let flag_cases: &[(&[&str], &str, &str, &str)] = &[
        (&["--proxy-mode", "ipvs"], "--proxy-mode", "mode", "ipvs"),
        (
            &["--proxy-mode", "nftables"],
            "--proxy-mode",
            "mode",
            "nftables",
        ),
        (
            &["--proxy-mode", "kernelspace"],
            "--proxy-mode",
            "mode",
            "kernelspace",
        ),
        (
            &["--proxy-mode", "userspace"],
            "--proxy-mode",
            "mode",
            "userspace",
        ),
        (
            &["--hostname-override", "  "],
            "--hostname-override",
            "hostnameOverride",
            "  ",
        ),
        (
            &["--bind-address", "10.0.0"],
            "--bind-address",
            "bindAddress",
            "10.0.0",
        ),
        (
            &["--cluster-cidr", "10.0.0.0/33"],
            "--cluster-cidr",
            "clusterCIDR",
            "10.0.0.0/33",
        ),
        (
            &["--cluster-cidr", "10.0.0.0/8,10.1.0.0/16"],
            "--cluster-cidr",
            "clusterCIDR",
            "10.0.0.0/8,10.1.0.0/16",
        ),
        (
            &["--cluster-cidr", "10.0.0.0/8,fd00::/8,fd01::/8"],
            "--cluster-cidr",
            "clusterCIDR",
            "10.0.0.0/8,fd00::/8,fd01::/8",
        ),
        (
            &["--nodeport-addresses", "10.0.0.0/8,foo"],
            "--nodeport-addresses",
            "nodePortAddresses[1]",
            "foo",
        ),
        (
            &["--nodeport-addresses", "primary,loopback"],
            "--nodeport-addresses",
            "nodePortAddresses[1]",
            "loopback",
        ),
        (
            &["--masquerade-all=maybe"],
            "--masquerade-all",
            "iptables.masqueradeAll",
            "maybe",
        ),
        (
            &["--iptables-masquerade-bit", "32"],
            "--iptables-masquerade-bit",
            "iptables.masqueradeBit",
            "32",
        ),
        (
            &["--iptables-masquerade-bit", "-1"],
            "--iptables-masquerade-bit",
            "iptables.masqueradeBit",
            "-1",
        ),
        (
            &["--iptables-masquerade-bit", "x"],
            "--iptables-masquerade-bit",
            "iptables.masqueradeBit",
            "x",
        ),
        (
            &["--iptables-sync-period", "0s"],
            "--iptables-sync-period",
            "iptables.syncPeriod",
            "0s",
        ),
        (
            &["--iptables-sync-period", "-5s"],
            "--iptables-sync-period",
            "iptables.syncPeriod",
            "-5s",
        ),
        (
            &["--iptables-sync-period", "30"],
            "--iptables-sync-period",
            "iptables.syncPeriod",
            "30",
        ),
        (
            &["--iptables-min-sync-period", "-1s"],
            "--iptables-min-sync-period",
            "iptables.minSyncPeriod",
            "-1s",
        ),
        (
            &["--iptables-min-sync-period", "1m"],
            "default",
            "iptables.syncPeriod",
            "30s",
        ),
        (
            &[
                "--iptables-sync-period",
                "1s",
                "--iptables-min-sync-period",
                "2s",
            ],
            "--iptables-sync-period",
            "iptables.syncPeriod",
            "1s",
        ),
        (
            &["--conntrack-max-per-core", "-1"],
            "--conntrack-max-per-core",
            "conntrack.maxPerCore",
            "-1",
        ),
        (
            &["--conntrack-min", "-1"],
            "--conntrack-min",
            "conntrack.min",
            "-1",
        ),
        (
            &["--conntrack-tcp-timeout-established", "-1s"],
            "--conntrack-tcp-timeout-established",
            "conntrack.tcpEstablishedTimeout",
            "-1s",
        ),
        (
            &["--conntrack-tcp-timeout-close-wait", "-1s"],
            "--conntrack-tcp-timeout-close-wait",
            "conntrack.tcpCloseWaitTimeout",
            "-1s",
        ),
        (
            &["--conntrack-udp-timeout", "-1s"],
            "--conntrack-udp-timeout",
            "conntrack.udpTimeout",
            "-1s",
        ),
        (
            &["--conntrack-udp-timeout-stream", "1d"],
            "--conntrack-udp-timeout-stream",
            "conntrack.udpStreamTimeout",
            "1d",
        ),
        (
            &["--conntrack-tcp-be-liberal=yes"],
            "--conntrack-tcp-be-liberal",
            "conntrack.tcpBeLiberal",
            "yes",
        ),
        (
            &["--healthz-bind-address", "1.2.3.4:0"],
            "--healthz-bind-address",
            "healthzBindAddress",
            "0",
        ),
        (
            &["--healthz-bind-address", "localhost:80"],
            "--healthz-bind-address",
            "healthzBindAddress",
            "localhost",
        ),
        (
            &["--metrics-bind-address", "1.2.3.4:70000"],
            "--metrics-bind-address",
            "metricsBindAddress",
            "70000",
        ),
        (
            &["--metrics-bind-address", "nonsense"],
            "--metrics-bind-address",
            "metricsBindAddress",
            "nonsense",
        ),
        (
            &["--oom-score-adj", "1001"],
            "--oom-score-adj",
            "oomScoreAdj",
            "1001",
        ),
        (
            &["--oom-score-adj", "-1001"],
            "--oom-score-adj",
            "oomScoreAdj",
            "-1001",
        ),
        (
            &["--kube-api-burst", "-1"],
            "--kube-api-burst",
            "clientConnection.burst",
            "-1",
        ),
        (
            &["--kube-api-qps", "fast"],
            "--kube-api-qps",
            "clientConnection.qps",
            "fast",
        ),
        (
            &["--config-sync-period", "-1m"],
            "--config-sync-period",
            "configSyncPeriod",
            "-1m0s",
        ),
        (
            &["--detect-local-mode", "Magic"],
            "--detect-local-mode",
            "detectLocalMode",
            "Magic",
        ),
        (
            &["--detect-local-mode", "BridgeInterface"],
            "default",
            "detectLocal.bridgeInterface",
            "",
        ),
        (
            &["--detect-local-mode", "InterfaceNamePrefix"],
            "default",
            "detectLocal.interfaceNamePrefix",
            "",
        ),
        (&["-v", "x"], "--v", "logging.verbosity", "x"),
        (&["--cleanup=nope"], "--cleanup", "", "nope"),
        (
            &["--bpf-map-frontends", "0"],
            "--bpf-map-frontends",
            "",
            "0",
        ),
        (
            &["--bpf-map-backends", "many"],
            "--bpf-map-backends",
            "",
            "many",
        ),
        (
            &["--bpf-max-frontends-per-service", "0"],
            "--bpf-max-frontends-per-service",
            "",
            "0",
        ),
        (
            &["--bpf-max-endpoints-per-service", "0"],
            "--bpf-max-endpoints-per-service",
            "",
            "0",
        ),
        (
            &["--bpf-max-endpoints-per-service", "65536"],
            "--bpf-max-endpoints-per-service",
            "",
            "65536",
        ),
        (&["--interfaces", "eth0,a/b"], "--interfaces", "", "a/b"),
        (&["--lb-algorithm", "ring"], "--lb-algorithm", "", "ring"),
        (
            &["--lb-algorithm", "Maglev"],
            "--lb-algorithm",
            "",
            "Maglev",
        ),
        (
            &["--bpf-maglev-table-size", "1024"],
            "--bpf-maglev-table-size",
            "",
            "1024",
        ),
        (
            &["--bpf-maglev-table-size", "2"],
            "--bpf-maglev-table-size",
            "",
            "2",
        ),
        (
            &["--bpf-maglev-table-size", "131101"],
            "--bpf-maglev-table-size",
            "",
            "131101",
        ),
        (
            &["--bpf-maglev-table-size", "-7"],
            "--bpf-maglev-table-size",
            "",
            "-7",
        ),
        (&["--bpf-map-maglev", "0"], "--bpf-map-maglev", "", "0"),
        (
            &["--bpf-map-conntrack", "0"],
            "--bpf-map-conntrack",
            "",
            "0",
        ),
        (
            &["--bpf-map-dynamic-size-ratio", "1.5"],
            "--bpf-map-dynamic-size-ratio",
            "",
            "1.5",
        ),
        (
            &["--bpf-map-dynamic-size-ratio", "lots"],
            "--bpf-map-dynamic-size-ratio",
            "",
            "lots",
        ),
        (
            &["--bpf-snat-port-range", "65535-61000"],
            "--bpf-snat-port-range",
            "",
            "65535-61000",
        ),
        (
            &["--bpf-snat-port-range", "80-90"],
            "--bpf-snat-port-range",
            "",
            "80-90",
        ),
        (
            &["--bpf-snat-port-range", "61000"],
            "--bpf-snat-port-range",
            "",
            "61000",
        ),
        (
            &["--bpf-disable-feature", "tcx,kfuncs"],
            "--bpf-disable-feature",
            "",
            "kfuncs",
        ),
    ];
    for (flags, source, field, value) in flag_cases {
        let lines = problems(flags);
        let expected = if field.is_empty() {
            format!("{source}: invalid value {value:?}: ")
        } else {
            format!("{source}: {field}: invalid value {value:?}: ")
        };
        assert!(
            lines.iter().any(|l| l.starts_with(&expected)),
            "{flags:?}: expected a line starting with {expected:?}, got {lines:?}"
        );
    }

    let file_cases: &[(&str, &str, &str)] = &[
        ("mode: ipvs\n", "mode", "ipvs"),
        ("bindAddress: ten\n", "bindAddress", "ten"),
        ("healthzBindAddress: '1.2.3.4:'\n", "healthzBindAddress", ""),
        ("metricsBindAddress: ':::1'\n", "metricsBindAddress", ":::1"),
        ("clusterCIDR: 10.0.0.0\n", "clusterCIDR", "10.0.0.0"),
        (
            "nodePortAddresses: [10.0.0.0/8, 1.2.3]\n",
            "nodePortAddresses[1]",
            "1.2.3",
        ),
        ("oomScoreAdj: 2000\n", "oomScoreAdj", "2000"),
        ("configSyncPeriod: -1s\n", "configSyncPeriod", "-1s"),
        ("portRange: 2000-300\n", "portRange", "2000-300"),
        (
            "showHiddenMetricsForVersion: latest\n",
            "showHiddenMetricsForVersion",
            "latest",
        ),
        ("detectLocalMode: Pods\n", "detectLocalMode", "Pods"),
        ("hostnameOverride: '  '\n", "hostnameOverride", "  "),
        (
            "iptables:\n  masqueradeBit: 40\n",
            "iptables.masqueradeBit",
            "40",
        ),
        (
            "iptables:\n  syncPeriod: -1s\n",
            "iptables.syncPeriod",
            "-1s",
        ),
        (
            "iptables:\n  minSyncPeriod: -1s\n",
            "iptables.minSyncPeriod",
            "-1s",
        ),
        (
            "iptables:\n  syncPeriod: 500ms\n",
            "iptables.syncPeriod",
            "500ms",
        ),
        (
            "conntrack:\n  maxPerCore: -1\n",
            "conntrack.maxPerCore",
            "-1",
        ),
        ("conntrack:\n  min: -2\n", "conntrack.min", "-2"),
        (
            "conntrack:\n  tcpEstablishedTimeout: -1s\n",
            "conntrack.tcpEstablishedTimeout",
            "-1s",
        ),
        (
            "conntrack:\n  tcpCloseWaitTimeout: -1s\n",
            "conntrack.tcpCloseWaitTimeout",
            "-1s",
        ),
        (
            "conntrack:\n  udpTimeout: -1s\n",
            "conntrack.udpTimeout",
            "-1s",
        ),
        (
            "conntrack:\n  udpStreamTimeout: -1s\n",
            "conntrack.udpStreamTimeout",
            "-1s",
        ),
        (
            "clientConnection:\n  burst: -1\n",
            "clientConnection.burst",
            "-1",
        ),
        (
            "detectLocalMode: BridgeInterface\n",
            "detectLocal.bridgeInterface",
            "",
        ),
        ("logging:\n  format: xml\n", "logging.format", "xml"),
        (
            "logging:\n  flushFrequency: -1s\n",
            "logging.flushFrequency",
            "-1s",
        ),
    ];
    for (body, field, value) in file_cases {
        let path = temp_file("bad.yaml", &format!("{HEADER}{body}"));
        let lines = problems(&["--config", path.to_str().unwrap()]);
        let expected = format!("{}: {field}: invalid value {value:?}: ", path.display());
        assert!(
            lines.iter().any(|l| l.starts_with(&expected)),
            "{body:?}: expected a line starting with {expected:?}, got {lines:?}"
        );
    }
}

#[test]
fn all_problems_are_reported_together() {
    let path = temp_file(
        "many.yaml",
        &format!("{HEADER}oomScoreAdj: 5000\niptables:\n  masqueradeBit: 99\n"),
    );
    let lines = problems(&[
        "--config",
        path.to_str().unwrap(),
        "--proxy-mode",
        "ipvs",
        "--conntrack-min",
        "-5",
        "--iptables-sync-period",
        "soon",
    ]);
    assert_eq!(lines.len(), 5, "{lines:?}");
    let file = path.display().to_string();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with(&format!("{file}: oomScoreAdj:")))
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with(&format!("{file}: iptables.masqueradeBit:")))
    );
    assert!(lines.iter().any(|l| l.starts_with("--proxy-mode: mode:")));
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("--conntrack-min: conntrack.min:"))
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("--iptables-sync-period: iptables.syncPeriod:"))
    );
}

#[test]
fn type_errors_in_the_file_name_the_field() {
    for (body, needle) in [
        (
            "iptables:\n  masqueradeBit: lots\n",
            "iptables.masqueradeBit",
        ),
        // A number where metav1.Duration wants a string, as upstream's JSON decoder refuses it.
        (
            "iptables:\n  syncPeriod: 30\n",
            "iptables.syncPeriod: invalid type: integer `30`",
        ),
        ("conntrack:\n  udpTimeout: 5 minutes\n", "invalid duration"),
        ("nodePortAddresses: 10.0.0.0/8\n", "nodePortAddresses"),
    ] {
        let path = temp_file("types.yaml", &format!("{HEADER}{body}"));
        let lines = problems(&["--config", path.to_str().unwrap()]);
        assert!(lines[0].contains(needle), "{body:?}: {lines:?}");
    }
}

#[test]
fn missing_file_is_an_error() {
    let lines = problems(&["--config", "/nonexistent/kube-proxy.yaml"]);
    assert!(
        lines[0].contains("/nonexistent/kube-proxy.yaml"),
        "{lines:?}"
    );
}

#[test]
fn notices_copy_upstreams_log_lines() {
    let notices = load_args(&[]).unwrap().notices;
    assert!(matches!(&notices[..], [Notice::Info(m)] if m.contains("clusterCIDR is not set")));
    let notices = load_args(&["--cluster-cidr", "10.0.0.0/8"])
        .unwrap()
        .notices;
    assert!(notices.is_empty());
}

#[test]
fn settings_without_effect_are_named_in_one_warning() {
    let notices = load_args(&[
        "--cluster-cidr",
        "10.0.0.0/8",
        "--config-sync-period",
        "1m",
        "--kube-api-qps",
        "50",
        "--kube-api-content-type",
        "application/json",
    ])
    .unwrap()
    .notices;
    let [Notice::Warn(message)] = &notices[..] else {
        panic!("expected one warning: {notices:?}");
    };
    assert!(
        message.contains("configSyncPeriod=1m"),
        "configSyncPeriod missing in {message}"
    );
    // Honoured (the client's token bucket, the encoding asked for), so not named.
    assert!(
        !message.contains("qps") && !message.contains("burst") && !message.contains("contentType"),
        "{message}"
    );
}

#[test]
fn integer_flags_take_gos_base_prefixes_and_underscores() {
    for (text, expected) in [
        ("-999", -999),
        ("-0x3e7", -999),
        ("-0o1747", -999),
        ("-01747", -999),
        ("-0b1111100111", -999),
        ("-9_99", -999),
    ] {
        let loaded = load_args(&["--oom-score-adj", text]).unwrap();
        assert_eq!(
            loaded.config.oom_score_adj, expected,
            "--oom-score-adj {text}"
        );
    }
    for bad in ["0x", "1__0", "_1", "1_", "0x1g", "9a"] {
        assert!(
            load_args(&["--oom-score-adj", bad]).is_err(),
            "--oom-score-adj {bad} must be refused"
        );
    }
    // klog's -v stays decimal.
    assert!(load_args(&["-v", "0x2"]).is_err());
}

#[test]
fn json_logging_is_not_reported_as_ignored() {
    let notices = load_args(&["--cluster-cidr", "10.0.0.0/8", "--logging-format", "json"])
        .unwrap()
        .notices;
    assert!(notices.is_empty(), "{notices:?}");
}

#[test]
fn verbosity_maps_to_tracing_levels() {
    for (v, level) in [
        ("0", LevelFilter::INFO),
        ("1", LevelFilter::INFO),
        ("2", LevelFilter::DEBUG),
        ("3", LevelFilter::DEBUG),
        ("4", LevelFilter::TRACE),
        ("10", LevelFilter::TRACE),
    ] {
        assert_eq!(load_args(&["-v", v]).unwrap().config.log_level(), level);
    }
}

/// `--tc-fast-path` was a boolean flag: alone it still means true, `=false` and `=true` keep
/// working, and without it the fast path follows the node's forwarding policy (`auto`).
#[test]
fn tc_fast_path_is_auto_by_default_and_takes_the_old_boolean_forms() {
    use crate::config::ebpf_settings::FastPathSetting;
    let setting = |list: &[&str]| load_args(list).unwrap().config.ebpf.tc_fast_path;
    assert_eq!(setting(&[]), FastPathSetting::Auto);
    assert_eq!(setting(&["--tc-fast-path"]), FastPathSetting::On);
    assert_eq!(setting(&["--tc-fast-path=true"]), FastPathSetting::On);
    assert_eq!(setting(&["--tc-fast-path=false"]), FastPathSetting::Off);
    assert_eq!(setting(&["--tc-fast-path=auto"]), FastPathSetting::Auto);
    // The flag alone does not take the next argument as its value.
    assert_eq!(
        setting(&["--tc-fast-path", "--bpf-xdp", "off"]),
        FastPathSetting::On
    );
    let lines = problems(&["--tc-fast-path=sometimes"]);
    assert!(
        lines.iter().any(|l| l.starts_with("--tc-fast-path: ")),
        "{lines:?}"
    );
}
