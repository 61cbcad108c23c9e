//! Percentiles of one run and the spread over repeated runs.

use std::time::Duration;

/// The `q`-quantile (0..=1) of `sorted` by the nearest-rank method; 0 for no samples.
pub fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    // Nearest rank: the smallest sample with at least q of all samples at or below it.
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted
        .get(rank.saturating_sub(1).min(sorted.len() - 1))
        .copied()
        .unwrap_or_default()
}

/// p50/p99/max of one run, in ns.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Percentiles {
    pub count: usize,
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
    pub mean: f64,
}

impl Percentiles {
    pub fn of(samples: &[u64]) -> Self {
        let mut sorted = samples.to_vec();
        sorted.sort_unstable();
        let mean = if sorted.is_empty() {
            0.0
        } else {
            sorted.iter().map(|&s| s as f64).sum::<f64>() / sorted.len() as f64
        };
        Self {
            count: sorted.len(),
            p50: quantile(&sorted, 0.50),
            p99: quantile(&sorted, 0.99),
            max: sorted.last().copied().unwrap_or_default(),
            mean,
        }
    }

    pub fn of_durations(samples: &[Duration]) -> Self {
        let ns: Vec<u64> = samples
            .iter()
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .collect();
        Self::of(&ns)
    }
}

/// One metric over repeated runs: min, median and max of the per-run values.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Spread {
    pub runs: usize,
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let median = match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v.get(n / 2).copied().unwrap_or(f64::NAN),
            n => {
                let a = v.get(n / 2 - 1).copied().unwrap_or(f64::NAN);
                let b = v.get(n / 2).copied().unwrap_or(f64::NAN);
                (a + b) / 2.0
            }
        };
        Self {
            runs: v.len(),
            min: v.first().copied().unwrap_or(f64::NAN),
            median,
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.runs == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let s: Vec<u64> = (1..=100).collect();
        assert_eq!(quantile(&s, 0.5), 50);
        assert_eq!(quantile(&s, 0.99), 99);
        assert_eq!(quantile(&s, 1.0), 100);
        assert_eq!(quantile(&[7], 0.99), 7);
        assert_eq!(quantile(&[], 0.5), 0);
        let p = Percentiles::of(&[3, 1, 2]);
        assert_eq!((p.p50, p.max, p.count), (2, 3, 3));
    }

    #[test]
    fn spread_min_median_max() {
        let s = Spread::of([3.0, 1.0, 2.0]);
        assert_eq!((s.min, s.median, s.max, s.runs), (1.0, 2.0, 3.0, 3));
        assert_eq!(Spread::of([1.0, 3.0]).median, 2.0);
        assert!(Spread::of([]).is_empty());
    }
}
