use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use proxy_common::node_flags;
use serde_json::json;

use super::{
    ebpf::{external_interfaces, is_pod_interface, node_config},
    manager::{pod_cidr_wait, pod_cidrs_changed},
    *,
};
use proxy_common::addr::{ip4_to_map, ip6_to_map};
use proxy_model::{
    config::{DetectLocal, NodePortAddresses},
    desired::IpFamily,
    objects::{NodeInfo, Store, Update},
};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| ip(s)).collect()
}

fn cidrs(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| s.parse().expect("cidr")).collect()
}

/// A Node with these `(type, address)` pairs and podCIDRs, as the sources deliver it.
fn node(addresses: &[(&str, &str)], pod_cidrs: &[&str]) -> NodeInfo {
    NodeInfo::from(&k8s_node(addresses, pod_cidrs))
}

/// The same as the API object.
fn k8s_node(addresses: &[(&str, &str)], pod_cidrs: &[&str]) -> Node {
    let addresses: Vec<_> = addresses
        .iter()
        .map(|(kind, address)| json!({"type": kind, "address": address}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "z1"}},
        "spec": {"podCIDRs": pod_cidrs},
        "status": {"addresses": addresses},
    }))
    .expect("node")
}

fn iface(name: &str, addrs: &[&str], loopback: bool) -> (String, Interface) {
    (
        name.to_owned(),
        Interface {
            name: name.to_owned(),
            addrs: ips(addrs),
            loopback,
            link: None,
        },
    )
}

/// lo, eth0 (dual-stack + link-local), eth1 (a second address), a pod bridge and a veth.
fn host() -> BTreeMap<String, Interface> {
    [
        iface("lo", &["127.0.0.1", "::1"], true),
        iface("eth0", &["10.10.0.1", "fe80::1", "fd00:10::1"], false),
        iface("eth1", &["192.168.5.1"], false),
        iface("cbr0", &["10.244.1.1"], false),
        iface("veth1", &["fe80::2"], false),
    ]
    .into_iter()
    .collect()
}

fn inputs(node_port_addresses: NodePortAddresses) -> NodeInputs {
    NodeInputs {
        bind_address: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        node_port_addresses,
        detect_local: DetectLocal::ClusterCidr,
        cluster_cidrs: cidrs(&["10.244.0.0/16"]),
        localhost_node_ports: true,
        masquerade_all: false,
    }
}

#[test]
fn node_host_ips_prefer_internal_then_external_and_pair_families() {
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: &[Case] = &[
        (&[], &[]),
        (&[("Hostname", "node-a")], &[]),
        (
            &[("ExternalIP", "203.0.113.1"), ("InternalIP", "10.0.0.1")],
            &["10.0.0.1"],
        ),
        (
            &[
                ("InternalIP", "fd00::1"),
                ("InternalIP", "10.0.0.1"),
                ("InternalIP", "10.0.0.2"),
            ],
            &["fd00::1", "10.0.0.1"],
        ),
        (
            &[("InternalIP", "10.0.0.1"), ("ExternalIP", "2001:db8::1")],
            &["10.0.0.1", "2001:db8::1"],
        ),
        (
            &[("InternalIP", "not-an-ip"), ("ExternalIP", "203.0.113.1")],
            &["203.0.113.1"],
        ),
    ];
    for (addresses, expected) in cases {
        assert_eq!(
            node_host_ips(&node(addresses, &[])),
            ips(expected),
            "{addresses:?}"
        );
    }
}

#[test]
fn detect_node_ips_bind_address_then_node_then_loopback() {
    let any = ip("0.0.0.0");
    let cases = [
        (vec![], any, (IpFamily::V4, "127.0.0.1", "::1")),
        (ips(&["10.0.0.1"]), any, (IpFamily::V4, "10.0.0.1", "::1")),
        (
            ips(&["fd00::1", "10.0.0.1"]),
            any,
            (IpFamily::V6, "10.0.0.1", "fd00::1"),
        ),
        // --bind-address wins for its family and makes it primary.
        (
            ips(&["fd00::1", "10.0.0.1"]),
            ip("192.168.0.9"),
            (IpFamily::V4, "192.168.0.9", "fd00::1"),
        ),
        (vec![], ip("::"), (IpFamily::V4, "127.0.0.1", "::1")),
    ];
    for (raw, bind, (family, v4, v6)) in cases {
        assert_eq!(
            detect_node_ips(&raw, bind),
            (family, ip(v4), ip(v6)),
            "{raw:?} {bind}"
        );
    }
}

