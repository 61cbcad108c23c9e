//! A Prometheus server (Debian's `prometheus` package, which `cargo xtask setup` installs) run
//! inside a test's network namespace, scraping one target there every second: its own
//! configuration and storage in a temporary directory, a port that was free in that
//! namespace, and a guard that kills it and removes the directory.

use std::{
    collections::BTreeMap,
    fs,
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use crate::{Result, RigError, netns::Netns, unique_name};

/// How long Prometheus may take to answer `/-/ready` (a second or two on an idle machine;
/// the suite runs beside agents loading eBPF programs).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A running Prometheus; killed, and its directory removed, on drop.
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    netns: PathBuf,
    addr: SocketAddr,
    // Dropped after the child is killed (fields drop after `Drop::drop`).
    dir: TempDir,
}

/// A directory removed (recursively) on drop.
#[derive(Debug)]
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            eprintln!("rig: removing {} failed: {e}", self.0.display());
        }
    }
}

/// One sample of an instant vector: its labels and its value (a float's text, or a native
/// histogram as Prometheus' API writes it).
#[derive(Debug, Clone)]
pub struct Sample {
    pub labels: BTreeMap<String, String>,
    pub value: Option<f64>,
    pub histogram: Option<serde_json::Value>,
}

impl Prometheus {
    /// Starts Prometheus in `netns`, scraping `target` (an address in that namespace) every
    /// second, with `extra_args` (e.g. `--enable-feature=native-histograms`); waits until it
    /// is ready.
    pub fn start(netns: &Netns, target: SocketAddr, extra_args: &[&str]) -> Result<Self> {
        let path = std::env::temp_dir().join(unique_name("prometheus"));
        let io = |what: String| move |e: std::io::Error| RigError::io(what, e);
        fs::create_dir(&path).map_err(io(format!("creating {}", path.display())))?;
        let dir = TempDir(path);
        let config = dir.0.join("prometheus.yml");
        fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: agent\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .map_err(io(format!("writing {}", config.display())))?;
        let addr = free_local_addr(&netns.path())?;
        let log_path = dir.0.join("prometheus.log");
        let log =
            fs::File::create(&log_path).map_err(io(format!("creating {}", log_path.display())))?;
        let log_err = log
            .try_clone()
            .map_err(io("cloning the log handle".into()))?;
        let child = Command::new("ip")
            .args(["netns", "exec", netns.name(), "prometheus"])
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.0.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|e| RigError::io("spawning prometheus (Debian package prometheus)", e))?;
        let mut server = Self {
            child,
            netns: netns.path(),
            addr,
            dir,
        };
        let ready = crate::wait::try_wait_until(
            "prometheus ready",
            READY_TIMEOUT,
            Duration::from_millis(200),
            || {
                if let Ok(Some(status)) = server.child.try_wait() {
                    return Err(RigError::Other(format!(
                        "prometheus exited ({status}):\n{}",
                        server.log()
                    )));
                }
                Ok(crate::http::get(&server.netns, server.addr, "/-/ready")
                    .is_ok_and(|reply| reply.status == 200))
            },
        );
        if let Err(e) = ready {
            return Err(RigError::Other(format!("{e}\n{}", server.log())));
        }
        Ok(server)
    }

    /// What Prometheus has logged.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.0.join("prometheus.log")).unwrap_or_default()
    }

    /// An instant query through the HTTP API (`/api/v1/query`): the result's samples.
    pub fn query(&self, promql: &str) -> Result<Vec<Sample>> {
        let path = format!("/api/v1/query?query={}", url_encode(promql));
        let reply = crate::http::get(&self.netns, self.addr, &path)?;
        let json: serde_json::Value = serde_json::from_str(&reply.body).map_err(|e| {
            RigError::Other(format!(
                "{promql}: answer is not JSON ({e}): {}",
                reply.body
            ))
        })?;
        if reply.status != 200 || json["status"] != "success" {
            return Err(RigError::Other(format!(
                "{promql}: {} {}",
                reply.status, reply.body
            )));
        }
        let result = json["data"]["result"]
            .as_array()
            .ok_or_else(|| RigError::Other(format!("{promql}: no result in {}", reply.body)))?;
        Ok(result
            .iter()
            .map(|sample| Sample {
                labels: sample["metric"]
                    .as_object()
                    .map(|labels| {
                        labels
                            .iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                            .collect()
                    })
                    .unwrap_or_default(),
                value: sample["value"][1]
                    .as_str()
                    .and_then(|text| text.parse().ok()),
                histogram: sample.get("histogram").map(|h| h[1].clone()),
            })
            .collect())
    }

    /// The directory with the configuration, the storage and the log.
    pub fn dir(&self) -> &Path {
        &self.dir.0
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        // `ip netns exec` execs Prometheus itself, so the child is the server.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port that was free in the namespace at `netns` a moment ago.
fn free_local_addr(netns: &Path) -> Result<SocketAddr> {
    crate::netns::on_thread_in(netns, || {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map_err(|e| RigError::io("binding a free port", e))
    })?
}

/// Percent-encoding of everything but RFC 3986's unreserved characters.
fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}
