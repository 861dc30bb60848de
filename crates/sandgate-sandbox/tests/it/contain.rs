//! The sandbox plays the attacker (DESIGN §8a, a malicious sandbox): processes that try to outlive
//! their call, a disk filled past its quota, a cell reaching for the agent's descriptors and
//! signals, a kernel killed from a terminal. Runs under runc and, with
//! `SANDGATE_TEST_RUNTIME=runsc`, under gVisor.

use std::time::Duration;

use sandgate_sandbox::{CommandOptions, CommandOutcome, ExecOptions, ExecOutcome, Sandbox};

use crate::support::{self, TestEnv};

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

async fn cell(sandbox: &Sandbox, code: &str) -> ExecOutcome {
    sandbox
        .exec(code, ExecOptions::default(), None)
        .await
        .expect("the cell is answered")
}

async fn shell(sandbox: &Sandbox, command: &str) -> CommandOutcome {
    sandbox
        .command(command, CommandOptions::default(), None)
        .await
        .expect("the command is answered")
}

fn text(outcome: &ExecOutcome) -> String {
    outcome
        .result
        .as_ref()
        .and_then(|r| r.get("text/plain").cloned())
        .unwrap_or_else(|| panic!("the cell has a value: {outcome:?}"))
}

/// A marker unique to this test run, so that survivors are not confused with other tests'.
fn marker() -> String {
    let id = uuid::Uuid::new_v4().as_u128() % 1_000_000;
    format!("{id:06}")
}

/// The live (not zombie) processes of the sandbox whose command line contains `needle`.
async fn survivors(sandbox: &Sandbox, needle: &str) -> Vec<String> {
    let out = shell(sandbox, "ps -eo stat=,args=").await;
    out.stdout
        .lines()
        .filter(|l| l.contains(needle) && !l.trim_start().starts_with('Z') && !l.contains("ps -eo"))
        .map(str::to_owned)
        .collect()
}

