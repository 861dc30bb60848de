//! The sandbox manager: warm pools per profile, leases, adoption after a restart, closing.
//!
//! DESIGN §4: each profile's pool keeps containers started and ready (agent handshake done),
//! refilled in the background. How many follows demand ([`crate::demand`]): the observed lease
//! rate and start time set the ready target between `min_ready` and `max_ready`, and the starts
//! allowed at once adapt to the machine. A lease takes a ready one (milliseconds) or, when the pool
//! is empty, starts one (never an error because the pool is empty). A container is handed out once
//! and never reused. Once a second, a pool whose target fell gives up its surplus: the manager
//! removes it itself, unless a recorder watches the pool ([`SandboxManager::watch_ready`]), which
//! then takes it with [`SandboxManager::take_surplus`].
//!
//! This crate keeps no records: the gateway records leases in Postgres. The hooks it needs are
//! [`SandboxManager::take_ready`] (take a warm sandbox without triggering anything else),
//! [`SandboxManager::launch`] (start one and learn its container id), [`SandboxManager::offer`]
//! (put a known warm sandbox, e.g. one re-adopted at start-up, into the pool) and
//! [`SandboxManager::refill`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backend::{BackendError, ContainerFate, ManagedContainer, SandboxBackend};
use crate::channel::ChannelError;
use crate::config::{ManagerConfig, ProfileError, SandboxProfile};
use crate::demand::{Demand, DemandLimits};

mod launcher;
mod sandbox;

use launcher::Launcher;
pub use sandbox::Sandbox;

/// How often the pools are checked against their targets (grown or shrunk).
const POOL_TICK: Duration = Duration::from_secs(1);

/// What went wrong managing sandboxes.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The sandbox's container stopped or vanished; the fate says why (e.g. its memory limit).
    #[error("sandbox {sandbox_id} stopped working: {fate}")]
    Died {
        /// The sandbox.
        sandbox_id: String,
        /// What happened to its container.
        fate: ContainerFate,
    },
    /// The attach stream to a container that still runs ended while the call was in flight
    /// (the engine restarted with live-restore, the connection dropped): the call's outcome is
    /// unknown, the kernel and files are intact, and the next call re-attaches
    /// ([`SandboxManager::adopt`]).
    #[error(
        "the connection to sandbox {sandbox_id} was lost while this call ran ({reason}); the \
         sandbox, its variables and files are intact and it is reconnected on the next call: \
         retry the call (it may or may not have run to the end)"
    )]
    ConnectionLost {
        /// The sandbox.
        sandbox_id: String,
        /// What the channel saw.
        reason: String,
    },
    /// Talking to the agent failed.
    #[error(transparent)]
    Channel(#[from] ChannelError),
    /// The engine could not launch a container.
    #[error("starting a sandbox failed")]
    Launch(#[source] BackendError),
    /// The container started but its agent never became ready.
    #[error("sandbox {sandbox_id} did not start ({fate})")]
    AgentStart {
        /// The sandbox.
        sandbox_id: String,
        /// What became of its container.
        fate: ContainerFate,
        /// What the channel saw.
        #[source]
        source: ChannelError,
    },
    /// No place among the starts the node runs at once came free within
    /// [`crate::ManagerConfig::start_wait`]: the node is busy starting others.
    #[error(
        "no sandbox could be started within {} s: the sandbox node is busy starting others",
        waited.as_secs()
    )]
    StartQueue {
        /// How long the start waited.
        waited: Duration,
    },
    /// No pool serves the named profile.
    #[error("no sandbox profile is named {0:?}")]
    UnknownProfile(String),
    /// A profile failed validation.
    #[error("sandbox profile {name:?} is invalid: {}: {reason}", .reason.field())]
    InvalidProfile {
        /// The profile.
        name: String,
        /// What is wrong, and in which field.
        reason: ProfileError,
    },
    /// `adopt` was given a container that this gateway instance does not own.
    #[error("container {container_id} is not a sandbox of this gateway")]
    NotOurs {
        /// The container.
        container_id: String,
    },
    /// An engine call (inspect, attach, remove, list) failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A sandbox node in another process failed the call for a reason it logged rather than
    /// sent (its engine's words, paths and addresses stay on the node): its log has the whole
    /// cause chain under `incident`.
    #[error(
        "the sandbox node at {node} failed {} (incident {incident}: the node's log has the details)",
        if *starting { "to start a sandbox" } else { "the call" }
    )]
    NodeFailed {
        /// The node's address.
        node: String,
        /// The id the node logged the failure under.
        incident: String,
        /// Whether it was starting a sandbox (else a call on one).
        starting: bool,
    },
}

