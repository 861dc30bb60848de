//! Resource limits: output floods, memory, processes, network.

use std::time::Duration;

use sandgate_sandbox::{
    ChannelError, CommandOptions, ContainerFate, ExecOptions, ExecOutcome, OciRuntime, Sandbox,
    SandboxError,
};

use crate::support::{self, TestEnv};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_flood_is_truncated_and_the_gateway_memory_stays_bounded() {
    let _heavy = support::MEMORY_HEAVY.lock().await;
    let env = TestEnv::new("flood", 0).await;
    let sandbox = env.lease().await;

    support::reset_peak_rss();
    let rss_before = support::proc_status_kib("VmRSS");
    let outcome = sandbox
        .exec(
            "print('x' * 200_000_000)",
            ExecOptions {
                timeout: Duration::from_secs(120),
                ..ExecOptions::default()
            },
            None,
        )
        .await
        .expect("the cell returns");
    let peak = support::proc_status_kib("VmHWM");

    assert!(outcome.truncated, "{:?}", outcome.stderr);
    assert!(
        outcome
            .stderr
            .contains("[output truncated: limit of 1048576 bytes reached]"),
        "the truncation marker is in stderr: {:?}",
        outcome.stderr
    );
    assert!(
        outcome.stdout.len() <= 1 << 20,
        "at most the limit is kept: {} bytes",
        outcome.stdout.len()
    );
    let grew_mib = peak.saturating_sub(rss_before) / 1024;
    assert!(
        grew_mib < 64,
        "200 MB of output must not pass through the gateway's memory: peak RSS grew by {grew_mib} MiB"
    );
    eprintln!(
        "output flood: took {:?}, gateway peak RSS grew by {grew_mib} MiB",
        outcome.duration
    );
    sandbox.ping().await.expect("the sandbox still answers");
    env.cleanup().await;
}

#[tokio::test]
async fn a_result_value_too_large_for_the_gateway_is_refused_and_the_kernel_lives_on() {
    let _heavy = support::MEMORY_HEAVY.lock().await;
    let env = TestEnv::new("huge-result", 0).await;
    let sandbox = env.lease().await;
    // The agent caps printed output but not the value of the last expression.
    let result = sandbox
        .exec("big = 'y' * 40_000_000\nbig", ExecOptions::default(), None)
        .await;
    match result {
        Err(SandboxError::Channel(err @ ChannelError::FrameTooLarge { .. })) => {
            assert!(err.to_string().contains("kernel state is kept"), "{err}");
        }
        other => panic!("a 40 MB result must be refused, got {other:?}"),
    }
    let len = sandbox
        .exec("len(big)", ExecOptions::default(), None)
        .await
        .unwrap();
    assert_eq!(len.result.unwrap()["text/plain"], "40000000");
    env.cleanup().await;
}

#[tokio::test]
async fn allocating_past_the_memory_limit_reports_the_memory_limit() {
    let env = TestEnv::new("oom", 0).await;
    let sandbox = env.lease().await;
    let result = sandbox
        .exec("x = bytearray(4 * 1024**3)", ExecOptions::default(), None)
        .await;
    match result {
        Err(
            err @ SandboxError::Died {
                fate: ContainerFate::OomKilled { .. },
                ..
            },
        ) => {
            let message = err.to_string();
            assert!(
                // 512 MiB for processes + 64 + 512 + 256 MiB for the tmpfs mounts (their pages
                // count).
                message.contains("memory limit of 1344 MiB was hit"),
                "the error names the memory limit: {message}"
            );
            eprintln!("oom: {message}");
        }
        // The out-of-memory killer picked the kernel: the container lives, a fresh kernel took
        // its place, and the cell says why its state is gone.
        Ok(outcome) if outcome.state_lost => {
            let reason = outcome.state_lost_reason.clone().unwrap_or_default();
            assert!(reason.contains("out-of-memory"), "{outcome:?}");
            let next = sandbox
                .exec("1 + 1", ExecOptions::default(), None)
                .await
                .expect("the next cell runs in the fresh kernel");
            assert_eq!(next.result.expect("a value")["text/plain"], "2");
        }
        Ok(outcome) => {
            let error = outcome.error.expect("the allocation fails");
            assert_eq!(error.name, "MemoryError", "{error:?}");
        }
        Err(other) => panic!("expected a memory-limit error, got {other:?} ({other})"),
    }
    env.cleanup().await;
}

/// The classic bomb, then a busy wait made of builtins (no fork needed) that keeps the command's
/// main process alive until its timeout: the agent kills the group as soon as the main process
/// exits, so without it the bomb would be over at once.
const FORK_BOMB: &str =
    "bomb(){ bomb|bomb& }; bomb; end=$((SECONDS+10)); while [ $SECONDS -lt $end ]; do :; done";

