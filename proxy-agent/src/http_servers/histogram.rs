//! kube-proxy's histograms as client_golang keeps them: the classic buckets and, with the
//! `NativeHistograms` feature gate, the native (sparse, exponential) buckets of the same
//! observations, under one lock so that a scrape never sees one without the other.
//!
//! The native side follows client_golang's `histogram.go` step for step: the schema is picked
//! from the bucket factor (`pickSchema`), an observation's bucket is found from
//! `math.Frexp` of its absolute value, values within the zero threshold go to the zero bucket,
//! and when an observation makes the populated buckets exceed the maximum the histogram is
//! reset (when the minimum reset duration has passed since the last reset), else the zero
//! bucket is widened (up to the maximum zero threshold), else the resolution is halved; a
//! reset is then scheduled for when the minimum reset duration has passed, which brings the
//! original resolution back. A reset clears the classic buckets, count and sum too, as
//! client_golang's does. client_golang runs the scheduled reset on a timer; here it is applied
//! by the first observation or scrape at or after its time, which nobody can tell apart.
//!
//! The classic side is written through prometheus-client's encoder, so the text and
//! OpenMetrics expositions are what they were; [`Histogram::snapshot`] is what the protobuf
//! exposition writes.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, PoisonError, RwLock},
    time::{Duration, Instant, SystemTime},
};

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet},
    metrics::{MetricType, TypedMetric},
};

/// client_golang's `DefNativeHistogramZeroThreshold`: 2^-128, a bucket boundary at every
/// schema.
pub const DEFAULT_ZERO_THRESHOLD: f64 = 2.938_735_877_055_719e-39;

/// The highest schema this implementation has bucket bounds for. Histograms only ever lower
/// their schema, and kube-proxy's factor (1.1) starts them at 3.
pub const MAX_SCHEMA: i32 = 3;

/// The lowest schema client_golang goes to (a factor of 2^16 between buckets).
pub const MIN_SCHEMA: i32 = -4;

/// client_golang's `nativeHistogramBounds` for schemas 0 to 3: the fractions (of `frexp`)
/// where each schema's buckets end within one power of two, 2^(i/2^schema - 1), as client_golang
/// writes them. Its 2^-1/2 is one ulp below `FRAC_1_SQRT_2`; a value between the two must
/// fall in the bucket client_golang puts it in, so the table is Go's, not std's constant.
#[allow(clippy::approx_constant)]
const SCHEMA_BOUNDS: [&[f64]; 4] = [
    &[0.5],
    &[0.5, 0.707_106_781_186_547_5],
    &[
        0.5,
        0.594_603_557_501_360_5,
        0.707_106_781_186_547_5,
        0.840_896_415_253_714_4,
    ],
    &[
        0.5,
        0.545_253_866_332_628_8,
        0.594_603_557_501_360_5,
        0.648_419_777_325_504_8,
        0.707_106_781_186_547_5,
        0.771_105_412_703_970_4,
        0.840_896_415_253_714_4,
        0.917_004_043_204_671_1,
    ],
];

/// The native side's options (client_golang's `NativeHistogram*` fields of `HistogramOpts`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NativeConfig {
    /// The starting schema (from `NativeHistogramBucketFactor`).
    pub schema: i32,
    /// `NativeHistogramZeroThreshold` (the default, 2^-128, unless set).
    pub zero_threshold: f64,
    /// `NativeHistogramMaxBucketNumber`; 0: no limit.
    pub max_buckets: u32,
    /// `NativeHistogramMinResetDuration`; zero: never reset for the bucket limit.
    pub min_reset_duration: Duration,
    /// `NativeHistogramMaxZeroThreshold`; 0: the zero bucket is never widened.
    pub max_zero_threshold: f64,
}

impl NativeConfig {
    /// What component-base gives every histogram when the gate is on (its
    /// `defaultNativeHistogramOptions`): bucket factor 1.1 (schema 3) and at most 160 buckets.
    /// It sets no minimum reset duration and no maximum zero threshold, so past 160 buckets a
    /// histogram halves its resolution and keeps it.
    pub fn kube_proxy() -> Self {
        Self::with_factor(1.1, 160)
    }

