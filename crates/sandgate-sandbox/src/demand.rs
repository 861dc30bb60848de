//! How big a warm pool should be, and how many containers may start at once: a pure controller
//! fed with observations (leases, finished starts) and asked with the time, so its logic is tested
//! with a fake clock. The manager owns one per profile; a sandbox node would own the same.
//!
//! - **Ready target.** Leases that arrive while a replacement starts must find a ready sandbox:
//!   with a lease rate `λ` and a start time `T`, `n = λ·T` leases arrive during one start on
//!   average. Arrivals are roughly Poisson, so the target is `n + 2·√n` (the mean plus two standard
//!   deviations) rounded up, plus one while there is any demand, between the configured floor and
//!   ceiling. `λ` is the larger of the rates over a short window (a sixth of the long one: reacts
//!   to a burst at once) and the long window ([`LONG_WINDOW`] by default: holds the pool through
//!   short lulls); both decay to nothing when leases stop, so the target falls back to the floor
//!   one long window after the last lease.
//! - **Start concurrency.** Starting more containers at once than the machine has cores only
//!   makes each slower. The limit starts at the number of CPUs and moves one step at a time
//!   (additive increase, decrease): down when a start took more than twice the best recent start
//!   (the machine is saturated), up when it took less than one and a half times it, between 1 and
//!   the configured most (twice the CPUs when not configured).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The default long window of the lease rate: the pool stays sized through short lulls.
pub const LONG_WINDOW: Duration = Duration::from_secs(60);
/// What a start is assumed to take before one has been seen.
const INITIAL_START: Duration = Duration::from_millis(800);
/// How many recent starts the "best recent start" is taken over.
const BASELINE_STARTS: usize = 32;
/// Weight of a new start time in the moving average.
const EWMA_WEIGHT: f64 = 0.3;

/// The controller's fixed parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DemandLimits {
    /// Ready sandboxes kept however low the demand.
    pub floor: usize,
    /// Ready sandboxes kept at most however high the demand.
    pub ceiling: usize,
    /// Most starts at once.
    pub max_starts: usize,
    /// Where the start limit begins (the machine's CPUs).
    pub initial_starts: usize,
    /// The long window of the lease rate (the short one is a sixth of it).
    pub window: Duration,
}

impl DemandLimits {
    /// Limits for this machine: `max_concurrent_starts` of 0 means twice its CPUs.
    pub fn for_machine(floor: usize, ceiling: usize, max_concurrent_starts: usize) -> Self {
        let cpus = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
        let max_starts = if max_concurrent_starts == 0 {
            2 * cpus
        } else {
            max_concurrent_starts
        };
        Self {
            floor,
            ceiling: ceiling.max(floor),
            max_starts: max_starts.max(1),
            initial_starts: cpus.clamp(1, max_starts.max(1)),
            window: LONG_WINDOW,
        }
    }
}

/// One pool's demand controller. See the module docs.
#[derive(Debug, Clone)]
pub struct Demand {
    limits: DemandLimits,
    /// When recent leases happened, oldest first (within [`LONG_WINDOW`]).
    leases: VecDeque<Instant>,
    /// Moving average of start times.
    start_time: Option<Duration>,
    /// The last few start times, for the best recent one.
    recent_starts: VecDeque<Duration>,
    /// Starts allowed at once now.
    start_limit: usize,
}

impl Demand {
    /// A controller with no observations yet: the target is the floor, the start limit the CPUs.
    pub fn new(limits: DemandLimits) -> Self {
        Self {
            limits,
            leases: VecDeque::new(),
            start_time: None,
            recent_starts: VecDeque::new(),
            start_limit: limits.initial_starts,
        }
    }

    /// The fixed parameters.
    pub fn limits(&self) -> DemandLimits {
        self.limits
    }

    /// A sandbox was leased at `now` (warm or cold).
    pub fn lease(&mut self, now: Instant) {
        self.forget(now);
        self.leases.push_back(now);
    }

    /// A start finished after `took` (container created and started, agent ready).
    pub fn started(&mut self, took: Duration) {
        self.start_time = Some(match self.start_time {
            None => took,
            Some(avg) => avg.mul_f64(1.0 - EWMA_WEIGHT) + took.mul_f64(EWMA_WEIGHT),
        });
        if self.recent_starts.len() == BASELINE_STARTS {
            self.recent_starts.pop_front();
        }
        self.recent_starts.push_back(took);
        let best = self
            .recent_starts
            .iter()
            .min()
            .copied()
            .unwrap_or(took)
            .max(Duration::from_millis(1));
        if took > best * 2 {
            self.start_limit = self.start_limit.saturating_sub(1).max(1);
        } else if took.as_secs_f64() < best.as_secs_f64() * 1.5 {
            self.start_limit = (self.start_limit + 1).min(self.limits.max_starts);
        }
    }

    /// The average start time (an assumed one before any start was seen).
    pub fn start_time(&self) -> Duration {
        self.start_time.unwrap_or(INITIAL_START)
    }

    /// How many starts may run at once now.
    pub fn start_limit(&self) -> usize {
        self.start_limit
    }

    /// Leases per second at `now`: the larger of the short- and long-window rates.
    pub fn lease_rate(&self, now: Instant) -> f64 {
        let within = |window: Duration| {
            self.leases
                .iter()
                .rev()
                .take_while(|at| now.saturating_duration_since(**at) < window)
                .count() as f64
        };
        let long_window = self.limits.window.max(Duration::from_millis(6));
        let short_window = long_window / 6;
        let short = within(short_window) / short_window.as_secs_f64();
        let long = within(long_window) / long_window.as_secs_f64();
        short.max(long)
    }

