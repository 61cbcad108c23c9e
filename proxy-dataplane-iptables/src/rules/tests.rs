//! Generator behaviour the upstream vectors do not pin down on their own: partial syncs, stale
//! chain deletion, IPv6 specifics and upstream's rule-jump invariants (`checkIPTablesRuleJumps`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::*;
use crate::{HostFeatures, IptablesConfig, localdetect::DetectLocalMode};
use proxy_model::desired::{Protocol, ServicePortName};

fn key(ns: &str, name: &str) -> ObjectKey {
    ObjectKey {
        namespace: ns.into(),
        name: name.into(),
    }
}

fn endpoint(addr: &str, port: u16) -> Endpoint {
    Endpoint {
        addr: addr.parse().unwrap(),
        port,
        is_local: false,
        ready: true,
        serving: true,
        terminating: false,
        cluster: true,
        local: false,
    }
}

fn port(ns: &str, name: &str, cluster_ip: &str, endpoints: &[&str]) -> ServicePort {
    let cluster_ip: IpAddr = cluster_ip.parse().unwrap();
    let endpoints: Vec<Endpoint> = endpoints.iter().map(|e| endpoint(e, 80)).collect();
    ServicePort {
        name: ServicePortName {
            service: key(ns, name),
            port: "p80".into(),
            protocol: Protocol::Tcp,
        },
        cluster_ip,
        port: 80,
        protocol: Protocol::Tcp,
        node_port: None,
        external_ips: Vec::new(),
        load_balancer_ips: Vec::new(),
        source_ranges: Vec::new(),
        affinity_timeout: None,
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: None,
        traffic_distribution: None,
        has_any_endpoints: !endpoints.is_empty(),
        endpoints,
    }
}

fn snapshot(ports: Vec<ServicePort>) -> FamilySnapshot {
    FamilySnapshot {
        service_ports: ports.into_iter().map(|p| (p.name.clone(), p)).collect(),
    }
}

fn context(family: IpFamily) -> FamilyRules {
    let config = IptablesConfig {
        detect_local: DetectLocalMode::ClusterCidr(vec![
            "10.0.0.0/8".parse().unwrap(),
            "fd00:10::/64".parse().unwrap(),
        ]),
        ..IptablesConfig::default()
    };
    FamilyRules::new(&config, family, None, &[], &HostFeatures::default())
}

fn text(ruleset: &Ruleset) -> String {
    String::from_utf8(ruleset.restore.to_vec()).unwrap()
}

const FULL: SyncInput<'static> = SyncInput {
    changed_services: None,
    existing_nat_chains: None,
};

#[test]
fn partial_sync_writes_only_changed_service_chains() {
    let ctx = context(IpFamily::V4);
    let snap = snapshot(vec![
        port("ns1", "a", "172.30.0.1", &["10.1.0.1"]),
        port("ns1", "b", "172.30.0.2", &["10.1.0.2"]),
    ]);
    let full = generate(&ctx, &snap, FULL);
    let changed: BTreeSet<ObjectKey> = [key("ns1", "b")].into();
    let partial = generate(
        &ctx,
        &snap,
        SyncInput {
            changed_services: Some(&changed),
            existing_nat_chains: Some(&full.active_nat_chains),
        },
    );
    let restore = text(&partial);
    // Top-level chains are always rewritten, with every service's entry rule.
    assert!(restore.contains("-d 172.30.0.1 --dport 80 -j KUBE-SVC-"));
    assert!(restore.contains("--to-destination 10.1.0.2:80"));
    assert!(!restore.contains("--to-destination 10.1.0.1:80"));
    // Unchanged chains are still active (never deleted) and still counted.
    assert_eq!(partial.active_nat_chains, full.active_nat_chains);
    assert!(partial.deleted_chains.is_empty());
    assert_eq!(partial.nat_rules_total, full.nat_rules_total);
    assert!(partial.nat_rules_written < full.nat_rules_written);
}

#[test]
fn stale_service_chains_are_flushed_and_deleted_others_ignored() {
    let ctx = context(IpFamily::V4);
    let snap = snapshot(vec![port("ns1", "a", "172.30.0.1", &["10.1.0.1"])]);
    let mut existing = generate(&ctx, &snap, FULL).active_nat_chains;
    existing.insert("KUBE-SVC-STALESTALESTALE1".into());
    existing.insert("KUBE-SERVICES".into());
    existing.insert("SOMEONE-ELSES".into());
    let ruleset = generate(
        &ctx,
        &snap,
        SyncInput {
            changed_services: None,
            existing_nat_chains: Some(&existing),
        },
    );
    assert_eq!(ruleset.deleted_chains, ["KUBE-SVC-STALESTALESTALE1"]);
    let restore = text(&ruleset);
    assert!(restore.contains(":KUBE-SVC-STALESTALESTALE1 - [0:0]\n"));
    assert!(restore.contains("\n-X KUBE-SVC-STALESTALESTALE1\n"));
    // The nodeports jump stays the last rule of KUBE-SERVICES, after the -X lines.
    let last_services_rule = restore
        .lines()
        .rfind(|l| l.starts_with("-A KUBE-SERVICES") || l.starts_with("-X"))
        .unwrap();
    assert!(last_services_rule.contains("must be the last rule"));
}

