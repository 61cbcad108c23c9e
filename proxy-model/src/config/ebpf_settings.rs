//! The eBPF mode's settings that are values of their own (flags and the configuration file
//! name them; `dataplane::ebpf` applies them).

use std::ops::RangeInclusive;

/// `--bpf-snat-port-range`'s default: the IANA dynamic ports, 16384 of them (a Linux node's
/// ephemeral range 32768–60999 keeps 32768–49151).
pub const DEFAULT_SNAT_RANGE: RangeInclusive<u16> = 49_152..=65_535;

/// `--bpf-max-frontends-per-service`'s default: half the default frontend map. Generous on
/// purpose: Kubernetes has no port ranges, so media servers list thousands of ports in one
/// Service (10 000 ports are 20 000 entries as a ClusterIP), and the map writer's reserve, not
/// this cap, is what keeps room for other namespaces.
pub const DEFAULT_MAX_FRONTENDS_PER_SERVICE: u32 = 32_768;

/// `--bpf-max-endpoints-per-service`'s default: the most slots one frontend can address (a
/// slot's index is 16 bits), so that by default no Service is truncated below what the
/// datapath could serve, and one with more endpoints is truncated rather than not programmed.
pub const DEFAULT_MAX_ENDPOINTS_PER_SERVICE: u32 = u16::MAX as u32;

/// `--bpf-map-dynamic-size-ratio`'s default (Cilium's): the share of the node's memory the LRU
/// maps get (`dataplane::ebpf::maps::map_sizes` divides it among them).
pub const DEFAULT_DYNAMIC_SIZE_RATIO: SizeRatio = SizeRatio(0.0025);

/// A share of the node's memory, between 0 and 1 (never NaN, so equality is total).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizeRatio(f64);

impl Eq for SizeRatio {}

impl SizeRatio {
    /// `None` outside 0..=1 (and for NaN).
    pub fn new(ratio: f64) -> Option<SizeRatio> {
        (0.0..=1.0).contains(&ratio).then_some(SizeRatio(ratio))
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

/// `--tc-fast-path`: whether translated external traffic is redirected past the host's
/// netfilter FORWARD and POSTROUTING (`node_flags::FAST_PATH`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FastPathSetting {
    /// The fast path while the node has no forwarding policy it would bypass
    /// (`forward_policy::decide`), the netfilter path while it has one; the agent watches the
    /// rulesets and switches at run time.
    #[default]
    Auto,
    /// Always the fast path (`--tc-fast-path`, `--tc-fast-path=true`): the host's forwarding
    /// policy does not apply to external Service traffic.
    On,
    /// Always the netfilter path (`--tc-fast-path=false`).
    Off,
}

impl FastPathSetting {
    /// The flag's value, as `--tc-fast-path=` takes it.
    pub fn name(self) -> &'static str {
        match self {
            FastPathSetting::Auto => "auto",
            FastPathSetting::On => "true",
            FastPathSetting::Off => "false",
        }
    }
}

impl std::str::FromStr for FastPathSetting {
    type Err = String;

    /// `auto`, or a boolean as Go's flags take it (the flag was a boolean before `auto`).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "auto" => Ok(FastPathSetting::Auto),
            "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(FastPathSetting::On),
            "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(FastPathSetting::Off),
            _ => Err("must be auto, true or false".to_owned()),
        }
    }
}

/// `--bpf-xdp`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum XdpSetting {
    /// Native XDP on the external interfaces whose driver has it while the fast path is taken
    /// (the only path XDP can take flows on: the netfilter path needs the skb); with
    /// `--tc-fast-path=auto` that follows the node's forwarding policy at run time.
    #[default]
    Auto,
    /// Native XDP on every external interface, also without `--tc-fast-path` (there it only
    /// takes flows that bypass netfilter anyway, `ct_flags::BYPASS`); an interface whose
    /// driver refuses it is logged as a warning.
    Native,
    /// No XDP.
    Off,
}

impl XdpSetting {
    /// The flag's value, as `--bpf-xdp` takes it.
    pub fn name(self) -> &'static str {
        match self {
            XdpSetting::Auto => "auto",
            XdpSetting::Native => "native",
            XdpSetting::Off => "off",
        }
    }

    /// Whether external interfaces get the XDP program, with or without the fast path (the
    /// path taken now: with `--tc-fast-path=auto` it changes at run time).
    pub fn attaches(self, fast_path: bool) -> bool {
        match self {
            XdpSetting::Auto => fast_path,
            XdpSetting::Native => true,
            XdpSetting::Off => false,
        }
    }
}

impl std::str::FromStr for XdpSetting {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "auto" => Ok(XdpSetting::Auto),
            "native" => Ok(XdpSetting::Native),
            "off" => Ok(XdpSetting::Off),
            _ => Err("must be auto, native or off".to_owned()),
        }
    }
}
