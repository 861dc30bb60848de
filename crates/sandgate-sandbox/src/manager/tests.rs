//! Unit tests of the manager's pools, leases and starts, over the fake backend.

use std::sync::atomic::Ordering;

use super::*;
use crate::backend::{BackendError, ContainerFate};
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

/// A backend without checkpoint support says so, typed, and a failed checkpoint leaves the
/// sandbox serving (not taken for one a checkpoint stopped).
#[tokio::test]
async fn a_backend_without_snapshots_says_so_and_the_sandbox_serves_on() {
    use crate::snapshot::{SnapshotError, SnapshotUnavailable};
    let backend = Arc::new(FakeBackend::default());
    let manager = start(&backend, 0, 1);
    let unavailable = manager.snapshots_available("default").await;
    assert!(
        matches!(
            unavailable,
            Err(SandboxError::SnapshotsUnavailable {
                reason: SnapshotUnavailable::NotSupported,
                ..
            })
        ),
        "{unavailable:?}"
    );
    let sandbox = manager.lease("default").await.expect("lease");
    let failed = manager.checkpoint(&sandbox, false).await;
    assert!(
        matches!(
            &failed,
            Err(SandboxError::Checkpoint { source, .. })
                if matches!(**source, SnapshotError::Unavailable(SnapshotUnavailable::NotSupported))
        ),
        "{failed:?}"
    );
    assert!(!sandbox.is_checkpointed());
    sandbox.ping().await.expect("the sandbox still serves");
    manager.shutdown().await;
}
