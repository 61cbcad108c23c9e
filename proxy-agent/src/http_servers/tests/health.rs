//! `/healthz` and `/livez` (reference §12.1).

use std::time::Duration;

use super::*;
use crate::http_servers::health::{json_time, node_eligible};
use proxy_model::{desired::IpFamily, objects::NodeInfo};

/// Every answer of the health server carries exactly these headers (plus Date and length).
fn assert_json_headers(reply: &Reply) {
    assert_eq!(reply.header("Content-Type"), Some("application/json"));
    assert_eq!(reply.header("X-Content-Type-Options"), Some("nosniff"));
    assert_eq!(
        reply.header("Content-Length"),
        Some(reply.body.len().to_string().as_str())
    );
    assert!(reply.header("Date").is_some());
}

const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";

/// Parses a body as JSON (as upstream's tests do) and checks the time fields have Go's
/// `time.Time` JSON format (RFC 3339, UTC, fractional digits as needed).
fn parse(body: &str) -> serde_json::Value {
    let value: serde_json::Value = serde_json::from_str(body).expect("JSON body");
    for field in ["lastUpdated", "currentTime"] {
        let text = value[field].as_str().expect(field);
        assert!(
            text == GO_ZERO_TIME || is_go_json_time(text),
            "{field}: {text}"
        );
    }
    value
}

/// `YYYY-MM-DDThh:mm:ss[.fraction]Z`, fraction without trailing zeros.
fn is_go_json_time(text: &str) -> bool {
    let Some(wall) = text.strip_suffix('Z') else {
        return false;
    };
    let (date, time) = wall.split_once('T').unwrap_or_default();
    let (hms, fraction) = time.split_once('.').unwrap_or((time, "1"));
    date.len() == 10
        && date.as_bytes()[4] == b'-'
        && hms.len() == 8
        && !fraction.ends_with('0')
        && fraction.len() <= 9
        && text.parse::<jiff::Timestamp>().is_ok()
}

#[tokio::test]
async fn healthy_while_starting_up_and_bodies_byte_for_byte() {
    let (services, clock) = start(ProxyMode::Ebpf);
    let addr = services.healthz_addr().unwrap();
    let now = json_time(Some(clock.now()));

    let reply = get(addr, "/healthz").await;
    assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
    assert_json_headers(&reply);
    // Healthy: lastUpdated is reported as the current time; no family synced yet, so no
    // status (omitempty).
    assert_eq!(
        reply.body,
        format!(
            r#"{{"lastUpdated":"{now}","currentTime":"{now}","nodeEligible":true,"healthy":true}}"#
        )
    );
    assert_eq!(parse(&reply.body)["nodeEligible"], true);

    let reply = get(addr, "/livez").await;
    assert_eq!(reply.status(), 200);
    assert_json_headers(&reply);
    assert_eq!(
        reply.body,
        format!(r#"{{"lastUpdated":"{now}","currentTime":"{now}","healthy":true}}"#)
    );
    parse(&reply.body);
}

#[tokio::test]
async fn a_queued_update_older_than_the_timeout_is_unhealthy() {
    let (services, clock) = start(ProxyMode::Ebpf);
    let addr = services.healthz_addr().unwrap();
    let snapshot = Snapshot::default();
    services.loop_started(IpFamily::V4);
    let updated = clock.now();
    clock.advance(Duration::from_secs(5));
    services.queued(IpFamily::V4);
    clock.advance(TIMEOUT - Duration::from_millis(1));
    assert_eq!(get(addr, "/healthz").await.status(), 200, "not late yet");

    // A second change does not move the oldest pending one.
    services.queued(IpFamily::V4);
    clock.advance(Duration::from_millis(1));
    let now = json_time(Some(clock.now()));
    let updated = json_time(Some(updated));
    let reply = get(addr, "/healthz").await;
    assert_eq!(reply.status_line, "HTTP/1.1 503 Service Unavailable");
    assert_json_headers(&reply);
    // Unhealthy: lastUpdated is the latest sync of any family; the status names the late one.
    assert_eq!(
        reply.body,
        format!(
            r#"{{"lastUpdated":"{updated}","currentTime":"{now}","nodeEligible":true,"healthy":false,"status":{{"IPv4":{{"lastUpdated":"{updated}","healthy":false}}}}}}"#
        )
    );
    let value = parse(&reply.body);
    assert_eq!(value["status"]["IPv4"]["healthy"], false);
    let reply = get(addr, "/livez").await;
    assert_eq!(reply.status(), 503);
    assert_eq!(
        reply.body,
        format!(
            r#"{{"lastUpdated":"{updated}","currentTime":"{now}","healthy":false,"status":{{"IPv4":{{"lastUpdated":"{updated}","healthy":false}}}}}}"#
        )
    );

    // Health check node ports see the same health.
    assert!(!services.health().is_healthy());

    services.synced(&[IpFamily::V4], &snapshot, None, Duration::from_millis(3));
    assert_eq!(get(addr, "/healthz").await.status(), 200);
    assert_eq!(get(addr, "/livez").await.status(), 200);

    let text = services.metrics().encode();
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 2\n"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"200\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"503\"} 1\n"),
        "{text}"
    );
}