#[test]
fn ipv6_uses_bracketed_endpoints_and_no_localhost_rules() {
    let ctx = context(IpFamily::V6);
    let mut p = port("ns1", "a", "fd00:172:30::1", &[]);
    p.endpoints = vec![endpoint("fd00:10:180::1", 80)];
    p.has_any_endpoints = true;
    p.node_port = Some(3001);
    let restore = text(&generate(&ctx, &snapshot(vec![p]), FULL));
    assert!(restore.contains("-j DNAT --to-destination [fd00:10:180::1]:80"));
    assert!(restore.contains("-s fd00:10:180::1 -j KUBE-MARK-MASQ"));
    assert!(restore.contains("! -s fd00:10::/64 -j KUBE-MARK-MASQ"));
    assert!(restore.contains("-m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS"));
    assert!(!restore.contains("KUBE-FIREWALL"));
    assert!(!restore.contains("127.0.0.0/8"));
    assert!(restore.contains("-m mark ! --mark 0x00004000/0x00004000 -j RETURN"));
}

/// upstream's checkIPTablesRuleJumps: every jumped-to chain is declared and non-empty, and
/// every declared service chain is used.
#[test]
fn every_jump_target_exists_and_every_chain_is_used() {
    let ctx = context(IpFamily::V4);
    let mut lb = port(
        "ns2",
        "lb",
        "172.30.0.2",
        &["10.1.0.1", "10.1.0.2", "10.1.0.3"],
    );
    lb.node_port = Some(3002);
    lb.load_balancer_ips = vec!["1.2.3.4".parse().unwrap()];
    lb.source_ranges = vec!["203.0.113.0/25".parse().unwrap()];
    lb.affinity_timeout = Some(10_800);
    let mut local = port("ns3", "local", "172.30.0.3", &["10.1.0.4", "10.1.0.5"]);
    local.external_ips = vec!["192.168.99.3".parse().unwrap()];
    local.external_policy_local = true;
    local.internal_policy_local = true;
    local.endpoints[0].local = true;
    local.endpoints[0].is_local = true;
    let snap = snapshot(vec![
        port("ns1", "a", "172.30.0.1", &["10.1.0.1"]),
        lb,
        local,
        port("ns4", "none", "172.30.0.4", &[]),
    ]);
    let restore = text(&generate(&ctx, &snap, FULL));
    let mut declared: BTreeMap<String, usize> = BTreeMap::new();
    let mut jumped: BTreeSet<String> = BTreeSet::new();
    for line in restore.lines() {
        if let Some(decl) = line.strip_prefix(':') {
            declared
                .entry(decl.split(' ').next().unwrap().to_owned())
                .or_default();
        } else if let Some(rest) = line.strip_prefix("-A ") {
            let chain = rest.split(' ').next().unwrap();
            *declared
                .get_mut(chain)
                .unwrap_or_else(|| panic!("undeclared {chain}")) += 1;
            if let Some((_, target)) = rest.split_once(" -j ") {
                let target = target.split(' ').next().unwrap();
                if target.starts_with("KUBE-") {
                    jumped.insert(target.to_owned());
                }
            }
        }
    }
    for target in &jumped {
        let rules = declared
            .get(target)
            .unwrap_or_else(|| panic!("{target} not declared"));
        assert!(
            *rules > 0 || target == "KUBE-NODEPORTS",
            "{target} is empty"
        );
    }
    for chain in declared.keys() {
        if super::is_service_chain_name(chain) {
            assert!(jumped.contains(chain), "{chain} is never used");
        }
    }
}