#[test]
fn node_port_address_sets_follow_upstream() {
    // (cidrs, family, match_all, contains_ipv4_loopback)
    let cases: &[(&[&str], IpFamily, bool, bool)] = &[
        (&[], IpFamily::V4, true, true),
        (&[], IpFamily::V6, true, false),
        (&["10.0.0.0/8"], IpFamily::V4, false, false),
        // Only IPv4 CIDRs: IPv6 matches all.
        (&["10.0.0.0/8"], IpFamily::V6, true, false),
        (&["127.0.0.1/32", "10.0.0.0/8"], IpFamily::V4, false, true),
        (&["127.0.0.0/8"], IpFamily::V4, false, true),
        (&["10.0.0.0/8", "0.0.0.0/0"], IpFamily::V4, true, true),
        (&["::1/128"], IpFamily::V6, false, false),
    ];
    for (list, family, match_all, loopback) in cases {
        let set = NodePortAddressSet::new(*family, &cidrs(list));
        assert_eq!(set.match_all, *match_all, "{list:?} {family:?}");
        assert_eq!(set.contains_ipv4_loopback, *loopback, "{list:?} {family:?}");
    }
}

#[test]
fn primary_means_the_node_ips_and_no_localhost_node_ports() {
    let node = node(
        &[("InternalIP", "10.10.0.1"), ("InternalIP", "fd00:10::1")],
        &[],
    );
    let settings = NodeSettings::compute(
        &inputs(NodePortAddresses::Primary(Vec::new())),
        Some(&node),
        &host(),
    );
    assert!(!settings.v4.node_ports.match_all);
    assert_eq!(settings.v4.node_port_ips, ips(&["10.10.0.1"]));
    assert_eq!(settings.v6.node_port_ips, ips(&["fd00:10::1"]));
    assert!(!settings.v4.localhost_node_ports);
    assert_eq!(settings.v4.node_ip, ip("10.10.0.1"));
    assert_eq!(settings.health_check_ips, ips(&["10.10.0.1", "fd00:10::1"]));
    let (config, addrs) = node_config(&settings, &host(), &external(&settings));
    assert_eq!(addrs, ips(&["10.10.0.1", "fd00:10::1"]));
    assert_eq!(config.flags & node_flags::LOCALHOST_NODEPORTS, 0);

    // A node IP that is not on the host: nothing of that family is served.
    let elsewhere = node_with_ips(&["10.99.0.1"]);
    let settings = NodeSettings::compute(
        &inputs(NodePortAddresses::Primary(Vec::new())),
        Some(&elsewhere),
        &host(),
    );
    assert!(settings.v4.node_port_ips.is_empty());
    assert!(!settings.v4.node_ports.match_all);
    // No IPv6 node IP: server.go adds no IPv6 CIDR, so IPv6 matches all (upstream).
    assert!(settings.v6.node_ports.match_all);
}

/// kube-proxy 1.37's `--nodeport-addresses primary,localhost`: the node IPs and the loopback
/// addresses, so localhost NodePorts are served (IPv4) while the node's other addresses are
/// not; `primary,all` serves every address.
#[test]
fn primary_with_localhost_adds_the_loopback_addresses() {
    let node = node(
        &[("InternalIP", "10.10.0.1"), ("InternalIP", "fd00:10::1")],
        &[],
    );
    let localhost = vec!["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()];
    let settings = NodeSettings::compute(
        &inputs(NodePortAddresses::Primary(localhost)),
        Some(&node),
        &host(),
    );
    assert!(!settings.v4.node_ports.match_all);
    assert_eq!(settings.v4.node_port_ips, ips(&["10.10.0.1", "127.0.0.1"]));
    assert_eq!(settings.v6.node_port_ips, ips(&["::1", "fd00:10::1"]));
    assert!(settings.v4.localhost_node_ports);
    assert!(!settings.v6.localhost_node_ports, "never IPv6");

    let all = vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()];
    let settings = NodeSettings::compute(
        &inputs(NodePortAddresses::Primary(all)),
        Some(&node),
        &host(),
    );
    assert!(settings.v4.node_ports.match_all && settings.v6.node_ports.match_all);
}

