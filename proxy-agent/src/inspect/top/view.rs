//! The pure part of `inspect top`: readings → totals since the view started and rates since the
//! last reading, the rows' order, and a frame as text of a given width and height.
//!
//! Readings count per unit (an eBPF service id, an iptables rule), cumulatively since the unit
//! began counting; a row is a Service port and frontend kind, the sum of its units. A unit whose
//! counts go back (the agent rewrote a rule's chain, which restarts its counters, or handed an
//! id to another frontend) or whose key changes has started over: its whole reading is its
//! increase, so no rate is ever negative and nothing is taken back from a total.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt::Write as _,
    time::Duration,
};

use proxy_model::{
    cli::TopSort,
    traffic::{ServiceTrafficKey, TrafficCounts, TrafficReading},
};

/// New, rejected and dropped connections (either reason).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub new: u64,
    pub rejected: u64,
    pub dropped: u64,
}

impl Counts {
    fn of(counts: &TrafficCounts) -> Self {
        Self {
            new: counts.new_connections,
            rejected: counts.rejected,
            dropped: counts
                .dropped_source_range
                .saturating_add(counts.dropped_no_local),
        }
    }

    fn add(&mut self, other: Counts) {
        self.new = self.new.saturating_add(other.new);
        self.rejected = self.rejected.saturating_add(other.rejected);
        self.dropped = self.dropped.saturating_add(other.dropped);
    }

    /// Whether any count is below `earlier`'s: the unit started over in between.
    fn went_back_from(&self, earlier: &Counts) -> bool {
        self.new < earlier.new || self.rejected < earlier.rejected || self.dropped < earlier.dropped
    }

    fn minus(&self, earlier: &Counts) -> Counts {
        Counts {
            new: self.new - earlier.new,
            rejected: self.rejected - earlier.rejected,
            dropped: self.dropped - earlier.dropped,
        }
    }
}

/// Per second, over the time between two readings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    pub new: f64,
    pub rejected: f64,
    pub dropped: f64,
}

/// One Service port and frontend kind.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub key: ServiceTrafficKey,
    /// Since the view's first reading.
    pub totals: Counts,
    /// Since the reading before the last one; `None` before the second reading.
    pub rates: Option<Rates>,
}

/// Totals and rates from successive readings.
#[derive(Debug, Default)]
pub struct Tracker {
    /// Each unit's last counts and what they were counted for.
    last: HashMap<u64, (ServiceTrafficKey, Counts)>,
    rows: BTreeMap<ServiceTrafficKey, Row>,
    readings: u64,
}

impl Tracker {
    /// Takes a reading made `elapsed` after the previous one (ignored for the first, which is
    /// the baseline: what was counted before the view started is in no total).
    pub fn record(&mut self, reading: &TrafficReading, elapsed: Duration) {
        let baseline = self.readings == 0;
        self.readings += 1;
        let mut increases: HashMap<&ServiceTrafficKey, Counts> = HashMap::new();
        let mut seen = HashSet::with_capacity(reading.services.len());
        for sample in &reading.services {
            // Two samples of one unit (never from the readers) would count twice: the first wins.
            if !seen.insert(sample.unit) {
                continue;
            }
            let counts = Counts::of(&sample.counts);
            let increase = match self.last.get(&sample.unit) {
                _ if baseline => Counts::default(),
                Some((key, last)) if *key == sample.key && !counts.went_back_from(last) => {
                    counts.minus(last)
                }
                // New since the view started, or started over: all of it is new.
                _ => counts,
            };
            self.last.insert(sample.unit, (sample.key.clone(), counts));
            increases.entry(&sample.key).or_default().add(increase);
        }
        // Units gone from the reading keep nothing: one that comes back starts over.
        self.last.retain(|unit, _| seen.contains(unit));
        let seconds = elapsed.as_secs_f64();
        let rate = |n: u64| {
            if seconds > 0.0 {
                n as f64 / seconds
            } else {
                0.0
            }
        };
        for row in self.rows.values_mut() {
            row.rates = (!baseline).then_some(Rates::default());
        }
        for (key, increase) in increases {
            let row = self.rows.entry(key.clone()).or_insert_with(|| Row {
                key: key.clone(),
                totals: Counts::default(),
                rates: (!baseline).then_some(Rates::default()),
            });
            row.totals.add(increase);
            if !baseline {
                row.rates = Some(Rates {
                    new: rate(increase.new),
                    rejected: rate(increase.rejected),
                    dropped: rate(increase.dropped),
                });
            }
        }
    }

    /// The rows in `sort`'s order.
    pub fn rows(&self, sort: TopSort) -> Vec<&Row> {
        let mut rows: Vec<&Row> = self.rows.values().collect();
        sort_rows(&mut rows, sort);
        rows
    }

    /// Readings taken so far.
    pub fn readings(&self) -> u64 {
        self.readings
    }
}

/// By a count's rate, then its total, busiest first, then by name; or by name alone.
pub fn sort_rows(rows: &mut [&Row], sort: TopSort) {
    let pick = |row: &Row| -> (f64, u64) {
        let rates = row.rates.unwrap_or_default();
        match sort {
            TopSort::New => (rates.new, row.totals.new),
            TopSort::Rejected => (rates.rejected, row.totals.rejected),
            TopSort::Dropped => (rates.dropped, row.totals.dropped),
            TopSort::Name => (0.0, 0),
        }
    };
    rows.sort_by(|a, b| {
        let (rate_a, total_a) = pick(a);
        let (rate_b, total_b) = pick(b);
        rate_b
            .total_cmp(&rate_a)
            .then(total_b.cmp(&total_a))
            .then_with(|| a.key.cmp(&b.key))
    });
}