    /// A bucket factor (> 1) and a bucket limit, with client_golang's other defaults.
    pub fn with_factor(factor: f64, max_buckets: u32) -> Self {
        Self {
            schema: pick_schema(factor).min(MAX_SCHEMA),
            zero_threshold: DEFAULT_ZERO_THRESHOLD,
            max_buckets,
            min_reset_duration: Duration::ZERO,
            max_zero_threshold: 0.0,
        }
    }
}

/// client_golang's `pickSchema`: the largest schema n in -4..=8 with 2^(2^-n) <= `factor`
/// (8 for factors below 2^(2^-8)). `factor` must be above 1, as client_golang only asks then.
pub fn pick_schema(factor: f64) -> i32 {
    let floor = factor.log2().log2().floor();
    if floor <= -8.0 {
        8
    } else if floor >= 4.0 {
        MIN_SCHEMA
    } else {
        // Within -7..=3 here, so the conversion is exact.
        -(floor as i32)
    }
}

/// Go's `math.Frexp`: `value` = frac × 2^exp with frac in [0.5, 1) (subnormals normalised);
/// zero, infinities and NaN come back as they are, with exponent 0.
pub fn frexp(value: f64) -> (f64, i32) {
    if value == 0.0 || !value.is_finite() {
        return (value, 0);
    }
    let (mut value, mut exp) = (value, 0);
    if value.abs() < f64::MIN_POSITIVE {
        value *= 4_503_599_627_370_496.0; // 2^52
        exp = -52;
    }
    let bits = value.to_bits();
    let biased = i32::try_from((bits >> 52) & 0x7ff).unwrap_or(0);
    exp += biased - 1022;
    let bits = (bits & !(0x7ff << 52)) | (1022 << 52);
    (f64::from_bits(bits), exp)
}

/// The index of the native bucket `value` falls into at `schema`, as client_golang's
/// `histogramCounts.observe` computes it: bucket i holds (2^((i-1)/2^schema), 2^(i/2^schema)]
/// in absolute value; ±Inf gets the bucket after the one of ±`f64::MAX`. Not for NaN.
pub fn bucket_key(value: f64, schema: i32) -> i32 {
    let infinite = value.is_infinite();
    let magnitude = if infinite { f64::MAX } else { value.abs() };
    let (frac, exp) = frexp(magnitude);
    let key = if schema > 0 {
        let bounds = schema_bounds(schema);
        let within = i32::try_from(bounds.partition_point(|bound| *bound < frac)).unwrap_or(0);
        let per_power = i32::try_from(bounds.len()).unwrap_or(1);
        within + (exp - 1) * per_power
    } else {
        let mut key = exp;
        if frac == 0.5 {
            key -= 1;
        }
        let offset = (1 << -schema) - 1;
        (key + offset) >> -schema
    };
    if infinite { key + 1 } else { key }
}

fn schema_bounds(schema: i32) -> &'static [f64] {
    let index = usize::try_from(schema.clamp(0, MAX_SCHEMA)).unwrap_or(0);
    SCHEMA_BOUNDS[index]
}

/// client_golang's `getLe`: the upper bound of native bucket `key` at `schema` (`f64::MAX` for
/// the last bucket before the one of ±Inf).
pub fn bucket_upper_bound(key: i32, schema: i32) -> f64 {
    if schema < 0 {
        let exp = key << -schema;
        if exp == 1024 {
            return f64::MAX;
        }
        return ldexp(1.0, exp);
    }
    let frac_index = usize::try_from(key & ((1 << schema) - 1)).unwrap_or(0);
    let frac = schema_bounds(schema)[frac_index];
    let exp = (key >> schema) + 1;
    if frac == 0.5 && exp == 1025 {
        return f64::MAX;
    }
    ldexp(frac, exp)
}

/// Go's `math.Ldexp` for the normal range the bucket bounds live in.
fn ldexp(frac: f64, exp: i32) -> f64 {
    // powi of 2 is exact while the result is a normal number; split the exponent so the
    // intermediate never overflows or underflows on its own.
    let half = exp / 2;
    frac * 2f64.powi(half) * 2f64.powi(exp - half)
}

/// A point in time on both clocks: durations are measured on the monotonic one, the created
/// timestamp a histogram reports is wall-clock time.
#[derive(Debug, Clone, Copy)]
pub struct Moment {
    pub mono: Instant,
    pub wall: SystemTime,
}