/// A cell's plain-text result.
fn plain(outcome: &ExecOutcome) -> Option<&str> {
    outcome
        .result
        .as_ref()
        .and_then(|r| r.get("text/plain"))
        .map(String::as_str)
}

/// Runs `1+1` in `sandbox` after a bomb and checks it gives 2; returns the outcome.
async fn one_plus_one_after_the_bomb(sandbox: &Sandbox) -> ExecOutcome {
    let after = sandbox
        .exec("1+1", ExecOptions::default(), None)
        .await
        .expect("the sandbox takes a cell after the bomb");
    assert_eq!(plain(&after), Some("2"), "1+1 after the bomb: {after:?}");
    after
}

/// Lets the kernel finish its own start (the shell and the background import of the data
/// stack), so that a test is about what it does next: a bomb during the import can end the
/// kernel (numpy's thread pool cannot start), which a test of its own covers.
async fn finish_the_kernels_start(sandbox: &Sandbox) {
    let warm = sandbox
        .exec(
            "import numpy, pandas, matplotlib.pyplot",
            ExecOptions::default(),
            None,
        )
        .await
        .expect("the kernel imports the data stack");
    assert!(warm.error.is_none(), "{warm:?}");
}

/// Ends the kernel with a cell while the process table is full (`what` fills it); its outcome.
/// `None` when the whole sandbox died instead, which only gVisor's may (it does not survive a
/// full process table; runc's must): the test is over then.
async fn end_the_kernel_while_full(sandbox: &Sandbox, what: &str) -> Option<ExecOutcome> {
    match sandbox
        .exec("import os; os._exit(3)", ExecOptions::default(), None)
        .await
    {
        Ok(outcome) => Some(outcome),
        Err(err @ SandboxError::Died { .. }) if support::runtime() == OciRuntime::Runsc => {
            eprintln!("{what} under gVisor: the sandbox died and says why: {err}");
            None
        }
        Err(other) => panic!("the cell that ends the kernel is answered: {other:?}"),
    }
}

#[tokio::test]
async fn a_fork_bomb_is_contained_by_the_pids_limit() {
    let env = TestEnv::new("forkbomb", 0).await;
    let sandbox = env.lease().await;
    finish_the_kernels_start(&sandbox).await;
    let bomb = sandbox
        .command(
            FORK_BOMB,
            CommandOptions {
                timeout: Duration::from_secs(4),
                ..CommandOptions::default()
            },
            None,
        )
        .await;

    // The host is fine: it starts processes and its engine answers.
    let host = std::process::Command::new("true")
        .status()
        .expect("the host can start a process");
    assert!(host.success());
    support::backend().await;

    match bomb {
        Ok(outcome) => {
            assert!(
                outcome.timed_out,
                "a fork bomb runs until its timeout: {outcome:?}"
            );
            assert!(
                outcome.stderr.contains("Resource temporarily unavailable"),
                "the bomb ran into the pids limit: {:?}",
                &outcome.stderr[..outcome.stderr.len().min(500)]
            );
            one_plus_one_after_the_bomb(&sandbox).await;
            let pids = support::eventually(
                Duration::from_secs(10),
                "the bomb's processes to be gone",
                || {
                    let sandbox = sandbox.clone();
                    async move {
                        let out = sandbox
                            .command(
                                "ls -d /proc/[0-9]* | wc -l",
                                CommandOptions::default(),
                                None,
                            )
                            .await
                            .ok()?;
                        let n: usize = out.stdout.trim().parse().ok()?;
                        (n < 20).then_some(n)
                    }
                },
            )
            .await;
            eprintln!("fork bomb: contained; {pids} processes afterwards");
        }
        Err(err @ SandboxError::Died { .. }) => {
            eprintln!("fork bomb: the sandbox died and says why: {err}");
        }
        Err(other) => panic!("expected containment or a reasoned death, got {other:?}"),
    }
    env.cleanup().await;
}

