//! A gateway's calls through the node RPC behave as they do in one process.

use std::time::Duration;

use sandgate_sandbox::{
    AgentError, ChannelError, CommandOptions, ExecOptions, OutputEvent, SandboxError,
};
use tokio::sync::mpsc;

use crate::support::{TestNode, profile, within};

const LONG: Duration = Duration::from_secs(180);

#[tokio::test]
async fn a_remote_sandbox_runs_cells_commands_jobs_and_files_with_streamed_output() {
    let node = TestNode::start("calls").await;
    let client = node.client();
    let sandbox = within(LONG, "a launch", client.launch(&profile()))
        .await
        .expect("the node starts a sandbox");
    assert!(
        sandbox.id().starts_with("sbx_"),
        "a sandbox id, got {}",
        sandbox.id()
    );

    // A cell: its value, and its output streamed while it runs.
    let (tx, mut rx) = mpsc::channel(16);
    let code = "import sys\nfor i in range(3):\n    print('line', i, flush=True)\n40 + 2";
    let outcome = within(
        LONG,
        "a cell",
        sandbox.exec(code, ExecOptions::default(), Some(tx)),
    )
    .await
    .expect("the cell runs");
    assert_eq!(
        outcome
            .result
            .as_ref()
            .and_then(|b| b.get("text/plain"))
            .map(String::as_str),
        Some("42"),
        "the cell's value comes back: {outcome:?}"
    );
    let mut streamed = String::new();
    while let Ok(event) = rx.try_recv() {
        if let OutputEvent::Stdout(s) = event {
            streamed.push_str(&s);
        }
    }
    assert!(
        streamed.contains("line 2"),
        "stdout was streamed as events, got {streamed:?}"
    );

    // State persists between cells; errors come back as the cell's error.
    let outcome = sandbox
        .exec("x = 7\nundefined_name", ExecOptions::default(), None)
        .await
        .expect("the cell runs");
    assert_eq!(outcome.error.map(|e| e.name).as_deref(), Some("NameError"));
    let outcome = sandbox
        .exec("x * 6", ExecOptions::default(), None)
        .await
        .expect("a cell");
    assert_eq!(
        outcome
            .result
            .and_then(|b| b.get("text/plain").cloned())
            .as_deref(),
        Some("42"),
        "the kernel kept x"
    );

    // A command.
    let out = sandbox
        .command("echo hi; exit 3", CommandOptions::default(), None)
        .await
        .expect("the command runs");
    assert_eq!((out.stdout.as_str(), out.exit_code), ("hi\n", Some(3)));

    // Files: write, read whole, read streamed, list.
    let info = sandbox
        .write_file("data/report.csv", b"a,b\n1,2\n", false)
        .await
        .expect("the file is written");
    assert_eq!(info.size, 8);
    let (data, read) = sandbox
        .read_file("data/report.csv", 1 << 20)
        .await
        .expect("the file is read");
    assert_eq!(
        (data.as_slice(), read.sha256.as_str()),
        (&b"a,b\n1,2\n"[..], info.sha256.as_str())
    );
    let (first, mut rest) = sandbox
        .read_file_stream("data/report.csv", 1 << 20)
        .await
        .expect("the file streams");
    let mut streamed = first.to_vec();
    while let Some(chunk) = futures::StreamExt::next(&mut rest).await {
        streamed.extend_from_slice(&chunk.expect("a chunk"));
    }
    assert_eq!(streamed, b"a,b\n1,2\n");
    let listing = sandbox.list("data").await.expect("a listing");
    assert_eq!(
        listing
            .entries
            .iter()
            .map(|e| e.name.as_str())
            .collect::<Vec<_>>(),
        ["report.csv"]
    );

    // The agent's refusals keep their kind across the RPC.
    let missing = sandbox
        .read_file("nope.txt", 1 << 20)
        .await
        .expect_err("no such file");
    assert!(
        matches!(
            missing,
            SandboxError::Channel(ChannelError::Agent(AgentError::NotFound { .. }))
        ),
        "a missing file is NotFound, got {missing:?}"
    );
    let exists = sandbox
        .write_file("data/report.csv", b"x", false)
        .await
        .expect_err("no overwrite");
    assert!(
        matches!(
            exists,
            SandboxError::Channel(ChannelError::Agent(AgentError::Exists { .. }))
        ),
        "an existing file is Exists, got {exists:?}"
    );

    // Jobs.
    let job = sandbox
        .start_job("sleep 300", None)
        .await
        .expect("a job starts");
    assert!(
        sandbox
            .jobs()
            .await
            .expect("jobs")
            .iter()
            .any(|j| j.id == job.id && j.running)
    );
    let killed = sandbox.kill_job(&job.id).await.expect("the job is killed");
    assert!(!killed.running, "the job ended: {killed:?}");

    // Ping, restart (variables go, files stay).
    sandbox.ping().await.expect("the agent answers");
    sandbox.restart().await.expect("the kernel restarts");
    let outcome = sandbox
        .exec("'x' in dir()", ExecOptions::default(), None)
        .await
        .expect("a cell");
    assert_eq!(
        outcome
            .result
            .and_then(|b| b.get("text/plain").cloned())
            .as_deref(),
        Some("False")
    );

    // Removing the container: the next call says the sandbox died.
    client
        .remove(sandbox.container_id())
        .await
        .expect("the container is removed");
    let gone = sandbox.ping().await.expect_err("the sandbox is gone");
    assert!(
        matches!(
            gone,
            SandboxError::Died { .. } | SandboxError::NotOurs { .. }
        ),
        "a removed sandbox answers as dead, got {gone:?}"
    );
    node.cleanup().await;
}

#[tokio::test]
async fn dropping_a_remote_call_interrupts_the_cell_and_the_kernel_survives() {
    let node = TestNode::start("cancel").await;
    let client = node.client();
    let sandbox = within(LONG, "a launch", client.launch(&profile()))
        .await
        .expect("the node starts a sandbox");
    sandbox
        .exec("state = 'kept'", ExecOptions::default(), None)
        .await
        .expect("a cell");

    let (tx, mut rx) = mpsc::channel(16);
    let running = sandbox.clone();
    let call = tokio::spawn(async move {
        let code = "import time\nprint('started', flush=True)\ntime.sleep(600)";
        running
            .exec(
                code,
                ExecOptions {
                    timeout: Duration::from_secs(900),
                    ..ExecOptions::default()
                },
                Some(tx),
            )
            .await
    });
    // The cell runs on the node once its first output arrives.
    let first = within(LONG, "the first output", rx.recv()).await;
    assert!(
        matches!(first, Some(OutputEvent::Stdout(ref s)) if s.contains("started")),
        "got {first:?}"
    );
    call.abort();

    // The node interrupts the cell: the kernel is idle again, with its state.
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let ping = sandbox.ping().await.expect("the agent answers");
        if !ping.busy {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cell was never interrupted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let outcome = sandbox
        .exec("state", ExecOptions::default(), None)
        .await
        .expect("a cell");
    assert_eq!(
        outcome
            .result
            .and_then(|b| b.get("text/plain").cloned())
            .as_deref(),
        Some("'kept'"),
        "the interrupt kept the kernel's state"
    );
    node.cleanup().await;
}
