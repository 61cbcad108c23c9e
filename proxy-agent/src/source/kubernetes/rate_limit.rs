//! `clientConnection.qps`/`burst` as client-go applies them (`flowcontrol.NewTokenBucketRateLimiter`
//! over `golang.org/x/time/rate`): a bucket of `burst` tokens, refilled at `qps` per second;
//! each request takes one, waiting for it when the bucket is empty. A watch is one request (its
//! start), like in client-go.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::{Duration, Instant},
};

/// The bucket's arithmetic, on times the caller passes in (tests use their own clock).
#[derive(Debug, Clone)]
pub struct TokenBucket {
    qps: f64,
    burst: f64,
    /// May go below zero: tokens already promised to requests that are waiting.
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket. `qps` must be positive and `burst` at least 1 ([`limit_layer`] decides).
    pub fn new(qps: f32, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            qps: f64::from(qps),
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Takes a token at `now`: how long the request must wait for it (zero if one was there).
    /// Like `rate.Limiter.Reserve`, the token is promised at once, so concurrent requests queue
    /// up in the order they asked.
    pub fn take(&mut self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst) - 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.qps)
        }
    }
}

/// The tower layer for the kube client, or None when client-go would not limit either
/// (`qps` ≤ 0: kube-proxy's defaulting turns 0 into 5, so only a negative value gets here).
/// A `burst` of 0 is defaulted to 10 the same way; validation refuses a negative one.
pub fn limit_layer(qps: f32, burst: i32) -> Option<RateLimitLayer> {
    if !(qps > 0.0 && qps.is_finite()) {
        return None;
    }
    let burst = u32::try_from(burst).unwrap_or(0).max(1);
    Some(RateLimitLayer {
        bucket: Arc::new(Mutex::new(TokenBucket::new(qps, burst, Instant::now()))),
    })
}

#[derive(Debug, Clone)]
pub struct RateLimitLayer {
    bucket: Arc<Mutex<TokenBucket>>,
}

impl<S> tower::Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            bucket: Arc::clone(&self.bucket),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RateLimit<S> {
    inner: S,
    bucket: Arc<Mutex<TokenBucket>>,
}

impl<S, R> tower::Service<R> for RateLimit<S>
where
    S: tower::Service<R>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let wait = self
            .bucket
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(Instant::now());
        // The client stack's futures send nothing until polled (hyper connects and writes in
        // the future), so waiting before the first poll delays the request itself.
        let response = self.inner.call(request);
        Box::pin(async move {
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            response.await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_bucket_serves_burst_requests_then_one_per_refill() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(2.0, 3, start);
        // Three at once from the full bucket, then each waits half a second more than the last.
        let waits: Vec<Duration> = (0..6).map(|_| bucket.take(start)).collect();
        assert_eq!(
            waits,
            [0.0, 0.0, 0.0, 0.5, 1.0, 1.5].map(Duration::from_secs_f64)
        );
    }

    #[test]
    fn refills_at_qps_up_to_burst() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(1.0, 1, start);
        assert_eq!(bucket.take(start), Duration::ZERO);
        // Half a refill later: half a second to wait.
        let half = start + Duration::from_millis(500);
        assert_eq!(bucket.take(half), Duration::from_millis(500));
        // A long pause fills the bucket to burst (1), not beyond.
        let later = start + Duration::from_secs(60);
        assert_eq!(bucket.take(later), Duration::ZERO);
        assert_eq!(bucket.take(later), Duration::from_secs(1));
        // A clock read out of order (another thread) does not add tokens.
        assert_eq!(
            bucket.take(later - Duration::from_secs(5)),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn no_limit_where_client_go_has_none() {
        assert!(limit_layer(-1.0, 10).is_none());
        assert!(limit_layer(f32::NAN, 10).is_none());
        assert!(limit_layer(5.0, 0).is_some());
    }
}
