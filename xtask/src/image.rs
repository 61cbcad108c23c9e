//! `cargo xtask image`: the agent's OCI image, assembled from Debian packages and the release
//! binary (no base image is pulled: CI and the developers' machines reach package registries
//! only), then loaded and smoke-run with podman.
//!
//! Layers: a minimal Debian root filesystem built by `mmdebstrap` (cached under
//! `target/image/`, keyed by what goes into it) and one layer with `/usr/local/bin/proxy-agent`.
//! `umoci` writes the OCI layout, `skopeo` turns it into an `oci-archive` whose reference is the
//! tag `deploy/daemonset.yaml` names.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    build::ebpf_object,
    commands::{run_cmd, step, workspace_root},
};

/// The image name without its tag. `localhost/` because nothing publishes it: a node gets it by
/// importing the archive (or the operator pushes it to a registry of theirs and renames it), and
/// a bare `kubeproxy-rs/proxy-agent` would make a node that lacks it try Docker Hub, where anyone
/// could own that name.
pub const IMAGE_NAME: &str = "localhost/kubeproxy-rs/proxy-agent";
/// The workspace version: the agent's `--version` and the image tag are both this.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The Debian release of the root filesystem: the one CI and the developers run, so the agent's
/// glibc dependency is met by the same glibc it was linked against.
const SUITE: &str = "bookworm";
/// The pin of the Debian layer: the point release of [`SUITE`] (its `Release` file's
/// `Version`) and every package in the root filesystem at its exact version. A build whose
/// root filesystem differs fails, listing the differences, until `--repin-base` rewrites this
/// file (to be reviewed and committed). Debian's archive keeps only the current versions and
/// Debian's snapshot archive is out of reach, so the pin is checked rather than replayed: it makes
/// every change of the base a reviewed commit, and names what a given image contains.
const BASE_LOCK: &str = "deploy/image-base.lock";
/// What the agent's modes run besides the binary, on top of mmdebstrap's `essential` variant
/// (which already brings `sh`, coreutils and util-linux's `mountpoint`):
/// - `iptables`: `iptables`/`ip6tables` with both backends (`iptables-nft*`, `iptables-legacy*`),
///   which the iptables mode's backend detection chooses between;
/// - `nftables`: `nft`, to look at what the nft backend holds;
/// - `mount`: `mount -t bpf` for the DaemonSet's bpffs init container;
/// - `iproute2`, `bpftool`: interfaces and tc/TCX links, the pinned maps, programs and cgroup
///   attachments, when debugging on a node (`kubectl exec`);
/// - `kmod`: `modprobe`, which iptables calls for missing xtables modules (`/lib/modules` is
///   mounted from the host).
const PACKAGES: [&str; 6] = [
    "iptables", "nftables", "mount", "iproute2", "bpftool", "kmod",
];
/// Documentation is not needed at run time; copyright files stay (the licences require them).
const DPKG_OPTIONS: [&str; 5] = [
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
];
/// Debian packages `cargo xtask image` needs on the build machine, with the command each gives.
/// runc rather than podman's default crun: crun refuses hybrid cgroup hosts whose cgroup2
/// hierarchy has any controller (this machine's has `hugetlb`), runc runs there and on pure
/// cgroup2 hosts alike.
const TOOLS: [(&str, &str); 5] = [
    ("mmdebstrap", "mmdebstrap"),
    ("umoci", "umoci"),
    ("skopeo", "skopeo"),
    ("podman", "podman"),
    ("runc", "runc"),
];

#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Build the Debian layer again even when a cached one matches (e.g. for security updates).
    pub rebuild_base: bool,
    /// Build the Debian layer again and write what it holds to [`BASE_LOCK`] (a new pin).
    pub repin_base: bool,
    /// Build the archive only.
    pub no_smoke: bool,
}

