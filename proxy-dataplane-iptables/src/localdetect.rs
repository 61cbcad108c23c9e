//! `--detect-local-mode`: how rules tell pod traffic from other traffic
//! (kube-proxy's `pkg/proxy/util/localdetector.go`).

use proxy_model::desired::IpFamily;

pub use proxy_kernel::node::DetectLocalMode;

/// The detector of one family: the rule arguments that match local (pod) traffic and their
/// negation, or nothing when the mode has no input for this family (kube-proxy's no-op
/// detector, `IsImplemented() == false`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LocalDetector {
    if_local: Vec<String>,
    if_not_local: Vec<String>,
}

impl LocalDetector {
    pub fn for_family(mode: &DetectLocalMode, family: IpFamily) -> Self {
        match mode {
            DetectLocalMode::ClusterCidr(cidrs) | DetectLocalMode::NodeCidr(cidrs) => {
                // kube-proxy uses the first CIDR of the family (one per family is allowed).
                match cidrs.iter().find(|c| IpFamily::of(&c.addr()) == family) {
                    Some(cidr) => Self::new("-s", &cidr.trunc().to_string()),
                    None => Self::default(),
                }
            }
            DetectLocalMode::BridgeInterface(name) if !name.is_empty() => Self::new("-i", name),
            DetectLocalMode::InterfaceNamePrefix(prefix) if !prefix.is_empty() => {
                Self::new("-i", &format!("{prefix}+"))
            }
            DetectLocalMode::BridgeInterface(_) | DetectLocalMode::InterfaceNamePrefix(_) => {
                Self::default()
            }
        }
    }

    fn new(flag: &str, value: &str) -> Self {
        Self {
            if_local: vec![flag.to_owned(), value.to_owned()],
            if_not_local: vec!["!".to_owned(), flag.to_owned(), value.to_owned()],
        }
    }

    pub fn is_implemented(&self) -> bool {
        !self.if_local.is_empty()
    }

    pub fn if_local(&self) -> &[String] {
        &self.if_local
    }

    pub fn if_not_local(&self) -> &[String] {
        &self.if_not_local
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_produce_kube_proxy_arguments() {
        let cidrs = vec![
            "10.0.0.0/8".parse().unwrap(),
            "fd00:10::/64".parse().unwrap(),
        ];
        let v4 =
            LocalDetector::for_family(&DetectLocalMode::ClusterCidr(cidrs.clone()), IpFamily::V4);
        assert_eq!(v4.if_local(), ["-s", "10.0.0.0/8"]);
        assert_eq!(v4.if_not_local(), ["!", "-s", "10.0.0.0/8"]);
        let v6 = LocalDetector::for_family(&DetectLocalMode::NodeCidr(cidrs), IpFamily::V6);
        assert_eq!(v6.if_local(), ["-s", "fd00:10::/64"]);

        let bridge = LocalDetector::for_family(
            &DetectLocalMode::BridgeInterface("cbr0".into()),
            IpFamily::V4,
        );
        assert_eq!(bridge.if_not_local(), ["!", "-i", "cbr0"]);
        let prefix = LocalDetector::for_family(
            &DetectLocalMode::InterfaceNamePrefix("veth".into()),
            IpFamily::V6,
        );
        assert_eq!(prefix.if_local(), ["-i", "veth+"]);
    }

    #[test]
    fn missing_family_cidr_is_a_no_op_detector() {
        let v4_only = DetectLocalMode::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]);
        assert!(!LocalDetector::for_family(&v4_only, IpFamily::V6).is_implemented());
        assert!(
            !LocalDetector::for_family(&DetectLocalMode::default(), IpFamily::V4).is_implemented()
        );
    }
}