    /// How many ready sandboxes the pool should hold at `now`.
    pub fn target(&self, now: Instant) -> usize {
        let rate = self.lease_rate(now);
        let demand = if rate > 0.0 {
            let during_start = rate * self.start_time().as_secs_f64();
            (during_start + 2.0 * during_start.sqrt()).ceil() as usize + 1
        } else {
            0
        };
        demand.clamp(self.limits.floor, self.limits.ceiling)
    }

    fn forget(&mut self, now: Instant) {
        while self
            .leases
            .front()
            .is_some_and(|at| now.saturating_duration_since(*at) >= self.limits.window)
        {
            self.leases.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(floor: usize, ceiling: usize) -> DemandLimits {
        DemandLimits {
            floor,
            ceiling,
            max_starts: 4,
            initial_starts: 2,
            window: LONG_WINDOW,
        }
    }

    /// Leases every `every` from `from` for `count` leases; returns the time of the last.
    fn leases(demand: &mut Demand, from: Instant, every: Duration, count: u32) -> Instant {
        let mut at = from;
        for i in 0..count {
            at = from + every * i;
            demand.lease(at);
        }
        at
    }

    #[test]
    fn with_no_demand_the_target_is_the_floor() {
        let demand = Demand::new(limits(2, 20));
        assert_eq!(demand.target(Instant::now()), 2);
        let zero = Demand::new(limits(0, 20));
        assert_eq!(zero.target(Instant::now()), 0);
    }

    #[test]
    fn the_target_grows_with_the_lease_rate_and_the_start_time() {
        let t0 = Instant::now();
        let mut slow_rate = Demand::new(limits(0, 100));
        slow_rate.started(Duration::from_millis(500));
        let now = leases(&mut slow_rate, t0, Duration::from_secs(1), 10);
        let mut fast_rate = Demand::new(limits(0, 100));
        fast_rate.started(Duration::from_millis(500));
        let fast_now = leases(&mut fast_rate, t0, Duration::from_millis(100), 100);
        let mut slow_start = Demand::new(limits(0, 100));
        slow_start.started(Duration::from_secs(3));
        let slow_start_now = leases(&mut slow_start, t0, Duration::from_millis(100), 100);

        let low = slow_rate.target(now);
        let high = fast_rate.target(fast_now);
        let higher = slow_start.target(slow_start_now);
        assert!(low >= 1, "any demand keeps one ready");
        assert!(
            high > low,
            "10 leases/s need more than 1/s: {high} vs {low}"
        );
        assert!(
            higher > high,
            "slower starts need more ready: {higher} vs {high}"
        );
        // 10/s × 0.5 s = 5 leases during a start: 5 + 2·√5 → 10, plus one.
        assert_eq!(high, 11);
    }

    #[test]
    fn a_burst_raises_the_target_at_once() {
        let t0 = Instant::now();
        let mut demand = Demand::new(limits(2, 100));
        demand.started(Duration::from_millis(500));
        // 40 leases within a second.
        let now = leases(&mut demand, t0, Duration::from_millis(25), 40);
        assert!(demand.target(now) > 2, "{}", demand.target(now));
    }

    #[test]
    fn the_target_shrinks_back_to_the_floor_when_demand_stops() {
        let t0 = Instant::now();
        let mut demand = Demand::new(limits(2, 100));
        demand.started(Duration::from_millis(500));
        let last = leases(&mut demand, t0, Duration::from_millis(100), 100);
        let busy = demand.target(last);
        let lull = demand.target(last + LONG_WINDOW / 6 + Duration::from_secs(1));
        let quiet = demand.target(last + LONG_WINDOW);
        assert!(
            busy > lull,
            "past the short window the target falls: {busy} → {lull}"
        );
        assert!(lull > 2, "the long window holds part of it through a lull");
        assert_eq!(quiet, 2, "a minute without leases: back to the floor");
    }

    #[test]
    fn the_target_never_leaves_floor_and_ceiling() {
        let t0 = Instant::now();
        let mut demand = Demand::new(limits(3, 6));
        demand.started(Duration::from_secs(5));
        let now = leases(&mut demand, t0, Duration::from_millis(10), 1000);
        assert_eq!(demand.target(now), 6, "capped at the ceiling");
        assert_eq!(demand.target(now + LONG_WINDOW * 2), 3, "held at the floor");
    }

    #[test]
    fn a_ceiling_below_the_floor_is_raised_to_it() {
        let limits = DemandLimits::for_machine(4, 1, 0);
        assert_eq!(limits.ceiling, 4);
        assert!(limits.max_starts >= 2);
        assert!(limits.initial_starts >= 1 && limits.initial_starts <= limits.max_starts);
    }

    #[test]
    fn the_start_limit_backs_off_when_starts_slow_down_and_recovers() {
        let mut demand = Demand::new(limits(0, 10));
        assert_eq!(demand.start_limit(), 2);
        demand.started(Duration::from_millis(200));
        assert_eq!(demand.start_limit(), 3, "a quick start allows one more");
        demand.started(Duration::from_millis(210));
        assert_eq!(demand.start_limit(), 4);
        demand.started(Duration::from_millis(220));
        assert_eq!(demand.start_limit(), 4, "never above the most");
        for _ in 0..10 {
            demand.started(Duration::from_millis(900));
        }
        assert_eq!(demand.start_limit(), 1, "saturated: one at a time");
        demand.started(Duration::from_millis(250));
        assert_eq!(demand.start_limit(), 2, "quick again: grows back");
    }

    #[test]
    fn leases_older_than_the_long_window_are_forgotten() {
        let t0 = Instant::now();
        let mut demand = Demand::new(limits(0, 10));
        leases(&mut demand, t0, Duration::from_millis(1), 500);
        demand.lease(t0 + LONG_WINDOW * 2);
        assert_eq!(demand.leases.len(), 1);
    }
}
