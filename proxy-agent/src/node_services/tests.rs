use super::*;

#[test]
fn print_exposition() {
    let m = Metrics::new(ProxyMode::Iptables);
    m.sync_succeeded(IpFamily::V4, Duration::from_millis(3), SystemTime::now());
    m.healthz_answered(axum::http::StatusCode::OK);
    m.iptables()
        .unwrap()
        .rules(IpFamily::V4, metrics::IptablesTable::Nat, 3, 2);
    println!("{}", m.encode());
}