impl Moment {
    pub fn now() -> Self {
        Self {
            mono: Instant::now(),
            wall: SystemTime::now(),
        }
    }

    pub fn after(self, duration: Duration) -> Self {
        Self {
            mono: self.mono + duration,
            wall: self.wall + duration,
        }
    }
}

/// The native buckets of one sign: index → observations.
type SparseBuckets = BTreeMap<i32, u64>;

#[derive(Debug, Clone)]
struct NativeState {
    schema: i32,
    zero_threshold: f64,
    zero_count: u64,
    positive: SparseBuckets,
    negative: SparseBuckets,
}

impl NativeState {
    fn new(config: &NativeConfig) -> Self {
        Self {
            schema: config.schema,
            zero_threshold: config.zero_threshold,
            zero_count: 0,
            positive: SparseBuckets::new(),
            negative: SparseBuckets::new(),
        }
    }

    fn buckets(&self) -> usize {
        self.positive.len() + self.negative.len()
    }

    fn observe(&mut self, value: f64) {
        let key = bucket_key(value, self.schema);
        // client_golang compares ±f64::MAX for ±Inf, which is the same comparison.
        if value > self.zero_threshold {
            *self.positive.entry(key).or_default() += 1;
        } else if value < -self.zero_threshold {
            *self.negative.entry(key).or_default() += 1;
        } else {
            self.zero_count += 1;
        }
    }

    /// `maybeWidenZeroBucket`: merges the bucket(s) closest to zero into the zero bucket when
    /// the new threshold stays within `max_zero_threshold`.
    fn widen_zero_bucket(&mut self, max_zero_threshold: f64) -> bool {
        if self.zero_threshold >= max_zero_threshold {
            return false;
        }
        let smallest = [&self.positive, &self.negative]
            .into_iter()
            .filter_map(|buckets| buckets.keys().next().copied())
            .min();
        let Some(smallest) = smallest else {
            return false;
        };
        let threshold = bucket_upper_bound(smallest, self.schema);
        if threshold > max_zero_threshold {
            return false;
        }
        self.zero_threshold = threshold;
        for buckets in [&mut self.positive, &mut self.negative] {
            if let Some(count) = buckets.remove(&smallest) {
                self.zero_count += count;
            }
        }
        true
    }

    /// `doubleBucketWidth`: one schema lower, each pair of buckets merged.
    fn double_bucket_width(&mut self) {
        if self.schema == MIN_SCHEMA {
            return;
        }
        self.schema -= 1;
        for buckets in [&mut self.positive, &mut self.negative] {
            let mut merged = SparseBuckets::new();
            for (&key, &count) in buckets.iter() {
                // Bucket k of the new schema covers 2k-1 and 2k of the old (Go's integer
                // division truncates toward zero, as Rust's does).
                let key = if key > 0 { key + 1 } else { key } / 2;
                *merged.entry(key).or_default() += count;
            }
            *buckets = merged;
        }
    }
}

#[derive(Debug)]
struct State {
    /// Observations per classic bucket (not cumulative); the last is +Inf's.
    classic: Vec<u64>,
    count: u64,
    sum: f64,
    native: Option<NativeState>,
    /// The last reset (or the creation): the created timestamp, and where the minimum
    /// reset duration counts from.
    last_reset: Moment,
    /// A reset for the minimum reset duration's end is pending.
    reset_scheduled: bool,
}

/// One histogram series. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: Arc<[f64]>,
    native: Option<NativeConfig>,
    state: Arc<Mutex<State>>,
}

/// What a scrape reads of a histogram, all of it at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    pub count: u64,
    pub sum: f64,
    /// Finite upper bounds with their cumulative counts (the +Inf bucket is `count`).
    pub buckets: Vec<(f64, u64)>,
    /// The creation or last reset (client_golang's created timestamp).
    pub created: SystemTime,
    pub native: Option<NativeSnapshot>,
}

/// The native buckets as the protobuf exposition carries them.
#[derive(Debug, Clone, PartialEq)]
pub struct NativeSnapshot {
    pub schema: i32,
    pub zero_threshold: f64,
    pub zero_count: u64,
    pub negative: SpanDeltas,
    pub positive: SpanDeltas,
}

/// Populated buckets as spans (offset from the previous span's end, or the first index;
/// length) and each bucket's count as a delta to the previous bucket's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpanDeltas {
    pub spans: Vec<(i32, u32)>,
    pub deltas: Vec<i64>,
}

