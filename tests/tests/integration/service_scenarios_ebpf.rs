//! The shared service scenario table (tests/src/service_scenarios.rs) with `--proxy-mode ebpf`:
//! socket-level LB for the node's own clients and the tc programs for traffic from the external
//! client namespace. Needs root.

proxy_tests::service_scenario_tests!("ebpf");

/// Run in the default path of each mode only: the gate changes what is programmed, not how a
/// programmed frontend is served.
mod external_ips_gate {
    proxy_tests::service_scenario_tests!("ebpf": external_ips_are_not_served_with_their_gate_off);
}

/// In the default path of each mode: the deletion's cleanup is the mode's own.
mod deleted_udp_services {
    proxy_tests::service_scenario_tests!("ebpf":
        a_udp_sender_leaves_a_deleted_service_and_follows_its_reused_address);
}

/// The scenarios whose translated packets the fast path (`--tc-fast-path`) handles differently
/// from the netfilter path.
mod fast_path {
    proxy_tests::service_scenario_tests!("ebpf-fast-path": host_network_backends);
}

/// The whole table again with XDP carrying the flows it takes (`--tc-fast-path`, XDP on the
/// external links, wire-like checksums from the client and the second node; see
/// `service_scenarios::EBPF_XDP`).
mod xdp {
    proxy_tests::service_scenario_tests!("ebpf-xdp");
}

/// The contested externalIP keeps its owner, the older Service, across switches between the
/// iptables and eBPF modes on one node and back (see the scenario).
#[test]
fn contested_external_ip_stays_with_the_older_service_across_mode_switches() -> anyhow::Result<()> {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    Ok(
        proxy_tests::service_scenarios::contested_external_ip_stays_with_the_older_service_across_mode_switches()?,
    )
}
