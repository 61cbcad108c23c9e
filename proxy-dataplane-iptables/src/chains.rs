//! kube-proxy's chain names: the fixed top-level chains and the hashed per-service-port chains
//! (`proxier.go` const block, `portProtoHash`, `servicePortEndpointChainName`).

use sha2::{Digest as _, Sha256};

use proxy_model::desired::{Endpoint, ServicePort};

pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
pub const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
pub const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
pub const KUBE_PROXY_CANARY: &str = "KUBE-PROXY-CANARY";
/// kubelet's chain; kube-proxy writes an identical copy of its localnet rule.
pub const KUBE_FIREWALL: &str = "KUBE-FIREWALL";

/// Prefixes of the per-service-port chains; a chain with one of them is ours to delete when no
/// service uses it any more (`isServiceChainName`).
const SERVICE_CHAIN_PREFIXES: [&str; 5] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-EXT-",
];

pub fn is_service_chain_name(chain: &str) -> bool {
    SERVICE_CHAIN_PREFIXES
        .iter()
        .any(|prefix| chain.starts_with(prefix))
}

/// The chains of one service port; they share one hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceChains {
    /// `KUBE-SVC-…`: endpoints for Cluster traffic policy.
    pub cluster: String,
    /// `KUBE-SVL-…`: endpoints for Local traffic policy.
    pub local: String,
    /// `KUBE-EXT-…`: entry for external destinations (NodePort, externalIPs, LB IPs).
    pub external: String,
    /// `KUBE-FW-…`: loadBalancerSourceRanges filter.
    pub firewall: String,
}

impl ServiceChains {
    pub fn of(port: &ServicePort) -> Self {
        let hash = port_proto_hash(&port.name.to_string(), port.protocol.as_lower());
        Self {
            cluster: format!("KUBE-SVC-{hash}"),
            local: format!("KUBE-SVL-{hash}"),
            external: format!("KUBE-EXT-{hash}"),
            firewall: format!("KUBE-FW-{hash}"),
        }
    }
}

/// `KUBE-SEP-…` of one endpoint of a service port; also the `xt_recent` list name for affinity.
pub fn endpoint_chain(port: &ServicePort, endpoint: &Endpoint) -> String {
    let input = format!(
        "{}{}{}",
        port.name,
        port.name.protocol.as_lower(),
        endpoint.to_endpoint_string()
    );
    format!("KUBE-SEP-{}", hash16(input.as_bytes()))
}

/// `portProtoHash`: the first 16 characters of base32(sha256(name + protocol)).
pub fn port_proto_hash(service_port_name: &str, protocol_lower: &str) -> String {
    hash16(format!("{service_port_name}{protocol_lower}").as_bytes())
}

fn hash16(input: &[u8]) -> String {
    let digest = Sha256::digest(input);
    let mut encoded = base32_std(&digest);
    encoded.truncate(16);
    encoded
}

/// RFC 4648 base32 (standard alphabet), without padding: only a prefix of the 56 characters is
/// ever used, and padding never appears before character 52 for a 32-byte input.
fn base32_std(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(data.len().div_ceil(5) * 8);
    let mut buffer: u32 = 0;
    let mut bits = 0u32;
    for &byte in data {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(ALPHABET[((buffer >> bits) & 31) as usize]));
        }
        // Only the low `bits` bits are still needed.
        buffer &= (1 << bits) - 1;
    }
    if bits > 0 {
        out.push(char::from(ALPHABET[((buffer << (5 - bits)) & 31) as usize]));
    }
    out
}

/// A chain declaration line of the restore format; in `--noflush` mode it also flushes the chain.
pub fn chain_line(chain: &str) -> String {
    format!(":{chain} - [0:0]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base32_matches_rfc4648_vectors() {
        assert_eq!(base32_std(b""), "");
        assert_eq!(base32_std(b"f"), "MY");
        assert_eq!(base32_std(b"fo"), "MZXQ");
        assert_eq!(base32_std(b"foo"), "MZXW6");
        assert_eq!(base32_std(b"foob"), "MZXW6YQ");
        assert_eq!(base32_std(b"fooba"), "MZXW6YTB");
        assert_eq!(base32_std(b"foobar"), "MZXW6YTBOI");
    }

    #[test]
    fn reference_hash_vectors() {
        assert_eq!(port_proto_hash("ns1/svc1:p80", "tcp"), "XPGD46QRK7WJZT7O");
        assert_eq!(port_proto_hash("ns2/svc2:p80", "tcp"), "GNZBNJ2PO5MGZ6GT");
        assert_eq!(hash16(b"ns1/svc1:p80tcp10.180.0.1:80"), "SXIVWICOYRO3J4NJ");
    }

    #[test]
    fn service_chain_prefixes() {
        assert!(is_service_chain_name("KUBE-SVC-XPGD46QRK7WJZT7O"));
        assert!(is_service_chain_name("KUBE-FW-XPGD46QRK7WJZT7O"));
        assert!(!is_service_chain_name("KUBE-SERVICES"));
        assert!(!is_service_chain_name("KUBE-MARK-MASQ"));
    }
}
