//! The iptables dataplane: kube-proxy's iptables proxier, rule for rule.
//!
//! - `chains.rs`: chain names and hashes.
//! - `config.rs`: [`IptablesConfig`] (kube-proxy defaults) and the per-family generator context.
//! - `localdetect.rs`: `--detect-local-mode`.
//! - `rules.rs`: the generator, a pure function snapshot → `iptables-restore` input.

pub mod chains;
pub mod config;
pub mod jumps;
pub mod localdetect;
pub mod rules;

pub use config::{FamilyRules, HostFeatures, IptablesConfig, NodePortAddresses};
pub use localdetect::{DetectLocalMode, LocalDetector};
pub use rules::{Ruleset, SyncInput, generate};