#[tokio::test]
async fn families_that_never_synced_do_not_count() {
    let (services, clock) = start(ProxyMode::Ebpf);
    services.queued(IpFamily::V6);
    clock.advance(TIMEOUT * 2);
    assert!(services.health().is_healthy());
    // Once it has synced, a late update counts.
    services.loop_started(IpFamily::V6);
    services.queued(IpFamily::V6);
    clock.advance(TIMEOUT);
    assert!(!services.health().is_healthy());
}

const DELETING: &str = r#"
kind: Node
metadata: {name: test-node, deletionTimestamp: "2025-01-02T03:04:05Z"}
"#;

const AUTOSCALER_TAINT: &str = r#"
kind: Node
metadata: {name: test-node}
spec:
  taints:
  - {key: ToBeDeletedByClusterAutoscaler, value: "1735787045", effect: NoSchedule}
"#;

const OTHER_TAINT: &str = r#"
kind: Node
metadata: {name: test-node}
spec:
  taints:
  - {key: node.kubernetes.io/unschedulable, effect: NoSchedule}
"#;

fn node(yaml: &str) -> NodeInfo {
    objects(yaml).node.expect("node")
}

#[tokio::test]
async fn a_node_being_deleted_fails_healthz_but_not_livez() {
    let (services, clock) = start(ProxyMode::Ebpf);
    let addr = services.healthz_addr().unwrap();
    for yaml in [DELETING, AUTOSCALER_TAINT] {
        services.node_changed(Some(&node(yaml)));
        let now = json_time(Some(clock.now()));
        let reply = get(addr, "/healthz").await;
        assert_eq!(reply.status(), 503);
        // Not healthy, so lastUpdated is not replaced: no family synced yet, Go's zero time.
        assert_eq!(
            reply.body,
            format!(
                r#"{{"lastUpdated":"{GO_ZERO_TIME}","currentTime":"{now}","nodeEligible":false,"healthy":true}}"#
            )
        );
        assert_eq!(parse(&reply.body)["nodeEligible"], false);
        let reply = get(addr, "/livez").await;
        assert_eq!(reply.status(), 200);
        assert_eq!(
            reply.body,
            format!(r#"{{"lastUpdated":"{now}","currentTime":"{now}","healthy":true}}"#)
        );
        // Health check node ports ignore node eligibility.
        assert!(services.health().is_healthy());
    }
    services.node_changed(Some(&node(OTHER_TAINT)));
    assert_eq!(get(addr, "/healthz").await.status(), 200);
    // An unknown node keeps what is known.
    services.node_changed(Some(&node(DELETING)));
    services.node_changed(None);
    assert_eq!(get(addr, "/healthz").await.status(), 503);
}

#[test]
fn eligibility_rules() {
    assert!(!node_eligible(&node(DELETING)));
    assert!(!node_eligible(&node(AUTOSCALER_TAINT)));
    assert!(node_eligible(&node(OTHER_TAINT)));
    assert!(node_eligible(&NodeInfo::default()));
}

#[tokio::test]
async fn other_paths_are_go_404s_and_any_method_is_served() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let addr = services.healthz_addr().unwrap();
    for path in ["/", "/metrics", "/healthz/extra", "/livezz"] {
        let reply = get(addr, path).await;
        assert_eq!(reply.status_line, "HTTP/1.1 404 Not Found", "{path}");
        assert_eq!(reply.body, "404 page not found\n");
        assert_eq!(
            reply.header("Content-Type"),
            Some("text/plain; charset=utf-8")
        );
        assert_eq!(reply.header("X-Content-Type-Options"), Some("nosniff"));
    }
    for method in ["POST", "HEAD", "DELETE"] {
        let reply = request(addr, method, "/healthz").await;
        assert_eq!(reply.status(), 200, "{method}");
    }
}

