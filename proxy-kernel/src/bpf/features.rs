//! The kernel features the eBPF dataplane can use, probed at start, and the path chosen for
//! each (`--bpf-disable-feature` forces a feature off, so every degraded path can run on a
//! kernel that has them all).
//!
//! | feature          | kernel | with it                        | without it                    |
//! |------------------|--------|--------------------------------|-------------------------------|
//! | `tcx`            | 6.6    | tc programs as pinned TCX links | legacy `clsact` + `cls_bpf` filters (`legacy_tc`) |
//! | `set-retval`     | 5.18   | refused connects: ECONNREFUSED / EHOSTUNREACH | EPERM    |
//! | `socket-destroy` | 5.4 (`CONFIG_INET_DIAG_DESTROY`) | connected UDP sockets of removed backends aborted | they keep sending to the removed backend until the application reconnects |
//! | `btf`            | 5.4 (`CONFIG_DEBUG_INFO_BTF`) | aya reads the kernel's BTF | the object loads without it (it has no CO-RE relocations) |
//! | `coarse-clock`   | 5.11   | the programs read the time the kernel kept at its last tick (`bpf_ktime_get_coarse_ns`), no clock-source read | they read the clock source on every packet that needs the time (`bpf_ktime_get_ns`: tens of ns where the TSC is slow to read, as in VMs) |
//! | `l4-csum-ipv6`   | 6.16 (`BPF_F_IPV6`) | IPv6 address rewrites leave a `CHECKSUM_COMPLETE` skb's `csum` right | the kernel adjusts `skb->csum` as for IPv4, so a NIC that sums packets (CHECKSUM_COMPLETE) logs "hw csum failure" for translated IPv6 packets (they are still delivered: the L4 checksum itself is right) |
//!
//! No kfuncs are used. Probes only read or load throwaway programs: nothing is attached.

use std::{collections::BTreeSet, path::Path};

use aya::{
    programs::{ProgramType, SchedClassifier, TcAttachType},
    sys::{BpfHelper, is_helper_supported},
};
use serde::Serialize;

use crate::bpf::sockdiag;

pub use proxy_model::config::kernel_features::Feature;

/// One feature: what the kernel offers and what the agent uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FeatureState {
    pub feature: Feature,
    /// The probe found it.
    pub kernel: bool,
    /// Forced off by `--bpf-disable-feature`.
    pub disabled: bool,
}

impl FeatureState {
    pub fn used(&self) -> bool {
        self.kernel && !self.disabled
    }
}

/// The probed features and the choice made for each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelFeatures {
    states: Vec<FeatureState>,
}

impl KernelFeatures {
    /// Probes the running kernel; `disabled` features are reported but not used.
    pub fn probe(disabled: &BTreeSet<Feature>) -> Self {
        Self::from_probe(disabled, |feature| match feature {
            Feature::Tcx => probe_tcx(),
            Feature::SetRetval => probe_set_retval(),
            Feature::SocketDestroy => sockdiag::destroy_supported(),
            Feature::Btf => Path::new("/sys/kernel/btf/vmlinux").exists(),
            Feature::L4CsumIpv6 => probe_l4_csum_ipv6(),
            Feature::CoarseClock => probe_coarse_clock(),
        })
    }

    /// The choice for a given probe result (for tests of the choice without a kernel).
    pub fn from_probe(disabled: &BTreeSet<Feature>, kernel: impl Fn(Feature) -> bool) -> Self {
        Self {
            states: Feature::ALL
                .into_iter()
                .map(|feature| FeatureState {
                    feature,
                    kernel: kernel(feature),
                    disabled: disabled.contains(&feature),
                })
                .collect(),
        }
    }

    pub fn states(&self) -> &[FeatureState] {
        &self.states
    }

    pub fn uses(&self, feature: Feature) -> bool {
        self.states
            .iter()
            .any(|state| state.feature == feature && state.used())
    }

