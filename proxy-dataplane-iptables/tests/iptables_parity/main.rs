//! Parity of the iptables rule generator with kube-proxy's iptables proxier, checked without a
//! kernel against upstream's test vectors in `vectors/` (copied unchanged from kube-proxy's
//! `pkg/proxy/iptables/proxier_test.go`; `vectors/PROVENANCE.md` gives the commit).
//!
//! - `fixtures.rs`: the parity files' compact objects → Services/EndpointSlices → snapshot.
//! - `normalize.rs`: upstream's `sortIPTablesRules`, the form of the scenario texts.
//! - `tracer.rs`: upstream's packet tracer over generated rules.
//! - `vectors.rs`: the tests, one per parity file (`sync-repeated.yaml`: partial syncs step by step).

// `cfg(test)` so the helpers count as test code (they may unwrap: a failed unwrap fails a test).
#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod normalize;
#[cfg(test)]
mod tracer;
#[cfg(test)]
mod vectors;
