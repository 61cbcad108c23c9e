//! `proxy-agent inspect top` used as a person would: in a terminal — a detached tmux session of
//! fixed size on a private server socket — inside the node's network namespace, against an agent
//! with two Services, in both modes. Real connections to the Services must show up as exact
//! totals in the frame, busiest first; the sort key for names must reorder the rows; a sync
//! (restarting the iptables rules' counters) must neither take from the totals nor add to them
//! more than the connections made; `q`, and SIGTERM, must end the process (exit status 0) and
//! leave the alternate screen. Batch mode prints its frames
//! to stdout, and with neither pins nor rules the command names both. Needs root and tmux.

use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Duration,
};

use anyhow::{Context as _, ensure};
use proxy_tests::{
    agent::agent_binary,
    client::Client,
    netns::Netns,
    scenario::{
        SERVICE_PORT, Scenario, cluster_addr, http_service, http_slice, is_pod, pod_endpoint,
    },
    wait::try_wait_until,
};

/// `default/api`: the second Service, one endpoint; its name sorts before `default/web`.
const API_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const TO_WEB: u32 = 12;
const TO_API: u32 = 3;
const MORE_TO_WEB: u32 = 2;
/// `default/extra`, written while the view runs.
const EXTRA_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const SESSION: &str = "top";
/// Bound of each wait on what the pane shows (frames come every second).
const FRAME_WAIT: Duration = Duration::from_secs(30);

fn api_addr() -> SocketAddr {
    SocketAddrV4::new(API_IP, SERVICE_PORT).into()
}

/// A tmux server of its own (`-L <socket>`, no configuration file but ours), killed on drop:
/// a user's tmux is never touched.
struct Tmux {
    socket: String,
    config: PathBuf,
}