fn node_with_ips(list: &[&str]) -> NodeInfo {
    let pairs: Vec<(&str, &str)> = list.iter().map(|a| ("InternalIP", *a)).collect();
    node(&pairs, &[])
}

fn external(settings: &NodeSettings) -> std::collections::BTreeSet<String> {
    external_interfaces(&[], &settings.detect_local, &host())
}

#[test]
fn primary_without_a_node_falls_back_like_upstream() {
    // detectNodeIPs falls back to 127.0.0.1/::1, which `primary` leaves out: both families
    // match all, and IPv4 then contains loopback.
    let settings = NodeSettings::compute(
        &inputs(NodePortAddresses::Primary(Vec::new())),
        None,
        &host(),
    );
    assert!(settings.v4.node_ports.match_all && settings.v6.node_ports.match_all);
    assert!(settings.v4.localhost_node_ports);
    assert_eq!(settings.v4.node_ip, ip("127.0.0.1"));
}

#[test]
fn match_all_serves_every_address_and_flags_localhost() {
    let settings = NodeSettings::compute(&inputs(NodePortAddresses::All), None, &host());
    assert!(settings.v4.localhost_node_ports);
    assert!(!settings.v6.localhost_node_ports, "never IPv6");
    assert_eq!(settings.health_check_ips, ips(&["0.0.0.0"]));
    let (config, addrs) = node_config(&settings, &host(), &external(&settings));
    assert_ne!(config.flags & node_flags::LOCALHOST_NODEPORTS, 0);
    // Every local address but loopback ones (the flag covers 127/8; ::1 is never served).
    assert_eq!(
        addrs,
        ips(&[
            "10.10.0.1",
            "10.244.1.1",
            "192.168.5.1",
            "fd00:10::1",
            "fe80::1",
            "fe80::2"
        ])
    );

    let off = NodeInputs {
        localhost_node_ports: false,
        ..inputs(NodePortAddresses::All)
    };
    let settings = NodeSettings::compute(&off, None, &host());
    let (config, _) = node_config(&settings, &host(), &external(&settings));
    assert_eq!(config.flags & node_flags::LOCALHOST_NODEPORTS, 0);
}

#[test]
fn explicit_cidrs_list_loopback_addresses_only_with_localhost_node_ports() {
    let with_lo = NodePortAddresses::Cidrs(cidrs(&["127.0.0.0/8", "10.10.0.0/16", "::1/128"]));
    let settings = NodeSettings::compute(&inputs(with_lo.clone()), None, &host());
    assert!(settings.v4.localhost_node_ports);
    assert_eq!(settings.v4.node_port_ips, ips(&["10.10.0.1", "127.0.0.1"]));
    let (config, addrs) = node_config(&settings, &host(), &external(&settings));
    assert_eq!(
        config.flags & node_flags::LOCALHOST_NODEPORTS,
        0,
        "listed, not flagged"
    );
    assert_eq!(addrs, ips(&["10.10.0.1", "127.0.0.1"]), "::1 never");
    // Per-family health check addresses: the IPv4 list and, as upstream lists it, ::1.
    assert_eq!(
        settings.health_check_ips,
        ips(&["10.10.0.1", "127.0.0.1", "::1"])
    );

    let off = NodeInputs {
        localhost_node_ports: false,
        ..inputs(with_lo)
    };
    let settings = NodeSettings::compute(&off, None, &host());
    assert!(!settings.v4.localhost_node_ports);
    let (_, addrs) = node_config(&settings, &host(), &external(&settings));
    assert_eq!(addrs, ips(&["10.10.0.1"]));

    // CIDRs without loopback: no localhost NodePorts even with the option on.
    let plain = NodeSettings::compute(
        &inputs(NodePortAddresses::Cidrs(cidrs(&["192.168.0.0/16"]))),
        None,
        &host(),
    );
    assert!(!plain.v4.localhost_node_ports);
    assert_eq!(plain.v4.node_port_ips, ips(&["192.168.5.1"]));
    assert!(plain.v6.node_ports.match_all);
    assert_eq!(plain.health_check_ips, ips(&["192.168.5.1", "::"]));
}

