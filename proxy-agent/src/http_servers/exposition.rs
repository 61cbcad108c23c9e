//! `/metrics` formats as client_golang's `promhttp` serves them: content negotiation
//! (`expfmt.NegotiateIncludingOpenMetrics` over goautoneg's parsing of `Accept`), the classic
//! Prometheus text format 0.0.4 (`expfmt.MetricFamilyToText`), and the families the protobuf
//! exposition (`protobuf.rs`) writes.
//!
//! prometheus-client only writes OpenMetrics, so the classic families are derived from its
//! output: a counter family `x` with samples `x_total` becomes the family `x_total` (what a Go
//! counter named `x_total` is), `_created` samples and `# EOF` go, `unknown` is `untyped`,
//! numbers are written as Go's `strconv.FormatFloat(f, 'g', -1, 64)`, histogram buckets come
//! before `_sum` and `_count`, and families are sorted by name and series by label values, as
//! client_golang's `Gather` does.

/// A negotiated exposition format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4.
    Text,
    /// OpenMetrics text; the version asked for (`0.0.1` or `1.0.0`).
    OpenMetrics(&'static str),
    /// Length-delimited `io.prometheus.client.MetricFamily` messages, the only format that
    /// carries native histograms.
    Protobuf,
}

/// expfmt's `ProtoType`, `ProtoProtocol` and the delimited encoding's parameter.
pub const PROTOBUF_MEDIA_TYPE: &str = "application/vnd.google.protobuf";
pub const PROTOBUF_PROTO: &str = "io.prometheus.client.MetricFamily";
pub const PROTOBUF_ENCODING: &str = "delimited";

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

/// `expfmt.NegotiateIncludingOpenMetrics` (what `promhttp` uses with `EnableOpenMetrics`): per
/// `Accept` entry, protobuf when the entry is expfmt's `ProtoType` with
/// `proto=io.prometheus.client.MetricFamily` and `encoding=delimited` (what Prometheus asks
/// for when it scrapes native histograms), then the text format, then OpenMetrics. The
/// protobuf text encodings (`encoding=text`, `compact-text`), debugging aids nobody scrapes,
/// are passed over, so such an entry gets the next one's format.
pub fn negotiate(accept: Option<&str>) -> Negotiated {
    let mut escaping = "underscores";
    for entry in parse_accept(accept.unwrap_or("")) {
        if let Some(scheme) = entry.param("escaping")
            && let Some(known) = ESCAPING_SCHEMES.iter().find(|s| **s == scheme)
        {
            escaping = known;
        }
        if entry.media == PROTOBUF_MEDIA_TYPE
            && entry.param("proto") == Some(PROTOBUF_PROTO)
            && entry.param("encoding") == Some(PROTOBUF_ENCODING)
        {
            return Negotiated {
                format: Format::Protobuf,
                content_type: format!(
                    "{PROTOBUF_MEDIA_TYPE}; proto={PROTOBUF_PROTO}; encoding={PROTOBUF_ENCODING}; escaping={escaping}"
                ),
            };
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
pub type Labels = Vec<(String, String)>;

/// One sample line: name, labels (name, escaped value) and the value text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub name: String,
    pub labels: Labels,
    pub value: String,
}

impl Sample {
    /// The bucket's `le` or the quantile's `quantile` (its value text), if the sample has one.
    pub fn bound(&self) -> Option<(&str, &str)> {
        self.labels
            .iter()
            .find(|(name, _)| name == "le" || name == "quantile")
            .map(|(name, value)| (name.as_str(), value.as_str()))
    }
}

/// A sample value or bound as written (`+Inf`, `-Inf` and `NaN` included).
pub fn parse_number(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        other => other.parse::<f64>().ok(),
    }
}

/// The type a family has in the classic formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
    Summary,
    Untyped,
}