impl Tmux {
    /// Starts `command` in a detached 160×40 session; its pane stays after the command exits,
    /// so that the exit status can be read.
    fn start(socket: String, command: &[String]) -> anyhow::Result<Self> {
        let config = std::env::temp_dir().join(format!("{socket}.conf"));
        std::fs::write(&config, "set -g remain-on-exit on\nset -g status off\n")?;
        let tmux = Tmux { socket, config };
        let mut args: Vec<String> = [
            "new-session",
            "-d",
            "-x",
            "160",
            "-y",
            "40",
            "-s",
            SESSION,
            "--",
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect();
        args.extend(command.iter().cloned());
        tmux.run(&args)?;
        Ok(tmux)
    }

    fn command(&self) -> Command {
        let mut command = Command::new("tmux");
        command
            .arg("-L")
            .arg(&self.socket)
            .arg("-f")
            .arg(&self.config)
            .env_remove("TMUX")
            .env("TERM", "xterm-256color");
        command
    }

    fn run<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> anyhow::Result<String> {
        let output = self.command().args(args).output().context("running tmux")?;
        ensure!(
            output.status.success(),
            "tmux {:?}: {}",
            args.iter()
                .map(|a| a.as_ref().to_owned())
                .collect::<Vec<_>>(),
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// What the pane shows now.
    fn screen(&self) -> anyhow::Result<String> {
        self.run(&["capture-pane", "-p", "-t", SESSION])
    }

    fn send_key(&self, key: &str) -> anyhow::Result<()> {
        self.run(&["send-keys", "-t", SESSION, key]).map(drop)
    }

    /// Whether the pane shows its alternate screen.
    fn alternate_screen(&self) -> anyhow::Result<bool> {
        let on = self.run(&["display-message", "-p", "-t", SESSION, "#{alternate_on}"])?;
        Ok(on.trim() == "1")
    }

    /// `Some(exit status)` once the pane's process has exited.
    fn exited(&self) -> anyhow::Result<Option<i32>> {
        let state = self.run(&[
            "display-message",
            "-p",
            "-t",
            SESSION,
            "#{pane_dead} #{pane_dead_status}",
        ])?;
        let mut words = state.split_whitespace();
        Ok(match (words.next(), words.next()) {
            (Some("1"), Some(status)) => Some(status.parse().unwrap_or(-1)),
            _ => None,
        })
    }

    /// Waits until the pane shows what `check` accepts; the error shows the last screen.
    fn wait_for(&self, what: &str, check: impl Fn(&str) -> bool) -> anyhow::Result<String> {
        let mut last = String::new();
        let waited = try_wait_until(what, FRAME_WAIT, Duration::from_millis(200), || {
            last = self
                .screen()
                .map_err(|e| proxy_tests::RigError::Other(e.to_string()))?;
            Ok(check(&last))
        });
        match waited {
            Ok(()) => Ok(last),
            Err(error) => {
                let exited = self.exited().ok().flatten();
                Err(anyhow::anyhow!(
                    "{error} (process exited: {exited:?}); the pane shows:\n{last}"
                ))
            }
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.command().arg("kill-server").output();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// The file the pane's shell writes `inspect top`'s exit status to, removed on drop.
struct TopPane(PathBuf);

impl TopPane {
    /// Runs `top` in a new tmux server's session, under a shell that waits for it and writes
    /// its exit status to a file: tmux 3.3 now and then left the exited process a zombie with
    /// its pane alive, so the pane's state cannot tell.
    fn start(socket: String, top: &[String]) -> anyhow::Result<(Tmux, TopPane)> {
        let file = std::env::temp_dir().join(format!("{socket}.status"));
        let _ = std::fs::remove_file(&file);
        let status = TopPane(file);
        let mut pane = vec![
            "sh".to_owned(),
            "-c".to_owned(),
            format!("\"$@\"; echo $? > {}", status.0.display()),
            "sh".to_owned(),
        ];
        pane.extend(top.iter().cloned());
        Ok((Tmux::start(socket, &pane)?, status))
    }

    /// Waits for `inspect top` to exit after `what`: status 0, the terminal back on its
    /// normal screen without the frame.
    fn expect_exit(&self, tmux: &Tmux, what: &str) -> anyhow::Result<()> {
        let mut status = None;
        try_wait_until(
            &format!("inspect top to exit on {what}"),
            FRAME_WAIT,
            Duration::from_millis(100),
            || {
                status = std::fs::read_to_string(&self.0).ok();
                Ok(status.as_deref().is_some_and(|s| s.ends_with('\n')))
            },
        )
        .with_context(|| diagnose(tmux))?;
        ensure!(
            status.as_deref() == Some("0\n"),
            "inspect top's exit status after {what}: {status:?}"
        );
        let screen = tmux.screen()?;
        ensure!(
            !tmux.alternate_screen()? && !screen.contains("kubeproxy-rs top:"),
            "the frame is still on the screen after {what}:\n{screen}"
        );
        Ok(())
    }
}

impl Drop for TopPane {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The pane and the processes of `inspect top`, for a failure's message.
fn diagnose(tmux: &Tmux) -> String {
    let ps = Command::new("ps")
        .args(["-eLo", "pid,ppid,tid,stat,wchan:32,cmd"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let pane = tmux
        .run(&["display-message", "-p", "-t", SESSION, "#{pane_pid}"])
        .unwrap_or_default();
    let pane = pane.trim();
    let related: Vec<&str> = ps
        .lines()
        .filter(|l| {
            l.contains("inspect top")
                || l.contains("proxy-agent")
                || (!pane.is_empty() && l.contains(pane))
        })
        .collect();
    format!(
        "pane pid {pane}, processes: {related:#?}\nthe pane shows:\n{}",
        tmux.screen().unwrap_or_default()
    )
}

/// A row of the frame: (frontend, NEW total, REJECTED total, DROPPED total) and its line
/// number, for the Service `default/<name>`.
fn row(screen: &str, name: &str) -> Option<(usize, String, [u64; 3])> {
    let service = format!("default/{name}");
    screen.lines().enumerate().find_map(|(i, line)| {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() != 9 || words[0] != service {
            return None;
        }
        let total = |w: &str| w.parse::<u64>().ok();
        Some((
            i,
            words[2].to_owned(),
            [total(words[6])?, total(words[7])?, total(words[8])?],
        ))
    })
}

/// Both rows with these totals of new connections (and nothing rejected or dropped), `first`
/// above `second`.
fn shows(screen: &str, first: (&str, u32), second: (&str, u32)) -> bool {
    match (row(screen, first.0), row(screen, second.0)) {
        (Some((i, kind_a, a)), Some((j, kind_b, b))) => {
            i < j
                && kind_a == "cluster_ip"
                && kind_b == "cluster_ip"
                && a == [u64::from(first.1), 0, 0]
                && b == [u64::from(second.1), 0, 0]
        }
        _ => false,
    }
}

/// `nsenter --net=<node> proxy-agent --bpf-root <root> inspect top ARGS`.
fn top_command(netns: &Path, bpf_root: &Path, args: &[&str]) -> anyhow::Result<Vec<String>> {
    let mut command = vec![
        "nsenter".to_owned(),
        format!("--net={}", netns.display()),
        agent_binary()?.display().to_string(),
        "--bpf-root".to_owned(),
        bpf_root.display().to_string(),
        "inspect".to_owned(),
        "top".to_owned(),
    ];
    command.extend(args.iter().map(|a| (*a).to_owned()));
    Ok(command)
}

fn run_top(netns: &Path, bpf_root: &Path, args: &[&str]) -> anyhow::Result<Output> {
    let command = top_command(netns, bpf_root, args)?;
    Ok(Command::new(&command[0])
        .args(&command[1..])
        .stdin(std::process::Stdio::null())
        .output()?)
}

fn top_in_a_terminal(mode: &str) -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    s.write_web_service(2)?;
    // Routable from the node, and answering should a connection not be translated.
    s.topo.add_decoy(API_IP, SERVICE_PORT)?;
    s.manifests
        .write("api-svc.yaml", &http_service("default", "api", API_IP))?;
    s.manifests.write(
        "api-slice.yaml",
        &http_slice("default", "api-1", "api", &[pod_endpoint(1)]),
    )?;
    // Every iptables sync rewrites KUBE-SERVICES, restarting its rules' counters: none may
    // come (the periodic one) between the connections and the frame that counts them.
    let args: &[&str] = if mode == "iptables" {
        &["--iptables-sync-period", "1h"]
    } else {
        &[]
    };
    let client: Client = s.start_serving(mode, args)?;
    s.wait_for_datapath_with(&client, api_addr(), "answered by a pod", is_pod)?;
    let netns = s.topo.node().path();
    // iptables mode: a bpf root without pins, so that the rules are read.
    let bpf_root = if mode == "ebpf" {
        s.agent()?.bpf_root().to_path_buf()
    } else {
        std::env::temp_dir().join(format!("kpr-top-no-pins-{}", std::process::id()))
    };

    // Batch mode: frames on stdout, the first one the baseline (no rates yet).
    let output = run_top(
        &netns,
        &bpf_root,
        &["--batch", "--iterations", "2", "--interval", "0.2"],
    )?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "inspect top --batch: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let frames: Vec<&str> = stdout
        .split("kubeproxy-rs top: ")
        .filter(|f| !f.is_empty())
        .collect();
    ensure!(frames.len() == 2, "two frames: {stdout}");
    ensure!(
        row(frames[0], "web").is_some() && row(frames[0], "api").is_some(),
        "both Services in the baseline frame: {stdout}"
    );
    let source = if mode == "ebpf" {
        "eBPF ("
    } else {
        "iptables ("
    };
    ensure!(frames[0].starts_with(source), "{stdout}");

    let socket = format!("kpr-top-{}-{mode}", std::process::id());
    let top = top_command(&netns, &bpf_root, &["--interval", "1"])?;
    let (tmux, status_file) = TopPane::start(socket.clone(), &top)?;
    // The first frame is the baseline: what comes after it is counted.
    let screen = tmux.wait_for("the first frame", |screen| {
        screen.contains("keys: n new/s") && row(screen, "web").is_some()
    })?;
    eprintln!("first frame ({mode}):\n{screen}");
    ensure!(
        screen.contains(&format!("kubeproxy-rs top: {source}")) && screen.contains("sort: new/s"),
        "{screen}"
    );

    for (target, count) in [(cluster_addr(), TO_WEB), (api_addr(), TO_API)] {
        let attempts = client.run(target, count)?;
        ensure!(
            attempts.len() == count as usize && attempts.iter().all(is_pod),
            "{target}: every connection answered by a pod: {attempts:?}"
        );
    }
    let screen = tmux.wait_for("web's 12 and api's 3, web first", |screen| {
        shows(screen, ("web", TO_WEB), ("api", TO_API))
    })?;
    eprintln!("after the connections ({mode}):\n{screen}");

    tmux.send_key("s")?;
    let screen = tmux.wait_for("the rows by name: api first", |screen| {
        screen.contains("sort: name") && shows(screen, ("api", TO_API), ("web", TO_WEB))
    })?;
    eprintln!("sorted by name ({mode}):\n{screen}");
    tmux.send_key("n")?;
    tmux.wait_for("the rows by new connections again", |screen| {
        screen.contains("sort: new/s") && shows(screen, ("web", TO_WEB), ("api", TO_API))
    })?;

    // A sync rewrites rules (iptables: KUBE-SERVICES, whose counters restart) and, in eBPF
    // mode, writes the new Service's ids: the totals neither go back nor jump, and the
    // connections after it are counted on top.
    let syncs = s.agent()?.syncs();
    s.topo.add_decoy(EXTRA_IP, SERVICE_PORT)?;
    s.manifests.write(
        "extra-svc.yaml",
        &http_service("default", "extra", EXTRA_IP),
    )?;
    s.manifests.write(
        "extra-slice.yaml",
        &http_slice("default", "extra-1", "extra", &[pod_endpoint(2)]),
    )?;
    let extra = SocketAddr::from(SocketAddrV4::new(EXTRA_IP, SERVICE_PORT));
    s.wait_for_datapath_with(&client, extra, "answered by a pod", is_pod)?;
    let agent = s.agent()?;
    ensure!(agent.syncs() > syncs, "no sync for default/extra");
    let attempts = client.run(cluster_addr(), MORE_TO_WEB)?;
    ensure!(attempts.iter().all(is_pod), "{attempts:?}");
    let screen = tmux.wait_for("web's 14 after the sync, api's 3", |screen| {
        shows(screen, ("web", TO_WEB + MORE_TO_WEB), ("api", TO_API))
            && row(screen, "extra").is_some()
    })?;
    eprintln!("after a sync ({mode}):\n{screen}");
    if mode == "iptables" {
        // The rule did restart: it counted only what came after the sync.
        let save = Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .args(["iptables-save", "-c", "-t", "nat"])
            .output()?;
        let save = String::from_utf8_lossy(&save.stdout);
        let rule = save
            .lines()
            .find(|l| l.contains("-A KUBE-SERVICES") && l.contains("default/web:http cluster IP"))
            .unwrap_or_default();
        ensure!(
            rule.starts_with(&format!("[{MORE_TO_WEB}:")),
            "web's ClusterIP rule did not restart its counters: {rule:?}"
        );
    }

    // Left on the alternate screen while it runs.
    ensure!(
        tmux.alternate_screen()?,
        "inspect top does not use the alternate screen"
    );
    tmux.send_key("q")?;
    status_file.expect_exit(&tmux, "q")?;

    // SIGTERM (a terminal's closing sends SIGHUP) ends it as q does, terminal put back.
    let (tmux, status_file) = TopPane::start(format!("{socket}-term"), &top)?;
    tmux.wait_for("the first frame", |screen| screen.contains("keys: n new/s"))?;
    let pane: i32 = tmux
        .run(&["display-message", "-p", "-t", SESSION, "#{pane_pid}"])?
        .trim()
        .parse()?;
    // The pane's shell waits for nsenter, which became the agent's binary.
    let children = std::fs::read_to_string(format!("/proc/{pane}/task/{pane}/children"))?;
    let pids: Vec<i32> = children
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    ensure!(pids.len() == 1, "the pane's shell runs {pids:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    status_file.expect_exit(&tmux, "SIGTERM")?;
    Ok(())
}

#[test]
fn inspect_top_in_a_terminal_ebpf() -> anyhow::Result<()> {
    top_in_a_terminal("ebpf")
}

#[test]
fn inspect_top_in_a_terminal_iptables() -> anyhow::Result<()> {
    top_in_a_terminal("iptables")
}

/// With no pins under `--bpf-root` and no kube-proxy rules in the namespace, `inspect top`
/// fails at once and names both.
#[test]
fn inspect_top_without_pins_or_rules_says_so() -> anyhow::Result<()> {
    proxy_tests::require_root();
    let netns = Netns::new("topnone")?;
    let bpf_root = std::env::temp_dir().join(format!("kpr-top-none-{}", std::process::id()));
    let output = run_top(&netns.path(), &bpf_root, &["--batch", "--iterations", "1"])?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(!output.status.success(), "it succeeded: {stderr}");
    ensure!(
        stderr.contains("no pinned eBPF maps under")
            && stderr.contains("no kube-proxy iptables rules"),
        "{stderr}"
    );
    ensure!(output.stdout.is_empty(), "{:?}", output.stdout);
    Ok(())
}