#[test]
fn node_cidr_detection_uses_the_pod_cidrs() {
    let node = node(
        &[("InternalIP", "10.10.0.1")],
        &["10.244.1.0/24", "fd00:244:1::/64"],
    );
    let node_cidr = NodeInputs {
        detect_local: DetectLocal::NodeCidr,
        ..inputs(NodePortAddresses::All)
    };
    let settings = NodeSettings::compute(&node_cidr, Some(&node), &host());
    assert_eq!(
        settings.detect_local,
        DetectLocalMode::NodeCidr(cidrs(&["10.244.1.0/24", "fd00:244:1::/64"]))
    );
    let (config, _) = node_config(&settings, &host(), &external(&settings));
    assert_eq!(
        config.flags & (node_flags::CLUSTER_CIDR4 | node_flags::CLUSTER_CIDR6),
        node_flags::CLUSTER_CIDR4 | node_flags::CLUSTER_CIDR6
    );
    assert_eq!(
        config.cluster4,
        ip4_to_map("10.244.1.0".parse().expect("v4"))
    );
    assert_eq!(
        config.cluster4_mask,
        ip4_to_map("255.255.255.0".parse().expect("v4"))
    );
    assert_eq!(
        config.cluster6,
        ip6_to_map("fd00:244:1::".parse().expect("v6"))
    );
    // Without a Node: no podCIDRs, so no detection at all (no masquerade), as upstream's
    // no-op detector.
    let settings = NodeSettings::compute(&node_cidr, None, &host());
    let (config, _) = node_config(&settings, &host(), &external(&settings));
    assert_eq!(
        config.flags & (node_flags::CLUSTER_CIDR4 | node_flags::CLUSTER_CIDR6),
        0
    );
}

#[test]
fn cluster_cidr_detection_takes_the_first_cidr_of_each_family() {
    let two = NodeInputs {
        cluster_cidrs: cidrs(&["10.244.0.0/16", "10.96.0.0/12"]),
        ..inputs(NodePortAddresses::All)
    };
    let settings = NodeSettings::compute(&two, None, &host());
    let (config, _) = node_config(&settings, &host(), &external(&settings));
    assert_eq!(
        config.cluster4,
        ip4_to_map("10.244.0.0".parse().expect("v4"))
    );
    assert_eq!(config.flags & node_flags::CLUSTER_CIDR6, 0);
}

#[test]
fn interface_detection_flags_the_node_and_keeps_pod_interfaces_internal() {
    for (mode, pod_if) in [
        (DetectLocal::BridgeInterface("cbr0".into()), "cbr0"),
        (DetectLocal::InterfaceNamePrefix("cbr".into()), "cbr0"),
    ] {
        let by_if = NodeInputs {
            detect_local: mode.clone(),
            ..inputs(NodePortAddresses::All)
        };
        let settings = NodeSettings::compute(&by_if, None, &host());
        assert!(is_pod_interface(&settings.detect_local, pod_if));
        assert!(!is_pod_interface(&settings.detect_local, "eth0"));
        let external = external(&settings);
        assert_eq!(
            external.into_iter().collect::<Vec<_>>(),
            ["eth0", "eth1"],
            "{mode:?}"
        );
        let (config, _) = node_config(&settings, &host(), &self::external(&settings));
        assert_ne!(config.flags & node_flags::LOCAL_BY_INTERFACE, 0);
        assert_eq!(config.flags & node_flags::CLUSTER_CIDR4, 0);
    }
    // ClusterCIDR: the bridge has a global address, so it is external as before.
    let settings = NodeSettings::compute(&inputs(NodePortAddresses::All), None, &host());
    assert!(external(&settings).contains("cbr0"));
}

#[test]
fn snat_addresses_and_masquerade_all() {
    let masq = NodeInputs {
        masquerade_all: true,
        ..inputs(NodePortAddresses::All)
    };
    let settings = NodeSettings::compute(&masq, None, &host());
    let only_eth0: std::collections::BTreeSet<String> = ["eth0".to_owned()].into();
    let (config, _) = node_config(&settings, &host(), &only_eth0);
    assert_ne!(config.flags & node_flags::MASQUERADE_ALL, 0);
    assert_eq!(config.snat4, ip4_to_map("10.10.0.1".parse().expect("v4")));
    assert_eq!(config.snat6, ip6_to_map("fd00:10::1".parse().expect("v6")));
}