/// The kernel dies while a fork bomb holds every process slot (numpy's thread pool ends the
/// kernel when it cannot start its threads; here the cell ends it itself, so the moment is not left
/// to chance): its successor cannot start until the bomb is gone, and then it must, so that the
/// sandbox takes cells again and says why their state is gone.
#[tokio::test]
async fn a_kernel_that_dies_during_a_fork_bomb_is_replaced_once_the_bomb_is_gone() {
    let env = TestEnv::new("forkbomb-kernel", 0).await;
    let sandbox = env.lease().await;
    let bomber = sandbox.clone();
    let bomb = tokio::spawn(async move {
        bomber
            .command(
                FORK_BOMB,
                CommandOptions {
                    timeout: Duration::from_secs(5),
                    ..CommandOptions::default()
                },
                None,
            )
            .await
    });
    // Let the bomb fill the process table (no duration is asserted: should the kernel die before
    // the table is full, its successor starts at once and the test checks the same things).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let Some(died) = end_the_kernel_while_full(&sandbox, "fork bomb").await else {
        env.cleanup().await;
        return;
    };
    assert!(died.state_lost, "{died:?}");
    assert_eq!(
        died.error.as_ref().map(|e| e.name.as_str()),
        Some("KernelDied"),
        "{died:?}"
    );
    let bomb = bomb
        .await
        .expect("the bomb's task")
        .expect("the bomb's command is answered");
    assert!(bomb.timed_out, "{bomb:?}");

    let after = one_plus_one_after_the_bomb(&sandbox).await;
    // A kernel that started during the bomb and died of it is reported with the limit as cause.
    if let Some(reason) = after.state_lost_reason.as_deref() {
        assert!(reason.contains("process limit"), "{after:?}");
    }
    env.cleanup().await;
}

/// A background job that fills the process table and keeps it full (four loops forking sleepers
/// the moment a slot frees up) keeps a kernel that dies meanwhile from being replaced: a cell sent
/// then is given up at its timeout and says why (the model learns what to do), and once the job
/// is killed the kernel is back. Should a replacement win a race for the slots the dead kernel
/// freed, it takes the cell instead, which is fine too (and said).
#[tokio::test]
async fn a_cell_waiting_for_a_kernel_that_cannot_start_says_why_and_runs_once_the_job_is_killed() {
    let env = TestEnv::new("forkbomb-job", 0).await;
    let sandbox = env.lease().await;
    finish_the_kernels_start(&sandbox).await;
    let job = sandbox
        .start_job(
            "for i in 1 2 3 4; do python3 -c 'import os, time\nwhile True:\n    try:\n        \
             if os.fork() == 0:\n            time.sleep(1000)\n            os._exit(0)\n    \
             except OSError:\n        pass' & done; wait",
            None,
        )
        .await
        .expect("the filler starts as a background job");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let Some(died) = end_the_kernel_while_full(&sandbox, "process table filled").await else {
        env.cleanup().await;
        return;
    };
    assert!(died.state_lost, "{died:?}");
    let waiting = match sandbox
        .exec(
            "1+1",
            ExecOptions {
                timeout: Duration::from_secs(3),
                ..ExecOptions::default()
            },
            None,
        )
        .await
    {
        Ok(waiting) => waiting,
        // gVisor's 2024 sentry may die a moment later than the kernel, while this cell waits:
        // the same end of a full process table as in `end_the_kernel_while_full`.
        Err(err @ SandboxError::Died { .. }) if support::runtime() == OciRuntime::Runsc => {
            eprintln!("process table filled under gVisor: the sandbox died and says why: {err}");
            env.cleanup().await;
            return;
        }
        Err(other) => panic!("the waiting cell is answered: {other:?}"),
    };
    if waiting.timed_out {
        let why = waiting
            .error
            .as_ref()
            .map(|e| e.value.as_str())
            .unwrap_or("");
        assert!(
            why.contains("process limit") && why.contains("kill_job"),
            "the cell says why no kernel took it: {waiting:?}"
        );
    } else {
        eprintln!("a replacement kernel won the race for the freed slots: {waiting:?}");
        assert_eq!(plain(&waiting), Some("2"), "{waiting:?}");
    }
    sandbox
        .kill_job(&job.id)
        .await
        .expect("the filler's job is killed");
    one_plus_one_after_the_bomb(&sandbox).await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_sandbox_has_no_network() {
    let env = TestEnv::new("network", 0).await;
    let sandbox = env.lease().await;
    let outcome = sandbox
        .exec(
            "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=5)",
            ExecOptions::default(),
            None,
        )
        .await
        .expect("the cell returns");
    let error = outcome.error.expect("the connection fails");
    assert!(
        error.name.ends_with("Error"),
        "an OS-level error, not a connection: {error:?}"
    );
    assert!(
        error.value.contains("unreachable") || error.name == "OSError",
        "no route out: {error:?}"
    );
    let interfaces = sandbox
        .exec(
            "import socket\nsorted(n for _, n in socket.if_nameindex())",
            ExecOptions::default(),
            None,
        )
        .await
        .unwrap();
    assert_eq!(interfaces.result.unwrap()["text/plain"], "['lo']");
    env.cleanup().await;
}
