//! The pool and leases: uniqueness, cold starts, adoption, independence of sandboxes.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use sandgate_sandbox::{ExecOptions, PoolConfig};

use crate::support::{self, TestEnv};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_never_share_a_container_and_an_empty_pool_cold_starts() {
    let warm = TestEnv::new("pool-warm", 2).await;
    support::eventually(Duration::from_secs(120), "the pool to fill", || async {
        (warm.manager.ready_count("default") == 2).then_some(())
    })
    .await;
    let started = Instant::now();
    let leases = futures::future::join_all((0..3).map(|_| warm.lease())).await;
    eprintln!(
        "pool: three leases (two warm, one cold) took {:?}",
        started.elapsed()
    );
    let ids: HashSet<&str> = leases.iter().map(|s| s.container_id()).collect();
    assert_eq!(ids.len(), 3, "three leases, three containers: {ids:?}");
    for sandbox in &leases {
        sandbox.ping().await.expect("every leased sandbox answers");
    }

    let cold = TestEnv::new("pool-cold", 0).await;
    assert_eq!(cold.manager.ready_count("default"), 0);
    let started = Instant::now();
    let sandbox = cold.lease().await;
    eprintln!("pool: a cold start took {:?}", started.elapsed());
    let outcome = sandbox
        .exec("1+1", ExecOptions::default(), None)
        .await
        .unwrap();
    assert_eq!(outcome.result.unwrap()["text/plain"], "2");
    assert_eq!(
        cold.manager.ready_count("default"),
        0,
        "min_ready 0 keeps nothing warm"
    );

    warm.cleanup().await;
    cold.cleanup().await;
}

