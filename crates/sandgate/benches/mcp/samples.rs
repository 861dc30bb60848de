//! Samples, rows and time budgets.

use super::*;

/// One measured quantity.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    /// Stable id, e.g. `mcp.exec_1p1`.
    pub(crate) id: String,
    /// Table section.
    pub(crate) section: String,
    /// What was measured, for a reader.
    pub(crate) what: String,
    /// `ms` or `MB`.
    pub(crate) unit: &'static str,
    pub(crate) n: usize,
    pub(crate) p50: Option<f64>,
    pub(crate) p99: Option<f64>,
    pub(crate) mean: Option<f64>,
    pub(crate) max: Option<f64>,
    pub(crate) errors: usize,
    /// The sandgate row this one is compared with.
    pub(crate) vs: Option<String>,
    /// This row's p50 over the compared row's p50 (how many times slower the alternative is).
    pub(crate) ratio_p50: Option<f64>,
    /// The same for p99.
    pub(crate) ratio_p99: Option<f64>,
    /// The first error messages, when there were errors.
    pub(crate) error_samples: Vec<String>,
    /// Extra figures (throughput, wall time …).
    pub(crate) extra: serde_json::Map<String, Value>,
    pub(crate) samples: Vec<f64>,
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    // Nearest rank.
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

impl Row {
    pub(crate) fn new(
        id: &str,
        section: &str,
        what: &str,
        unit: &'static str,
        samples: Vec<f64>,
    ) -> Row {
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        let mean = (!sorted.is_empty()).then(|| sorted.iter().sum::<f64>() / sorted.len() as f64);
        Row {
            id: id.into(),
            section: section.into(),
            what: what.into(),
            unit,
            n: sorted.len(),
            p50: percentile(&sorted, 0.5),
            p99: percentile(&sorted, 0.99),
            mean,
            max: sorted.last().copied(),
            errors: 0,
            vs: None,
            ratio_p50: None,
            ratio_p99: None,
            error_samples: Vec::new(),
            extra: serde_json::Map::new(),
            samples,
        }
    }

    pub(crate) fn ms(id: &str, section: &str, what: &str, s: &Samples) -> Row {
        let mut row = Row::new(id, section, what, "ms", s.ms.clone());
        row.errors = s.errors.len();
        row.error_samples = s.errors.iter().take(3).cloned().collect();
        row
    }

    pub(crate) fn vs(mut self, id: &str) -> Row {
        self.vs = Some(id.into());
        self
    }

    pub(crate) fn extra(mut self, key: &str, value: Value) -> Row {
        self.extra.insert(key.into(), value);
        self
    }
}

/// Timings of one operation, in milliseconds, plus its failures.
#[derive(Debug, Default, Clone)]
pub(crate) struct Samples {
    pub(crate) ms: Vec<f64>,
    pub(crate) errors: Vec<String>,
}

impl Samples {
    pub(crate) fn push(&mut self, elapsed: Duration) {
        self.ms.push(elapsed.as_secs_f64() * 1000.0);
    }

    pub(crate) fn fail(&mut self, err: impl std::fmt::Display) {
        self.errors.push(err.to_string());
    }

    /// Times `f` unless the budget is spent; a failure is recorded, not fatal.
    pub(crate) async fn time<T, F>(&mut self, budget: &Budget, f: F) -> Option<T>
    where
        F: Future<Output = Result<T>>,
    {
        if budget.spent() {
            return None;
        }
        let t0 = Instant::now();
        match f.await {
            Ok(v) => {
                self.push(t0.elapsed());
                Some(v)
            }
            Err(e) => {
                self.fail(format!("{e:#}"));
                None
            }
        }
    }
}

/// A time budget for one loop: loops stop early rather than run long.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget(Instant);

impl Budget {
    pub(crate) fn secs(s: u64) -> Budget {
        Budget(Instant::now() + Duration::from_secs(s))
    }
    pub(crate) fn spent(&self) -> bool {
        Instant::now() >= self.0
    }
}

/// Busy and total jiffies of the whole host, from `/proc/stat`.
fn host_jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().sum();
    // user nice system idle iowait …: idle and iowait are not busy.
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// Waits (at most `limit`) until the host's CPU was under 15 % busy for a whole second, so a
/// row that times single calls does not measure the warm pool's background imports (a sandbox
/// says ready before its kernel has imported pandas and matplotlib: ten fresh pool members are
/// ~10 CPU-seconds of imports right after `wait_pool`). Says so when the host did not settle.
pub(crate) async fn wait_quiet(limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut last = host_jiffies();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = host_jiffies();
        if let (Some((b0, t0)), Some((b1, t1))) = (last, now)
            && t1 > t0
            && ((b1 - b0) as f64) / ((t1 - t0) as f64) < 0.15
        {
            return;
        }
        if Instant::now() >= deadline {
            eprintln!(
                "[bench] the host did not settle under 15 % CPU within {} s; measuring anyway",
                limit.as_secs()
            );
            return;
        }
        last = now;
    }
}