/// What the frame's first line says besides the rows.
#[derive(Debug, Clone)]
pub struct Header<'a> {
    /// `eBPF (…)` or `iptables (…)`: where the counts are read.
    pub source: &'a str,
    pub interval: Duration,
    /// Since the view started.
    pub elapsed: Duration,
    pub sort: TopSort,
    /// Show the keys line (interactive).
    pub keys: bool,
    /// The last reading's error, shown instead of hiding the last good rows.
    pub error: Option<&'a str>,
}

pub const fn sort_name(sort: TopSort) -> &'static str {
    match sort {
        TopSort::New => "new/s",
        TopSort::Rejected => "rejected/s",
        TopSort::Dropped => "dropped/s",
        TopSort::Name => "name",
    }
}

/// Interactive keys → the order they ask for.
pub const fn sort_for_key(key: u8) -> Option<TopSort> {
    match key {
        b'n' => Some(TopSort::New),
        b'r' => Some(TopSort::Rejected),
        b'd' => Some(TopSort::Dropped),
        b's' | b'N' => Some(TopSort::Name),
        _ => None,
    }
}

/// The column headings; the rows are written with the same widths.
const COLUMNS: &str = "SERVICE                                  PORT                 FRONTEND         NEW/S    REJ/S   DROP/S        NEW   REJECTED    DROPPED";

/// A frame: the header lines, the column headings and as many rows as fit in `height` lines
/// (the last one saying how many did not), each line cut to `width` characters. Names are
/// escaped (anything but printable ASCII), so no reading can move the cursor or change the
/// terminal.
pub fn render(header: &Header<'_>, rows: &[&Row], width: usize, height: usize) -> String {
    let mut lines: Vec<String> = Vec::new();
    lines.push(format!(
        "kubeproxy-rs top: {} | every {} | up {} | sort: {}",
        header.source,
        duration_text(header.interval),
        clock(header.elapsed),
        sort_name(header.sort),
    ));
    if header.keys {
        lines.push("keys: n new/s  r rejected/s  d dropped/s  s name  q quit".to_owned());
    }
    if let Some(error) = header.error {
        lines.push(format!("error: {}", escape(error)));
    }
    lines.push(COLUMNS.to_owned());
    let room = height.saturating_sub(lines.len());
    let shown = if rows.len() > room {
        room.saturating_sub(1)
    } else {
        rows.len()
    };
    for row in &rows[..shown] {
        lines.push(row_line(row));
    }
    if shown < rows.len() && room > 0 {
        lines.push(format!("... {} more", rows.len() - shown));
    }
    let mut out = String::new();
    for line in lines.iter().take(height) {
        out.extend(line.chars().take(width));
        out.push('\n');
    }
    out
}

fn row_line(row: &Row) -> String {
    let service = &row.key.service;
    let name = escape(&format!("{}/{}", service.namespace, service.name));
    let port = if service.port.is_empty() {
        "-".to_owned()
    } else {
        escape(&service.port)
    };
    let port = format!("{port}/{}", service.protocol.as_k8s());
    let rate = |value: Option<f64>| value.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    let rates = row.rates;
    let mut line = String::new();
    let _ = write!(
        line,
        "{name:<40} {port:<20} {:<14} {:>7}  {:>7}  {:>7} {:>10} {:>10} {:>10}",
        row.key.frontend.label(),
        rate(rates.map(|r| r.new)),
        rate(rates.map(|r| r.rejected)),
        rate(rates.map(|r| r.dropped)),
        row.totals.new,
        row.totals.rejected,
        row.totals.dropped,
    );
    line
}

/// Printable ASCII as is, anything else as a Rust escape (`\u{1b}`, `\n`, `\u{e9}`):
/// Kubernetes names are ASCII, so a name that is not is shown for what it holds.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c == ' ' || c.is_ascii_graphic() {
            out.push(c);
        } else {
            out.extend(c.escape_default());
        }
    }
    out
}

/// `1:02:03` or `2:03`.
fn clock(elapsed: Duration) -> String {
    let secs = elapsed.as_secs();
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

fn duration_text(interval: Duration) -> String {
    if interval.subsec_millis() == 0 {
        format!("{}s", interval.as_secs())
    } else {
        format!("{}ms", interval.as_millis())
    }
}

/// `--interval`: seconds (`2`, `0.5`) or a number with `s` or `ms`; at least 100 ms, at most a
/// day.
pub fn parse_interval(text: &str) -> Option<Duration> {
    let text = text.trim();
    let (number, scale) = if let Some(ms) = text.strip_suffix("ms") {
        (ms, 0.001)
    } else if let Some(s) = text.strip_suffix('s') {
        (s, 1.0)
    } else {
        (text, 1.0)
    };
    let seconds = number.trim().parse::<f64>().ok()? * scale;
    (seconds.is_finite() && (0.1..=86_400.0).contains(&seconds))
        .then(|| Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests;