/// The iptables rules context takes the node settings: `primary` gives one NodePort jump for
/// the node IP and no localnet firewall rule; NodeCIDR gives the podCIDR detector.
#[test]
fn iptables_rules_follow_the_node_settings() {
    use proxy_kernel::node::{NodeInputs, NodeSettings};
    use proxy_model::{
        config::{DetectLocal, NodePortAddresses},
        desired::{FamilySnapshot, IpFamily},
        objects::NodeInfo,
    };

    use crate::{FamilyRules, SyncInput};
    let node = |addresses: &[(&str, &str)], pod_cidrs: &[&str]| {
        let addresses: Vec<_> = addresses
            .iter()
            .map(|(kind, address)| serde_json::json!({"type": kind, "address": address}))
            .collect();
        let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-a"},
            "spec": {"podCIDRs": pod_cidrs},
            "status": {"addresses": addresses},
        }))
        .expect("node");
        NodeInfo::from(&node)
    };
    // lo, eth0 (dual-stack + link-local), eth1 (a second address), a pod bridge and a veth.
    let host: BTreeMap<String, proxy_kernel::node::Interface> = [
        ("lo", &["127.0.0.1", "::1"][..], true),
        ("eth0", &["10.10.0.1", "fe80::1", "fd00:10::1"][..], false),
        ("eth1", &["192.168.5.1"][..], false),
        ("cbr0", &["10.244.1.1"][..], false),
        ("veth1", &["fe80::2"][..], false),
    ]
    .into_iter()
    .map(|(name, addrs, loopback)| {
        let iface = proxy_kernel::node::Interface {
            name: name.to_owned(),
            addrs: addrs.iter().map(|a| a.parse().expect("ip")).collect(),
            loopback,
            link: None,
        };
        (name.to_owned(), iface)
    })
    .collect();
    let all_addresses: Vec<IpAddr> = host
        .values()
        .flat_map(|i| i.addrs.iter().copied())
        .collect();
    let config = IptablesConfig::default();
    let mut rules = FamilyRules::new(
        &config,
        IpFamily::V4,
        None,
        &all_addresses,
        &HostFeatures::default(),
    );
    assert!(
        rules.localhost_node_ports,
        "default: match-all with localhost NodePorts"
    );
    let restore = |rules: &FamilyRules| {
        let ruleset = generate(
            rules,
            &FamilySnapshot::default(),
            SyncInput {
                changed_services: None,
                existing_nat_chains: None,
            },
        );
        String::from_utf8_lossy(&ruleset.restore).into_owned()
    };
    assert!(restore(&rules).contains("block incoming localnet connections"));

    let node = node(&[("InternalIP", "10.10.0.1")], &["10.244.1.0/24"]);
    let inputs = NodeInputs {
        bind_address: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        node_port_addresses: NodePortAddresses::Primary(Vec::new()),
        detect_local: DetectLocal::NodeCidr,
        cluster_cidrs: vec!["10.244.0.0/16".parse().expect("cidr")],
        localhost_node_ports: true,
        masquerade_all: false,
    };
    let settings = NodeSettings::compute(&inputs, Some(&node), &host);
    rules.set_node(&settings.v4, &settings.detect_local);
    assert_eq!(rules.node_ip, Some("10.10.0.1".parse().expect("ip")));
    assert_eq!(rules.local_detector.if_local(), ["-s", "10.244.1.0/24"]);
    let text = restore(&rules);
    assert!(
        !text.contains("block incoming localnet connections"),
        "{text}"
    );
    assert!(!text.contains("--dst-type LOCAL"), "{text}");
    assert!(text.contains("-d 10.10.0.1 -j KUBE-NODEPORTS"), "{text}");
}

/// Kubernetes 1.36 validates Service names as DNS labels (a name may start with a digit): the
/// longest names there can be — a 63-character namespace and Service name starting with
/// digits, with a 15-character port name — still give chain names iptables takes (at most 28
/// characters) and comments within the comment match's 256 bytes.
#[test]
fn the_longest_service_names_fit_chain_names_and_comments() {
    let namespace = format!("9{}", "n".repeat(62));
    let name = format!("1{}", "w".repeat(62));
    let mut port = port(&namespace, &name, "172.30.0.9", &["10.1.0.9"]);
    port.name.port = "p234567890abcde".into();
    port.node_port = Some(30099);
    port.external_ips = vec!["192.0.2.9".parse().unwrap()];
    let ruleset = generate(&context(IpFamily::V4), &snapshot(vec![port]), FULL);
    let restore = text(&ruleset);
    assert!(restore.contains(&format!("{namespace}/{name}:p234567890abcde")));
    for line in restore.lines() {
        if let Some(chain) = line.strip_prefix(':') {
            let chain = chain.split(' ').next().unwrap_or_default();
            assert!(
                chain.len() <= 28,
                "chain name too long for iptables: {chain}"
            );
        }
        if let Some((_, rest)) = line.split_once("--comment ") {
            let comment = rest
                .strip_prefix('"')
                .and_then(|quoted| quoted.split_once('"'))
                .map_or_else(|| rest.split(' ').next().unwrap_or_default(), |(c, _)| c);
            assert!(comment.len() <= 256, "comment too long: {comment}");
        }
    }
}
