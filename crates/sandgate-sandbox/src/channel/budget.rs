//! Budgets on what one sandbox sends: frames and bytes per second on its output (beyond them the
//! reader pauses, which pushes back on the agent), and lines per second of its stderr into the
//! gateway's log (beyond them lines are counted, not logged, and a summary says how many).

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

/// Frames per second one sandbox may send on average, and in a burst.
pub(crate) const FRAMES_PER_SEC: f64 = 5_000.0;
const FRAMES_BURST: f64 = 20_000.0;
/// Bytes per second one sandbox may send on average, and in a burst.
pub(crate) const BYTES_PER_SEC: f64 = 64.0 * 1024.0 * 1024.0;
const BYTES_BURST: f64 = 256.0 * 1024.0 * 1024.0;
/// Lines of stderr one sandbox may put into the gateway's log: a burst, then this many per second.
pub(crate) const STDERR_BURST_LINES: f64 = 20.0;
const STDERR_LINES_PER_SEC: f64 = 0.5;

/// A token bucket.
#[derive(Debug)]
pub(crate) struct Bucket {
    capacity: f64,
    per_sec: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    pub(crate) fn new(capacity: f64, per_sec: f64) -> Self {
        Self {
            capacity,
            per_sec,
            tokens: capacity,
            last: Instant::now(),
        }
    }

    fn refill(&mut self) {
        let now = Instant::now();
        let earned = now.duration_since(self.last).as_secs_f64() * self.per_sec;
        self.tokens = (self.tokens + earned).min(self.capacity);
        self.last = now;
    }

    /// Takes `n` tokens if there are that many.
    pub(crate) fn try_take(&mut self, n: f64) -> bool {
        self.refill();
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }

    /// Takes `n` tokens (going into debt) and says how long to wait until the debt is paid.
    pub(crate) fn take(&mut self, n: f64) -> Duration {
        self.refill();
        self.tokens -= n.min(self.capacity);
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.per_sec)
        }
    }
}

/// The output budget of one sandbox: frames and bytes per second.
#[derive(Debug)]
pub(crate) struct OutputBudget {
    frames: Bucket,
    bytes: Bucket,
}

impl OutputBudget {
    pub(crate) fn new() -> Self {
        Self {
            frames: Bucket::new(FRAMES_BURST, FRAMES_PER_SEC),
            bytes: Bucket::new(BYTES_BURST, BYTES_PER_SEC),
        }
    }

    /// Accounts for `frames` frames of `bytes` bytes; the pause that keeps the sandbox within
    /// budget (zero while it is).
    pub(crate) fn charge(&mut self, frames: usize, bytes: usize) -> Duration {
        let wait = self
            .frames
            .take(frames as f64)
            .max(self.bytes.take(bytes as f64));
        if !wait.is_zero() {
            crate::telemetry::counters().output_throttled.inc();
        }
        wait
    }
}

/// Logs the container's stderr line by line (agent diagnostics, crash tracebacks) within a budget.
pub(crate) struct StderrLog {
    label: String,
    line: Vec<u8>,
    budget: Bucket,
    dropped: u64,
}

impl StderrLog {
    const MAX_LINE: usize = 8192;

    pub(crate) fn new(label: String) -> Self {
        Self {
            label,
            line: Vec::new(),
            budget: Bucket::new(STDERR_BURST_LINES, STDERR_LINES_PER_SEC),
            dropped: 0,
        }
    }

    pub(crate) fn push(&mut self, data: &[u8]) {
        for &b in data {
            if b == b'\n' {
                self.flush();
            } else if self.line.len() < Self::MAX_LINE {
                self.line.push(b);
            }
        }
    }

    pub(crate) fn flush(&mut self) {
        if self.line.is_empty() {
            return;
        }
        if self.budget.try_take(1.0) {
            self.summarize();
            let text = String::from_utf8_lossy(&self.line);
            tracing::warn!(sandbox = %self.label, line = %text, "sandbox stderr");
        } else {
            self.dropped += 1;
            crate::telemetry::counters().stderr_lines_dropped.inc();
        }
        self.line.clear();
    }

    /// Says how many lines were dropped since the last line that was logged.
    pub(crate) fn summarize(&mut self) {
        if self.dropped > 0 {
            tracing::warn!(
                sandbox = %self.label,
                dropped = self.dropped,
                "sandbox stderr over its log budget: lines dropped"
            );
            self.dropped = 0;
        }
    }
}
