//! The eBPF dataplane's error type.

use std::{io, path::PathBuf};

use proxy_kernel::bpf::{bpffs, cgroup};

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error(
        "this proxy-agent was built with PROXY_EBPF_PLACEHOLDER=1 for checking only and has no \
         eBPF object; build it with `cargo xtask build-ebpf` and `cargo build -p proxy-agent`"
    )]
    Placeholder,
    #[error(transparent)]
    Bpffs(#[from] bpffs::BpffsError),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("--cgroup-path {path}: cannot open: {source}")]
    OpenCgroup { path: PathBuf, source: io::Error },
    #[error("{path}: cannot prepare pin directory: {source}")]
    PinDir { path: PathBuf, source: io::Error },
    #[error("loading the eBPF object failed: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("eBPF object has no map {0}")]
    MissingMap(&'static str),
    #[error("map {name}: cannot open a second descriptor of it: {source}")]
    DupMap {
        name: &'static str,
        source: io::Error,
    },
    #[error("eBPF object has no program {0}")]
    MissingProgram(&'static str),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("program {name}: BPF_PROG_TEST_RUN: {source}")]
    TestRun {
        name: &'static str,
        source: std::io::Error,
    },
    #[error("program {name}: link: {source}")]
    Link {
        name: &'static str,
        source: aya::programs::links::LinkError,
    },
    #[error("program {name}: pinning its link: {source}")]
    Pin {
        name: &'static str,
        source: aya::pin::PinError,
    },
    #[error("program {name}: pinning it: {source}")]
    PinProgram {
        name: &'static str,
        source: aya::pin::PinError,
    },
    /// A legacy tc filter (`attach::legacy_tc::LegacyTcError`, which names the interface and
    /// why): boxed so that this type, which every room of the dataplane returns, names none of
    /// them.
    #[error(transparent)]
    LegacyTc(Box<dyn std::error::Error + Send + Sync + 'static>),
    #[error("map KPR_PORT_FILTER: {0}")]
    PortFilter(String),
    #[error("walking the tc conntrack map: {0}")]
    Conntrack(io::Error),
    #[error("reading the monotonic clock: {0}")]
    Clock(nix::Error),
}
