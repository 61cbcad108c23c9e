//! The iptables dataplane: kube-proxy's iptables proxier, rule for rule.
//!
//! - `chains.rs`: chain names and hashes; `jumps.rs`: jumps from the built-in chains.
//! - `config.rs`: [`IptablesConfig`] (kube-proxy defaults) and the per-family generator context.
//! - `localdetect.rs`: `--detect-local-mode`.
//! - `rules.rs`: the generator, a pure function snapshot → `iptables-restore` input.
//! - `proxy_kernel::iptables` detects the backend and runs the tools; `canary.rs`: flush detection; `sync.rs`: [`IptablesDataplane`] (full/partial syncs);
//!   `cleanup.rs`: removing what this mode created; `kube_proxy_modes.rs`: what kube-proxy's
//!   nftables and IPVS modes leave behind (`ipvs.rs`: virtual services over generic netlink).
//! - `traffic.rs`: per-Service traffic from the counters of each Service's rules
//!   (`iptables-save -c`), read by [`IptablesDataplane::read_service_traffic`].

pub mod canary;
pub mod chains;
mod cleanup;
pub mod config;
pub mod ipvs;
pub mod jumps;
pub mod kube_proxy_modes;
pub mod localdetect;
pub mod rules;
pub mod rules_drift;
mod sync;
pub mod tracer;
pub mod traffic;

pub use config::{FamilyRules, HostFeatures, IptablesConfig, NodePortAddresses};
pub use localdetect::{DetectLocalMode, LocalDetector};
pub use rules::{Ruleset, SyncInput, generate};
pub use sync::{
    CanaryReader, CanaryReading, ConntrackCleanup, DriftInput, FamilyDrift, IptablesDataplane,
    IptablesError, SettledDrift, SyncReport, TrafficInput, TrafficRead, cleanup, settle,
};
