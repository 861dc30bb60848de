//! The stateful Python kernel: cells, output, errors, charts, interrupts, commands.

use std::time::Duration;

use sandgate_sandbox::{CommandOptions, ExecOptions, ExecOutcome, Sandbox};

use crate::support::{self, TestEnv};

async fn run(sandbox: &Sandbox, code: &str) -> ExecOutcome {
    sandbox
        .exec(code, ExecOptions::default(), None)
        .await
        .unwrap_or_else(|e| panic!("cell {code:?} could not run: {e}"))
}

fn text(outcome: &ExecOutcome) -> &str {
    outcome
        .result
        .as_ref()
        .and_then(|r| r.get("text/plain"))
        .map_or("", String::as_str)
}

/// The PNG signature and a sane IHDR chunk: width and height of the image.
fn png_size(png: &[u8]) -> (u32, u32) {
    assert!(png.len() > 33, "a PNG is longer than {} bytes", png.len());
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&png[12..16], b"IHDR", "the first chunk is IHDR");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
    (width, height)
}

#[tokio::test]
async fn cells_keep_state_return_values_capture_output_report_errors_and_show_charts() {
    let env = TestEnv::new("cells", 0).await;
    let sandbox = env.lease().await;

    run(&sandbox, "x = 20").await;
    let value = run(&sandbox, "x * 2 + 2").await;
    assert_eq!(text(&value), "42", "the last expression's value: {value:?}");
    assert!(value.error.is_none());

    let printed = run(
        &sandbox,
        "import os\nprint('from python')\nos.system('echo hi')",
    )
    .await;
    assert!(
        printed.stdout.contains("from python\n") && printed.stdout.contains("hi\n"),
        "print and a child process both land in stdout: {:?}",
        printed.stdout
    );

    let failed = run(&sandbox, "1/0").await;
    let error = failed.error.expect("1/0 raises");
    assert_eq!(error.name, "ZeroDivisionError");
    assert!(error.value.contains("division by zero"), "{error:?}");
    assert!(
        error.traceback.iter().any(|l| l.contains("1/0")),
        "the traceback shows the failing line: {:?}",
        error.traceback
    );
    assert!(
        !error.traceback.concat().contains('\u{1b}'),
        "no ANSI colours in tracebacks"
    );

    let chart = run(
        &sandbox,
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()",
    )
    .await;
    assert!(chart.error.is_none(), "{:?}", chart.error);
    assert_eq!(
        chart.displays.len(),
        1,
        "one figure: {:?}",
        chart.displays.len()
    );
    let display = &chart.displays[0];
    let (w, h) = png_size(display.png.as_ref().expect("the display carries a PNG"));
    assert!(w > 100 && h > 100, "a real chart, not a dot: {w}x{h}");
    let saved = display.path.as_deref().expect("the chart is saved");
    assert!(
        saved.starts_with("/home/user/"),
        "saved under home: {saved}"
    );
    let (bytes, _) = sandbox
        .read_file(saved, 10 << 20)
        .await
        .expect("the saved chart can be read");
    assert_eq!(
        &bytes,
        display.png.as_ref().unwrap(),
        "the saved file is the displayed PNG"
    );

    env.cleanup().await;
}

#[tokio::test]
async fn an_endless_cell_is_interrupted_at_its_timeout_and_earlier_state_survives() {
    let env = TestEnv::new("interrupt", 0).await;
    let sandbox = env.lease().await;
    run(&sandbox, "survivor = 'still here'").await;

    let options = ExecOptions {
        timeout: Duration::from_secs(2),
        ..ExecOptions::default()
    };
    let outcome = sandbox
        .exec("while True:\n    pass", options, None)
        .await
        .expect("the cell returns an outcome");
    assert!(outcome.timed_out, "{outcome:?}");
    assert!(
        !outcome.state_lost,
        "an interrupt keeps the state: {outcome:?}"
    );
    assert_eq!(
        outcome.error.as_ref().map(|e| e.name.as_str()),
        Some("KeyboardInterrupt")
    );

    let after = run(&sandbox, "survivor").await;
    assert_eq!(text(&after), "'still here'");
    env.cleanup().await;
}

#[tokio::test]
async fn a_timed_out_command_is_killed_with_its_whole_process_group() {
    let env = TestEnv::new("command-timeout", 0).await;
    let sandbox = env.lease().await;

    let done = sandbox
        .command(
            "echo out; echo err >&2; exit 3",
            CommandOptions::default(),
            None,
        )
        .await
        .expect("a command runs");
    assert_eq!(
        (done.stdout.as_str(), done.stderr.as_str(), done.exit_code),
        ("out\n", "err\n", Some(3))
    );

    let options = CommandOptions {
        timeout: Duration::from_secs(1),
        ..CommandOptions::default()
    };
    let outcome = sandbox
        .command("sleep 1000 & sleep 1000", options, None)
        .await
        .expect("the command returns an outcome");
    assert!(outcome.timed_out, "{outcome:?}");

    // Zombies are reaped by the container's init a moment later: poll until none is left.
    let count = "grep -lx sleep /proc/[0-9]*/comm 2>/dev/null | wc -l";
    support::eventually(
        Duration::from_secs(10),
        "every sleep process to be gone",
        || {
            let sandbox = sandbox.clone();
            async move {
                let left = sandbox
                    .command(count, CommandOptions::default(), None)
                    .await
                    .expect("the count runs");
                (left.stdout.trim() == "0").then_some(())
            }
        },
    )
    .await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_cell_that_ignores_its_interrupt_gets_a_fresh_kernel_and_says_state_was_lost() {
    let env = TestEnv::new("restart", 0).await;
    let sandbox = env.lease().await;
    run(&sandbox, "doomed = 1").await;
    sandbox
        .write_file("kept.txt", b"files survive a restart", true)
        .await
        .unwrap();

    let options = ExecOptions {
        timeout: Duration::from_secs(1),
        ..ExecOptions::default()
    };
    // SIGINT ignored: the interrupt cannot stop this cell, only a restart can.
    let stubborn =
        "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass";
    let outcome = sandbox
        .exec(stubborn, options, None)
        .await
        .expect("the cell returns an outcome");
    assert!(outcome.timed_out && outcome.state_lost, "{outcome:?}");
    let error = outcome.error.expect("the outcome explains");
    assert!(error.value.contains("variables are lost"), "{error:?}");

    let gone = run(&sandbox, "doomed").await;
    assert_eq!(
        gone.error.map(|e| e.name).as_deref(),
        Some("NameError"),
        "a fresh kernel"
    );
    let (kept, _) = sandbox.read_file("kept.txt", 1024).await.unwrap();
    assert_eq!(kept, b"files survive a restart");
    env.cleanup().await;
}