struct PoolState {
    ready: VecDeque<Sandbox>,
    /// Background starts in flight for this pool (counted so refills do not overshoot the target).
    starting: usize,
    /// Cold starts (outside the pool) in flight.
    cold_starting: usize,
    /// What the pool's size and start concurrency follow.
    demand: Demand,
}

struct Pool {
    profile: SandboxProfile,
    state: Mutex<PoolState>,
    /// Starts running at once for this pool (background and cold), bounded by the demand's limit.
    gate: Arc<StartGate>,
}

impl Pool {
    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A cold start (waiting for its place, or launching) counted in its pool's numbers for as long
/// as it lives, so a caller that gives up half-way (a cancelled request) is uncounted too.
struct ColdStarting<'a>(&'a Pool);

impl<'a> ColdStarting<'a> {
    fn new(pool: &'a Pool) -> Self {
        pool.state().cold_starting += 1;
        Self(pool)
    }
}

impl Drop for ColdStarting<'_> {
    fn drop(&mut self) {
        self.0.state().cold_starting -= 1;
    }
}

/// A pool's numbers, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolStats {
    /// Ready sandboxes waiting.
    pub ready: usize,
    /// Background starts in flight.
    pub starting: usize,
    /// Cold starts (a lease found the pool empty) in flight.
    pub cold_starting: usize,
    /// Ready sandboxes the pool aims for now.
    pub target: usize,
    /// Starts allowed at once now.
    pub start_limit: usize,
    /// Average start time.
    pub start_time: Duration,
    /// Leases per second lately.
    pub lease_rate: f64,
}

/// Bounds the starts running at once by a limit that may change between acquisitions.
#[derive(Default)]
struct StartGate {
    running: Mutex<usize>,
    freed: Notify,
}

/// A place among the starts a pool runs at once ([`SandboxManager::start_permit`]); freed on drop.
pub struct StartPermit {
    gate: Arc<StartGate>,
    profile: String,
}

impl std::fmt::Debug for StartPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartPermit")
            .field("profile", &self.profile)
            .finish_non_exhaustive()
    }
}

impl StartGate {
    async fn acquire(self: &Arc<Self>, profile: &str, limit: impl Fn() -> usize) -> StartPermit {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
                if *running < limit().max(1) {
                    *running += 1;
                    return StartPermit {
                        gate: self.clone(),
                        profile: profile.to_owned(),
                    };
                }
            }
            freed.await;
        }
    }
}

impl Drop for StartPermit {
    fn drop(&mut self) {
        *self.gate.running.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.gate.freed.notify_waiters();
    }
}

struct ManagerInner {
    launcher: Launcher,
    config: ManagerConfig,
    pools: HashMap<String, Pool>,
    tasks: TaskTracker,
    stop: CancellationToken,
    /// Told about every sandbox a background start put into a pool (see
    /// [`SandboxManager::watch_ready`]).
    ready_hook: Mutex<Option<mpsc::UnboundedSender<Sandbox>>>,
    /// While set (a draining node), no pool starts a sandbox ([`SandboxManager::pause_refills`]).
    paused: std::sync::atomic::AtomicBool,
}

impl Drop for ManagerInner {
    fn drop(&mut self) {
        // Background starts still waiting for a permit give up; one already launching removes its
        // container when it finds the manager gone.
        self.stop.cancel();
    }
}

/// The sandbox manager: a warm pool per profile over a [`SandboxBackend`]. Cheap to clone.
#[derive(Clone)]
pub struct SandboxManager {
    inner: Arc<ManagerInner>,
}

