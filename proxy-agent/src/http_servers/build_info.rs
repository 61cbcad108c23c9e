//! `kubernetes_build_info`, the constant gauge every Kubernetes component serves (component-base,
//! beta since 1.36), so that dashboards and alerts that read a node proxy's version find one.
//! Its labels describe this agent's build: its own version (not a Kubernetes release it could
//! be mistaken for), the commit, `rustc` as the compiler; `go_version`, `build_date` and
//! `git_tree_state` are left empty (no Go toolchain; reproducible builds carry no date).

use prometheus_client::{encoding::EncodeLabelSet, metrics::family::Family, metrics::gauge::Gauge};

/// component-base's help, with the stability prefix of 1.36.
pub const HELP: &str = "[BETA] A metric with a constant '1' value labeled by major, minor, git \
                        version, git commit, git tree state, build date, Go version, and \
                        compiler from which Kubernetes was built, and platform on which it is \
                        running.";

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct BuildInfo {
    build_date: &'static str,
    compiler: &'static str,
    git_commit: &'static str,
    git_tree_state: &'static str,
    git_version: String,
    go_version: &'static str,
    major: &'static str,
    minor: &'static str,
    platform: String,
}

impl BuildInfo {
    pub fn of_this_build() -> Self {
        Self {
            build_date: "",
            compiler: "rustc",
            git_commit: env!("KPR_GIT_COMMIT"),
            git_tree_state: "",
            git_version: format!("v{}", env!("CARGO_PKG_VERSION")),
            go_version: "",
            major: env!("CARGO_PKG_VERSION_MAJOR"),
            minor: env!("CARGO_PKG_VERSION_MINOR"),
            platform: format!(
                "{}/{}",
                std::env::consts::OS,
                go_arch(std::env::consts::ARCH)
            ),
        }
    }
}

/// Go's `GOARCH` names, which the `platform` label uses (`linux/amd64`).
fn go_arch(arch: &str) -> &str {
    match arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// The family with its one series at 1.
pub fn family() -> Family<BuildInfo, Gauge> {
    let family = Family::<BuildInfo, Gauge>::default();
    family.get_or_create(&BuildInfo::of_this_build()).set(1);
    family
}