#[test]
fn an_added_address_changes_the_settings_once() {
    let mut manager = NodeManager::with_watcher(
        inputs(NodePortAddresses::Cidrs(cidrs(&["192.168.0.0/16"]))),
        "node-a",
        None,
    );
    let mut interfaces = host();
    let first = manager
        .update(None, &interfaces)
        .cloned()
        .expect("first settings");
    assert_eq!(first.v4.node_port_ips, ips(&["192.168.5.1"]));
    assert!(manager.update(None, &interfaces).is_none(), "unchanged");
    interfaces
        .get_mut("eth1")
        .expect("eth1")
        .addrs
        .push(ip("192.168.77.7"));
    let second = manager.update(None, &interfaces).cloned().expect("changed");
    assert_eq!(
        second.v4.node_port_ips,
        ips(&["192.168.5.1", "192.168.77.7"])
    );
    assert_eq!(
        second.health_check_ips[..2],
        ips(&["192.168.5.1", "192.168.77.7"])[..]
    );
    // Removed again.
    interfaces.get_mut("eth1").expect("eth1").addrs.pop();
    let third = manager
        .update(None, &interfaces)
        .cloned()
        .expect("changed back");
    assert_eq!(third, first);
}

#[test]
fn node_ip_follows_the_node_object() {
    let mut manager = NodeManager::with_watcher(
        inputs(NodePortAddresses::Primary(Vec::new())),
        "node-a",
        None,
    );
    let before = manager.update(None, &host()).cloned().expect("settings");
    assert_eq!(before.v4.node_ip, ip("127.0.0.1"));
    let node = node_with_ips(&["192.168.5.1"]);
    let after = manager
        .update(Some(&node), &host())
        .cloned()
        .expect("changed");
    assert_eq!(after.v4.node_ip, ip("192.168.5.1"));
    assert_eq!(after.v4.node_port_ips, ips(&["192.168.5.1"]));
    // --bind-address overrides the Node for its family.
    let bound = NodeInputs {
        bind_address: ip("10.10.0.1"),
        ..inputs(NodePortAddresses::Primary(Vec::new()))
    };
    let settings = NodeSettings::compute(&bound, Some(&node), &host());
    assert_eq!(settings.v4.node_ip, ip("10.10.0.1"));
    assert_eq!(settings.v4.node_port_ips, ips(&["10.10.0.1"]));
}

#[test]
fn node_cidr_waits_then_fails_and_exits_on_a_change() {
    let without = node(&[("InternalIP", "10.0.0.1")], &[]);
    let with = node(&[("InternalIP", "10.0.0.1")], &["10.244.1.0/24"]);
    assert!(!pod_cidr_wait("node-a", None, Duration::ZERO).expect("waiting"));
    assert!(!pod_cidr_wait("node-a", Some(&without), Duration::from_secs(299)).expect("waiting"));
    assert!(pod_cidr_wait("node-a", Some(&with), Duration::from_secs(1000)).expect("ready"));
    let error =
        pod_cidr_wait("node-a", Some(&without), POD_CIDR_POLL_TIMEOUT).expect_err("times out");
    let message = error.to_string();
    assert!(
        message.contains("node-a") && message.contains("no PodCIDR allocated"),
        "{message}"
    );
    assert!(pod_cidr_wait("node-a", None, POD_CIDR_POLL_TIMEOUT).is_err());

    let first = vec!["10.244.1.0/24".to_owned()];
    assert!(pod_cidrs_changed("node-a", &first, &with).is_ok());
    let moved = node(&[("InternalIP", "10.0.0.1")], &["10.244.2.0/24"]);
    assert!(matches!(
        pod_cidrs_changed("node-a", &first, &moved),
        Err(NodeError::PodCidrsChanged { .. })
    ));
    assert!(pod_cidrs_changed("node-a", &first, &without).is_err());
}

