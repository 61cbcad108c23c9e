//! Stale conntrack cleanup against the real kernel: UDP entries DNATed by iptables inside a
//! private network namespace, then the agent's reconcile for a snapshot without that backend.
//! Needs root.
#![expect(
    clippy::expect_used,
    reason = "test helpers: a failed expectation is a failed test"
)]

use std::{collections::BTreeMap, net::SocketAddr, path::Path};

use proxy_kernel::conntrack::{ConntrackEntry, Ctnetlink, GoneFrontends, ServedStreams, reconcile};
use proxy_model::{
    desired::{IpFamily, Snapshot},
    objects::{ObjectKey, Objects},
};
use proxy_tests::{
    client::Client,
    client::Proto,
    echo::EchoServer,
    netns::{Netns, on_thread_in},
};

const VIP: &str = "10.96.0.10";

/// Runs `f` on a thread that has entered the network namespace at `path` (network namespaces
/// are per thread, so the rest of the test process is unaffected).
fn in_netns<T: Send + 'static>(path: &Path, f: impl FnOnce() -> T + Send + 'static) -> T {
    on_thread_in(path, f).expect("netns thread")
}

fn dump(path: &Path) -> Vec<ConntrackEntry> {
    in_netns(path, || {
        Ctnetlink::open()
            .expect("ctnetlink")
            .dump(IpFamily::V4)
            .expect("dump")
    })
}

fn to_vip(entries: &[ConntrackEntry]) -> Vec<String> {
    entries
        .iter()
        .filter(|e| e.original.dst.to_string() == VIP && e.original.dst_port == 53)
        .map(|e| e.reply.src.to_string())
        .collect()
}

/// The snapshot of a UDP Service on the VIP with the given serving endpoints.
fn snapshot(endpoints: &[&str]) -> proxy_model::desired::FamilySnapshot {
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: kube-system}}\n\
         spec: {{clusterIP: {VIP}, ports: [{{name: dns, port: 53, protocol: UDP}}]}}\n"
    );
    let slice = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: dns-1, namespace: kube-system, labels: {{kubernetes.io/service-name: dns}}}}\n\
         addressType: IPv4\nports: [{{name: dns, port: 5353, protocol: UDP}}]\nendpoints: [{}]\n",
        endpoints
            .iter()
            .map(|ip| format!("{{addresses: [{ip}]}}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let service: k8s_openapi::api::core::v1::Service =
        serde_yaml::from_str(&yaml).expect("service");
    let slice: k8s_openapi::api::discovery::v1::EndpointSlice =
        serde_yaml::from_str(&slice).expect("slice");
    yaml.clear();
    let key = |name: &str| ObjectKey {
        namespace: "kube-system".into(),
        name: name.into(),
    };
    let objects = Objects::new(
        BTreeMap::from([(key("dns"), service.into())]),
        BTreeMap::from([(key("dns-1"), slice.into())]),
        None,
    );
    Snapshot::compute(&objects, "node").v4
}

/// One UDP request to the VIP from inside the namespace, DNATed to `backend`.
fn request_via(ns: &Netns, backend: &str) {
    ns.exec("iptables", &["-t", "nat", "-F", "OUTPUT"])
        .expect("flush");
    ns.exec(
        "iptables",
        &[
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "udp",
            "-d",
            VIP,
            "--dport",
            "53",
            "-j",
            "DNAT",
            "--to-destination",
            &format!("{backend}:5353"),
        ],
    )
    .expect("dnat");
    let target: SocketAddr = format!("{VIP}:53").parse().expect("addr");
    let attempts = Client::new(ns.path())
        .proto(Proto::Udp)
        .run(target, 1)
        .expect("client");
    assert!(
        attempts[0].backend().is_some(),
        "no answer through the DNAT: {attempts:?}"
    );
}

#[test]
fn stale_udp_entries_are_deleted_and_live_ones_kept() {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let ns = Netns::new("ct").expect("netns");
    // The VIP needs a route for connect(); nat OUTPUT then DNATs it to a backend.
    for ip in ["10.96.0.10/32", "10.244.1.2/32", "10.244.1.3/32"] {
        ns.ip(&["addr", "add", ip, "dev", "lo"]).expect("addr");
    }
    let _old = EchoServer::start(&ns.path(), "old", "10.244.1.2:5353".parse().expect("addr"))
        .expect("echo");
    let _new = EchoServer::start(&ns.path(), "new", "10.244.1.3:5353".parse().expect("addr"))
        .expect("echo");

    // A flow DNATed to 10.244.1.2, then the endpoint moves to 10.244.1.3.
    request_via(&ns, "10.244.1.2");
    assert_eq!(to_vip(&dump(&ns.path())), ["10.244.1.2"]);
    let moved = snapshot(&["10.244.1.3"]);
    let report = in_netns(&ns.path(), move || {
        reconcile(
            IpFamily::V4,
            &moved,
            &GoneFrontends::default(),
            &ServedStreams::default(),
        )
        .expect("reconcile")
    });
    eprintln!("endpoint moved: {report:?}");
    assert_eq!(report.deleted, 1);
    assert!(
        to_vip(&dump(&ns.path())).is_empty(),
        "the stale entry is gone"
    );

    // A flow to a live endpoint survives.
    request_via(&ns, "10.244.1.3");
    let live = snapshot(&["10.244.1.3"]);
    let report = in_netns(&ns.path(), move || {
        reconcile(
            IpFamily::V4,
            &live,
            &GoneFrontends::default(),
            &ServedStreams::default(),
        )
        .expect("reconcile")
    });
    eprintln!("live endpoint: {report:?}");
    assert_eq!(report.deleted, 0);
    assert_eq!(to_vip(&dump(&ns.path())), ["10.244.1.3"]);

    // N → 0: the last endpoint goes away; its entry must not survive (upstream regression).
    let none = snapshot(&[]);
    let report = in_netns(&ns.path(), move || {
        reconcile(
            IpFamily::V4,
            &none,
            &GoneFrontends::default(),
            &ServedStreams::default(),
        )
        .expect("reconcile")
    });
    eprintln!("last endpoint removed: {report:?}");
    assert_eq!(report.deleted, 1);
    assert!(to_vip(&dump(&ns.path())).is_empty());
}
