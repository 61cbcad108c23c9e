//! `/metrics` formats as client_golang's `promhttp` serves them: content negotiation
//! (`expfmt.NegotiateIncludingOpenMetrics` over goautoneg's parsing of `Accept`) and the classic
//! Prometheus text format 0.0.4 (`expfmt.MetricFamilyToText`).
//!
//! prometheus-client only writes OpenMetrics, so the classic text is derived from its output:
//! a counter family `x` with samples `x_total` becomes the family `x_total` (what a Go counter
//! named `x_total` is), `_created` samples and `# EOF` go, `unknown` is `untyped`, numbers are
//! written as Go's `strconv.FormatFloat(f, 'g', -1, 64)`, histogram buckets come before `_sum`
//! and `_count`, and families are sorted by name and series by label values, as client_golang's
//! `Gather` does.

/// A negotiated exposition format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4.
    Text,
    /// OpenMetrics text; the version asked for (`0.0.1` or `1.0.0`).
    OpenMetrics(&'static str),
}

/// Name escaping schemes a scraper may ask for (prometheus/common `model`); every name we expose
/// is a legacy name, so the body is the same whichever it is, only the header echoes it.
const ESCAPING_SCHEMES: [&str; 4] = ["allow-utf-8", "underscores", "dots", "values"];

/// The negotiated format and the `Content-Type` answered with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub format: Format,
    pub content_type: String,
}

struct AcceptEntry<'a> {
    media: &'a str,
    q: f64,
    params: Vec<(&'a str, &'a str)>,
}

impl AcceptEntry<'_> {
    fn param(&self, key: &str) -> Option<&str> {
        self.params.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }
}

/// goautoneg's `ParseAccept`: entries sorted by quality, then concrete types before wildcards.
fn parse_accept(header: &str) -> Vec<AcceptEntry<'_>> {
    let mut entries: Vec<AcceptEntry<'_>> = header
        .split(',')
        .filter_map(|part| {
            let mut pieces = part.split(';');
            let media = pieces.next()?.trim();
            if media.is_empty() {
                return None;
            }
            let mut q = 1.0;
            let mut params = Vec::new();
            for piece in pieces {
                let Some((key, value)) = piece.split_once('=') else {
                    continue;
                };
                let (key, value) = (key.trim(), value.trim());
                if key == "q" {
                    q = value.parse().unwrap_or(0.0);
                } else {
                    params.push((key, value));
                }
            }
            Some(AcceptEntry { media, q, params })
        })
        .collect();
    let wildcards = |media: &str| {
        let (kind, sub) = media.split_once('/').unwrap_or((media, "*"));
        (kind == "*", sub == "*")
    };
    entries.sort_by(|a, b| {
        b.q.total_cmp(&a.q)
            .then_with(|| wildcards(a.media).cmp(&wildcards(b.media)))
    });
    entries
}

/// `expfmt.NegotiateIncludingOpenMetrics` (what `promhttp` uses with `EnableOpenMetrics`),
/// without the protobuf formats: a protobuf entry is passed over, so such a scraper gets the
/// text format it lists next (Prometheus always lists it) or by default.
pub fn negotiate(accept: Option<&str>) -> Negotiated {
    let mut escaping = "underscores";
    for entry in parse_accept(accept.unwrap_or("")) {
        if let Some(scheme) = entry.param("escaping")
            && let Some(known) = ESCAPING_SCHEMES.iter().find(|s| **s == scheme)
        {
            escaping = known;
        }
        let version = entry.param("version").unwrap_or("");
        if entry.media == "text/plain" && (version == "0.0.4" || version.is_empty()) {
            return text(escaping);
        }
        if entry.media == "application/openmetrics-text"
            && matches!(version, "" | "0.0.1" | "1.0.0")
        {
            let version = if version == "1.0.0" { "1.0.0" } else { "0.0.1" };
            return Negotiated {
                format: Format::OpenMetrics(version),
                content_type: format!(
                    "application/openmetrics-text; version={version}; charset=utf-8; escaping={escaping}"
                ),
            };
        }
    }
    text(escaping)
}

fn text(escaping: &str) -> Negotiated {
    Negotiated {
        format: Format::Text,
        content_type: format!("text/plain; version=0.0.4; charset=utf-8; escaping={escaping}"),
    }
}