#[test]
fn node_manager_gates_on_pod_cidrs_only_in_node_cidr_mode() {
    let mut plain = NodeManager::with_watcher(inputs(NodePortAddresses::All), "node-a", None);
    assert!(plain.ready(true, None).expect("ready"));
    assert!(!plain.ready(false, None).expect("not listed"));

    let node_cidr = NodeInputs {
        detect_local: DetectLocal::NodeCidr,
        ..inputs(NodePortAddresses::All)
    };
    let mut manager = NodeManager::with_watcher(node_cidr, "node-a", None);
    assert!(!manager.ready(true, None).expect("waiting"));
    assert_eq!(
        manager.poll_interval(Duration::from_secs(30)),
        Duration::from_secs(1)
    );
    let with = node(&[("InternalIP", "10.0.0.1")], &["10.244.1.0/24"]);
    assert!(manager.ready(true, Some(&with)).expect("ready"));
    // Once started, a later change of the podCIDRs fails the refresh.
    let moved = node(&[("InternalIP", "10.0.0.1")], &["10.244.2.0/24"]);
    assert!(manager.refresh(Some(&with)).is_ok());
    assert!(matches!(
        manager.refresh(Some(&moved)),
        Err(NodeError::PodCidrsChanged { .. })
    ));
}

fn with_heartbeat(mut node: Node, time: &str) -> Node {
    let status = node.status.get_or_insert_with(Default::default);
    status.conditions = Some(vec![
        serde_json::from_value(json!({
            "type": "Ready", "status": "True", "lastHeartbeatTime": time
        }))
        .expect("condition"),
    ]);
    node.metadata.resource_version = Some(time.to_owned());
    node
}

#[test]
fn only_relevant_node_fields_are_changes() {
    let info = NodeInfo::from;
    let base = k8s_node(&[("InternalIP", "10.0.0.1")], &["10.244.1.0/24"]);
    let beat1 = with_heartbeat(base.clone(), "2026-01-01T00:00:00Z");
    let beat2 = with_heartbeat(base.clone(), "2026-01-01T00:00:10Z");
    assert!(
        !node_change(Some(&info(&beat1)), Some(&info(&beat2))).any(),
        "heartbeat"
    );

    let mut zone = beat2.clone();
    zone.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("topology.kubernetes.io/zone".into(), "z2".into());
    let change = node_change(Some(&info(&beat2)), Some(&info(&zone)));
    assert!(change.topology && !change.settings && !change.health);

    let mut other_label = beat2.clone();
    other_label
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("example.com/team".into(), "a".into());
    assert!(!node_change(Some(&info(&beat2)), Some(&info(&other_label))).any());

    let base = info(&base);
    let addresses = node(&[("InternalIP", "10.0.0.2")], &["10.244.1.0/24"]);
    let change = node_change(Some(&base), Some(&addresses));
    assert!(change.settings && !change.topology);
    let cidrs = node(&[("InternalIP", "10.0.0.1")], &["10.244.9.0/24"]);
    assert!(node_change(Some(&base), Some(&cidrs)).settings);

    let mut deleting = k8s_node(&[("InternalIP", "10.0.0.1")], &["10.244.1.0/24"]);
    deleting.metadata.deletion_timestamp =
        Some(serde_json::from_value(json!("2026-01-01T00:00:00Z")).expect("time"));
    let change = node_change(Some(&base), Some(&info(&deleting)));
    assert!(change.health && !change.topology && !change.settings);

    let appeared = node_change(None, Some(&base));
    assert!(appeared.topology && appeared.settings && appeared.health);
    assert!(!node_change(None, None).any());
}

#[test]
fn store_ignores_node_heartbeats() {
    let base = k8s_node(&[("InternalIP", "10.0.0.1")], &["10.244.1.0/24"]);
    let mut store = Store::default();
    assert!(store.apply(Update::ReplaceNode(Some(
        with_heartbeat(base.clone(), "2026-01-01T00:00:00Z").into()
    ))));
    store.take_changes();
    let beat = with_heartbeat(base.clone(), "2026-01-01T00:00:10Z");
    assert!(!store.apply(Update::ReplaceNode(Some(NodeInfo::from(&beat)))));
    assert!(store.take_changes().is_empty());
    let mut zone = beat;
    zone.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("topology.kubernetes.io/zone".into(), "z9".into());
    assert!(store.apply(Update::ReplaceNode(Some(zone.into()))));
    assert!(store.take_changes().node.topology);
    assert_eq!(
        store
            .objects()
            .node
            .as_ref()
            .and_then(|n| n.zone.as_deref()),
        Some("z9")
    );
}

