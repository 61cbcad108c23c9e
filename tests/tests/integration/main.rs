//! Every integration test of the project, one module per concern, in one binary: one link
//! instead of forty, and one pool of test threads across all of them. Most need root
//! (network namespaces, cgroups, bpffs); `cargo xtask test` runs them.

mod bad_input;
mod capabilities;
mod client_port_reuse;
mod clusterip_iptables;
mod clusterip_socket_complete;
mod clusterip_socket_lb;
mod conntrack_cleanup;
mod conntrack_pressure;
mod drift;
mod drift_reading;
mod explain;
mod explain_agreement;
mod external_interfaces;
mod external_sctp;
mod external_tc;
mod external_xdp;
mod floods;
mod generation_race;
mod icmp_errors;
mod inspect;
mod ip_fragments;
mod iptables_cleanup;
mod iptables_large_cluster;
mod kubernetes_source;
mod maglev;
mod map_memory;
mod mesh_host_namespace_only;
mod metrics_exposition;
mod migration;
mod node_endpoints;
mod node_settings;
mod reachability_matrix;
mod reliability;
mod reply_interface;
mod reused_pod_addresses;
mod rig;
mod service_scenarios_ebpf;
mod service_scenarios_ebpf_legacy_tc;
mod service_scenarios_iptables;
mod takeover;
mod takeover_scenario;
mod tc_fuzz;
mod tc_test_run;
mod upgrade;