/// proxy_health.go NodeEligible: `node == nil` → not eligible. With the API source a deleted
/// (or never seen) Node fails /healthz; /livez does not look at the node.
#[tokio::test]
async fn a_missing_node_fails_healthz_when_a_node_is_required() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let addr = services.healthz_addr().unwrap();
    services.health().require_node();
    services.node_changed(Some(&node(OTHER_TAINT)));
    assert_eq!(get(addr, "/healthz").await.status(), 200);
    services.node_changed(None);
    let reply = get(addr, "/healthz").await;
    assert_eq!(reply.status(), 503);
    assert_eq!(parse(&reply.body)["nodeEligible"], false);
    assert_eq!(get(addr, "/livez").await.status(), 200);
    // The Node back: eligible again.
    services.node_changed(Some(&node(OTHER_TAINT)));
    assert_eq!(get(addr, "/healthz").await.status(), 200);
}

#[test]
fn json_time_is_gos() {
    use proxy_model::time_format::Stamp;
    let at = |nanos: u64| Stamp {
        wall: std::time::UNIX_EPOCH + Duration::from_nanos(1_700_000_000_000_000_000 + nanos),
        mono: std::time::Instant::now(),
    };
    assert_eq!(json_time(Some(at(0))), "2023-11-14T22:13:20Z");
    assert_eq!(json_time(Some(at(120_000_000))), "2023-11-14T22:13:20.12Z");
    assert_eq!(json_time(Some(at(1))), "2023-11-14T22:13:20.000000001Z");
    assert_eq!(json_time(None), GO_ZERO_TIME);
}

/// The datapath's verdict: after upstream's fields in `/healthz` only, 503 only when it is
/// unhealthy (upstream's `healthy` unchanged), and never in `/livez`.
#[tokio::test]
async fn an_unhealthy_datapath_turns_healthz_503_but_not_livez() {
    use crate::http_servers::datapath::{Attachments, DatapathHealth, Hook};
    let (services, clock) = start(ProxyMode::Ebpf);
    let addr = services.healthz_addr().unwrap();
    let now = json_time(Some(clock.now()));
    services.health().set_datapath(DatapathHealth::new("ebpf"));
    let reply = get(addr, "/healthz").await;
    assert_eq!(reply.status(), 200);
    assert_eq!(
        reply.body,
        format!(
            r#"{{"lastUpdated":"{now}","currentTime":"{now}","nodeEligible":true,"healthy":true,"datapath":{{"mode":"ebpf","healthy":true,"reasons":[],"lastDriftCheck":null}}}}"#
        )
    );

    let mut broken = DatapathHealth::new("ebpf");
    broken.attachments = Some(Attachments {
        time: now.clone(),
        expected: 1,
        attached: 0,
        hooks: vec![Hook {
            interface: "eth0".to_owned(),
            hook: "ingress",
            program: "kpr_tc_external",
            attached: false,
            program_id: None,
            error: Some("pinning the link failed".to_owned()),
        }],
        reattached: Vec::new(),
    });
    broken.evaluate();
    services.health().set_datapath(broken);
    let reply = get(addr, "/healthz").await;
    assert_eq!(reply.status_line, "HTTP/1.1 503 Service Unavailable");
    let value = parse(&reply.body);
    // Upstream's fields keep their meaning: the syncs are fine.
    assert_eq!(value["healthy"], true);
    assert_eq!(value["nodeEligible"], true);
    assert_eq!(value["datapath"]["healthy"], false);
    assert!(
        value["datapath"]["reasons"][0]
            .as_str()
            .unwrap()
            .contains("could not be attached again: pinning the link failed"),
        "{value}"
    );
    let reply = get(addr, "/livez").await;
    assert_eq!(reply.status(), 200);
    assert!(!reply.body.contains("datapath"), "{}", reply.body);
}
