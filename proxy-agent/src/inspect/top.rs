//! `proxy-agent inspect top`: the busiest Service ports, live, read from the node itself
//! without the agent's HTTP ports — in eBPF mode the pinned per-Service counters and names
//! (`proxy_dataplane_ebpf::TrafficReader`), in iptables mode the counters of each Service's
//! rules (`iptables-save -c`, both families, `proxy_dataplane_iptables::traffic`). `view.rs`
//! turns readings into rows and frames; `terminal.rs` is the interactive terminal.

use std::{
    io::{self, IsTerminal as _, Write as _},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use proxy_common::map_names;
use proxy_dataplane_ebpf::traffic::TrafficReader;
use proxy_dataplane_iptables::traffic::TrafficContext;
use proxy_kernel::iptables::exec::Iptables;
use proxy_model::{cli::InspectArgs, desired::IpFamily, traffic::TrafficReading};

mod terminal;
pub mod view;

/// Where the counts come from.
enum Source {
    Ebpf(Box<TrafficReader>),
    /// The families whose nat table has kube-proxy's `KUBE-SERVICES`.
    Iptables(Vec<Iptables>),
}

impl Source {
    /// eBPF mode when the agent's maps are pinned under `pin_dir` (as the other `inspect`
    /// commands decide), else iptables mode when either family has kube-proxy's rules.
    fn open(pin_dir: &Path) -> anyhow::Result<(Source, String)> {
        if pin_dir.join(map_names::FRONTENDS4).exists() {
            let reader = TrafficReader::open(pin_dir).with_context(|| {
                format!(
                    "eBPF maps are pinned under {} but not the per-Service counters (an older \
                     agent?)",
                    pin_dir.display()
                )
            })?;
            return Ok((
                Source::Ebpf(Box::new(reader)),
                format!("eBPF ({})", pin_dir.display()),
            ));
        }
        let backend = proxy_kernel::iptables::detect::detect_backend();
        let mut families = Vec::new();
        let mut problems = Vec::new();
        for family in IpFamily::ALL {
            let iptables = Iptables {
                family,
                backend,
                version: None,
            };
            match iptables.save_chains("nat") {
                Ok(chains) if chains.contains("KUBE-SERVICES") => families.push(iptables),
                Ok(_) => problems.push(format!(
                    "{}: no KUBE-SERVICES chain in nat",
                    family.as_k8s()
                )),
                Err(error) => problems.push(format!("{}: {error}", family.as_k8s())),
            }
        }
        if families.is_empty() {
            bail!(
                "nothing to read: no pinned eBPF maps under {} (is --bpf-root the agent's?) and \
                 no kube-proxy iptables rules ({})",
                pin_dir.display(),
                problems.join("; ")
            );
        }
        let names: Vec<&str> = families.iter().map(|f| f.family.as_k8s()).collect();
        let label = format!("iptables ({} rule counters)", names.join("+"));
        Ok((Source::Iptables(families), label))
    }

    fn read(&mut self) -> anyhow::Result<TrafficReading> {
        match self {
            Source::Ebpf(reader) => Ok(reader.read()?),
            Source::Iptables(families) => {
                let mut reading = TrafficReading::default();
                // Without the agent's record of its restores every rule keeps one unit; a
                // rewritten chain shows as counters going back, which the view takes as a
                // restart.
                let context = TrafficContext::default();
                for iptables in families.iter() {
                    let mut text = String::new();
                    for table in ["nat", "filter"] {
                        text.push_str(&iptables.save_with_counters(table)?);
                    }
                    let family = proxy_dataplane_iptables::traffic::reading(
                        iptables.family,
                        &text,
                        &context,
                    );
                    reading.services.extend(family.services);
                }
                Ok(reading)
            }
        }
    }
}

/// Runs the view until `q` (interactive) or `--iterations` frames; returns nothing to print
/// (the frames are printed as they come).
pub fn run(args: &InspectArgs, pin_dir: &Path) -> anyhow::Result<String> {
    let Some(interval) = view::parse_interval(&args.interval) else {
        bail!(
            "--interval {:?}: seconds (2, 0.5) or a number with s or ms, from 100ms to a day",
            args.interval
        );
    };
    let (mut source, label) = Source::open(pin_dir)?;
    // The first reading must work; later failures are shown in the frame.
    let first = source.read()?;
    let interactive = !args.batch && io::stdin().is_terminal() && io::stdout().is_terminal();
    let mut top = Top {
        source,
        label,
        interval,
        sort: args.sort,
        tracker: view::Tracker::default(),
        start: Instant::now(),
        last_read: Instant::now(),
        error: None,
    };
    top.tracker.record(&first, Duration::ZERO);
    if interactive {
        top.interactive(args.iterations)?;
    } else {
        top.batch(args.iterations)?;
    }
    Ok(String::new())
}

struct Top {
    source: Source,
    label: String,
    interval: Duration,
    sort: proxy_model::cli::TopSort,
    tracker: view::Tracker,
    start: Instant,
    last_read: Instant,
    error: Option<String>,
}

impl Top {
    fn read(&mut self) {
        let now = Instant::now();
        match self.source.read() {
            Ok(reading) => {
                self.tracker
                    .record(&reading, now.duration_since(self.last_read));
                self.last_read = now;
                self.error = None;
            }
            Err(error) => self.error = Some(format!("{error:#}")),
        }
    }

    fn frame(&self, keys: bool, width: usize, height: usize) -> String {
        let header = view::Header {
            source: &self.label,
            interval: self.interval,
            elapsed: self.start.elapsed(),
            sort: self.sort,
            keys,
            error: self.error.as_deref(),
        };
        view::render(&header, &self.tracker.rows(self.sort), width, height)
    }

    /// Frames as plain text, a blank line after each; a closed stdout (`| head`) ends it.
    fn batch(&mut self, iterations: Option<u64>) -> anyhow::Result<()> {
        let mut frames = 0u64;
        loop {
            let frame = self.frame(false, usize::MAX, usize::MAX);
            let mut out = io::stdout().lock();
            match writeln!(out, "{frame}").and_then(|()| out.flush()) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::BrokenPipe => return Ok(()),
                Err(error) => return Err(error.into()),
            }
            drop(out);
            frames += 1;
            if iterations.is_some_and(|n| frames >= n) {
                return Ok(());
            }
            std::thread::sleep(self.interval);
            self.read();
        }
    }

    fn interactive(&mut self, iterations: Option<u64>) -> anyhow::Result<()> {
        let mut terminal = terminal::RawTerminal::enter().context("cannot set up the terminal")?;
        let mut frames = 0u64;
        loop {
            let (width, height) = terminal::RawTerminal::size();
            terminal.draw(&self.frame(true, width, height))?;
            frames += 1;
            if iterations.is_some_and(|n| frames >= n) {
                return Ok(());
            }
            let next = Instant::now() + self.interval;
            loop {
                if terminal::RawTerminal::stopped() {
                    return Ok(());
                }
                let left = next.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                for key in terminal.keys(left)? {
                    // q, Ctrl-C, Ctrl-D: raw mode makes the last two keys, not signals.
                    if matches!(key, b'q' | b'Q' | 3 | 4) {
                        return Ok(());
                    }
                    if let Some(sort) = view::sort_for_key(key) {
                        self.sort = sort;
                        let (width, height) = terminal::RawTerminal::size();
                        terminal.draw(&self.frame(true, width, height))?;
                    }
                }
            }
            self.read();
        }
    }
}
