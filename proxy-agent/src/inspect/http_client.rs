//! The one HTTP client of `inspect`: a GET to the agent's metrics address, which answers a
//! short body or, for `/debug/drift`, `429` with `Retry-After` when asked too often.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context as _, bail};

/// A 200's body, or how long a 429 asks to wait.
pub enum Answer {
    Body(String),
    RetryAfter(Duration),
}

pub fn get(addr: SocketAddr, path: &str, read_timeout: Duration) -> anyhow::Result<Answer> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))
        .with_context(|| format!("cannot reach the agent at {addr}"))?;
    stream.set_read_timeout(Some(read_timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    if head.starts_with("HTTP/1.1 429") {
        let seconds = head
            .lines()
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("retry-after")
                    .then(|| value.trim().parse::<u64>().ok())
                    .flatten()
            })
            .unwrap_or(1);
        return Ok(Answer::RetryAfter(Duration::from_secs(
            seconds.clamp(1, 10),
        )));
    }
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "{addr}{path}: {} {}",
            head.lines().next().unwrap_or_default(),
            body.trim()
        );
    }
    Ok(Answer::Body(body.to_owned()))
}
