//! A rate limit for WARN lines a client can cause at will (refused resumes): at most one per
//! interval, the next one saying how many were left out meanwhile, so a caller probing
//! session ids cannot flood the log. The metric still counts every one.
//!
//! Knows tokio's clock; nothing of what is logged.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// One WARN per `every`; the rest are counted and reported with the next one allowed.
#[derive(Debug)]
pub(super) struct WarnLimit {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl WarnLimit {
    pub(super) fn new(every: Duration) -> WarnLimit {
        WarnLimit {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(left out since the last line)` when a line may be written now; `None` when this
    /// one is left out.
    pub(super) fn allow(&self) -> Option<u64> {
        let now = Instant::now();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (last, suppressed) = &mut *st;
        if last.is_some_and(|t| now.duration_since(t) < self.every) {
            *suppressed += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_line_per_interval_and_the_count_of_the_rest() {
        let l = WarnLimit::new(Duration::from_secs(1));
        assert_eq!(l.allow(), Some(0));
        for _ in 0..1000 {
            assert_eq!(l.allow(), None);
        }
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(l.allow(), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            l.allow(),
            Some(1001),
            "the next line says how many were left out"
        );
        assert_eq!(l.allow(), None);
    }
}
