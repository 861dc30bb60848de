//! The pool and leases: uniqueness, cold starts, adoption, independence of sandboxes.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use sandgate_sandbox::ExecOptions;

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
