//! The external-traffic part of the shared service scenario table (tests/src/service_scenarios.rs)
//! with `--proxy-mode ebpf --bpf-disable-feature tcx`: the tc programs attach as legacy clsact
//! filters, as on kernels older than 6.6. Needs root.

proxy_tests::service_scenario_tests!("ebpf-legacy-tc":
    node_port_cluster_policy,
    node_port_local_policy_preserves_the_client,
    node_port_local_policy_without_local_endpoints_drops,
    node_port_without_endpoints_is_refused,
    external_ip_and_load_balancer_ip_reach_pods,
    source_ranges_admit_only_listed_clients,
    node_port_to_a_pod_on_another_node,
    node_port_client_ip_affinity,
);
