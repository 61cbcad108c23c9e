//! Feature gates that change what the proxy does. Upstream reads them from a process-wide
//! registry (`utilfeature.DefaultFeatureGate`), set once from `featureGates` /
//! `--feature-gates` before the proxier starts; this is the same, for the gates whose
//! behaviour we implement. Every other gate name is accepted and listed in a warning.

use std::{collections::BTreeMap, sync::OnceLock};

/// pkg/features: PreferSameNode traffic distribution (node hints in EndpointSlices). Beta
/// and on by default since 1.34 — the topology code honours node hints only when it is on
/// (pkg/proxy/topology.go `topologyModeFromHints`).
pub const PREFER_SAME_TRAFFIC_DISTRIBUTION: &str = "PreferSameTrafficDistribution";

/// The gates with an effect here, with upstream's default.
const DEFAULTS: &[(&str, bool)] = &[(PREFER_SAME_TRAFFIC_DISTRIBUTION, true)];

/// Names of the gates with an effect here.
pub const APPLIED: &[&str] = &[PREFER_SAME_TRAFFIC_DISTRIBUTION];

static GATES: OnceLock<BTreeMap<String, bool>> = OnceLock::new();

/// Sets the gates from the configuration; only the first call counts (as upstream, the gates
/// are fixed for the life of the process).
pub fn set(gates: &BTreeMap<String, bool>) {
    let _ = GATES.set(gates.clone());
}

/// Whether `name` is on: the configured value, else upstream's default.
pub fn enabled(name: &str) -> bool {
    resolve(GATES.get(), name)
}

fn resolve(gates: Option<&BTreeMap<String, bool>>, name: &str) -> bool {
    if let Some(&on) = gates.and_then(|g| g.get(name)) {
        return on;
    }
    DEFAULTS
        .iter()
        .find(|(gate, _)| *gate == name)
        .is_some_and(|(_, on)| *on)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_value_wins_over_the_default() {
        let mut gates = BTreeMap::new();
        assert!(resolve(None, PREFER_SAME_TRAFFIC_DISTRIBUTION));
        gates.insert(PREFER_SAME_TRAFFIC_DISTRIBUTION.to_owned(), false);
        assert!(!resolve(Some(&gates), PREFER_SAME_TRAFFIC_DISTRIBUTION));
        assert!(!resolve(Some(&gates), "SomeUnknownGate"));
    }
}