/// Go's `strconv.FormatFloat(value, 'g', -1, 64)` with client_golang's spellings of the
/// specials (`+Inf`, `-Inf`, `NaN`).
pub fn go_float(value: f64) -> String {
    if value.is_nan() {
        return "NaN".to_owned();
    }
    if value.is_infinite() {
        return if value > 0.0 { "+Inf" } else { "-Inf" }.to_owned();
    }
    if value == 0.0 {
        return if value.is_sign_negative() { "-0" } else { "0" }.to_owned();
    }
    // Rust's `{:e}` gives the shortest digits that round-trip, as Go's shortest mode does.
    let scientific = format!("{:e}", value.abs());
    let (mantissa, exponent) = scientific
        .split_once('e')
        .unwrap_or((scientific.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if value < 0.0 { "-" } else { "" };
    // Go: %e when the exponent is < -4 or >= the precision, 6 in shortest mode.
    if !(-4..6).contains(&exponent) {
        let (first, rest) = digits.split_at(1);
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{first}{fraction}e{exp_sign}{:02}", exponent.abs());
    }
    let point = exponent + 1; // digits before the decimal point
    let formatted = if point <= 0 {
        let zeros = "0".repeat(usize::try_from(-point).unwrap_or(0));
        format!("0.{zeros}{digits}")
    } else {
        let point = usize::try_from(point).unwrap_or(0);
        if digits.len() <= point {
            format!("{digits}{}", "0".repeat(point - digits.len()))
        } else {
            format!("{}.{}", &digits[..point], &digits[point..])
        }
    };
    format!("{sign}{formatted}")
}

/// Label pairs (name, escaped value).
type Labels = Vec<(String, String)>;

/// One sample line: name, labels (name, escaped value) and the value text.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: String,
}

#[derive(Debug, Default)]
struct Family {
    name: String,
    kind: String,
    help: Option<String>,
    samples: Vec<Sample>,
}

/// Splits `name{a="x",b="y"} value ...`; label values stay escaped (both formats escape them
/// alike). `None` for a line that is not a sample.
fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices();
        let mut start = 0;
        let mut close = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '}' => {
                    close = Some(i);
                    break;
                }
                '=' => {
                    let key = inner[start..i].trim_start_matches(',').trim();
                    let (open, quote) = chars.next()?;
                    if quote != '"' {
                        return None;
                    }
                    let mut end = None;
                    while let Some((j, c)) = chars.next() {
                        match c {
                            '\\' => {
                                chars.next();
                            }
                            '"' => {
                                end = Some(j);
                                break;
                            }
                            _ => {}
                        }
                    }
                    let end = end?;
                    labels.push((key.to_owned(), inner[open + 1..end].to_owned()));
                    start = end + 1;
                }
                _ => {}
            }
        }
        rest = &inner[close? + 1..];
    }
    let value = rest.split_whitespace().next()?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value: value.to_owned(),
    })
}