/// client_golang's `makeBuckets`: a gap of one or two empty buckets is written as empty
/// buckets inside the span, a longer one starts a new span.
pub fn spans_and_deltas(buckets: &BTreeMap<i32, u64>) -> SpanDeltas {
    let mut out = SpanDeltas::default();
    let mut previous_count: i64 = 0;
    let mut next_index: i32 = 0;
    let mut push = |out: &mut SpanDeltas, count: i64| {
        if let Some(span) = out.spans.last_mut() {
            span.1 += 1;
        }
        out.deltas.push(count - previous_count);
        previous_count = count;
    };
    for (n, (&index, &count)) in buckets.iter().enumerate() {
        let gap = index - next_index;
        if n == 0 || gap > 2 {
            out.spans.push((gap, 0));
        } else {
            for _ in 0..gap {
                push(&mut out, 0);
            }
        }
        push(&mut out, i64::try_from(count).unwrap_or(i64::MAX));
        next_index = index + 1;
    }
    out
}

impl Histogram {
    /// A histogram with classic `bounds` (ascending, finite; +Inf is implied) and, with
    /// `native`, native buckets.
    pub fn new(bounds: Arc<[f64]>, native: Option<NativeConfig>) -> Self {
        Self::new_at(bounds, native, Moment::now())
    }

    pub(crate) fn new_at(bounds: Arc<[f64]>, native: Option<NativeConfig>, now: Moment) -> Self {
        let state = State {
            classic: vec![0; bounds.len() + 1],
            count: 0,
            sum: 0.0,
            native: native.as_ref().map(NativeState::new),
            last_reset: now,
            reset_scheduled: false,
        };
        Self {
            bounds,
            native,
            state: Arc::new(Mutex::new(state)),
        }
    }

    pub fn observe(&self, value: f64) {
        self.observe_at(value, Moment::now());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn observe_at(&self, value: f64, now: Moment) {
        let mut state = self.lock();
        self.reset_if_due(&mut state, now);
        self.record(&mut state, value);
        self.limit_buckets(&mut state, value, now);
    }

    /// client_golang's `findBucket` (the first bound at or above `value`; NaN and anything
    /// above the last bound go to +Inf) and `observe`.
    fn record(&self, state: &mut State, value: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|bound| value <= *bound)
            .unwrap_or(self.bounds.len());
        if let Some(slot) = state.classic.get_mut(bucket) {
            *slot += 1;
        }
        state.sum += value;
        state.count += 1;
        if !value.is_nan()
            && let Some(native) = state.native.as_mut()
        {
            native.observe(value);
        }
    }

    /// `limitBuckets`, after an observation at `now`.
    fn limit_buckets(&self, state: &mut State, value: f64, now: Moment) {
        let Some(config) = self.native else {
            return;
        };
        let over = state.native.as_ref().is_some_and(|native| {
            config.max_buckets != 0
                && native.buckets() > usize::try_from(config.max_buckets).unwrap_or(usize::MAX)
        });
        if !over || value.is_nan() {
            return;
        }
        // `maybeReset`: the whole histogram, then the observation again so it is not lost.
        if !config.min_reset_duration.is_zero()
            && !state.reset_scheduled
            && now.mono.saturating_duration_since(state.last_reset.mono)
                >= config.min_reset_duration
        {
            self.reset(state, now);
            self.record(state, value);
            return;
        }
        if !config.min_reset_duration.is_zero() {
            state.reset_scheduled = true;
        }
        let Some(native) = state.native.as_mut() else {
            return;
        };
        if native.widen_zero_bucket(config.max_zero_threshold) {
            return;
        }
        native.double_bucket_width();
    }

    /// When the scheduled reset is due, if one is.
    fn scheduled_reset_time(&self, state: &State) -> Option<Moment> {
        let config = self.native?;
        state
            .reset_scheduled
            .then(|| state.last_reset.after(config.min_reset_duration))
    }

    /// Applies a scheduled reset whose time has come by `now`, as of its time (client_golang's
    /// timer would have run it then).
    fn reset_if_due(&self, state: &mut State, now: Moment) {
        if let Some(due) = self.scheduled_reset_time(state)
            && now.mono >= due.mono
        {
            self.reset(state, due);
        }
    }