    /// `tcx=on set-retval=off(disabled) …`: the one log line's summary.
    pub fn summary(&self) -> String {
        self.states
            .iter()
            .map(|s| {
                let why = match (s.kernel, s.disabled) {
                    (true, false) => "on",
                    (true, true) => "off(disabled by flag)",
                    (false, _) => "off(kernel)",
                };
                format!("{}={why}", s.feature)
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// TCX: querying the loopback's TCX ingress chain is read-only and fails with EINVAL on
/// kernels without TCX (the attach type is unknown there).
fn probe_tcx() -> bool {
    SchedClassifier::query_tcx("lo", TcAttachType::Ingress).is_ok()
}

/// `bpf_set_retval` in cgroup sock_addr programs: the verifier of a kernel without it rejects
/// a program calling it as an unknown helper.
fn probe_set_retval() -> bool {
    is_helper_supported(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval)
        .unwrap_or(false)
}

/// `bpf_ktime_get_coarse_ns`, for tc programs (the XDP and sock_addr programs get the same
/// base helpers): unknown to the verifier of a kernel before 5.11.
fn probe_coarse_clock() -> bool {
    is_helper_supported(
        ProgramType::SchedClassifier,
        BpfHelper::BPF_FUNC_ktime_get_coarse_ns,
    )
    .unwrap_or(false)
}

/// `BPF_F_IPV6` of `bpf_l4_csum_replace`: flag bits are checked when the helper runs, not by
/// the verifier, so the probe runs a program calling it with the flag (a checksum difference of
/// 0, on a throwaway packet) and reads the helper's result: 0, or `-EINVAL` on kernels that do
/// not know the flag.
fn probe_l4_csum_ipv6() -> bool {
    use std::os::fd::AsFd as _;

    use crate::bpf::bpf_syscall::{SkbTestRun, load_sched_cls, test_run_skb};

    const PSEUDO_HDR_AND_IPV6: u64 = 0x10 | 0x80;
    const BPF_FUNC_L4_CSUM_REPLACE: u64 = 11;
    // r1 (the skb) stays as given: r2 = offset 0, r3 = from 0, r4 = diff 0, r5 = flags;
    // call bpf_l4_csum_replace; exit with its result in r0.
    let insns = [
        0x02b7,
        0x03b7,
        0x04b7,
        0x05b7 | (PSEUDO_HDR_AND_IPV6 << 32),
        0x85 | (BPF_FUNC_L4_CSUM_REPLACE << 32),
        0x95,
    ];
    let Ok(program) = load_sched_cls(&insns) else {
        return false;
    };
    let packet = [0u8; 64];
    let mut out = [0u8; 128];
    let run = SkbTestRun {
        data_in: &packet,
        ..SkbTestRun::default()
    };
    test_run_skb(program.as_fd(), &run, &mut out, &mut []).is_ok_and(|result| result.retval == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_feature_is_used_when_the_kernel_has_it_and_no_flag_turns_it_off() {
        let disabled: BTreeSet<_> = [Feature::Tcx].into_iter().collect();
        let features = KernelFeatures::from_probe(&disabled, |f| f != Feature::SocketDestroy);
        assert!(!features.uses(Feature::Tcx));
        assert!(features.uses(Feature::SetRetval));
        assert!(!features.uses(Feature::SocketDestroy));
        assert_eq!(
            features.summary(),
            "tcx=off(disabled by flag) set-retval=on socket-destroy=off(kernel) btf=on \
             l4-csum-ipv6=on coarse-clock=on"
        );
    }

    #[test]
    fn feature_names_round_trip_and_unknown_names_are_listed() {
        for feature in Feature::ALL {
            assert_eq!(feature.name().parse::<Feature>(), Ok(feature));
        }
        let error = "tcx2".parse::<Feature>().expect_err("unknown");
        assert!(
            error.contains("tcx2") && error.contains("socket-destroy"),
            "{error}"
        );
    }

    /// The probes agree with the kernel's version for the features that came with a release
    /// (TCX 6.6, `bpf_set_retval` for sock_addr hooks 5.18); a wrong probe would silently take
    /// a degraded path (or a path the kernel refuses).
    #[test]
    fn probes_agree_with_the_kernel_version() {
        let release =
            std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("kernel release");
        let mut parts = release
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|p| p.parse::<u32>().ok());
        let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        let features = KernelFeatures::probe(&BTreeSet::new());
        let kernel = |feature| {
            features
                .states()
                .iter()
                .any(|s| s.feature == feature && s.kernel)
        };
        assert_eq!(
            kernel(Feature::Tcx),
            version >= (6, 6),
            "{release}: {}",
            features.summary()
        );
        assert_eq!(
            kernel(Feature::SetRetval),
            version >= (5, 18),
            "{release}: {}",
            features.summary()
        );
        assert_eq!(
            kernel(Feature::CoarseClock),
            version >= (5, 11),
            "{release}: {}",
            features.summary()
        );
        // BPF_F_IPV6 came with 6.16 and went to some stable kernels before: only a kernel
        // that has it is certain.
        if version >= (6, 16) {
            assert!(
                kernel(Feature::L4CsumIpv6),
                "{release}: {}",
                features.summary()
            );
        }
    }
}
