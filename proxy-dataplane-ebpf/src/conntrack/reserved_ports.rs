//! The SNAT port range (`--bpf-snat-port-range`) kept out of the node's ephemeral ports through
//! `net.ipv4.ip_local_reserved_ports` (per network namespace; it covers IPv6 too). The tc
//! programs source-NAT to the node address with ports of that range; a connection the node
//! itself made from one of them to the same backend would share the flow's 4-tuple, and the
//! backend's replies would go to whichever flow the tc conntrack names. Reserved ports are
//! skipped by the kernel's automatic port choice (connect, bind to port 0); an explicit bind
//! still gets them.
//!
//! The agent adds the range at start and leaves it when it exits (a restarted agent keeps its
//! flows' ports); `--cleanup` and a switch to iptables mode remove it again (the whole range:
//! a port inside it the administrator reserved too is released as well).

use std::{io, ops::RangeInclusive, path::Path};

use tracing::{debug, info, warn};

pub const SYSCTL: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

pub use proxy_model::config::ebpf_settings::DEFAULT_SNAT_RANGE as DEFAULT_RANGE;

/// The sysctl's text (`"8080,9000-9010"`, empty: none) as sorted, merged ranges. `None` if
/// the text is not such a list.
pub fn parse(text: &str) -> Option<Vec<RangeInclusive<u16>>> {
    let mut ranges = Vec::new();
    for item in text
        .trim()
        .split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
    {
        let (low, high) = match item.split_once('-') {
            Some((low, high)) => (low.trim().parse().ok()?, high.trim().parse().ok()?),
            None => {
                let port = item.parse().ok()?;
                (port, port)
            }
        };
        if low > high {
            return None;
        }
        ranges.push(low..=high);
    }
    Some(normalize(ranges))
}

fn normalize(mut ranges: Vec<RangeInclusive<u16>>) -> Vec<RangeInclusive<u16>> {
    ranges.sort_by_key(|r| *r.start());
    let mut merged: Vec<RangeInclusive<u16>> = Vec::new();
    for range in ranges {
        match merged.last_mut() {
            Some(last) if u32::from(*range.start()) <= u32::from(*last.end()) + 1 => {
                *last = *last.start()..=(*last.end()).max(*range.end());
            }
            _ => merged.push(range),
        }
    }
    merged
}

/// The sysctl's text for `ranges`.
pub fn format(ranges: &[RangeInclusive<u16>]) -> String {
    ranges
        .iter()
        .map(|r| {
            if r.start() == r.end() {
                r.start().to_string()
            } else {
                format!("{}-{}", r.start(), r.end())
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `ranges` with `add` reserved too.
pub fn with(ranges: &[RangeInclusive<u16>], add: &RangeInclusive<u16>) -> Vec<RangeInclusive<u16>> {
    let mut all = ranges.to_vec();
    all.push(add.clone());
    normalize(all)
}

/// `ranges` without the ports of `remove`.
pub fn without(
    ranges: &[RangeInclusive<u16>],
    remove: &RangeInclusive<u16>,
) -> Vec<RangeInclusive<u16>> {
    let mut left = Vec::new();
    for range in ranges {
        if range.end() < remove.start() || range.start() > remove.end() {
            left.push(range.clone());
            continue;
        }
        if range.start() < remove.start() {
            left.push(*range.start()..=remove.start() - 1);
        }
        if range.end() > remove.end() {
            left.push(remove.end() + 1..=*range.end());
        }
    }
    left
}

/// Rewrites the sysctl at `path` with `change` applied to its ranges, if that changes them.
/// Returns whether it wrote.
fn update(
    path: &Path,
    change: impl FnOnce(&[RangeInclusive<u16>]) -> Vec<RangeInclusive<u16>>,
) -> io::Result<bool> {
    let text = std::fs::read_to_string(path)?;
    let have = parse(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected content {:?}", text.trim()),
        )
    })?;
    let want = change(&have);
    if want == have {
        return Ok(false);
    }
    // With a newline: a zero-length write never reaches the sysctl, so "none" would not stick.
    std::fs::write(path, format!("{}\n", format(&want)))?;
    Ok(true)
}

/// Reserves `range` in this network namespace; a failure is logged (the agent runs on, with
/// the risk of collisions the reservation avoids).
pub fn reserve(range: &RangeInclusive<u16>) {
    match update(Path::new(SYSCTL), |have| with(have, range)) {
        Ok(true) => info!(
            ports = %format(std::slice::from_ref(range)),
            "SNAT ports reserved from the node's ephemeral ports (ip_local_reserved_ports)"
        ),
        Ok(false) => {
            debug!(ports = %format(std::slice::from_ref(range)), "SNAT ports already reserved")
        }
        Err(error) => warn!(
            sysctl = SYSCTL,
            %error,
            "cannot reserve the SNAT ports; a connection of the node itself may take one"
        ),
    }
}

/// Releases `range` (`--cleanup`, a switch to iptables mode).
pub fn release(range: &RangeInclusive<u16>) {
    match update(Path::new(SYSCTL), |have| without(have, range)) {
        Ok(true) => info!(
            ports = %format(std::slice::from_ref(range)),
            "SNAT ports released (ip_local_reserved_ports)"
        ),
        Ok(false) => debug!("no SNAT ports to release"),
        Err(error) => warn!(sysctl = SYSCTL, %error, "cannot release the SNAT ports"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_merges_adds_and_removes() {
        let have = parse("8080, 9000-9010,9011,50000-50010\n").expect("parse");
        assert_eq!(have, vec![8080..=8080, 9000..=9011, 50000..=50010]);
        assert_eq!(parse(""), Some(vec![]));
        assert_eq!(parse("5-4"), None);
        assert_eq!(parse("x"), None);
        let added = with(&have, &DEFAULT_RANGE);
        assert_eq!(format(&added), "8080,9000-9011,49152-65535");
        let removed = without(&added, &DEFAULT_RANGE);
        assert_eq!(format(&removed), "8080,9000-9011");
        assert_eq!(format(&without(&[1..=10], &(3..=5))), "1-2,6-10");
        assert_eq!(format(&without(&[1..=10], &(1..=10))), "");
        assert_eq!(format(&with(&[1..=2], &(3..=3))), "1-3");
    }
}