    /// `resetCounts` on everything, at `at`.
    fn reset(&self, state: &mut State, at: Moment) {
        state.classic.iter_mut().for_each(|slot| *slot = 0);
        state.count = 0;
        state.sum = 0.0;
        state.native = self.native.as_ref().map(NativeState::new);
        state.last_reset = at;
        state.reset_scheduled = false;
    }

    /// Everything a scrape writes, read at once.
    pub fn snapshot(&self) -> HistogramSnapshot {
        self.snapshot_at(Moment::now())
    }

    pub(crate) fn snapshot_at(&self, now: Moment) -> HistogramSnapshot {
        let mut state = self.lock();
        self.reset_if_due(&mut state, now);
        Self::snapshot_of(&self.bounds, &state)
    }

    fn snapshot_of(bounds: &[f64], state: &State) -> HistogramSnapshot {
        let mut cumulative = 0;
        let buckets = bounds
            .iter()
            .zip(&state.classic)
            .map(|(bound, count)| {
                cumulative += count;
                (*bound, cumulative)
            })
            .collect();
        HistogramSnapshot {
            count: state.count,
            sum: state.sum,
            buckets,
            created: state.last_reset.wall,
            native: state.native.as_ref().map(|native| NativeSnapshot {
                schema: native.schema,
                zero_threshold: native.zero_threshold,
                zero_count: native.zero_count,
                negative: spans_and_deltas(&native.negative),
                positive: spans_and_deltas(&native.positive),
            }),
        }
    }

    /// The classic buckets, sum and count through prometheus-client's encoder (OpenMetrics).
    fn encode_classic(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = {
            let mut state = self.lock();
            self.reset_if_due(&mut state, Moment::now());
            let buckets: Vec<(f64, u64)> = self
                .bounds
                .iter()
                .copied()
                .chain([f64::INFINITY])
                .zip(state.classic.iter().copied())
                .collect();
            (state.sum, state.count, buckets)
        };
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.encode_classic(encoder)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A series' labels as (name, value) pairs, for the protobuf exposition.
pub trait LabelPairs {
    fn label_pairs(&self) -> Vec<(&'static str, String)>;
}

/// A histogram family by label set (client_golang's `HistogramVec`), every series with the
/// same buckets and native options. Cheap to clone (shared series).
#[derive(Debug, Clone)]
pub struct HistogramVec<L> {
    bounds: Arc<[f64]>,
    native: Option<NativeConfig>,
    series: Arc<RwLock<BTreeMap<L, Histogram>>>,
}

impl<L: Ord + Clone> HistogramVec<L> {
    pub fn new(bounds: impl IntoIterator<Item = f64>, native: Option<NativeConfig>) -> Self {
        Self {
            bounds: bounds.into_iter().filter(|b| b.is_finite()).collect(),
            native,
            series: Arc::default(),
        }
    }

    /// The series of `labels`, created on first use.
    pub fn get_or_create(&self, labels: &L) -> Histogram {
        if let Some(histogram) = self
            .series
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(labels)
        {
            return histogram.clone();
        }
        self.series
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(labels.clone())
            .or_insert_with(|| Histogram::new(Arc::clone(&self.bounds), self.native))
            .clone()
    }

    /// Every series, in label order.
    fn all(&self) -> Vec<(L, Histogram)> {
        self.series
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(labels, histogram)| (labels.clone(), histogram.clone()))
            .collect()
    }
}

/// A series' label pairs and its snapshot.
pub type SeriesSnapshot = (Vec<(&'static str, String)>, HistogramSnapshot);

impl<L: Ord + Clone + LabelPairs> HistogramVec<L> {
    /// Every series' labels and snapshot.
    pub fn snapshots(&self) -> Vec<SeriesSnapshot> {
        self.all()
            .into_iter()
            .map(|(labels, histogram)| (labels.label_pairs(), histogram.snapshot()))
            .collect()
    }
}

impl<L> TypedMetric for HistogramVec<L> {
    const TYPE: MetricType = MetricType::Histogram;
}

impl<L: Ord + Clone + EncodeLabelSet> EncodeMetric for HistogramVec<L> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, histogram) in self.all() {
            let series = encoder.encode_family(&labels)?;
            histogram.encode_classic(series)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }

    fn is_empty(&self) -> bool {
        self.series
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }
}
