//! Feature gates that change what the proxy does. Upstream reads them from a process-wide
//! registry (`utilfeature.DefaultFeatureGate`), set once from `featureGates` /
//! `--feature-gates` before the proxier starts; this is the same, for the gates whose
//! behaviour we implement. Every other gate name is accepted and listed in a warning.

use std::{collections::BTreeMap, sync::OnceLock};

/// pkg/features: PreferSameNode traffic distribution (node hints in EndpointSlices). Beta
/// and on by default since 1.34 — the topology code honours node hints only when it is on
/// (pkg/proxy/topology.go `topologyModeFromHints`).
pub const PREFER_SAME_TRAFFIC_DISTRIBUTION: &str = "PreferSameTrafficDistribution";

/// pkg/features: whether kube-proxy still serves `spec.externalIPs`, deprecated with the
/// field in 1.36 and on by default until upstream turns it off (planned for 1.40, KEP-5707).
/// Off, a Service's external IPs are read as if it listed none.
pub const ALLOW_SERVICE_EXTERNAL_IPS: &str = "AllowServiceExternalIPs";

/// pkg/features (1.37): IPVS mode behind a gate, deprecated. There is no IPVS mode here; the
/// gate is accepted for its deprecation warning.
pub const KUBE_PROXY_IPVS: &str = "KubeProxyIPVS";

/// component-base (KEP-5808): every histogram also keeps Prometheus native buckets, which
/// the protobuf exposition carries. Alpha and off in 1.36, beta and on by default in 1.37.
pub const NATIVE_HISTOGRAMS: &str = "NativeHistograms";

/// The gates with an effect here, with upstream's default.
const DEFAULTS: &[(&str, bool)] = &[
    (PREFER_SAME_TRAFFIC_DISTRIBUTION, true),
    (ALLOW_SERVICE_EXTERNAL_IPS, true),
    (NATIVE_HISTOGRAMS, true),
];

/// Names of the gates with an effect here.
pub const APPLIED: &[&str] = &[
    PREFER_SAME_TRAFFIC_DISTRIBUTION,
    ALLOW_SERVICE_EXTERNAL_IPS,
    NATIVE_HISTOGRAMS,
];

/// Gates at upstream's `Deprecated` stage: setting one is logged as component-base's
/// feature gate logs it.
pub const DEPRECATED: &[&str] = &[ALLOW_SERVICE_EXTERNAL_IPS, KUBE_PROXY_IPVS];

/// component-base's warning for a deprecated gate that is set (either way).
pub fn deprecation_warning(name: &str, on: bool) -> Option<String> {
    DEPRECATED.contains(&name).then(|| {
        format!(
            "Setting deprecated feature gate {name}={on}. It will be removed in a future release."
        )
    })
}

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

    /// Upstream's default until its planned switch: external IPs are served unless the gate
    /// is turned off.
    #[test]
    fn external_ips_are_served_unless_the_gate_is_off() {
        assert!(resolve(None, ALLOW_SERVICE_EXTERNAL_IPS));
        let gates = BTreeMap::from([(ALLOW_SERVICE_EXTERNAL_IPS.to_owned(), false)]);
        assert!(!resolve(Some(&gates), ALLOW_SERVICE_EXTERNAL_IPS));
    }

    /// kube-proxy 1.37's default: native histograms unless the gate is turned off.
    #[test]
    fn native_histograms_are_kept_unless_the_gate_is_off() {
        assert!(resolve(None, NATIVE_HISTOGRAMS));
        assert!(APPLIED.contains(&NATIVE_HISTOGRAMS));
        let gates = BTreeMap::from([(NATIVE_HISTOGRAMS.to_owned(), false)]);
        assert!(!resolve(Some(&gates), NATIVE_HISTOGRAMS));
    }

    #[test]
    fn setting_a_deprecated_gate_is_warned_as_component_base_does() {
        assert_eq!(
            deprecation_warning(ALLOW_SERVICE_EXTERNAL_IPS, false).as_deref(),
            Some(
                "Setting deprecated feature gate AllowServiceExternalIPs=false. It will be \
                 removed in a future release."
            )
        );
        assert!(deprecation_warning(KUBE_PROXY_IPVS, true).is_some());
        assert_eq!(
            deprecation_warning(PREFER_SAME_TRAFFIC_DISTRIBUTION, true),
            None
        );
    }
}
