//! The parity files' compact Service / EndpointSlice descriptions → real Kubernetes objects, so
//! every test runs the whole pipeline (`Objects` → `Snapshot::compute` → generator).

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_dataplane_iptables::{
    FamilyRules, LocalDetector, NodePortAddresses, SyncInput, config::node_port_addresses,
    generate, localdetect::DetectLocalMode,
};
use proxy_model::{
    desired::{IpFamily, Snapshot},
    objects::{ObjectKey, Objects},
};
use serde_yaml::{Mapping, Value};

pub const NODE_NAME: &str = "test-node";

/// The upstream vectors, kept in the repository (`vectors/PROVENANCE.md` says where they come
/// from) so that a plain clone runs these tests.
pub fn parity_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/iptables_parity/vectors"
    ))
}

pub fn load(relative: &str) -> Value {
    let path = parity_dir().join(relative);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn str_of<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

/// The addresses NewFakeProxier's fake network has (scenario 07's `interfaces`).
pub fn test_interface_ips() -> Vec<IpAddr> {
    [
        "127.0.0.1",
        "::1",
        "192.168.0.2",
        "192.168.1.2",
        "192.168.99.11",
        "2001:db8::1",
        "2001:db8:1::2",
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect()
}

/// NewFakeProxier's settings for a family.
pub fn fake_proxier(family: IpFamily) -> FamilyRules {
    let (cidr, node_ip) = match family {
        IpFamily::V4 => ("10.0.0.0/8", "192.168.0.2"),
        IpFamily::V6 => ("fd00:10::/64", "2001:db8::1"),
    };
    FamilyRules {
        family,
        mark: "0x4000".into(),
        masquerade_all: false,
        local_detector: LocalDetector::for_family(
            &DetectLocalMode::ClusterCidr(vec![cidr.parse().unwrap()]),
            family,
        ),
        node_ip: Some(node_ip.parse().unwrap()),
        node_ports: NodePortAddresses::All,
        localhost_node_ports: family == IpFamily::V4,
        random_fully: false,
        conntrack_tcp_liberal: false,
        nfacct_invalid: true,
        nfacct_localhost: true,
        large_cluster_threshold: 1000,
    }
}

pub fn with_node_port_addresses(mut rules: FamilyRules, cidrs: &[&str]) -> FamilyRules {
    let cidrs: Vec<ipnet::IpNet> = cidrs.iter().map(|c| c.parse().unwrap()).collect();
    rules.node_ports = node_port_addresses(&cidrs, rules.family, &test_interface_ips());
    rules
}

/// A full sync's restore text.
pub fn full_sync(rules: &FamilyRules, objects: &Objects) -> String {
    let snapshot = Snapshot::compute(objects, NODE_NAME);
    let ruleset = generate(
        rules,
        snapshot.family(rules.family),
        SyncInput {
            changed_services: None,
            existing_nat_chains: None,
        },
    );
    String::from_utf8(ruleset.restore.to_vec()).unwrap()
}

pub fn objects(services: &[Value], slices: &[Value]) -> Objects {
    let mut svc_map = BTreeMap::new();
    for compact in services {
        let service = service(compact);
        svc_map.insert(ObjectKey::of(&service.metadata).unwrap(), service.into());
    }
    let mut slice_map = BTreeMap::new();
    for (i, compact) in slices.iter().enumerate() {
        let slice = slice(compact, i);
        slice_map.insert(ObjectKey::of(&slice.metadata).unwrap(), slice.into());
    }
    Objects::new(svc_map, slice_map, None)
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    let mut m = Mapping::new();
    for (k, v) in entries {
        if !v.is_null() {
            m.insert(Value::from(k), v);
        }
    }
    Value::Mapping(m)
}

fn get(value: &Value, key: &str) -> Value {
    value.get(key).cloned().unwrap_or(Value::Null)
}

/// Takes the value for one family from strings like `"172.30.0.41 (IPv6: fd00:172:30::41)"`.
pub fn pick_family(text: &str, family: IpFamily) -> String {
    match text.split_once(" (IPv6: ") {
        Some((v4, rest)) => match family {
            IpFamily::V4 => v4.trim().to_owned(),
            IpFamily::V6 => rest.trim_end_matches(')').trim().to_owned(),
        },
        None => text.to_owned(),
    }
}

/// Rewrites every string of a compact description for one family (TestNodePorts' inputs).
pub fn for_family(value: &Value, family: IpFamily) -> Value {
    match value {
        Value::String(s) => Value::String(pick_family(s, family)),
        Value::Sequence(items) => {
            Value::Sequence(items.iter().map(|v| for_family(v, family)).collect())
        }
        Value::Mapping(m) => Value::Mapping(
            m.iter()
                .map(|(k, v)| (k.clone(), for_family(v, family)))
                .collect(),
        ),
        other => other.clone(),
    }
}

pub fn service(compact: &Value) -> Service {
    let ports: Vec<Value> = compact
        .get("ports")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .map(|p| {
            map(vec![
                ("name", get(p, "name")),
                ("port", get(p, "port")),
                ("protocol", get(p, "protocol")),
                ("nodePort", get(p, "nodePort")),
                ("targetPort", get(p, "targetPort")),
            ])
        })
        .collect();
    let ingress: Vec<Value> = compact
        .get("loadBalancerIngress")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .map(|i| match i {
            Value::String(ip) => map(vec![("ip", Value::from(ip.as_str()))]),
            other => map(vec![
                ("ip", get(other, "ip")),
                ("ipMode", get(other, "ipMode")),
            ]),
        })
        .collect();
    let cluster_ip = get(compact, "clusterIP");
    let spec = map(vec![
        ("type", get(compact, "type")),
        ("clusterIP", cluster_ip.clone()),
        (
            "clusterIPs",
            if cluster_ip.is_null() {
                Value::Null
            } else {
                Value::Sequence(vec![cluster_ip])
            },
        ),
        ("externalIPs", get(compact, "externalIPs")),
        ("ports", Value::Sequence(ports)),
        (
            "externalTrafficPolicy",
            get(compact, "externalTrafficPolicy"),
        ),
        (
            "internalTrafficPolicy",
            get(compact, "internalTrafficPolicy"),
        ),
        ("healthCheckNodePort", get(compact, "healthCheckNodePort")),
        (
            "loadBalancerSourceRanges",
            get(compact, "loadBalancerSourceRanges"),
        ),
        ("sessionAffinity", get(compact, "sessionAffinity")),
        (
            "sessionAffinityConfig",
            get(compact, "sessionAffinityConfig"),
        ),
        ("selector", get(compact, "selector")),
    ]);
    let status = if ingress.is_empty() {
        Value::Null
    } else {
        map(vec![(
            "loadBalancer",
            map(vec![("ingress", Value::Sequence(ingress))]),
        )])
    };
    let object = map(vec![
        ("apiVersion", "v1".into()),
        ("kind", "Service".into()),
        (
            "metadata",
            map(vec![
                ("namespace", get(compact, "ns")),
                ("name", get(compact, "name")),
            ]),
        ),
        ("spec", spec),
        ("status", status),
    ]);
    serde_yaml::from_value(object).unwrap_or_else(|e| panic!("service {compact:?}: {e}"))
}

pub fn slice(compact: &Value, index: usize) -> EndpointSlice {
    let svc = str_of(compact, "svc")
        .or_else(|| str_of(compact, "name").and_then(|n| n.rsplit_once('-').map(|(s, _)| s)))
        .expect("slice service");
    let name = str_of(compact, "name").map_or_else(|| format!("{svc}-{index}"), str::to_owned);
    let default_conditions = get(compact, "endpointConditions");
    let endpoints: Vec<Value> = compact
        .get("endpoints")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .map(|e| {
            let addresses = match e.get("ip") {
                Some(ip) => Value::Sequence(vec![ip.clone()]),
                None => get(e, "addresses"),
            };
            let conditions = match e.get("conditions") {
                Some(c) => c.clone(),
                None => default_conditions.clone(),
            };
            map(vec![
                ("addresses", addresses),
                ("nodeName", get(e, "nodeName")),
                ("conditions", conditions),
            ])
        })
        .collect();
    let ports: Vec<Value> = compact
        .get("ports")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .map(|p| {
            map(vec![
                ("name", get(p, "name")),
                ("port", get(p, "port")),
                ("protocol", get(p, "protocol")),
            ])
        })
        .collect();
    let object = map(vec![
        ("apiVersion", "discovery.k8s.io/v1".into()),
        ("kind", "EndpointSlice".into()),
        (
            "metadata",
            map(vec![
                ("namespace", get(compact, "ns")),
                ("name", Value::from(name)),
                (
                    "labels",
                    map(vec![("kubernetes.io/service-name", Value::from(svc))]),
                ),
            ]),
        ),
        ("addressType", get(compact, "addressType")),
        ("endpoints", Value::Sequence(endpoints)),
        ("ports", Value::Sequence(ports)),
    ]);
    serde_yaml::from_value(object).unwrap_or_else(|e| panic!("slice {compact:?}: {e}"))
}
