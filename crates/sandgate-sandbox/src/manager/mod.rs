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

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backend::{ManagedContainer, SandboxBackend};
use crate::config::{ManagerConfig, SandboxProfile};
use crate::demand::{Demand, DemandLimits};

mod error;
mod launcher;
mod pool;
mod sandbox;
mod sealed;
mod snapshots;
mod templates;

pub use error::SandboxError;
use launcher::Launcher;
use pool::{ColdStarting, Pool, PoolState};
pub use pool::{PoolStats, StartPermit};
pub use sandbox::Sandbox;
pub use templates::{TemplateError, TemplateInfo, TemplateStatus};

/// How often the pools are checked against their targets (grown or shrunk).
const POOL_TICK: Duration = Duration::from_secs(1);

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
    /// Places for restores running at once ([`ManagerConfig::max_concurrent_restores`]).
    restores: tokio::sync::Semaphore,
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
                    template: Arc::default(),
                },
            );
        }
        let config_restores = config.max_concurrent_restores.max(1);
        let manager = Self {
            inner: Arc::new(ManagerInner {
                launcher: Launcher {
                    backend,
                    instance: config.instance.clone(),
                    channel: config.channel.clone(),
                    launched: Arc::default(),
                    abandoned: Arc::default(),
                    attached: Arc::default(),
                    adopting: Arc::default(),
                },
                config,
                pools,
                tasks: TaskTracker::new(),
                stop: CancellationToken::new(),
                ready_hook: Mutex::new(None),
                paused: std::sync::atomic::AtomicBool::new(false),
                restores: tokio::sync::Semaphore::new(config_restores),
            }),
        };
        let names: Vec<String> = manager.inner.pools.keys().cloned().collect();
        // A tmpfs of a few directories: a blocking sweep here takes microseconds.
        manager.sweep_leftover_templates();
        for name in names {
            manager.refill(&name)?;
            manager.spawn_template_keeper(name);
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

    /// Which engine serves `profile`'s sandboxes, and why (`/readyz`); `None` for a profile this
    /// manager has no pool of.
    pub fn engine(&self, profile: &str) -> Option<String> {
        let pool = self.inner.pools.get(profile)?;
        Some(self.inner.launcher.backend.engine(&pool.profile))
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
        self.abandoned_ids()
    }

    /// Gives up `sandbox_id`, a sandbox of this process whose container could not be removed
    /// (its engine away): nobody will record it again, so reconciliation removes what is left of
    /// it at its first pass once the engine answers, as it does for an abandoned launch, instead
    /// of sparing it as a fresh launch of this process.
    pub fn abandon(&self, sandbox_id: &str) {
        self.inner
            .launcher
            .launched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(sandbox_id);
        launcher::note(&self.inner.launcher.abandoned, sandbox_id);
    }

    fn abandoned_ids(&self) -> HashSet<String> {
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
        self.launch_permitted_as(profile, permit, None).await
    }

    /// [`Self::launch_permitted`] under the sandbox id `sandbox_id` when given (a files-only
    /// resume: the sandbox keeps its id; such a start is never a template's restore). The id
    /// must look like one the manager makes (`sbx_` and 32 hex digits).
    pub async fn launch_permitted_as(
        &self,
        profile: &SandboxProfile,
        permit: StartPermit,
        sandbox_id: Option<&str>,
    ) -> Result<Sandbox, SandboxError> {
        if let Some(id) = sandbox_id
            && !is_sandbox_id(id)
        {
            return Err(SandboxError::NotOurs {
                container_id: id.to_owned(),
            });
        }
        let pool = self.pool(&profile.name)?;
        if permit.profile != profile.name {
            return Err(SandboxError::UnknownProfile(permit.profile.clone()));
        }
        validated(profile)?;
        let counted = ColdStarting::new(pool);
        let started = std::time::Instant::now();
        // Only the pool's own profile can be restored from its template (a restore needs the
        // checkpointed container's exact limits and mounts).
        let launched = if let Some(id) = sandbox_id {
            self.inner.launcher.launch_as(profile, Some(id)).await
        } else if *profile == pool.profile {
            let templates = &self.inner.config.templates;
            templates::start_pooled(&self.inner.launcher, &pool.template, templates, profile).await
        } else {
            self.inner.launcher.launch(profile).await
        };
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

    /// The engine's id of the image profile `name` runs now (`None` when the profile is
    /// unknown or the engine cannot say): containers made from another one are of an image
    /// that has since been replaced.
    pub async fn current_image_id(&self, name: &str) -> Option<String> {
        let image = &self.profile(name).ok()?.image;
        self.inner.launcher.backend.image_id(image).await
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
        let template = self.inner.pools[&profile].template.clone();
        let templates = self.inner.config.templates.clone();
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
            let launched =
                templates::start_pooled(&launcher, &template, &templates, &pool_profile).await;
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
        for pool in self.inner.pools.values() {
            // Its plaintext image goes as soon as no restore holds it.
            pool.template.clear();
        }
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
mod tests;

/// Whether `id` looks like a sandbox id the manager makes: `sbx_` and 32 lowercase hex digits.
pub fn is_sandbox_id(id: &str) -> bool {
    id.strip_prefix("sbx_").is_some_and(|hex| {
        hex.len() == 32
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}