pub fn run(options: Options) -> Result<()> {
    let started = Instant::now();
    ensure_tools()?;
    let root = workspace_root();
    let tag = format!("{IMAGE_NAME}:{VERSION}");
    let daemonset = read_daemonset(&root, &tag)?;

    step("image: proxy-agent (release)");
    run_cmd(
        Command::new("cargo")
            .current_dir(&root)
            .args(["build", "--release", "--package", "proxy-agent"])
            .env("PROXY_EBPF_OBJECT", ebpf_object()),
    )?;
    let binary = root.join("target/release/proxy-agent");
    let version = output_of(Command::new(&binary).arg("--version"))?;
    if version.trim() != format!("proxy-agent {VERSION}") {
        bail!(
            "{} --version says {:?}, the image tag is {VERSION}",
            binary.display(),
            version.trim()
        );
    }

    let dir = root.join("target/image");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let base = base_layer(&root, &dir, options.rebuild_base, options.repin_base)?;
    let agent = agent_layer(&dir, &binary)?;
    let archive = dir.join(format!("proxy-agent-{VERSION}.oci.tar"));
    assemble(&dir, &base, &agent, &tag, &archive)?;
    let size = fs::metadata(&archive)
        .with_context(|| format!("reading {}", archive.display()))?
        .len();
    println!(
        "  image archive: {} ({:.1} MiB), reference {tag}",
        archive.display(),
        mib(size)
    );
    if !options.no_smoke {
        smoke::run(&dir, &archive, &tag, &daemonset)?;
    }
    println!(
        "\nimage: {tag} in {} ({:.1} MiB) after {:.0?}",
        archive.display(),
        mib(size),
        started.elapsed()
    );
    Ok(())
}

fn mib(bytes: u64) -> f64 {
    // Display only: an image is far below f64's exact integer range.
    bytes as f64 / (1024.0 * 1024.0)
}

