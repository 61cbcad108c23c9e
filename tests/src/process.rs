//! Bounded execution of short-lived commands (`ip`, the client helper).

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Result, RigError};

/// Default bound for topology commands; `ip` normally finishes in milliseconds.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// Renders a command for error messages.
pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd` to completion, capturing output; kills it if it outlives `timeout`.
pub fn run_bounded(cmd: &mut Command, timeout: Duration) -> Result<Output> {
    run_bounded_with_input(cmd, None, timeout)
}

/// [`run_bounded`] with `input` written to the child's stdin (then closed); `None`: stdin is
/// `/dev/null`.
pub fn run_bounded_with_input(
    cmd: &mut Command,
    input: Option<&[u8]>,
    timeout: Duration,
) -> Result<Output> {
    let what = describe(cmd);
    let mut child = cmd
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| RigError::io(format!("spawning `{what}`"), e))?;
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        // Small (a network configuration): the pipe's buffer takes it whole, so writing
        // before draining stdout cannot deadlock.
        if let Err(e) = stdin.write_all(input) {
            kill_and_reap(&mut child);
            return Err(RigError::io(format!("writing the stdin of `{what}`"), e));
        }
    }
    // Drain both pipes on threads so a chatty child cannot block on a full pipe.
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let status = wait_bounded(&mut child, timeout)?;
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    match status {
        Some(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        None => Err(RigError::Timeout {
            what: format!("`{what}`"),
            waited: timeout,
            detail: format!("; stderr: {}", String::from_utf8_lossy(&stderr)),
        }),
    }
}

/// Runs `cmd` (bounded) and fails unless it exits successfully; returns stdout.
pub fn run_ok(cmd: &mut Command) -> Result<String> {
    run_ok_within(cmd, COMMAND_TIMEOUT)
}

/// [`run_ok`] with a bound of the caller's (a client helper's run).
pub fn run_ok_within(cmd: &mut Command, timeout: Duration) -> Result<String> {
    let out = run_bounded(cmd, timeout)?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(RigError::Command {
            command: describe(cmd),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// Waits up to `timeout` for `child`; on timeout kills it (SIGKILL), reaps it and returns None.
pub fn wait_bounded(child: &mut Child, timeout: Duration) -> Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child
            .try_wait()
            .map_err(|e| RigError::io("waiting for child", e))?
        {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            kill_and_reap(child);
            return Ok(None);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILLs and reaps `child`, ignoring errors (it may already be gone). For Drop paths.
pub fn kill_and_reap(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        buf
    })
}
