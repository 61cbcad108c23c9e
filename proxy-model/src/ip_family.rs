//! [`IpFamily`]: the address family, named by every layer (objects, node settings, desired
//! state, both dataplanes, metrics labels), so it sits below all of them.

use std::net::IpAddr;

use ipnet::IpNet;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    pub fn of(addr: &IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    /// kube-proxy's label value (`ip_family` metric label, `ipFamilies` entries).
    pub const fn as_k8s(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }
}

/// The reasons [`unusable_address`] gives, each a metric label.
pub const UNUSABLE_REASONS: [&str; 5] = [
    "unspecified",
    "loopback",
    "link-local",
    "multicast",
    "broadcast",
];

/// Why an address can never be a Service's frontend or endpoint, if it cannot: the kernel
/// treats these as the node's own (unspecified, loopback), as on-link only (link-local, where
/// clouds serve instance metadata at 169.254.169.254), or as group traffic (multicast,
/// broadcast). The API server rejects most of them in `externalIPs` and endpoint addresses
/// (`ValidateNonSpecialIP`), but not in `status.loadBalancer.ingress`, and a manifests folder
/// has no API server at all: a `0.0.0.0` frontend would otherwise become the NodePort
/// wildcard and capture every port of the node. An IPv4-mapped IPv6 address is judged by the
/// IPv4 address it carries.
pub fn unusable_address(ip: &IpAddr) -> Option<&'static str> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            if v4.is_unspecified() {
                Some("unspecified")
            } else if v4.is_loopback() {
                Some("loopback")
            } else if v4.is_link_local() {
                Some("link-local")
            } else if v4.is_multicast() {
                Some("multicast")
            } else if v4.is_broadcast() {
                Some("broadcast")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            if v6.is_unspecified() {
                Some("unspecified")
            } else if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unicast_link_local() {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else {
                None
            }
        }
    }
}

/// k8s.io/utils/net `ParseIPSloppy`: Go's `net.ParseIP`, except that the parts of an IPv4
/// address (also one embedded at the end of an IPv6 one) may have leading zeros, read as
/// decimal (`010.001.002.003` is 10.1.2.3) — what Go accepted before 1.17, kept by Kubernetes
/// for stored objects. The address is canonical once parsed, so rules and chain-name hashes
/// use `10.1.2.3`.
pub fn parse_ip_sloppy(text: &str) -> Option<IpAddr> {
    text.parse()
        .ok()
        .or_else(|| strip_zeros(text)?.parse().ok())
}

/// k8s.io/utils/net `ParseCIDRSloppy`: `ParseCIDR` with [`parse_ip_sloppy`]'s leading zeros,
/// in the prefix length too.
pub fn parse_cidr_sloppy(text: &str) -> Option<IpNet> {
    // Go's ParseCIDR requires the prefix length; ipnet's parser does too.
    text.parse()
        .ok()
        .or_else(|| strip_zeros(text)?.parse().ok())
}

/// utils/net's `matchZeros` regular expression and its `stripZeros` replacement:
/// `(^|:)0*(0|[1-9][0-9]*)\.` ×4 `((/)0*(0|[1-9][0-9]*))?$`, i.e. a trailing dotted quad of
/// decimal digits (after the start or a ':'), optionally `/` and digits; each number loses
/// its leading zeros. None when the text has no such shape (the caller's parse fails then).
fn strip_zeros(text: &str) -> Option<String> {
    let (address, prefix) = match text.split_once('/') {
        Some((address, prefix)) => (address, Some(prefix)),
        None => (text, None),
    };
    let (head, quad) = match address.rfind(':') {
        Some(i) => address.split_at(i + 1),
        None => ("", address),
    };
    let digits = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
    let strip = |part: &str| match part.trim_start_matches('0') {
        "" => "0".to_owned(),
        rest => rest.to_owned(),
    };
    let parts: Vec<&str> = quad.split('.').collect();
    if parts.len() != 4 || !parts.iter().all(|p| digits(p)) {
        return None;
    }
    let mut out = format!(
        "{head}{}",
        parts.iter().map(|p| strip(p)).collect::<Vec<_>>().join(".")
    );
    if let Some(prefix) = prefix {
        if !digits(prefix) {
            return None;
        }
        out.push('/');
        out.push_str(&strip(prefix));
    }
    Some(out)
}

#[cfg(test)]
mod unusable_tests {
    use super::*;

    #[test]
    fn addresses_that_are_never_a_services() {
        let kind = |s: &str| unusable_address(&s.parse().expect("test address"));
        for (address, expected) in [
            ("0.0.0.0", Some("unspecified")),
            ("::", Some("unspecified")),
            ("127.0.0.1", Some("loopback")),
            ("127.255.0.9", Some("loopback")),
            ("::1", Some("loopback")),
            ("::ffff:127.0.0.1", Some("loopback")),
            ("169.254.169.254", Some("link-local")),
            ("fe80::1", Some("link-local")),
            ("febf::1", Some("link-local")),
            ("224.0.0.1", Some("multicast")),
            ("239.1.2.3", Some("multicast")),
            ("ff02::1", Some("multicast")),
            ("255.255.255.255", Some("broadcast")),
            ("::ffff:0.0.0.0", Some("unspecified")),
            ("10.0.0.1", None),
            ("192.0.2.1", None),
            ("203.0.113.7", None),
            ("fd00::1", None),
            ("2001:db8::1", None),
            ("fec0::1", None),
        ] {
            assert_eq!(kind(address), expected, "{address}");
        }
    }
}