/// Installs the missing tools from Debian (idempotent: nothing runs when all are present).
fn ensure_tools() -> Result<()> {
    let missing: Vec<&str> = TOOLS
        .iter()
        .filter(|(_, command)| !on_path(command))
        .map(|(package, _)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    step(&format!("image: installing {}", missing.join(" ")));
    run_cmd(Command::new("apt-get").arg("update").arg("-q"))?;
    run_cmd(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn on_path(command: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {command}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// What the smoke run takes from `deploy/daemonset.yaml`, so that it runs the image as the
/// DaemonSet does rather than as a copy of the manifest says.
#[derive(Debug)]
pub struct DaemonSet {
    /// The script of the bpffs init container (`sh -c SCRIPT`).
    pub mount_bpffs: String,
    /// The agent container's added capabilities.
    pub capabilities: Vec<String>,
    /// The agent's `--cgroup-path`, where the host's cgroup2 hierarchy is mounted.
    pub cgroup_path: String,
}

/// Reads the DaemonSet and checks that every container runs `tag`, the image this version
/// builds (the typed manifest test checks the rest of the manifest).
fn read_daemonset(root: &Path, tag: &str) -> Result<DaemonSet> {
    let path = root.join("deploy/daemonset.yaml");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let manifest: serde_yaml::Value =
        serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let strings = |value: &serde_yaml::Value| -> Vec<String> {
        value
            .as_sequence()
            .into_iter()
            .flatten()
            .filter_map(|item| item.as_str().map(str::to_owned))
            .collect()
    };
    let pod = &manifest["spec"]["template"]["spec"];
    let mut mount_bpffs = None;
    let mut agent = None;
    for kind in ["initContainers", "containers"] {
        for container in pod[kind].as_sequence().into_iter().flatten() {
            let name = container["name"].as_str().unwrap_or_default();
            if container["image"].as_str() != Some(tag) {
                bail!(
                    "{}: container {name} does not run {tag}, the image this version builds",
                    path.display()
                );
            }
            match name {
                "mount-bpffs" => mount_bpffs = Some(strings(&container["command"])),
                "proxy-agent" => agent = Some(container),
                _ => {}
            }
        }
    }
    let mount_bpffs = match mount_bpffs.as_deref() {
        Some([sh, c, script]) if sh == "sh" && c == "-c" => script.clone(),
        other => bail!(
            "{}: mount-bpffs runs {other:?}, not `sh -c SCRIPT`",
            path.display()
        ),
    };
    let agent = agent.with_context(|| format!("{}: no proxy-agent container", path.display()))?;
    let cgroup_path = strings(&agent["command"])
        .iter()
        .find_map(|arg| arg.strip_prefix("--cgroup-path=").map(str::to_owned))
        .with_context(|| format!("{}: proxy-agent has no --cgroup-path", path.display()))?;
    Ok(DaemonSet {
        mount_bpffs,
        capabilities: strings(&agent["securityContext"]["capabilities"]["add"]),
        cgroup_path,
    })
}

/// The Debian root filesystem as a layer tarball, built once per package set and pin, and
/// checked against the pin ([`BASE_LOCK`]).
fn base_layer(root: &Path, dir: &Path, rebuild: bool, repin: bool) -> Result<PathBuf> {
    let lock_path = root.join(BASE_LOCK);
    let lock_text = match fs::read_to_string(&lock_path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && repin => None,
        Err(e) => return Err(e).with_context(|| format!("reading {}", lock_path.display())),
    };
    let pinned = lock_text.as_deref().map(BaseLock::parse).transpose()?;
    let recipe = format!(
        "{SUITE} essential {} {} {}",
        PACKAGES.join(","),
        DPKG_OPTIONS.join(" "),
        lock_text.as_deref().unwrap_or_default()
    );
    let base = dir.join(format!("debian-{SUITE}-{:016x}.tar", fnv1a(&recipe)));
    if base.is_file() && !rebuild && !repin {
        println!(
            "  Debian layer: {} (cached; pinned by {BASE_LOCK}; --rebuild-base to refresh)",
            base.display()
        );
        return Ok(base);
    }
    step(&format!(
        "image: Debian {SUITE} root filesystem (mmdebstrap, essential + {})",
        PACKAGES.join(" ")
    ));
    let partial = base.with_extension("tar.partial.tar");
    let found_release = base.with_extension("release");
    let found_packages = base.with_extension("packages");
    let mut command = Command::new("mmdebstrap");
    command
        .args(["--variant=essential", "--quiet"])
        .arg(format!("--include={}", PACKAGES.join(",")));
    for option in DPKG_OPTIONS {
        command.arg(format!("--dpkgopt={option}"));
    }
    // What the pin compares, written while apt's lists are still in the root filesystem
    // (mmdebstrap removes them at the end): the release's point version and every package.
    command
        .arg(format!(
            "--customize-hook=grep -h '^Version:' \"$1\"/var/lib/apt/lists/*_dists_{SUITE}_InRelease > '{}'",
            found_release.display()
        ))
        .arg(format!(
            "--customize-hook=dpkg-query --admindir=\"$1/var/lib/dpkg\" -W -f='${{Package}} ${{Version}}\\n' > '{}'",
            found_packages.display()
        ));
    // No mirror argument: mmdebstrap then uses Debian's default mirror and, for a stable
    // release, adds its updates and security suites; the pin checks what they delivered.
    command.arg(SUITE).arg(&partial);
    run_cmd(&mut command)?;
    let read = |path: &Path| {
        fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    let found = BaseLock::from_build(&read(&found_release)?, &read(&found_packages)?)?;
    let _ = fs::remove_file(&found_release);
    let _ = fs::remove_file(&found_packages);
    let changes = pinned
        .as_ref()
        .map(|pinned| pinned.changes_to(&found))
        .unwrap_or_else(|| vec!["(no pin yet)".to_owned()]);
    if !changes.is_empty() {
        if !repin {
            let _ = fs::remove_file(&partial);
            bail!(
                "the Debian layer differs from its pin {BASE_LOCK}:\n  {}\nDebian published \
                 updates since the pin was taken. Review them, then run `cargo xtask image \
                 --repin-base` and commit {BASE_LOCK}",
                changes.join("\n  ")
            );
        }
        fs::write(&lock_path, found.render())
            .with_context(|| format!("writing {}", lock_path.display()))?;
        println!(
            "  re-pinned {BASE_LOCK} (review and commit it):\n    {}",
            changes.join("\n    ")
        );
    } else {
        println!(
            "  Debian layer matches {BASE_LOCK}: {SUITE} {}, {} packages",
            found.release,
            found.packages.len()
        );
    }
    // The pin is part of the cache key: after a re-pin the layer is filed under the new one.
    let recipe = format!(
        "{SUITE} essential {} {} {}",
        PACKAGES.join(","),
        DPKG_OPTIONS.join(" "),
        found.render()
    );
    let base = dir.join(format!("debian-{SUITE}-{:016x}.tar", fnv1a(&recipe)));
    fs::rename(&partial, &base).with_context(|| format!("renaming to {}", base.display()))?;
    // Layers of other recipes are never used again: 120 MB each.
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path != base && name.starts_with("debian-") && name.ends_with(".tar") {
            let _ = fs::remove_file(&path);
        }
    }
    Ok(base)
}

/// What [`BASE_LOCK`] pins: the point release and each package's version.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BaseLock {
    /// The suite's `Release` `Version`, e.g. `12.15`.
    release: String,
    packages: std::collections::BTreeMap<String, String>,
}

impl BaseLock {
    const HEADER: &str =
        "# The Debian layer of the agent image (`cargo xtask image`), pinned: the point release of
# its suite and every package of the root filesystem at its version (amd64). A build that
# finds anything else fails; `cargo xtask image --repin-base` rewrites this file from a fresh
# build, for review. Format: `release SUITE VERSION`, then `PACKAGE VERSION` lines.
";

    fn parse(text: &str) -> Result<Self> {
        let mut release = None;
        let mut packages = std::collections::BTreeMap::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            match fields[..] {
                ["release", suite, version] if suite == SUITE => release = Some(version.to_owned()),
                ["release", suite, _] => {
                    bail!(
                        "{BASE_LOCK}:{}: pins suite {suite}, the image is {SUITE}",
                        number + 1
                    )
                }
                [package, version] => {
                    if packages
                        .insert(package.to_owned(), version.to_owned())
                        .is_some()
                    {
                        bail!("{BASE_LOCK}:{}: {package} pinned twice", number + 1);
                    }
                }
                _ => bail!("{BASE_LOCK}:{}: cannot read {line:?}", number + 1),
            }
        }
        let release =
            release.with_context(|| format!("{BASE_LOCK}: no `release {SUITE} VERSION` line"))?;
        if packages.is_empty() {
            bail!("{BASE_LOCK}: no packages");
        }
        Ok(Self { release, packages })
    }

    /// From what the build's hooks wrote: `Version: 12.15` and `PACKAGE VERSION` lines.
    fn from_build(release: &str, packages: &str) -> Result<Self> {
        let release = release
            .lines()
            .find_map(|line| line.strip_prefix("Version:"))
            .map(|version| version.trim().to_owned())
            .filter(|version| !version.is_empty())
            .with_context(|| format!("no `Version:` in {SUITE}'s Release file"))?;
        Self::parse(&format!("release {SUITE} {release}\n{packages}"))
    }

    fn render(&self) -> String {
        let mut text = format!("{}release {SUITE} {}\n", Self::HEADER, self.release);
        for (package, version) in &self.packages {
            text.push_str(&format!("{package} {version}\n"));
        }
        text
    }

    /// What differs in `found`, one line each; empty when it is the pin.
    fn changes_to(&self, found: &Self) -> Vec<String> {
        let mut changes = Vec::new();
        if self.release != found.release {
            changes.push(format!(
                "{SUITE} point release {} -> {}",
                self.release, found.release
            ));
        }
        for (package, version) in &self.packages {
            match found.packages.get(package) {
                None => changes.push(format!("{package} {version} -> (gone)")),
                Some(now) if now != version => {
                    changes.push(format!("{package} {version} -> {now}"));
                }
                Some(_) => {}
            }
        }
        for (package, version) in &found.packages {
            if !self.packages.contains_key(package) {
                changes.push(format!("{package} (new) -> {version}"));
            }
        }
        changes
    }
}

/// `/usr/local/bin/proxy-agent`, owned by root, with fixed timestamps.
fn agent_layer(dir: &Path, binary: &Path) -> Result<PathBuf> {
    let staging = dir.join("agent-root");
    if staging.exists() {
        fs::remove_dir_all(&staging).with_context(|| format!("emptying {}", staging.display()))?;
    }
    let bin = staging.join("usr/local/bin");
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    fs::copy(binary, bin.join("proxy-agent"))
        .with_context(|| format!("copying {}", binary.display()))?;
    let layer = dir.join("agent-layer.tar");
    run_cmd(
        Command::new("tar")
            .arg("--create")
            .arg("--file")
            .arg(&layer)
            .args([
                "--sort=name",
                "--owner=0",
                "--group=0",
                "--numeric-owner",
                "--mtime=@0",
            ])
            .arg("--directory")
            .arg(&staging)
            .arg("usr/local/bin/proxy-agent"),
    )?;
    Ok(layer)
}

/// OCI layout with both layers and the agent as entrypoint, written out as an `oci-archive`.
fn assemble(dir: &Path, base: &Path, agent: &Path, tag: &str, archive: &Path) -> Result<()> {
    step("image: OCI layout (umoci) and archive (skopeo)");
    let layout = dir.join("oci");
    if layout.exists() {
        fs::remove_dir_all(&layout).with_context(|| format!("emptying {}", layout.display()))?;
    }
    let image = format!("{}:proxy-agent", layout.display());
    run_cmd(
        Command::new("umoci")
            .arg("init")
            .arg("--layout")
            .arg(&layout),
    )?;
    run_cmd(Command::new("umoci").args(["new", "--image", &image]))?;
    for (layer, created_by) in [
        (base, format!("mmdebstrap {SUITE} + {}", PACKAGES.join(" "))),
        (agent, "proxy-agent".to_owned()),
    ] {
        run_cmd(
            Command::new("umoci")
                .args(["raw", "add-layer", "--image", &image])
                .arg(format!("--history.created_by={created_by}"))
                .arg(layer),
        )?;
    }
    run_cmd(Command::new("umoci").args([
        "config",
        "--image",
        &image,
        "--config.entrypoint=/usr/local/bin/proxy-agent",
        "--config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--config.label=org.opencontainers.image.title=proxy-agent",
        &format!("--config.label=org.opencontainers.image.version={VERSION}"),
        "--config.label=org.opencontainers.image.description=kubeproxy-rs node agent",
        "--history.created_by=entrypoint proxy-agent",
    ]))?;
    if archive.exists() {
        fs::remove_file(archive).with_context(|| format!("removing {}", archive.display()))?;
    }
    run_cmd(
        Command::new("skopeo")
            .args(["copy", "--quiet"])
            .arg(format!("oci:{image}"))
            .arg(format!("oci-archive:{}:{tag}", archive.display())),
    )
}

/// FNV-1a, 64 bits: a stable cache key without a hashing dependency.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Runs `command` and returns its stdout; fails with its stderr.
fn output_of(command: &mut Command) -> Result<String> {
    let shown = format!("{command:?}");
    let out = command
        .output()
        .with_context(|| format!("cannot start {shown}"))?;
    if !out.status.success() {
        bail!(
            "command failed ({}): {shown}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Loading the archive into podman and running the image as the DaemonSet runs it.
mod smoke {
    use super::{
        DaemonSet, Duration, Instant, Path, PathBuf, Result, VERSION, bail, fs, output_of, step,
    };
    use anyhow::Context as _;
    use std::process::Command;

    /// The Service of the smoke run and its one endpoint.
    const CLUSTER_IP: &str = "10.96.77.10";
    const ENDPOINT: &str = "10.244.7.5";

    /// Everything the smoke run creates on the host, removed on drop (also after a failure):
    /// containers, the network namespace, the child cgroup.
    struct Scratch {
        name: String,
        netns: Option<String>,
        cgroup: Option<PathBuf>,
        containers: Vec<String>,
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            for container in &self.containers {
                let _ = podman().args(["rm", "--force", container]).output();
            }
            if let Some(cgroup) = &self.cgroup {
                let _ = fs::remove_dir(cgroup);
            }
            if let Some(netns) = &self.netns {
                let _ = Command::new("ip").args(["netns", "delete", netns]).output();
            }
        }
    }

    /// podman with runc (see `TOOLS` for why not crun).
    fn podman() -> Command {
        let mut command = Command::new("podman");
        command.args(["--runtime", "runc"]);
        command
    }

    /// `podman run` options every smoke container gets. The rlimits are explicit because
    /// podman's defaults (and even `--ulimit host`) raise them, which this sandbox forbids
    /// (`setrlimit RLIMIT_NOFILE: operation not permitted`); these are below any host's.
    fn run_args(command: &mut Command) -> &mut Command {
        command.args([
            "run",
            "--ulimit=nofile=16384:16384",
            "--ulimit=nproc=4096:4096",
        ])
    }

    pub fn run(dir: &Path, archive: &Path, tag: &str, daemonset: &DaemonSet) -> Result<()> {
        let started = Instant::now();
        step("image smoke: podman load");
        // Replace an earlier load of the same tag rather than leaving it dangling.
        let _ = podman().args(["image", "rm", "--force", tag]).output();
        let loaded = output_of(podman().arg("load").arg("--input").arg(archive))?;
        print!("{loaded}");
        if !loaded.contains(tag) {
            bail!("podman load did not name the image {tag}: {loaded}");
        }
        let size = output_of(podman().args(["image", "inspect", "--format", "{{.Size}}", tag]))?;
        println!("  loaded size: {} bytes", size.trim());

        step("image smoke: --version and the run-time tools");
        let version = output_of(run_args(&mut podman()).args(["--rm", tag, "--version"]))?;
        if version.trim() != format!("proxy-agent {VERSION}") {
            bail!("the image's agent says {:?}", version.trim());
        }
        println!("  {}", version.trim());
        let tools = output_of(run_args(&mut podman()).args([
            "--rm",
            "--entrypoint=sh",
            tag,
            "-c",
            "set -e; for t in iptables ip6tables iptables-nft ip6tables-nft iptables-legacy \
             ip6tables-legacy iptables-nft-restore iptables-legacy-restore; do $t --version; \
             done; nft --version; ip -V; bpftool version | head -n 1; modprobe --version; \
             mount --version; mountpoint --version",
        ]))?;
        print!("{tools}");

        let mut scratch = Scratch {
            name: format!("kpr-image-smoke-{}", std::process::id()),
            netns: None,
            cgroup: None,
            containers: Vec::new(),
        };
        step("image smoke: the bpffs init container's command");
        // On a scratch directory bind-mounted like the hostPath volume (the bpffs mount lives
        // and dies in the container's mount namespace: podman's binds are private).
        let bpffs = dir.join("smoke-bpffs");
        fs::create_dir_all(&bpffs).with_context(|| format!("creating {}", bpffs.display()))?;
        let mounted = output_of(run_args(&mut podman()).args([
            "--rm",
            // Like the init container.
            "--privileged",
            &format!("--volume={}:/sys/fs/bpf", bpffs.display()),
            "--entrypoint=sh",
            tag,
            "-c",
            &format!("{} && stat -f -c %T /sys/fs/bpf", daemonset.mount_bpffs),
        ]))?;
        if mounted.trim() != "bpf_fs" {
            bail!(
                "the init container's command left {:?} at /sys/fs/bpf",
                mounted.trim()
            );
        }
        println!("  /sys/fs/bpf: {}", mounted.trim());

        // The node: a throwaway network namespace with loopback and one "external" interface,
        // shared with the container as the DaemonSet's hostNetwork shares the node's.
        let netns = scratch.name.clone();
        host(Command::new("ip").args(["netns", "add", &netns]))?;
        scratch.netns = Some(netns.clone());
        for args in [
            &["link", "set", "lo", "up"][..],
            // A veth pair with both ends inside (this kernel has no dummy devices).
            &[
                "link",
                "add",
                "ext0",
                "type",
                "veth",
                "peer",
                "name",
                "ext0-peer",
            ],
            &["addr", "add", "192.0.2.10/24", "dev", "ext0"],
            &["link", "set", "ext0", "up"],
            &["link", "set", "ext0-peer", "up"],
        ] {
            host(Command::new("ip").args(["-n", &netns]).args(args))?;
        }
        // The programs attach to a child cgroup of the host's cgroup2 hierarchy, never to the
        // root: no process of the host is translated by the smoke run.
        let cgroup = cgroup2_mount()?.join(&scratch.name);
        fs::create_dir(&cgroup).with_context(|| format!("creating {}", cgroup.display()))?;
        scratch.cgroup = Some(cgroup.clone());
        let manifests = dir.join("smoke-manifests");
        fs::create_dir_all(&manifests)
            .with_context(|| format!("creating {}", manifests.display()))?;
        fs::write(manifests.join("smoke.yaml"), service_manifests())
            .context("writing the smoke Service")?;

        for mode in ["ebpf", "iptables"] {
            standalone(&mut scratch, tag, daemonset, mode, &cgroup, &manifests)?;
        }
        println!("  smoke run took {:.0?}", started.elapsed());
        Ok(())
    }

    /// The agent in `mode` with `--manifests`, as the DaemonSet runs it (same capabilities,
    /// host PID namespace, cgroup2 at its own path, the node's network): its metrics server
    /// must report the mode and `proxy-agent inspect services` in the container must show the
    /// Service's backend in the datapath (pinned maps or nat table).
    fn standalone(
        scratch: &mut Scratch,
        tag: &str,
        daemonset: &DaemonSet,
        mode: &str,
        cgroup: &Path,
        manifests: &Path,
    ) -> Result<()> {
        step(&format!("image smoke: standalone agent, {mode} mode"));
        let netns = scratch.netns.clone().unwrap_or_default();
        let container = format!("{}-{mode}", scratch.name);
        let capabilities = format!("--cap-add={}", daemonset.capabilities.join(","));
        let cgroup_path = &daemonset.cgroup_path;
        let _ = podman().args(["rm", "--force", &container]).output();
        scratch.containers.push(container.clone());
        output_of(run_args(&mut podman()).args([
            "--detach",
            &format!("--name={container}"),
            &format!("--network=ns:/run/netns/{netns}"),
            "--pid=host",
            "--cap-drop=ALL",
            &capabilities,
            "--security-opt=apparmor=unconfined",
            &format!("--volume={}:{cgroup_path}", cgroup.display()),
            &format!("--volume={}:/manifests:ro", manifests.display()),
            tag,
            &format!("--proxy-mode={mode}"),
            "--manifests=/manifests",
            "--hostname-override=smoke-node",
            &format!("--cgroup-path={cgroup_path}"),
        ]))?;
        let result = check_standalone(&container, &netns, mode);
        let logs = podman().args(["logs", &container]).output();
        if result.is_err()
            && let Ok(logs) = logs
        {
            eprintln!(
                "--- agent log ({container}) ---\n{}{}",
                String::from_utf8_lossy(&logs.stdout),
                String::from_utf8_lossy(&logs.stderr)
            );
        }
        result?;
        // SIGTERM, as the kubelet stops it; the datapath stays, so remove it like an operator.
        output_of(podman().args(["stop", "--time=10", &container]))?;
        let exit =
            output_of(podman().args(["inspect", "--format={{.State.ExitCode}}", &container]))?;
        println!("  stopped with SIGTERM, exit code {}", exit.trim());
        output_of(run_args(&mut podman()).args([
            "--rm",
            &format!("--network=ns:/run/netns/{netns}"),
            "--cap-drop=ALL",
            &capabilities,
            "--security-opt=apparmor=unconfined",
            tag,
            "--cleanup",
        ]))?;
        Ok(())
    }

    fn check_standalone(container: &str, netns: &str, mode: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let inspect = loop {
            let proxy_mode = Command::new("nsenter")
                .arg(format!("--net=/run/netns/{netns}"))
                .args([
                    "curl",
                    "--silent",
                    "--max-time",
                    "2",
                    "http://127.0.0.1:10249/proxyMode",
                ])
                .output();
            let inspect = podman()
                .args(["exec", container, "proxy-agent", "inspect", "services"])
                .output();
            if let (Ok(proxy_mode), Ok(inspect)) = (proxy_mode, inspect) {
                let text = String::from_utf8_lossy(&inspect.stdout).into_owned();
                if String::from_utf8_lossy(&proxy_mode.stdout).trim() == mode
                    && text.contains(CLUSTER_IP)
                    && text.contains(ENDPOINT)
                {
                    break text;
                }
            }
            let running =
                output_of(podman().args(["inspect", "--format={{.State.Running}}", container]))?;
            if running.trim() != "true" {
                bail!("the agent ({mode} mode) exited");
            }
            if Instant::now() > deadline {
                bail!(
                    "after 60 s the agent ({mode} mode) does not report /proxyMode {mode} \
                     with {CLUSTER_IP} → {ENDPOINT} in `inspect services`"
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        print!("{inspect}");
        let healthz = output_of(
            Command::new("nsenter")
                .arg(format!("--net=/run/netns/{netns}"))
                .args([
                    "curl",
                    "--silent",
                    "--fail",
                    "--max-time",
                    "2",
                    "http://127.0.0.1:10256/healthz",
                ]),
        )?;
        println!("  /healthz: {}", healthz.trim());
        Ok(())
    }

    fn host(command: &mut Command) -> Result<()> {
        output_of(command).map(drop)
    }

    /// The host's cgroup2 mount (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on hybrid
    /// hosts), from /proc/mounts.
    fn cgroup2_mount() -> Result<PathBuf> {
        let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
        mounts
            .lines()
            .find_map(|line| {
                let mut fields = line.split_whitespace();
                let (_, path, kind) = (fields.next()?, fields.next()?, fields.next()?);
                (kind == "cgroup2").then(|| PathBuf::from(path))
            })
            .context("no cgroup2 hierarchy is mounted")
    }

    fn service_manifests() -> String {
        format!(
            "apiVersion: v1
kind: Service
metadata: {{name: smoke, namespace: default}}
spec:
  clusterIP: {CLUSTER_IP}
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: smoke-1
  namespace: default
  labels: {{kubernetes.io/service-name: smoke}}
addressType: IPv4
endpoints:
- addresses: [{ENDPOINT}]
  conditions: {{ready: true}}
ports: [{{name: http, port: 8080, protocol: TCP}}]
"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUILT_RELEASE: &str = "Version: 12.15\n";
    const BUILT_PACKAGES: &str = "base-files 12.4+deb12u13\nlibc6 2.36-9+deb12u13\n";

    #[test]
    fn a_build_renders_and_parses_back() {
        let found = BaseLock::from_build(BUILT_RELEASE, BUILT_PACKAGES).unwrap();
        assert_eq!(found.release, "12.15");
        assert_eq!(found.packages["libc6"], "2.36-9+deb12u13");
        let text = found.render();
        assert!(text.starts_with('#'));
        assert!(text.contains("\nrelease bookworm 12.15\n"));
        assert_eq!(BaseLock::parse(&text).unwrap(), found);
        assert!(found.changes_to(&found).is_empty());
    }

    #[test]
    fn every_difference_is_named() {
        let pinned = BaseLock::from_build(BUILT_RELEASE, BUILT_PACKAGES).unwrap();
        let found = BaseLock::from_build(
            "Version: 12.16\n",
            "libc6 2.36-9+deb12u14\nzlib1g 1:1.2.13.dfsg-1\n",
        )
        .unwrap();
        assert_eq!(
            pinned.changes_to(&found),
            [
                "bookworm point release 12.15 -> 12.16",
                "base-files 12.4+deb12u13 -> (gone)",
                "libc6 2.36-9+deb12u13 -> 2.36-9+deb12u14",
                "zlib1g (new) -> 1:1.2.13.dfsg-1",
            ]
        );
    }

    #[test]
    fn a_broken_pin_is_refused() {
        assert!(BaseLock::parse("libc6 2.36\n").is_err(), "no release line");
        assert!(
            BaseLock::parse("release bookworm 12.15\n").is_err(),
            "no packages"
        );
        assert!(BaseLock::parse("release trixie 13.2\nlibc6 2.41\n").is_err());
        assert!(BaseLock::parse("release bookworm 12.15\nlibc6 2.36\nlibc6 2.37\n").is_err());
        assert!(BaseLock::parse("release bookworm 12.15\nlibc6\n").is_err());
        assert!(BaseLock::from_build("Origin: Debian\n", BUILT_PACKAGES).is_err());
    }

    /// The committed pin reads, and pins this suite.
    #[test]
    fn the_committed_pin_reads() {
        let text = fs::read_to_string(workspace_root().join(BASE_LOCK)).unwrap();
        let lock = BaseLock::parse(&text).unwrap();
        assert!(lock.release.starts_with("12."), "{}", lock.release);
        for package in PACKAGES {
            assert!(
                lock.packages.contains_key(package),
                "{package} is not pinned"
            );
        }
        assert_eq!(
            lock.render(),
            text,
            "{BASE_LOCK} is not in its canonical form"
        );
    }
}