#[test]
fn tc_node_config_matches_the_previous_behaviour_for_plain_options() {
    // What the bare dataplane (no node manager) computed before: ClusterCIDR detection, SNAT
    // to the external interface's first global addresses, no localhost NodePorts.
    let all: BTreeMap<_, _> = [
        iface("lo", &["127.0.0.1", "::1"], true),
        iface("eth0", &["10.10.0.1", "fd00:10::1"], false),
        iface("veth1", &[], false),
    ]
    .into_iter()
    .collect();
    let plain = NodeInputs {
        localhost_node_ports: false,
        ..inputs(NodePortAddresses::All)
    };
    let settings = NodeSettings::compute(&plain, None, &all);
    let external = external_interfaces(&[], &settings.detect_local, &all);
    assert_eq!(external.iter().collect::<Vec<_>>(), ["eth0"]);
    let (config, addrs) = node_config(&settings, &all, &external);
    assert_eq!(config.flags, node_flags::CLUSTER_CIDR4);
    assert_eq!(config.snat4, ip4_to_map(Ipv4Addr::new(10, 10, 0, 1)));
    assert_eq!(addrs, ips(&["10.10.0.1", "fd00:10::1"]));
    // --interfaces overrides the choice.
    let chosen = external_interfaces(&["veth1".to_owned()], &settings.detect_local, &all);
    assert_eq!(chosen.iter().collect::<Vec<_>>(), ["veth1"]);
}

#[test]
fn a_deleted_node_keeps_its_settings() {
    let node_cidr = NodeInputs {
        detect_local: DetectLocal::NodeCidr,
        ..inputs(NodePortAddresses::Primary(Vec::new()))
    };
    let mut manager = NodeManager::with_watcher(node_cidr, "node-a", None);
    let node = node(&[("InternalIP", "10.10.0.1")], &["10.244.1.0/24"]);
    let with_node = manager
        .update(Some(&node), &host())
        .cloned()
        .expect("settings");
    assert_eq!(with_node.pod_cidrs, cidrs(&["10.244.1.0/24"]));
    assert!(
        manager.update(None, &host()).is_none(),
        "deletion changes nothing"
    );
}

/// An interface with link facts: `kind`, up or not, Ethernet or `hardware_type`, port of
/// `master`.
fn linked(
    name: &str,
    addrs: &[&str],
    index: u32,
    kind: Option<&str>,
    up: bool,
    hardware_type: u16,
    master: Option<u32>,
) -> (String, Interface) {
    let (name, mut interface) = iface(name, addrs, false);
    interface.link = Some(Link {
        index,
        up,
        kind: kind.map(str::to_owned),
        hardware_type,
        master,
        mac: None,
    });
    (name, interface)
}