fn unescape_openmetrics_help(help: &str) -> String {
    let mut out = String::with_capacity(help.len());
    let mut chars = help.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

fn escape_text_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

fn parse_openmetrics(openmetrics: &str) -> Vec<Family> {
    let mut families: Vec<Family> = Vec::new();
    for line in openmetrics.lines() {
        if let Some(comment) = line.strip_prefix("# ") {
            let mut parts = comment.splitn(3, ' ');
            let (Some(keyword), Some(name)) = (parts.next(), parts.next()) else {
                continue;
            };
            let rest = parts.next().unwrap_or("");
            if families.last().is_none_or(|f| f.name != name) {
                if !matches!(keyword, "HELP" | "TYPE" | "UNIT") {
                    continue;
                }
                families.push(Family {
                    name: name.to_owned(),
                    kind: "unknown".to_owned(),
                    ..Family::default()
                });
            }
            let Some(family) = families.last_mut() else {
                continue;
            };
            match keyword {
                "HELP" => family.help = Some(unescape_openmetrics_help(rest)),
                "TYPE" => rest.clone_into(&mut family.kind),
                _ => {}
            }
        } else if let Some(sample) = parse_sample(line) {
            match families.last_mut() {
                Some(family) => family.samples.push(sample),
                None => families.push(Family {
                    name: sample.name.clone(),
                    kind: "unknown".to_owned(),
                    help: None,
                    samples: vec![sample],
                }),
            }
        }
    }
    families
}

/// A series of a family: its labels without `le`/`quantile`, sorted by name.
fn series_key(sample: &Sample) -> Vec<(String, String)> {
    let mut labels: Vec<(String, String)> = sample
        .labels
        .iter()
        .filter(|(name, _)| name != "le" && name != "quantile")
        .cloned()
        .collect();
    labels.sort();
    labels
}

/// Go's `MetricSorter`: fewer labels first, then label values in label-name order.
fn series_order(a: &[(String, String)], b: &[(String, String)]) -> std::cmp::Ordering {
    a.len()
        .cmp(&b.len())
        .then_with(|| a.iter().map(|(_, v)| v).cmp(b.iter().map(|(_, v)| v)))
}

fn write_sample(
    out: &mut String,
    name: &str,
    labels: &[(String, String)],
    extra: Option<(&str, &str)>,
    value: &str,
) {
    out.push_str(name);
    let extra = extra.map(|(key, raw)| {
        // The bound is a number: client_golang writes it as Go formats a float.
        let parsed = match raw {
            "+Inf" => Some(f64::INFINITY),
            "-Inf" => Some(f64::NEG_INFINITY),
            other => other.parse::<f64>().ok(),
        };
        (key, parsed.map_or_else(|| raw.to_owned(), go_float))
    });
    if !labels.is_empty() || extra.is_some() {
        out.push('{');
        let mut first = true;
        let pairs = labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .chain(extra);
        for (key, value) in pairs {
            if !first {
                out.push(',');
            }
            first = false;
            out.push_str(key);
            out.push_str("=\"");
            out.push_str(&value);
            out.push('"');
        }
        out.push('}');
    }
    out.push(' ');
    let number = match value {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        other => other.parse::<f64>().ok(),
    };
    out.push_str(&number.map_or_else(|| value.to_owned(), go_float));
    out.push('\n');
}

/// The classic text format of an OpenMetrics exposition (see the module comment).
pub fn openmetrics_to_text(openmetrics: &str) -> String {
    let mut families = parse_openmetrics(openmetrics);
    for family in &mut families {
        if family.kind == "counter" && !family.name.ends_with("_total") {
            family.name.push_str("_total");
        }
    }
    families.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = String::with_capacity(openmetrics.len());
    for family in families {
        let kind = match family.kind.as_str() {
            "counter" | "gauge" | "histogram" | "summary" => family.kind.as_str(),
            "info" => "gauge",
            _ => "untyped",
        };
        // Series in first-seen order, then sorted; each keeps its samples.
        let mut series: Vec<(Labels, Vec<Sample>)> = Vec::new();
        for sample in family.samples {
            if sample.name.ends_with("_created")
                && matches!(kind, "counter" | "histogram" | "summary")
            {
                continue;
            }
            let key = series_key(&sample);
            match series.iter_mut().find(|(k, _)| *k == key) {
                Some((_, samples)) => samples.push(sample),
                None => series.push((key, vec![sample])),
            }
        }
        if series.is_empty() {
            continue;
        }
        series.sort_by(|a, b| series_order(&a.0, &b.0));
        if let Some(help) = &family.help {
            out.push_str(&format!(
                "# HELP {} {}\n",
                family.name,
                escape_text_help(help)
            ));
        }
        out.push_str(&format!("# TYPE {} {kind}\n", family.name));
        for (labels, mut samples) in series {
            // client_golang: buckets (or quantiles) first, then _sum and _count.
            let rank = |s: &Sample| {
                if s.name.ends_with("_sum") {
                    1
                } else if s.name.ends_with("_count") {
                    2
                } else {
                    0
                }
            };
            if matches!(kind, "histogram" | "summary") {
                samples.sort_by_key(rank);
            }
            for sample in &samples {
                let extra = sample
                    .labels
                    .iter()
                    .find(|(name, _)| name == "le" || name == "quantile")
                    .map(|(name, value)| (name.as_str(), value.as_str()));
                write_sample(&mut out, &sample.name, &labels, extra, &sample.value);
            }
        }
    }
    out
}
