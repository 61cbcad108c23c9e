//! The shared service scenario table (tests/src/service_scenarios.rs) with `--proxy-mode ebpf`:
//! socket-level LB for the node's own clients and the tc programs for traffic from the external
//! client namespace. Needs root.

proxy_tests::service_scenario_tests!("ebpf");