impl Kind {
    /// The OpenMetrics type's classic counterpart (`info` is a gauge there).
    fn of_openmetrics(kind: &str) -> Self {
        match kind {
            "counter" => Self::Counter,
            "gauge" | "info" => Self::Gauge,
            "histogram" => Self::Histogram,
            "summary" => Self::Summary,
            _ => Self::Untyped,
        }
    }

    pub fn as_text(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
            Self::Summary => "summary",
            Self::Untyped => "untyped",
        }
    }
}

/// One series of a family: its labels (without `le`/`quantile`, sorted by name, values
/// escaped) and its samples (a histogram's buckets, then `_sum`, then `_count`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Series {
    pub labels: Labels,
    pub samples: Vec<Sample>,
}

/// A family as the classic formats expose it (client_golang's gathered `MetricFamily`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExposedFamily {
    pub name: String,
    pub kind: Kind,
    /// The help text, unescaped.
    pub help: Option<String>,
    pub series: Vec<Series>,
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

/// OpenMetrics escapes HELP text as it escapes label values.
fn unescape_openmetrics_help(help: &str) -> String {
    unescape_label_value(help)
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
        (
            key,
            parse_number(raw).map_or_else(|| raw.to_owned(), go_float),
        )
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
    out.push_str(&parse_number(value).map_or_else(|| value.to_owned(), go_float));
    out.push('\n');
}

/// The families of an OpenMetrics exposition as client_golang gathers them (see the module
/// comment): sorted by name, series sorted, families without series left out.
pub fn families(openmetrics: &str) -> Vec<ExposedFamily> {
    let mut parsed = parse_openmetrics(openmetrics);
    for family in &mut parsed {
        if family.kind == "counter" && !family.name.ends_with("_total") {
            family.name.push_str("_total");
        }
    }
    parsed.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = Vec::with_capacity(parsed.len());
    for family in parsed {
        let kind = Kind::of_openmetrics(&family.kind);
        // Series in first-seen order, then sorted; each keeps its samples.
        let mut series: Vec<Series> = Vec::new();
        for sample in family.samples {
            if sample.name.ends_with("_created")
                && matches!(kind, Kind::Counter | Kind::Histogram | Kind::Summary)
            {
                continue;
            }
            let key = series_key(&sample);
            match series.iter_mut().find(|s| s.labels == key) {
                Some(existing) => existing.samples.push(sample),
                None => series.push(Series {
                    labels: key,
                    samples: vec![sample],
                }),
            }
        }
        if series.is_empty() {
            continue;
        }
        series.sort_by(|a, b| series_order(&a.labels, &b.labels));
        if matches!(kind, Kind::Histogram | Kind::Summary) {
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
            for one in &mut series {
                one.samples.sort_by_key(rank);
            }
        }
        out.push(ExposedFamily {
            name: family.name,
            kind,
            help: family.help,
            series,
        });
    }
    out
}

/// The classic text format of `families`.
pub fn render_text(families: &[ExposedFamily]) -> String {
    let mut out = String::new();
    for family in families {
        if let Some(help) = &family.help {
            out.push_str(&format!(
                "# HELP {} {}\n",
                family.name,
                escape_text_help(help)
            ));
        }
        out.push_str(&format!(
            "# TYPE {} {}\n",
            family.name,
            family.kind.as_text()
        ));
        for series in &family.series {
            for sample in &series.samples {
                write_sample(
                    &mut out,
                    &sample.name,
                    &series.labels,
                    sample.bound(),
                    &sample.value,
                );
            }
        }
    }
    out
}

/// The classic text format of an OpenMetrics exposition (see the module comment).
pub fn openmetrics_to_text(openmetrics: &str) -> String {
    render_text(&families(openmetrics))
}

/// A label value as written in either text format, unescaped (`\\`, `\"`, `\n`).
pub fn unescape_label_value(escaped: &str) -> String {
    let mut out = String::with_capacity(escaped.len());
    let mut chars = escaped.chars();
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
