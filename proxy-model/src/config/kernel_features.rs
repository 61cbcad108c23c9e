//! [`Feature`]: the kernel features the eBPF dataplane has a fallback for, by the names
//! `--bpf-disable-feature` takes. The probes that find them are the dataplane's
//! (`dataplane::ebpf::kernel::features`); the names are configuration.

use std::{fmt, str::FromStr};

use serde::Serialize;

/// A kernel feature the dataplane has a fallback for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Feature {
    Tcx,
    SetRetval,
    SocketDestroy,
    Btf,
    L4CsumIpv6,
    CoarseClock,
}

impl Feature {
    pub const ALL: [Feature; 6] = [
        Feature::Tcx,
        Feature::SetRetval,
        Feature::SocketDestroy,
        Feature::Btf,
        Feature::L4CsumIpv6,
        Feature::CoarseClock,
    ];

    /// The name used by `--bpf-disable-feature`, the metric label and `inspect features`.
    pub fn name(self) -> &'static str {
        match self {
            Feature::Tcx => "tcx",
            Feature::SetRetval => "set-retval",
            Feature::SocketDestroy => "socket-destroy",
            Feature::Btf => "btf",
            Feature::L4CsumIpv6 => "l4-csum-ipv6",
            Feature::CoarseClock => "coarse-clock",
        }
    }

    /// What the dataplane does with the feature, and without it.
    pub fn paths(self) -> (&'static str, &'static str) {
        match self {
            Feature::Tcx => ("tc programs as TCX links", "legacy clsact tc filters"),
            Feature::SetRetval => (
                "refused connects fail with ECONNREFUSED/EHOSTUNREACH",
                "refused connects fail with EPERM",
            ),
            Feature::SocketDestroy => (
                "connected UDP sockets of removed backends are aborted",
                "connected UDP sockets keep their removed backend",
            ),
            Feature::Btf => (
                "kernel BTF given to the loader",
                "loaded without kernel BTF",
            ),
            Feature::L4CsumIpv6 => (
                "IPv6 L4 checksum updates keep CHECKSUM_COMPLETE skbs' csum right (BPF_F_IPV6)",
                "IPv6 NAT on CHECKSUM_COMPLETE NICs may log hw csum failures (packets still valid)",
            ),
            Feature::CoarseClock => (
                "conntrack and affinity times read from the tick's clock (bpf_ktime_get_coarse_ns)",
                "conntrack and affinity times read from the clock source on every packet",
            ),
        }
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Feature {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Feature::ALL
            .into_iter()
            .find(|feature| feature.name() == text)
            .ok_or_else(|| {
                let names: Vec<_> = Feature::ALL.iter().map(|f| f.name()).collect();
                format!("unknown feature {text:?}; known: {}", names.join(", "))
            })
    }
}