#[test]
fn only_up_uplinks_are_external_and_links_without_ethernet_get_nothing() {
    use super::ebpf::{TcRole, tc_roles};
    const ETHER: u16 = ARPHRD_ETHER;
    const NONE: u16 = 0xfffe;
    let all: BTreeMap<_, _> = [
        iface("lo", &["127.0.0.1"], true),
        // docker0 sorts first and holds a global address: a container bridge all the same.
        linked(
            "docker0",
            &["10.0.0.1"],
            3,
            Some("bridge"),
            true,
            ETHER,
            None,
        ),
        linked("dvc", &[], 4, Some("veth"), true, ETHER, Some(3)),
        linked("eth0", &["10.10.0.1"], 2, None, true, ETHER, None),
        // A down NIC with an address.
        linked("eth1", &["192.168.5.1"], 5, None, false, ETHER, None),
        // br0 bridges a NIC: the node's uplink.
        linked("br0", &["10.30.0.1"], 6, Some("bridge"), true, ETHER, None),
        linked("eth2", &[], 7, None, true, ETHER, Some(6)),
        linked(
            "flannel.1",
            &["10.244.0.0"],
            8,
            Some("vxlan"),
            true,
            ETHER,
            None,
        ),
        linked(
            "kube-ipvs0",
            &["10.96.0.1"],
            9,
            Some("dummy"),
            true,
            ETHER,
            None,
        ),
        linked("tunl0", &["10.244.0.1"], 10, Some("ipip"), true, 768, None),
        linked(
            "wg0",
            &["10.99.0.1"],
            11,
            Some("wireguard"),
            true,
            NONE,
            None,
        ),
        // A node in a container: its uplink is a veth.
        linked(
            "veth9",
            &["172.18.0.2"],
            12,
            Some("veth"),
            true,
            ETHER,
            None,
        ),
    ]
    .into_iter()
    .collect();
    let local = DetectLocalMode::ClusterCidr(vec![]);
    let roles = tc_roles(&[], &local, &all);
    let with = |role: TcRole| -> Vec<&str> {
        roles
            .iter()
            .filter(|(_, r)| **r == role)
            .map(|(n, _)| n.as_str())
            .collect()
    };
    assert_eq!(with(TcRole::External), ["br0", "eth0", "veth9"]);
    assert_eq!(
        with(TcRole::Pod),
        ["docker0", "dvc", "eth1", "eth2", "flannel.1", "kube-ipvs0"]
    );
    assert_eq!(with(TcRole::Untouched), ["lo", "tunl0", "wg0"]);

    // The SNAT address is an uplink's, never docker0's although it sorts first.
    let settings = NodeSettings::compute(&inputs(NodePortAddresses::All), None, &all);
    let external = external_interfaces(&[], &local, &all);
    let (config, _) = node_config(&settings, &all, &external);
    assert_eq!(config.snat4, ip4_to_map(Ipv4Addr::new(10, 30, 0, 1)));

    // --interfaces: external while up; a link without Ethernet header still gets nothing.
    let named = ["docker0", "eth1", "wg0"].map(str::to_owned);
    let roles = tc_roles(&named, &local, &all);
    assert_eq!(roles["docker0"], TcRole::External);
    assert_eq!(roles["eth1"], TcRole::Pod);
    assert_eq!(roles["eth0"], TcRole::Pod);
    assert_eq!(roles["wg0"], TcRole::Untouched);

    // Without link facts (the dump failed) addresses alone decide, as before.
    let unknown: BTreeMap<_, _> = [iface("docker0", &["10.0.0.1"], false)]
        .into_iter()
        .collect();
    assert_eq!(
        external_interfaces(&[], &local, &unknown)
            .into_iter()
            .collect::<Vec<_>>(),
        ["docker0"]
    );
}

/// Each external interface's own first global address per family, by ifindex (MASQUERADE's
/// choice for a route leaving there), and its MAC (replies sent out by it directly);
/// link-local addresses never, interfaces without link facts or with neither a global address
/// nor a MAC not at all, non-external interfaces not at all.
#[test]
fn every_external_interface_has_its_own_snat_addresses() {
    use proxy_common::SnatAddrs;

    use super::ebpf::snat_by_interface;
    let mut all: BTreeMap<String, Interface> = [
        linked(
            "eth0",
            &["fe80::1", "10.10.0.1", "10.10.0.9", "fd00:10::1"],
            2,
            None,
            true,
            ARPHRD_ETHER,
            None,
        ),
        linked("eth1", &["192.168.5.1"], 3, None, true, ARPHRD_ETHER, None),
        linked("eth2", &["fe80::3"], 4, None, true, ARPHRD_ETHER, None),
        linked(
            "cbr0",
            &["10.244.1.1"],
            5,
            Some("bridge"),
            true,
            ARPHRD_ETHER,
            None,
        ),
        iface("eth3", &["172.16.0.1"], false),
    ]
    .into_iter()
    .collect();
    let mac = [2, 0, 0, 0, 0, 4];
    if let Some(link) = all.get_mut("eth2").and_then(|i| i.link.as_mut()) {
        link.mac = Some(mac);
    }
    let external = ["eth0", "eth1", "eth2", "eth3"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    let v4 = |s: &str| ip4_to_map(s.parse().expect("v4"));
    assert_eq!(
        snat_by_interface(&all, &external),
        BTreeMap::from([
            (
                2,
                SnatAddrs {
                    snat4: v4("10.10.0.1"),
                    snat6: ip6_to_map("fd00:10::1".parse().expect("v6")),
                    ..SnatAddrs::default()
                }
            ),
            (
                3,
                SnatAddrs {
                    snat4: v4("192.168.5.1"),
                    snat6: [0; 4],
                    ..SnatAddrs::default()
                }
            ),
            (
                4,
                SnatAddrs {
                    mac,
                    ..SnatAddrs::default()
                }
            ),
        ])
    );
}