/// Polls until no live process matches `needle` (the sweep is over within 2 s); fails with what
/// survived.
async fn none_survive(sandbox: &Sandbox, needle: &str) {
    let deadline = tokio::time::Instant::now() + secs(5);
    loop {
        let left = survivors(sandbox, needle).await;
        if left.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "survivors of {needle}: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn setsid_nohup_and_double_fork_do_not_outlive_a_timed_out_command() {
    let env = TestEnv::new("contain-cmd", 0).await;
    let sandbox = env.lease().await;
    let m = marker();
    let outcome = sandbox
        .command(
            &format!(
                "setsid sleep 71{m} & nohup sleep 72{m} >/dev/null 2>&1 & (sleep 73{m} &) ; \
                 setsid sh -c 'sleep 74{m} & exec sleep 75{m}' & setsid sh -c '(sleep 77{m} &)'; \
                 sleep 60"
            ),
            CommandOptions {
                timeout: secs(2),
                ..CommandOptions::default()
            },
            None,
        )
        .await
        .expect("the command is answered");
    assert!(outcome.timed_out, "{outcome:?}");
    none_survive(&sandbox, &m).await;
    // A command that ends by itself takes its escapees along too.
    let done = shell(&sandbox, &format!("setsid sleep 76{m} & echo started")).await;
    assert_eq!(done.stdout, "started\n");
    none_survive(&sandbox, &m).await;
    env.cleanup().await;
}

const ESCAPING_CELL: &str = "import subprocess, time\n\
    subprocess.Popen(['setsid', 'sleep', '81MARK'])\n\
    subprocess.Popen(['sh', '-c', '(sleep 82MARK &)'])\n\
    subprocess.Popen(['nohup', 'sleep', '83MARK'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n\
    subprocess.Popen(['setsid', 'sh', '-c', '(sleep 84MARK &)'])\n\
    while True:\n    time.sleep(0.1)";

#[tokio::test]
async fn processes_started_by_a_timed_out_cell_do_not_survive_and_its_variables_do() {
    let env = TestEnv::new("contain-cell", 0).await;
    let sandbox = env.lease().await;
    let m = marker();
    cell(&sandbox, "kept = 42").await;
    let outcome = sandbox
        .exec(
            &ESCAPING_CELL.replace("MARK", &m),
            ExecOptions {
                timeout: secs(2),
                ..ExecOptions::default()
            },
            None,
        )
        .await
        .expect("the cell is answered");
    assert!(outcome.timed_out && !outcome.state_lost, "{outcome:?}");
    none_survive(&sandbox, &m).await;
    assert_eq!(text(&cell(&sandbox, "kept").await), "42");
    env.cleanup().await;
}

/// Starts a child that calls setsid, an orphan of a double fork (the shell has exited when its
/// `wait()` returns) and a nohup child, says so with a file, and runs on.
const STARTING_CELL: &str = "import subprocess, time\n\
    subprocess.Popen(['setsid', 'sleep', '81MARK'])\n\
    subprocess.Popen(['sh', '-c', '(sleep 82MARK &)']).wait()\n\
    subprocess.Popen(['nohup', 'sleep', '83MARK'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n\
    open('/tmp/started-MARK', 'w').close()\n\
    while True:\n    time.sleep(0.1)";

#[tokio::test]
async fn processes_started_by_a_cancelled_cell_do_not_survive() {
    let env = TestEnv::new("contain-cancel", 0).await;
    let sandbox = env.lease().await;
    let m = marker();
    let code = STARTING_CELL.replace("MARK", &m);
    let mut running = Box::pin(sandbox.exec(&code, ExecOptions::default(), None));
    // Commands poll for the cell's file; each one ends, and sweeps, while the cell runs.
    let probe = format!("test -e /tmp/started-{m}");
    let deadline = tokio::time::Instant::now() + secs(60);
    loop {
        let started = tokio::select! {
            done = &mut running => panic!("the cell ended by itself: {done:?}"),
            polled = shell(&sandbox, &probe) => polled.exit_code == Some(0),
        };
        if started {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cell never started its children"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shell(&sandbox, "true").await;
    let alive = survivors(&sandbox, &m).await;
    for n in 81..=83 {
        assert!(
            alive.iter().any(|p| p.contains(&format!("sleep {n}{m}"))),
            "sleep {n}{m} of the running cell was killed by another call's sweep: {alive:?}"
        );
    }
    // Cancel (drop the call): now everything the cell started goes, and the kernel stays.
    drop(running);
    none_survive(&sandbox, &m).await;
    assert_eq!(text(&cell(&sandbox, "1 + 1").await), "2");
    env.cleanup().await;
}

#[tokio::test]
async fn a_background_job_survives_its_call_and_can_be_listed_and_killed() {
    let env = TestEnv::new("contain-job", 0).await;
    let sandbox = env.lease().await;
    let m = marker();
    let job = sandbox
        .start_job(&format!("echo hello; sleep 91{m}"), None)
        .await
        .expect("a job starts");
    assert!(job.running, "{job:?}");
    // Other calls end, and sweep, meanwhile; the job lives on.
    shell(&sandbox, "true").await;
    cell(&sandbox, "1").await;
    assert_eq!(survivors(&sandbox, &format!("sleep 91{m}")).await.len(), 1);
    let jobs = sandbox.jobs().await.expect("jobs are listed");
    assert!(jobs.iter().any(|j| j.id == job.id && j.running), "{jobs:?}");
    let log = shell(&sandbox, &format!("cat {}", job.log)).await;
    assert_eq!(log.stdout, "hello\n", "its output is in its log");
    let ended = sandbox.kill_job(&job.id).await.expect("the job is killed");
    assert!(!ended.running && ended.signal == Some(9), "{ended:?}");
    none_survive(&sandbox, &m).await;
    let unknown = sandbox.kill_job("job-999").await.expect_err("unknown job");
    assert!(
        unknown.to_string().contains("no background job"),
        "{unknown}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn filling_home_and_tmp_is_enospc_in_user_code_and_the_kernel_lives_on() {
    let _heavy = support::MEMORY_HEAVY.lock().await;
    let env = TestEnv::new("contain-disk", 0).await;
    let sandbox = env.lease().await;
    cell(&sandbox, "earlier = 'still here'").await;
    for dir in ["/home/user", "/tmp"] {
        let filled = cell(
            &sandbox,
            &format!(
                "import os\n\
                 err = None\n\
                 try:\n    with open('{dir}/fill', 'wb') as f:\n        \
                 while True:\n            f.write(b'x' * (1 << 20))\n\
                 except OSError as e:\n    err = e.errno\n\
                 os.remove('{dir}/fill')\n\
                 err"
            ),
        )
        .await;
        assert_eq!(text(&filled), "28", "ENOSPC filling {dir}: {filled:?}");
        assert!(!filled.state_lost, "{filled:?}");
    }
    // From the shell too, with the error the user expects.
    let dd = shell(
        &sandbox,
        "dd if=/dev/zero of=/home/user/big bs=1M count=4000",
    )
    .await;
    assert_ne!(dd.exit_code, Some(0), "{dd:?}");
    assert!(dd.stderr.contains("No space left on device"), "{dd:?}");
    let listing = sandbox.list(".").await.expect("the home is listed");
    let space = listing.space.expect("the listing reports space");
    assert!(
        space.free < (1 << 20) && space.used > 500 << 20,
        "{space:?}"
    );
    assert_eq!(text(&cell(&sandbox, "earlier").await), "'still here'");
    shell(&sandbox, "rm /home/user/big").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_cell_cannot_reach_the_agent_nor_forge_or_read_its_frames() {
    let env = TestEnv::new("contain-fds", 0).await;
    let sandbox = env.lease().await;
    let agent = sandbox.ping().await.expect("ping").pid;
    // The command's request id follows the cell's: the cell reads its own id from the kernel's
    // memory and forges finals for the next ids, on every descriptor it can open.
    let probe = format!(
        r#"
import gc, glob, json, os, signal, time
runner = [o for o in gc.get_objects() if type(o).__name__ == 'CellRunner'][0]
me = runner.running_exec
report = {{'opened': [], 'signalled': []}}
paths = glob.glob('/proc/1/fd/*') + glob.glob('/proc/{agent}/fd/*') + glob.glob('/proc/{agent}/task/*/fd/*')
for path in ['/proc/1/fd/0', '/proc/1/fd/1', '/proc/1/fd/2', '/proc/{agent}/fd/0', '/proc/{agent}/mem'] + paths:
    for flags in (os.O_RDONLY, os.O_WRONLY):
        try:
            fd = os.open(path, flags | os.O_NONBLOCK)
        except OSError:
            continue
        # gVisor lets anyone re-open the agent's fd 0-2, which are /dev/null: that reaches nothing.
        if os.fstat(fd).st_rdev != os.stat('/dev/null').st_rdev:
            report['opened'].append(path)
        os.close(fd)
for pid in (1, {agent}):
    for sig in (0, signal.SIGTERM, signal.SIGSTOP):
        try:
            os.kill(pid, sig)
            report['signalled'].append(pid)
        except OSError:
            pass
forged = b''.join(
    json.dumps({{'id': i, 'ok': True, 'result': {{'exit_code': 0, 'signal': None, 'timed_out': False, 'truncated': False}}}}).encode() + b'\n'
    + json.dumps({{'id': i, 'event': 'stdout', 'data': 'FORGED'}}).encode() + b'\n'
    for i in range(me + 1, me + 20))
deadline = time.monotonic() + 3
while time.monotonic() < deadline:
    for fd in range(0, 1024):
        try:
            os.write(fd, forged)
        except OSError:
            pass
    time.sleep(0.05)
report
"#
    );
    let (forger, genuine) = tokio::join!(cell(&sandbox, &probe), async {
        // Sent right after the cell, so its id is one the cell forges for.
        tokio::time::sleep(Duration::from_millis(50)).await;
        shell(&sandbox, "sleep 1; echo genuine").await
    });
    assert_eq!(
        text(&forger),
        "{'opened': [], 'signalled': []}",
        "user code reached PID 1 or the agent"
    );
    assert_eq!(
        genuine.stdout, "genuine\n",
        "a forged frame was accepted: {genuine:?}"
    );
    assert_eq!(genuine.exit_code, Some(0));
    // The agent still answers and is the same process.
    assert_eq!(sandbox.ping().await.expect("ping").pid, agent);
    // And neither can a terminal command signal it.
    let kill = shell(&sandbox, "kill -9 $PPID 1").await;
    assert_ne!(kill.exit_code, Some(0), "{kill:?}");
    assert!(kill.stderr.contains("Operation not permitted"), "{kill:?}");
    assert_eq!(sandbox.ping().await.expect("ping").pid, agent);
    env.cleanup().await;
}

#[tokio::test]
async fn killing_the_kernel_from_a_terminal_loses_its_state_but_not_the_sandbox() {
    let env = TestEnv::new("contain-kill", 0).await;
    let sandbox = env.lease().await;
    cell(&sandbox, "x = 1\nopen('kept.txt', 'w').write('still here')").await;
    let kernel = sandbox
        .ping()
        .await
        .expect("ping")
        .kernel_pid
        .expect("a kernel pid");
    let kill = shell(&sandbox, "kill -9 $(pgrep -u user -x python3)").await;
    assert_eq!(kill.exit_code, Some(0), "{kill:?}");
    let next = cell(&sandbox, "print(open('kept.txt').read())\n'x' in globals()").await;
    assert!(next.state_lost, "{next:?}");
    let reason = next.state_lost_reason.clone().unwrap_or_default();
    assert!(reason.contains("SIGKILL"), "{reason}");
    assert_eq!(next.stdout, "still here\n", "files are kept");
    assert_eq!(text(&next), "False", "variables are gone");
    assert_ne!(sandbox.ping().await.expect("ping").kernel_pid, Some(kernel));
    // A cell that kills itself hears why, and the one after runs.
    let died = cell(&sandbox, "import os\nos._exit(7)").await;
    assert!(died.state_lost, "{died:?}");
    assert!(
        died.state_lost_reason
            .as_deref()
            .unwrap_or("")
            .contains("status 7"),
        "{died:?}"
    );
    assert_eq!(text(&cell(&sandbox, "2 + 2").await), "4");
    env.cleanup().await;
}

#[tokio::test]
async fn ordinary_shell_work_runs_under_the_profiles_runtime() {
    // Under gVisor this needs the image's statx shim (deploy/sandbox/statx_shim.c).
    let env = TestEnv::new("contain-shell", 0).await;
    let sandbox = env.lease().await;
    let out = shell(
        &sandbox,
        "set -e; echo data > a.txt; ls -la /home/user; stat / >/dev/null; ls -la /tmp >/dev/null; \
         cp -p a.txt b.txt; find . -newer /etc/hostname -name b.txt; tar cf t.tar a.txt b.txt; \
         tar tvf t.tar",
    )
    .await;
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert!(out.stdout.contains(" a.txt\n"), "a long listing: {out:?}");
    assert!(out.stdout.contains("./b.txt\n"), "find -newer: {out:?}");
    assert!(
        out.stdout.contains("user/user"),
        "tar keeps owners: {out:?}"
    );
    env.cleanup().await;
}

/// Counts the events logged with the message "sandbox stderr" (one per container stderr line the
/// gateway logs).
#[derive(Clone, Default)]
struct StderrLinesLogged(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for StderrLinesLogged {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(bool);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" && format!("{value:?}") == "sandbox stderr" {
                    self.0 = true;
                }
            }
        }
        let mut message = Message(false);
        event.record(&mut message);
        if message.0 {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

// The current-thread runtime keeps the channel's reader task on this thread, where the counting
// subscriber is installed.
#[tokio::test]
async fn a_sandbox_flooding_stderr_does_not_flood_the_gateway_log() {
    use tracing_subscriber::layer::SubscriberExt as _;
    let logged = StderrLinesLogged::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(logged.clone()));
    let env = TestEnv::new("stderr-flood", 0).await;
    let sandbox = env.lease().await;
    let flood = r#"
import os, sys
for i in range(20000):
    os.write(2, b"flood line %d\n" % i)
reached = []
for pid in os.listdir('/proc'):
    if not pid.isdigit():
        continue
    for fd in ('1', '2'):
        try:
            with open(f'/proc/{pid}/fd/{fd}', 'w') as f:
                f.write('forged stderr line\n' * 1000)
            reached.append((pid, fd))
        except OSError:
            pass
print(len(reached))
"#;
    let outcome = sandbox
        .exec(
            flood,
            ExecOptions {
                timeout: Duration::from_secs(60),
                ..ExecOptions::default()
            },
            None,
        )
        .await
        .expect("the flooding cell answers");
    assert!(outcome.error.is_none(), "{:?}", outcome.error);
    let command = sandbox
        .command(
            "seq 20000 >&2; for p in /proc/[0-9]*; do echo forged > $p/fd/2; done 2>/dev/null; true",
            CommandOptions {
                timeout: Duration::from_secs(60),
                ..CommandOptions::default()
            },
            None,
        )
        .await
        .expect("the flooding command answers");
    assert_eq!(command.exit_code, Some(0), "{:?}", command.stderr);
    // The kernel's and the command's own stderr come back as the call's (capped) output; no more
    // than the log budget's burst (20 lines) of container stderr may reach the gateway's log.
    let lines = logged.0.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        lines <= 22,
        "{lines} lines of the sandbox's stderr reached the gateway's log"
    );
    sandbox.ping().await.expect("the sandbox lives on");
}
