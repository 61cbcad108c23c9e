//! Running the iptables tools of one family and backend (kube-proxy's `pkg/util/iptables`):
//! `iptables-restore` fed on stdin, `iptables-save` parsed for chain names or read with counters,
//! and the single-rule commands used for jump rules and the canary.

use std::{
    collections::BTreeSet,
    io::Write as _,
    process::{Command, Stdio},
};

use bytes::Bytes;

use super::detect::{Backend, Version};
use proxy_model::desired::IpFamily;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("cannot run {command}: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("{command} failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
}

/// The tools of one family with one backend, and the wait flags its version takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Iptables {
    pub family: IpFamily,
    pub backend: Backend,
    pub version: Option<Version>,
}

/// Exit status 1 of `-C`/`-N`: "no such rule" / "chain already exists".
const EXIT_NOT_FOUND_OR_EXISTS: i32 = 1;

impl Iptables {
    fn tool(&self, suffix: &str) -> String {
        let base = match self.family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        match self.backend.binary_infix() {
            Some(infix) => format!("{base}-{infix}{suffix}"),
            None => format!("{base}{suffix}"),
        }
    }

    /// kube-proxy's wait flags: wait for the xtables lock (5 s, polling every 100 ms) where the
    /// version supports it, so a concurrent firewall tool does not fail our sync.
    fn wait_args(&self, restore: bool) -> Vec<&'static str> {
        let Some(version) = self.version else {
            return Vec::new();
        };
        if version >= Version(1, 6, 2) || (!restore && version >= Version(1, 6, 1)) {
            vec!["-w", "5", "-W", "100000"]
        } else if restore {
            vec!["-w"]
        } else if version >= Version(1, 4, 22) {
            vec!["-w", "5"]
        } else if version >= Version(1, 4, 20) {
            vec!["-w"]
        } else {
            Vec::new()
        }
    }

    /// `iptables-restore <wait> --noflush --counters [-T table]` with `data` on stdin.
    pub fn restore(&self, data: &Bytes, table: Option<&str>) -> Result<(), ExecError> {
        let mut args = self.wait_args(true);
        args.extend(["--noflush", "--counters"]);
        if let Some(table) = table {
            args.extend(["-T", table]);
        }
        let program = self.tool("-restore");
        let command = format!("{program} {}", args.join(" "));
        let mut child = Command::new(&program)
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| ExecError::Spawn {
                command: command.clone(),
                source,
            })?;
        if let Some(mut stdin) = child.stdin.take() {
            // A write error means the child exited early; its status and stderr say why.
            let _ = stdin.write_all(data);
        }
        let output = child
            .wait_with_output()
            .map_err(|source| ExecError::Spawn {
                command: command.clone(),
                source,
            })?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
        if let Some(context) = failed_line_context(&stderr, data) {
            tracing::error!(%command, "restore input around the failing line:\n{context}");
        }
        Err(ExecError::Failed {
            command,
            status: output.status.to_string(),
            stderr,
        })
    }

    /// The chain names of one table (`iptables-save -t <table>`).
    pub fn save_chains(&self, table: &str) -> Result<BTreeSet<String>, ExecError> {
        let output = self.output(&self.tool("-save"), &["-t", table])?;
        Ok(chains_of_save(&output))
    }

    /// `iptables-save -t <table>` as text (the drift check).
    pub fn save(&self, table: &str) -> Result<String, ExecError> {
        self.output(&self.tool("-save"), &["-t", table])
    }

    /// `iptables-save -c -t <table>`: the rules with their `[packets:bytes]` counters (the
    /// iptables mode's traffic counters).
    pub fn save_with_counters(&self, table: &str) -> Result<String, ExecError> {
        self.output(&self.tool("-save"), &["-c", "-t", table])
    }

    /// `iptables <wait> -N <chain> -t <table>`; an existing chain is fine.
    pub fn ensure_chain(&self, table: &str, chain: &str) -> Result<(), ExecError> {
        match self.run_cli(&["-N", chain, "-t", table]) {
            Ok(()) => Ok(()),
            Err(ExecStatus::Code(EXIT_NOT_FOUND_OR_EXISTS, _)) => Ok(()),
            Err(status) => Err(status.into_error(self, &["-N", chain, "-t", table])),
        }
    }

    /// Whether a chain exists (`-S <chain> -t <table>`); a resource problem (exit 4, e.g. the
    /// lock) counts as "exists" so a busy system does not trigger a resync storm.
    pub fn chain_exists(&self, table: &str, chain: &str) -> bool {
        match self.run_cli(&["-S", chain, "-t", table]) {
            Ok(()) | Err(ExecStatus::Code(4, _)) => true,
            Err(_) => false,
        }
    }

    /// `-C` then `-I` (position 1) if missing: kube-proxy's `EnsureRule(Prepend, …)`.
    pub fn ensure_rule_first(
        &self,
        table: &str,
        chain: &str,
        rule: &[&str],
    ) -> Result<(), ExecError> {
        let mut check = vec!["-C", chain, "-t", table];
        check.extend_from_slice(rule);
        match self.run_cli(&check) {
            Ok(()) => return Ok(()),
            Err(ExecStatus::Code(EXIT_NOT_FOUND_OR_EXISTS, _)) => {}
            Err(status) => return Err(status.into_error(self, &check)),
        }
        let mut insert = vec!["-I", chain, "-t", table];
        insert.extend_from_slice(rule);
        self.run_cli(&insert)
            .map_err(|status| status.into_error(self, &insert))
    }

    /// Deletes every copy of a rule (`-D` while `-C` finds it).
    pub fn delete_rule(&self, table: &str, chain: &str, rule: &[&str]) -> Result<(), ExecError> {
        let mut check = vec!["-C", chain, "-t", table];
        check.extend_from_slice(rule);
        let mut delete = vec!["-D", chain, "-t", table];
        delete.extend_from_slice(rule);
        while self.run_cli(&check).is_ok() {
            self.run_cli(&delete)
                .map_err(|status| status.into_error(self, &delete))?;
        }
        Ok(())
    }

    /// `iptables <wait> -X <chain> -t <table>`.
    pub fn delete_chain(&self, table: &str, chain: &str) -> Result<(), ExecError> {
        let args = ["-X", chain, "-t", table];
        self.run_cli(&args)
            .map_err(|status| status.into_error(self, &args))
    }

    fn run_cli(&self, args: &[&str]) -> Result<(), ExecStatus> {
        let mut full = self.wait_args(false);
        full.extend_from_slice(args);
        let output = Command::new(self.tool(""))
            .args(&full)
            .stdin(Stdio::null())
            .output()
            .map_err(ExecStatus::Spawn)?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
        Err(ExecStatus::Code(output.status.code().unwrap_or(-1), stderr))
    }

    fn output(&self, program: &str, args: &[&str]) -> Result<String, ExecError> {
        let command = format!("{program} {}", args.join(" "));
        let output = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| ExecError::Spawn {
                command: command.clone(),
                source,
            })?;
        if !output.status.success() {
            return Err(ExecError::Failed {
                command,
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }
}

#[derive(Debug)]
enum ExecStatus {
    Spawn(std::io::Error),
    Code(i32, String),
}

impl ExecStatus {
    fn into_error(self, iptables: &Iptables, args: &[&str]) -> ExecError {
        let command = format!("{} {}", iptables.tool(""), args.join(" "));
        match self {
            ExecStatus::Spawn(source) => ExecError::Spawn { command, source },
            ExecStatus::Code(code, stderr) => ExecError::Failed {
                command,
                status: format!("exit status: {code}"),
                stderr,
            },
        }
    }
}

/// Chain names declared in `iptables-save` output (`:NAME POLICY [p:b]`).
pub fn chains_of_save(save: &str) -> BTreeSet<String> {
    super::save::parse(save)
        .into_iter()
        .flat_map(|table| table.chains)
        .collect()
}

/// For `iptables-restore: line N failed`, the input lines N-3..=N+3 (kube-proxy logs the same).
fn failed_line_context(stderr: &str, data: &[u8]) -> Option<String> {
    let (_, rest) = stderr.split_once("line ")?;
    let line: usize = rest
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    let text = String::from_utf8_lossy(data);
    let first = line.saturating_sub(3).max(1);
    Some(
        text.lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l))
            .filter(|(n, _)| *n >= first && *n <= line + 3)
            .map(|(n, l)| format!("{n:>6} {} {l}", if n == line { "=>" } else { "  " }))
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_output_chain_names() {
        let save = "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SVC-X - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n";
        let chains = chains_of_save(save);
        assert_eq!(
            chains.into_iter().collect::<Vec<_>>(),
            ["KUBE-SVC-X", "PREROUTING"]
        );
    }

    #[test]
    fn failing_line_is_shown_with_context() {
        let data = b"a\nb\nc\nd\ne\nf\ng\nh\n";
        let context = failed_line_context("iptables-restore: line 5 failed", data).unwrap();
        assert!(context.contains("     5 => e"));
        assert!(context.contains("     2    b"));
        assert!(context.contains("     8    h"));
        assert!(!context.contains(" a"));
    }

    #[test]
    fn wait_flags_follow_the_version() {
        let tool = |version| Iptables {
            family: IpFamily::V4,
            backend: Backend::Default,
            version,
        };
        assert_eq!(
            tool(Some(Version(1, 8, 9))).wait_args(true),
            ["-w", "5", "-W", "100000"]
        );
        assert_eq!(tool(Some(Version(1, 6, 1))).wait_args(true), ["-w"]);
        assert_eq!(
            tool(Some(Version(1, 6, 1))).wait_args(false),
            ["-w", "5", "-W", "100000"]
        );
        assert_eq!(tool(Some(Version(1, 4, 21))).wait_args(false), ["-w"]);
        assert!(tool(None).wait_args(true).is_empty());
        assert_eq!(tool(None).tool("-restore"), "iptables-restore");
        let nft = Iptables {
            family: IpFamily::V6,
            backend: Backend::Nft,
            version: None,
        };
        assert_eq!(nft.tool("-save"), "ip6tables-nft-save");
    }
}