impl std::fmt::Debug for SandboxManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxManager")
            .field("instance", &self.inner.config.instance)
            .field("profiles", &self.inner.pools.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Checks a profile, naming it in the error.
fn validated(profile: &SandboxProfile) -> Result<(), SandboxError> {
    profile
        .validate()
        .map_err(|reason| SandboxError::InvalidProfile {
            name: profile.name.clone(),
            reason,
        })
}

impl SandboxManager {
    /// Validates the profiles and starts filling each pool up to its target (at first
    /// `min_ready`) in the background, checking the pools against their targets once a second.
    /// Must be called inside a Tokio runtime.
    pub fn start(
        backend: Arc<dyn SandboxBackend>,
        profiles: Vec<SandboxProfile>,
        config: ManagerConfig,
    ) -> Result<Self, SandboxError> {
        let mut pools = HashMap::new();
        for profile in profiles {
            validated(&profile)?;
            let limits = DemandLimits {
                window: config.demand_window,
                ..DemandLimits::for_machine(
                    config.pool.min_ready,
                    config.pool.max_ready,
                    config.pool.max_concurrent_starts,
                )
            };
            pools.insert(
                profile.name.clone(),
                Pool {
                    profile,
                    state: Mutex::new(PoolState {
                        ready: VecDeque::new(),
                        starting: 0,
                        cold_starting: 0,
                        demand: Demand::new(limits),
                    }),
                    gate: Arc::default(),
                },
            );
        }
        let manager = Self {
            inner: Arc::new(ManagerInner {
                launcher: Launcher {
                    backend,
                    instance: config.instance.clone(),
                    channel: config.channel.clone(),
                    launched: Arc::default(),
                    abandoned: Arc::default(),
                },
                config,
                pools,
                tasks: TaskTracker::new(),
                stop: CancellationToken::new(),
                ready_hook: Mutex::new(None),
                paused: std::sync::atomic::AtomicBool::new(false),
            }),
        };
        let names: Vec<String> = manager.inner.pools.keys().cloned().collect();
        for name in names {
            manager.refill(&name)?;
        }
        manager.spawn_ticker();
        Ok(manager)
    }

    /// Once a second: each pool refilled to its target, and its surplus removed when nobody
    /// records the pool (a recorder takes it with [`Self::take_surplus`]).
    fn spawn_ticker(&self) {
        let weak = Arc::downgrade(&self.inner);
        let stop = self.inner.stop.clone();
        self.inner.tasks.spawn(async move {
            let mut ticker = tokio::time::interval(POOL_TICK);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    () = stop.cancelled() => return,
                }
                let Some(inner) = weak.upgrade() else { return };
                let manager = SandboxManager { inner };
                let recorded = manager
                    .inner
                    .ready_hook
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_some();
                let names: Vec<String> = manager.inner.pools.keys().cloned().collect();
                for name in names {
                    let _ = manager.refill(&name);
                    if !recorded {
                        for sandbox in manager.take_surplus(&name) {
                            tracing::debug!(sandbox_id = %sandbox.id(), "demand fell: removing a warm sandbox");
                            let _ = sandbox.close().await;
                        }
                    }
                }
            }
        });
    }

    /// Records a lease of `profile` (warm or cold) for its pool's demand. [`Self::lease`] does so
    /// itself; callers that lease through [`Self::take_ready_id`] or [`Self::launch_with`] call it.
    pub fn record_lease(&self, profile: &str) {
        if let Some(pool) = self.inner.pools.get(profile) {
            pool.state().demand.lease(std::time::Instant::now());
        }
    }

    /// The ready sandboxes beyond `profile`'s target, taken out of the pool (oldest first) for the
    /// caller to remove. Empty for an unknown profile.
    pub fn take_surplus(&self, profile: &str) -> Vec<Sandbox> {
        let Some(pool) = self.inner.pools.get(profile) else {
            return Vec::new();
        };
        let mut state = pool.state();
        let target = state.demand.target(std::time::Instant::now());
        let surplus = state.ready.len().saturating_sub(target);
        state.ready.drain(..surplus).collect()
    }

    /// `profile`'s pool numbers now (`None` for an unknown profile).
    pub fn pool_stats(&self, profile: &str) -> Option<PoolStats> {
        let pool = self.inner.pools.get(profile)?;
        let state = pool.state();
        let now = std::time::Instant::now();
        Some(PoolStats {
            ready: state.ready.len(),
            starting: state.starting,
            cold_starting: state.cold_starting,
            target: state.demand.target(now),
            start_limit: state.demand.start_limit(),
            start_time: state.demand.start_time(),
            lease_rate: state.demand.lease_rate(now),
        })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &ManagerConfig {
        &self.inner.config
    }

    fn pool(&self, profile: &str) -> Result<&Pool, SandboxError> {
        self.inner
            .pools
            .get(profile)
            .ok_or_else(|| SandboxError::UnknownProfile(profile.to_owned()))
    }

    /// Leases a sandbox of `profile`: a warm one when the pool has one, else a cold start. The
    /// pool is refilled in the background either way.
    #[tracing::instrument(skip_all, fields(profile = %profile, sandbox_id, warm))]
    pub async fn lease(&self, profile: &str) -> Result<Sandbox, SandboxError> {
        let taken = self.take_ready(profile)?;
        self.record_lease(profile);
        self.refill(profile)?;
        let span = tracing::Span::current();
        span.record("warm", taken.is_some());
        let sandbox = match taken {
            Some(sandbox) => sandbox,
            None => self.launch(profile).await?,
        };
        span.record("sandbox_id", sandbox.id());
        Ok(sandbox)
    }

    /// Takes a ready sandbox from the pool, if it has one, without refilling. Sandboxes whose
    /// connection ended while they waited are removed, never handed out.
    pub fn take_ready(&self, profile: &str) -> Result<Option<Sandbox>, SandboxError> {
        let pool = self.pool(profile)?;
        loop {
            let next = pool.state().ready.pop_front();
            match next {
                Some(sandbox) if sandbox.is_lost() => {
                    tracing::warn!(sandbox_id = %sandbox.id(), "a warm sandbox died while waiting; removing it");
                    self.inner.tasks.spawn(async move {
                        let _ = sandbox.close().await;
                    });
                }
                other => return Ok(other),
            }
        }
    }

    /// Takes the ready sandbox with this id out of whichever pool holds it, without refilling.
    /// `None` when no pool of this process holds it (another process started it, or it was
    /// taken already).
    pub fn take_ready_id(&self, sandbox_id: &str) -> Option<Sandbox> {
        self.inner.pools.values().find_map(|pool| {
            let mut state = pool.state();
            let at = state.ready.iter().position(|s| s.id() == sandbox_id)?;
            state.ready.remove(at)
        })
    }

    /// The ids of the sandboxes this process started launching within `within` (ready, leased or
    /// still starting; a launch that failed or was given up is not among them): reconciliation
    /// must not take their containers for orphans before the caller has had time to record them.
    pub fn launched_within(&self, within: Duration) -> Vec<String> {
        self.inner
            .launcher
            .launched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, at)| at.elapsed() < within)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The ids of the sandboxes whose launch in this process failed or was given up within the
    /// last ten minutes. Nobody records them: a container such a launch left behind (its removal
    /// failed, e.g. while the engine was away) is an orphan to remove at once, not one to spare.
    pub fn abandoned_launches(&self) -> HashSet<String> {
        self.inner
            .launcher
            .abandoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, at)| at.elapsed() < launcher::LAUNCH_MEMORY)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The ids of the ready sandboxes in every pool of this process.
    pub fn ready_ids(&self) -> Vec<String> {
        self.inner
            .pools
            .values()
            .flat_map(|pool| {
                pool.state()
                    .ready
                    .iter()
                    .map(|s| s.id().to_owned())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Returns a receiver told about every sandbox a background start puts into a pool from now
    /// on, so that the caller can record it (the gateway writes a `warm` row). Replaces an
    /// earlier receiver.
    pub fn watch_ready(&self) -> mpsc::UnboundedReceiver<Sandbox> {
        let (tx, rx) = mpsc::unbounded_channel();
        *self
            .inner
            .ready_hook
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(tx);
        rx
    }

    /// Starts a sandbox from a variant of a pool's profile (e.g. a tenant's own memory and CPU
    /// limits), outside the pool. The variant keeps the pool's name, so its container is labelled
    /// like the pool's. Waits for a place among the pool's starts (see [`crate::demand`]).
    pub async fn launch_with(&self, profile: &SandboxProfile) -> Result<Sandbox, SandboxError> {
        let permit = self.start_permit(&profile.name).await?;
        self.launch_permitted(profile, permit).await
    }

    /// Waits for a place among the starts `profile`'s pool runs at once (shared by its refills
    /// and cold starts; the limit adapts, see [`crate::demand`]). A caller that may not need the
    /// start after all (a warm sandbox appeared meanwhile) drops the permit.
    pub async fn start_permit(&self, profile: &str) -> Result<StartPermit, SandboxError> {
        let pool = self.pool(profile)?;
        let _counted = ColdStarting::new(pool);
        let wait = self.inner.config.start_wait;
        tokio::time::timeout(
            wait,
            pool.gate
                .acquire(profile, || pool.state().demand.start_limit()),
        )
        .await
        .map_err(|_| SandboxError::StartQueue { waited: wait })
    }

    /// [`Self::launch_with`] in a place the caller already holds.
    pub async fn launch_permitted(
        &self,
        profile: &SandboxProfile,
        permit: StartPermit,
    ) -> Result<Sandbox, SandboxError> {
        let pool = self.pool(&profile.name)?;
        if permit.profile != profile.name {
            return Err(SandboxError::UnknownProfile(permit.profile.clone()));
        }
        validated(profile)?;
        let counted = ColdStarting::new(pool);
        let started = std::time::Instant::now();
        let launched = self.inner.launcher.launch(profile).await;
        drop(permit);
        drop(counted);
        if launched.is_ok() {
            pool.state().demand.started(started.elapsed());
        }
        launched
    }

    /// The profile a pool serves.
    pub fn profile(&self, name: &str) -> Result<&SandboxProfile, SandboxError> {
        Ok(&self.pool(name)?.profile)
    }

    /// Removes a container of this instance by id, with no handle on it (it may have been
    /// started by another process, or before a restart). Removing a missing one succeeds; a
    /// container that is not a sandbox of this instance (no `sandgate.managed` label, or another
    /// instance's) is refused with [`SandboxError::NotOurs`] and left alone: whoever names a
    /// container here (a gateway over the node RPC, an operator's purge) can remove sandboxes,
    /// never the engine's other containers.
    pub async fn remove_container(&self, container_id: &str) -> Result<(), SandboxError> {
        let backend = &self.inner.launcher.backend;
        match backend.inspect(container_id).await? {
            None => Ok(()),
            Some(found) if found.managed && found.instance == self.inner.config.instance => {
                Ok(backend.remove(&found.container_id).await?)
            }
            Some(_) => Err(SandboxError::NotOurs {
                container_id: container_id.to_owned(),
            }),
        }
    }

    /// Starts a sandbox of `profile` now (a cold start), outside the pool. Its
    /// [`Sandbox::container_id`] is known once this returns.
    pub async fn launch(&self, profile: &str) -> Result<Sandbox, SandboxError> {
        let pool = self.pool(profile)?;
        self.launch_with(&pool.profile.clone()).await
    }

    /// Puts a ready sandbox (e.g. a warm container re-adopted after a restart) into its profile's
    /// pool. Returns it back when its profile has no pool here.
    pub fn offer(&self, sandbox: Sandbox) -> Result<(), Sandbox> {
        match self.inner.pools.get(sandbox.profile()) {
            Some(pool) => {
                pool.state().ready.push_back(sandbox);
                Ok(())
            }
            None => Err(sandbox),
        }
    }

    /// Re-attaches to a running sandbox container of this instance (after a gateway restart); its
    /// kernel and files are as they were. Fails with [`SandboxError::Died`] when the container is
    /// gone or stopped, [`SandboxError::NotOurs`] when it is not this instance's sandbox.
    pub async fn adopt(&self, container_id: &str) -> Result<Sandbox, SandboxError> {
        self.inner.launcher.adopt(container_id).await
    }

    /// Ends a lease: removes the container.
    pub async fn close(&self, sandbox: Sandbox) -> Result<(), SandboxError> {
        sandbox.close().await
    }

    /// Every container of this instance, running or not (for reconciliation).
    pub async fn list_containers(&self) -> Result<Vec<ManagedContainer>, SandboxError> {
        Ok(self
            .inner
            .launcher
            .backend
            .list(&self.inner.config.instance)
            .await?)
    }

    /// Ready sandboxes waiting in `profile`'s pool (0 for an unknown profile).
    pub fn ready_count(&self, profile: &str) -> usize {
        self.inner
            .pools
            .get(profile)
            .map_or(0, |p| p.state().ready.len())
    }

    /// Starts as many background starts as `profile`'s pool lacks to reach its target.
    /// Pauses (or resumes) every pool's refills: a draining node gives its warm sandboxes up
    /// and must not start new ones, neither on the once-a-second tick nor after a lease. Starts
    /// already in flight finish and land in the pool (whoever retires the pool takes them
    /// then); a lease with an empty pool still starts its own sandbox.
    pub fn pause_refills(&self, paused: bool) {
        self.inner
            .paused
            .store(paused, std::sync::atomic::Ordering::Relaxed);
        if !paused {
            for name in self.inner.pools.keys() {
                let _ = self.refill(name);
            }
        }
    }

    pub fn refill(&self, profile: &str) -> Result<(), SandboxError> {
        let pool = self.pool(profile)?;
        if self.inner.stop.is_cancelled()
            || self.inner.paused.load(std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(());
        }
        let missing = {
            let mut state = pool.state();
            let have = state.ready.len() + state.starting;
            let target = state.demand.target(std::time::Instant::now());
            let missing = target.saturating_sub(have);
            state.starting += missing;
            missing
        };
        for _ in 0..missing {
            self.spawn_start(profile.to_owned());
        }
        Ok(())
    }

    fn spawn_start(&self, profile: String) {
        let weak: Weak<ManagerInner> = Arc::downgrade(&self.inner);
        let launcher = self.inner.launcher.clone();
        let gate = self.inner.pools[&profile].gate.clone();
        let stop = self.inner.stop.clone();
        let backoff = self.inner.config.refill_backoff;
        let pool_profile = self.inner.pools[&profile].profile.clone();
        self.inner.tasks.spawn(async move {
            let done = |weak: &Weak<ManagerInner>| {
                if let Some(inner) = weak.upgrade() {
                    inner.pools[&profile].state().starting -= 1;
                }
            };
            let limit = || {
                weak.upgrade()
                    .map_or(1, |inner| inner.pools[&profile].state().demand.start_limit())
            };
            let slot = tokio::select! {
                slot = gate.acquire(&profile, limit) => slot,
                () = stop.cancelled() => { done(&weak); return; }
            };
            // Not cancelled half-way: a launch dropped mid-flight could leave a container behind.
            let started = std::time::Instant::now();
            let launched = launcher.launch(&pool_profile).await;
            let took = started.elapsed();
            drop(slot);
            let Some(inner) = weak.upgrade().filter(|i| !i.stop.is_cancelled()) else {
                if let Ok(sandbox) = launched {
                    let _ = sandbox.close().await;
                }
                return;
            };
            let failed = match launched {
                Ok(sandbox) => {
                    tracing::debug!(sandbox_id = %sandbox.id(), profile = %profile, "warm sandbox ready");
                    {
                        let mut state = inner.pools[&profile].state();
                        state.starting -= 1;
                        state.demand.started(took);
                        state.ready.push_back(sandbox.clone());
                    }
                    if let Some(hook) = inner.ready_hook.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                        let _ = hook.send(sandbox);
                    }
                    return;
                }
                Err(err) => {
                    inner.pools[&profile].state().starting -= 1;
                    err
                }
            };
            drop(inner);
            tracing::warn!(error = %failed, profile = %profile, "starting a warm sandbox failed; retrying after a pause");
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = stop.cancelled() => return,
            }
            if let Some(inner) = weak.upgrade() {
                let _ = (SandboxManager { inner }).refill(&profile);
            }
        });
    }

    /// Stops refilling, waits for starts in flight (a start that finishes after the stop removes
    /// its container) and hands back the warm sandboxes, still running, for the caller to keep
    /// or close. Leased sandboxes are not touched.
    pub async fn stop(&self) -> Vec<Sandbox> {
        self.inner.stop.cancel();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
        self.inner
            .pools
            .values()
            .flat_map(|p| std::mem::take(&mut p.state().ready))
            .collect()
    }

    /// Stops refilling, waits for starts in flight, and removes the warm sandboxes (for callers
    /// that keep no record of them). Leased sandboxes are left running.
    pub async fn shutdown(&self) {
        for sandbox in self.stop().await {
            if let Err(err) = sandbox.close().await {
                tracing::warn!(error = %err, "removing a warm sandbox at shutdown failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::channel::ExecOptions;
    use crate::testing::{FakeBackend, eventually};

    fn profile() -> SandboxProfile {
        SandboxProfile {
            image: "fake".into(),
            ..SandboxProfile::default()
        }
    }

    fn config(min_ready: usize, max_concurrent_starts: usize) -> ManagerConfig {
        let mut config = ManagerConfig::new("unit");
        config.pool = crate::config::PoolConfig {
            min_ready,
            // A pool of fixed size unless a test says otherwise.
            max_ready: min_ready,
            max_concurrent_starts,
        };
        config.refill_backoff = Duration::from_millis(20);
        config
    }

    fn start(backend: &Arc<FakeBackend>, min_ready: usize, max: usize) -> SandboxManager {
        SandboxManager::start(backend.clone(), vec![profile()], config(min_ready, max))
            .expect("valid configuration")
    }

    const WITHIN: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn the_pool_fills_to_min_ready_and_leases_never_share_a_container() {
        let backend = Arc::new(FakeBackend::default());
        let manager = start(&backend, 3, 2);
        eventually("the pool to fill", WITHIN, || {
            manager.ready_count("default") == 3
        })
        .await;
        let mut seen = HashSet::new();
        for _ in 0..6 {
            let sandbox = manager.lease("default").await.expect("lease");
            assert!(
                seen.insert(sandbox.container_id().to_owned()),
                "container {} was handed out twice",
                sandbox.container_id()
            );
        }
        // The pool refills behind the leases, and never beyond min_ready.
        eventually("the pool to refill", WITHIN, || {
            manager.ready_count("default") == 3
        })
        .await;
        assert_eq!(backend.live(), 6 + 3);
        manager.shutdown().await;
        assert_eq!(
            backend.live(),
            6,
            "shutdown removes the warm sandboxes, not leased ones"
        );
    }

    #[tokio::test]
    async fn concurrent_leases_get_distinct_containers() {
        let backend = Arc::new(FakeBackend::default());
        let manager = start(&backend, 2, 2);
        eventually("the pool to fill", WITHIN, || {
            manager.ready_count("default") == 2
        })
        .await;
        let leases = futures::future::join_all((0..8).map(|_| manager.lease("default"))).await;
        let ids: HashSet<String> = leases
            .into_iter()
            .map(|l| l.expect("lease").container_id().to_owned())
            .collect();
        assert_eq!(ids.len(), 8, "eight leases, eight containers");
        manager.shutdown().await;
    }

    #[tokio::test]
    async fn an_empty_pool_answers_by_cold_start() {
        let backend = Arc::new(FakeBackend::default());
        let manager = start(&backend, 0, 1);
        assert_eq!(manager.ready_count("default"), 0);
        let sandbox = manager
            .lease("default")
            .await
            .expect("a cold start, not an error");
        let outcome = sandbox
            .exec("1+1", ExecOptions::default(), None)
            .await
            .unwrap();
        assert_eq!(outcome.result.unwrap()["text/plain"], "1+1");
        assert_eq!(backend.launches.load(Ordering::SeqCst), 1);
        assert_eq!(
            manager.ready_count("default"),
            0,
            "min_ready 0 keeps nothing warm"
        );
    }

    #[tokio::test]
    async fn a_failed_launch_is_not_counted_among_the_launches_reconciliation_spares() {
        let backend = Arc::new(FakeBackend::default());
        let manager = start(&backend, 0, 1);
        backend.fail.store(true, Ordering::SeqCst);
        manager
            .lease("default")
            .await
            .expect_err("the engine refuses the launch");
        assert_eq!(
            manager.launched_within(Duration::from_secs(600)),
            Vec::<String>::new(),
            "a failed launch is forgotten (what it left behind is an orphan)"
        );
        let abandoned = manager.abandoned_launches();
        assert_eq!(
            abandoned.len(),
            1,
            "the failed launch is remembered as abandoned: {abandoned:?}"
        );
        backend.fail.store(false, Ordering::SeqCst);
        let sandbox = manager.lease("default").await.expect("a cold start");
        assert_eq!(
            manager.launched_within(Duration::from_secs(600)),
            vec![sandbox.id().to_owned()],
            "a launch that succeeded is remembered until its row is written"
        );
        assert!(
            !manager.abandoned_launches().contains(sandbox.id()),
            "a launch that succeeded is not abandoned"
        );
        manager.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_launch_the_engine_holds_past_the_ready_timeout_is_given_up_and_abandoned() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let backend = Arc::new(FakeBackend::gated(gate.clone()));
        let mut config = config(0, 1);
        config.channel.ready_timeout = Duration::from_secs(60);
        let manager = SandboxManager::start(backend.clone(), vec![profile()], config)
            .expect("valid configuration");
        // The engine never answers the launch (virtual time runs past the ready timeout).
        let failed = manager.lease("default").await;
        assert!(
            matches!(
                &failed,
                Err(SandboxError::Launch(BackendError::TimedOut { after, .. }))
                    if *after == Duration::from_secs(60)
            ),
            "a launch the engine holds is given up at the ready timeout: {failed:?}"
        );
        assert!(
            manager.launched_within(Duration::from_secs(600)).is_empty(),
            "the given-up launch is not spared by reconciliation"
        );
        assert_eq!(
            manager.abandoned_launches().len(),
            1,
            "it is remembered as abandoned, for reconciliation to remove what it left"
        );
        gate.add_permits(10);
        manager
            .lease("default")
            .await
            .expect("the engine answers again");
        manager.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_pool_starts_nothing_until_it_is_resumed() {
        let backend = Arc::new(FakeBackend::default());
        let manager = start(&backend, 2, 2);
        eventually("the pool to fill", WITHIN, || {
            manager.ready_count("default") == 2
        })
        .await;
        manager.pause_refills(true);
        for _ in 0..2 {
            let sandbox = manager.take_ready("default").unwrap().expect("a warm one");
            sandbox.close().await.unwrap();
        }
        let launched = backend.launches.load(Ordering::SeqCst);
        // Five ticks of the pool (virtual time) and a lease: none starts a warm sandbox.
        tokio::time::sleep(POOL_TICK * 5).await;
        let leased = manager.lease("default").await.expect("a cold start");
        tokio::time::sleep(POOL_TICK * 5).await;
        assert_eq!(
            backend.launches.load(Ordering::SeqCst),
            launched + 1,
            "only the lease's own start ran while paused"
        );
        assert_eq!(manager.ready_count("default"), 0);
        manager.pause_refills(false);
        eventually("the pool to refill once resumed", WITHIN, || {
            manager.ready_count("default") == 2
        })
        .await;
        drop(leased);
        manager.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_cold_start_that_waits_past_start_wait_is_refused_and_the_next_one_goes_through() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let backend = Arc::new(FakeBackend::gated(gate.clone()));
        let mut config = config(0, 1);
        config.start_wait = Duration::from_secs(30);
        let manager = SandboxManager::start(backend.clone(), vec![profile()], config)
            .expect("valid configuration");
        // The one place is taken by a start the engine holds.
        let launching = tokio::spawn({
            let manager = manager.clone();
            async move { manager.lease("default").await }
        });
        eventually("a start in flight", WITHIN, || {
            backend.in_flight.load(Ordering::SeqCst) == 1
        })
        .await;
        let refused = manager.lease("default").await;
        assert!(
            matches!(refused, Err(SandboxError::StartQueue { waited }) if waited == Duration::from_secs(30)),
            "a start that found no place within start_wait is refused: {refused:?}"
        );
        assert_eq!(
            manager.pool_stats("default").unwrap().cold_starting,
            1,
            "the refused start is no longer counted"
        );
        gate.add_permits(10);
        launching.await.unwrap().expect("the held start completes");
        manager
            .lease("default")
            .await
            .expect("with the place free again, a start goes through");
        manager.shutdown().await;
    }

    #[tokio::test]
    async fn a_cold_start_given_up_while_waiting_or_launching_is_no_longer_counted() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let backend = Arc::new(FakeBackend::gated(gate.clone()));
        let manager = start(&backend, 0, 1);
        let cold = |m: &SandboxManager| m.pool_stats("default").unwrap().cold_starting;
        // One lease launching (held by the backend's gate), one waiting for its place.
        let launching = tokio::spawn({
            let manager = manager.clone();
            async move { manager.lease("default").await }
        });
        eventually("a start in flight", WITHIN, || {
            backend.in_flight.load(Ordering::SeqCst) == 1
        })
        .await;
        let waiting = tokio::spawn({
            let manager = manager.clone();
            async move { manager.start_permit("default").await.map(drop) }
        });
        eventually("two cold starts counted", WITHIN, || cold(&manager) == 2).await;
        // Both callers go away (their requests were cancelled).
        waiting.abort();
        launching.abort();
        let _ = (waiting.await, launching.await);
        assert_eq!(cold(&manager), 0, "cancelled cold starts are uncounted");
        gate.add_permits(10);
        manager.shutdown().await;
    }

    #[tokio::test]
    async fn refills_respect_max_concurrent_starts() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let backend = Arc::new(FakeBackend::gated(gate.clone()));
        let manager = start(&backend, 5, 2);
        eventually("two starts in flight", WITHIN, || {
            backend.in_flight.load(Ordering::SeqCst) == 2
        })
        .await;
        gate.add_permits(5);
        eventually("the pool to fill", WITHIN, || {
            manager.ready_count("default") == 5
        })
        .await;
        assert_eq!(backend.max_in_flight.load(Ordering::SeqCst), 2);
        manager.shutdown().await;
        assert_eq!(backend.live(), 0);
    }

    #[tokio::test]
    async fn a_failing_engine_fails_the_lease_and_the_pool_recovers_when_it_does() {
        let backend = Arc::new(FakeBackend::default());
        backend.fail.store(true, Ordering::SeqCst);
        let manager = start(&backend, 1, 1);
        let err = manager
            .lease("default")
            .await
            .expect_err("no container can start");
        assert!(matches!(err, SandboxError::Launch(_)), "{err:?}");
        backend.fail.store(false, Ordering::SeqCst);
        eventually("the pool to recover", WITHIN, || {
            manager.ready_count("default") == 1
        })
        .await;
        manager.shutdown().await;
    }

    #[tokio::test]
    async fn a_warm_sandbox_that_died_is_never_leased() {
        let backend = Arc::new(FakeBackend::default());
        let manager = start(&backend, 1, 1);
        eventually("the pool to fill", WITHIN, || {
            manager.ready_count("default") == 1
        })
        .await;
        let doomed = backend.list("unit").await.unwrap().remove(0).container_id;
        backend.kill(&doomed, ContainerFate::Exited { code: 1 });
        let sandbox = manager.take_ready("default").unwrap();
        // The dead one may still look alive for a moment (its stream ends asynchronously).
        if let Some(sandbox) = sandbox {
            eventually("the stream end to be seen", WITHIN, || sandbox.is_lost()).await;
            manager.offer(sandbox).unwrap();
        }
        let leased = manager.lease("default").await.unwrap();
        assert_ne!(leased.container_id(), doomed);
        leased.ping().await.expect("the leased sandbox answers");
        manager.shutdown().await;
    }

    #[tokio::test]
    async fn a_sandbox_killed_for_memory_says_so() {
        let backend = Arc::new(FakeBackend::default());
        let manager = start(&backend, 0, 1);
        let sandbox = manager.lease("default").await.unwrap();
        backend.kill(
            sandbox.container_id(),
            ContainerFate::OomKilled {
                memory_limit_bytes: Some(512 << 20),
            },
        );
        let err = sandbox
            .exec("1+1", ExecOptions::default(), None)
            .await
            .expect_err("the sandbox is dead");
        assert!(
            matches!(
                err,
                SandboxError::Died {
                    fate: ContainerFate::OomKilled { .. },
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("memory limit of 512 MiB"), "{err}");
    }

    #[tokio::test]
    async fn an_unknown_profile_is_an_error() {
        let backend = Arc::new(FakeBackend::default());
        let manager = start(&backend, 0, 1);
        let err = manager.lease("gpu").await.expect_err("no such profile");
        assert!(matches!(err, SandboxError::UnknownProfile(_)));
    }
}
