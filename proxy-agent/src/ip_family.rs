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