#[tokio::test]
async fn adopt_after_the_owner_is_gone_finds_variables_defined_before() {
    let env = TestEnv::new("adopt", 0).await;
    let first = env.another_manager().await;
    let container_id = {
        let sandbox = first.lease("default").await.expect("a lease");
        sandbox
            .exec(
                "secret = 'defined before the restart'",
                ExecOptions::default(),
                None,
            )
            .await
            .unwrap();
        sandbox.container_id().to_owned()
    };
    // The owner goes away: its sandbox handle, attach stream, manager and engine connection.
    drop(first);

    let restarted = env.another_manager().await;
    let adopted = restarted
        .adopt(&container_id)
        .await
        .expect("a running sandbox of this instance can be adopted");
    let outcome = adopted
        .exec("secret", ExecOptions::default(), None)
        .await
        .unwrap();
    assert_eq!(
        outcome.result.unwrap()["text/plain"],
        "'defined before the restart'",
        "the kernel's state survived the owner's departure"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_cell_does_not_hold_up_other_work() {
    let env = TestEnv::new("independent", 0).await;
    let (sleeper, other) = tokio::join!(env.lease(), env.lease());
    sleeper
        .write_file("notes.txt", b"readable while a cell sleeps", true)
        .await
        .unwrap();

    let sleeping = tokio::spawn({
        let sleeper = sleeper.clone();
        async move {
            sleeper
                .exec("import time\ntime.sleep(600)", ExecOptions::default(), None)
                .await
        }
    });
    support::eventually(
        Duration::from_secs(10),
        "the sleeping cell to start",
        || {
            let sleeper = sleeper.clone();
            async move { sleeper.ping().await.ok().filter(|p| p.busy).map(|_| ()) }
        },
    )
    .await;

    let started = Instant::now();
    let outcome = other
        .exec("1+1", ExecOptions::default(), None)
        .await
        .unwrap();
    let exec_took = started.elapsed();
    assert_eq!(outcome.result.unwrap()["text/plain"], "2");

    let started = Instant::now();
    let (bytes, _) = sleeper.read_file("notes.txt", 1024).await.unwrap();
    let read_took = started.elapsed();
    assert_eq!(bytes, b"readable while a cell sleeps");

    // The other work is done while the sleeper's cell (ten minutes long) still runs: it did not
    // wait for it.
    assert!(
        !sleeping.is_finished(),
        "the sleeping cell is still running"
    );
    eprintln!(
        "independence: 1+1 elsewhere took {exec_took:?}, read_file on the sleeper {read_took:?}"
    );
    // Dropping the call interrupts the cell.
    sleeping.abort();
    env.cleanup().await;
}

/// The pool follows demand against the real engine: a burst of leases grows it up to its ceiling
/// (never beyond), and once leases stop it shrinks back to its floor (never below).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_grows_under_a_burst_within_its_ceiling_and_shrinks_to_its_floor_when_idle() {
    let pool = PoolConfig {
        min_ready: 1,
        max_ready: 3,
        max_concurrent_starts: 0,
    };
    // A short demand window, so the shrink is seen within seconds.
    let env = TestEnv::with_pool_window("demand", pool, Duration::from_secs(20)).await;
    let stats = || env.manager.pool_stats("default").expect("the pool exists");
    support::eventually(Duration::from_secs(120), "the floor to fill", || async {
        (stats().ready == 1).then_some(())
    })
    .await;

    // A burst: more leases at once than the pool holds.
    let leases = futures::future::join_all((0..5).map(|_| env.lease())).await;
    let ids: HashSet<&str> = leases.iter().map(|s| s.container_id()).collect();
    assert_eq!(ids.len(), 5, "five leases, five containers");
    let grown = support::eventually(Duration::from_secs(120), "the pool to grow", || async {
        let now = stats();
        assert!(
            now.ready <= 3 && now.ready + now.starting <= 3,
            "never beyond the ceiling: {now:?}"
        );
        (now.ready > 1).then_some(now)
    })
    .await;
    eprintln!("pool: grown to {grown:?}");

    // No more leases: back to the floor, and not below it.
    support::eventually(Duration::from_secs(120), "the pool to shrink", || async {
        let now = stats();
        assert!(now.ready <= 3, "never beyond the ceiling: {now:?}");
        (now.target == 1 && now.ready == 1 && now.starting == 0).then_some(())
    })
    .await;
    // The surplus containers are removed (the leased ones and the floor kept).
    support::eventually(
        Duration::from_secs(60),
        "the surplus containers to be removed",
        || async { (support::containers(&env.instance).await == 5 + 1).then_some(()) },
    )
    .await;
    assert_eq!(stats().ready, 1, "never below the floor");
    env.cleanup().await;
}

/// A container named to `remove_container` (what a node does for a gateway's `Remove`) goes only
/// when it is a sandbox of the manager's instance: a container sandgate did not make, or another
/// instance's sandbox, is refused and stays; a missing one is already removed.
#[tokio::test]
async fn remove_container_removes_only_this_instances_sandboxes() {
    use bollard::models::ContainerCreateBody;
    use bollard::query_parameters::{CreateContainerOptionsBuilder, RemoveContainerOptionsBuilder};
    use sandgate_sandbox::SandboxError;

    let env = TestEnv::new("remove-guard", 0).await;
    let other = TestEnv::new("remove-guard-other", 0).await;
    let docker = support::docker();
    // Not a sandbox at all: the sandbox image, never started, with a label of its own only.
    let foreign = docker
        .create_container(
            Some(CreateContainerOptionsBuilder::default().build()),
            ContainerCreateBody {
                image: Some(support::image()),
                cmd: Some(vec!["true".into()]),
                labels: Some([("sandgate.test".to_string(), "remove-guard".to_string())].into()),
                ..Default::default()
            },
        )
        .await
        .expect("a plain container can be created")
        .id;
    let theirs = other.lease().await;
    let ours = env.lease().await;

    for (what, id) in [
        ("a container sandgate did not make", foreign.as_str()),
        ("another instance's sandbox", theirs.container_id()),
    ] {
        let refused = env.manager.remove_container(id).await;
        assert!(
            matches!(refused, Err(SandboxError::NotOurs { .. })),
            "{what} is refused as not ours: {refused:?}"
        );
        assert!(
            docker.inspect_container(id, None).await.is_ok(),
            "{what} is still there"
        );
    }
    theirs
        .ping()
        .await
        .expect("the other instance's sandbox still answers");

    env.manager
        .remove_container(ours.container_id())
        .await
        .expect("this instance's sandbox is removed");
    assert!(
        docker
            .inspect_container(ours.container_id(), None)
            .await
            .is_err(),
        "this instance's sandbox is gone"
    );
    env.manager
        .remove_container(ours.container_id())
        .await
        .expect("removing a container that is gone succeeds");

    let _ = docker
        .remove_container(
            &foreign,
            Some(RemoveContainerOptionsBuilder::default().force(true).build()),
        )
        .await;
    other.cleanup().await;
    env.cleanup().await;
}
