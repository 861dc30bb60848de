//! Background jobs through MCP: `run_terminal_command` with `background: true`, `list_jobs`,
//! `kill_job` — the real binary, real Postgres, real Docker, rmcp's client.

use serde_json::{Value, json};

use crate::mcp::stack;
use crate::mcp_client::{Client, Era};

/// The job named `job_id` in a `list_jobs` answer.
fn listed<'a>(list: &'a Value, job_id: &str) -> Option<&'a Value> {
    list["jobs"]
        .as_array()
        .expect("list_jobs has a jobs array")
        .iter()
        .find(|j| j["job_id"] == job_id)
}

/// Whether process `pid` exists in the sandbox, asked through a normal command.
async fn alive(client: &Client, sandbox: &str, pid: u64) -> bool {
    let probe = client
        .call(
            "run_terminal_command",
            json!({"sandbox_id": sandbox, "command": format!("test -d /proc/{pid}")}),
        )
        .await
        .expect("a tool result");
    probe.structured["exit_code"] == 0
}

#[tokio::test]
async fn a_background_command_survives_other_calls_until_kill_job_ends_it() {
    let (gateway, token) = stack().await;
    let client = Client::connect(&gateway.mcp_url(), &token, Era::Stateless)
        .await
        .expect("client connects");
    let tools = client.service.list_all_tools().await.expect("tools/list");
    for name in ["list_jobs", "kill_job"] {
        let tool = tools
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("{name} is listed"));
        assert!(tool.output_schema.is_some(), "{name} has an output schema");
    }
    let sandbox = client.ok("create_sandbox", json!({})).await.structured["sandbox_id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned();

    let started = client
        .ok(
            "run_terminal_command",
            json!({"sandbox_id": sandbox, "command": "sleep 300", "background": true}),
        )
        .await;
    let job = &started.structured["job"];
    let job_id = job["job_id"].as_str().expect("a job_id").to_owned();
    let pid = job["pid"].as_u64().expect("a pid");
    assert_eq!(job["command"], "sleep 300");
    assert_eq!(job["running"], true);
    assert_eq!(started.structured["sandbox_id"], sandbox.as_str());
    assert!(
        started.text.contains(&job_id)
            && started.text.contains("list_jobs")
            && started.text.contains("kill_job"),
        "the text says how to reach the job: {}",
        started.text
    );

    // A command that times out, and a cell, end their own processes — not the job's.
    let timed_out = client
        .call(
            "run_terminal_command",
            json!({"sandbox_id": sandbox, "command": "sleep 30", "timeout_seconds": 1}),
        )
        .await
        .expect("a tool result");
    assert_eq!(
        timed_out.structured["timed_out"], true,
        "{}",
        timed_out.text
    );
    client
        .ok(
            "execute_code",
            json!({"sandbox_id": sandbox, "code": "1 + 1"}),
        )
        .await;

    let list = client.ok("list_jobs", json!({"sandbox_id": sandbox})).await;
    let entry = listed(&list.structured, &job_id).expect("the job is listed");
    assert_eq!(entry["running"], true, "the job still runs: {}", list.text);
    assert_eq!(entry["pid"], pid);
    assert!(list.text.contains(&job_id), "{}", list.text);
    assert!(alive(&client, &sandbox, pid).await, "its process is there");

    let killed = client
        .ok("kill_job", json!({"sandbox_id": sandbox, "job_id": job_id}))
        .await;
    assert_eq!(killed.structured["job"]["job_id"], job_id.as_str());
    assert_eq!(
        killed.structured["job"]["running"], false,
        "{}",
        killed.text
    );
    assert!(
        !killed.structured["job"]["signal"].is_null()
            || !killed.structured["job"]["exit_code"].is_null(),
        "the job says how it ended: {}",
        killed.structured
    );

    let list = client.ok("list_jobs", json!({"sandbox_id": sandbox})).await;
    if let Some(entry) = listed(&list.structured, &job_id) {
        assert_eq!(entry["running"], false, "the job has ended: {}", list.text);
    }
    assert!(!alive(&client, &sandbox, pid).await, "its process is gone");

    // Killing it again is harmless; an unknown job is a clear error naming list_jobs.
    client
        .ok("kill_job", json!({"sandbox_id": sandbox, "job_id": job_id}))
        .await;
    let unknown = client
        .call(
            "kill_job",
            json!({"sandbox_id": sandbox, "job_id": "job-999"}),
        )
        .await
        .expect("a tool result");
    assert!(unknown.is_error, "an unknown job is an error");
    assert!(
        unknown.text.contains("job-999") && unknown.text.contains("list_jobs"),
        "{}",
        unknown.text
    );

    // A background command has no timeout to give.
    let refused = client
        .call(
            "run_terminal_command",
            json!({"sandbox_id": sandbox, "command": "sleep 1", "background": true,
                   "timeout_seconds": 5}),
        )
        .await;
    let message = refused.expect_err("invalid params").to_string();
    assert!(message.contains("timeout_seconds"), "{message}");
}

#[tokio::test]
async fn another_tenants_jobs_look_exactly_like_a_missing_sandbox() {
    let (gateway, token_a) = stack().await;
    let tenant_b = gateway.create_tenant().await;
    let token_b = gateway.token(&tenant_b).await;
    let a = Client::connect(&gateway.mcp_url(), &token_a, Era::Stateless)
        .await
        .expect("A connects");
    let b = Client::connect(&gateway.mcp_url(), &token_b, Era::Stateless)
        .await
        .expect("B connects");
    let sandbox_a = a.ok("create_sandbox", json!({})).await.structured["sandbox_id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned();
    let started = a
        .ok(
            "run_terminal_command",
            json!({"sandbox_id": sandbox_a, "command": "sleep 300", "background": true}),
        )
        .await;
    let job_id = started.structured["job"]["job_id"]
        .as_str()
        .expect("a job_id")
        .to_owned();
    let pid = started.structured["job"]["pid"].as_u64().expect("a pid");

    let calls: Vec<(&str, Value)> = vec![
        ("list_jobs", json!({})),
        ("kill_job", json!({"job_id": job_id})),
        (
            "run_terminal_command",
            json!({"command": "sleep 300", "background": true}),
        ),
    ];
    for (tool, args) in calls {
        b.assert_foreign_looks_missing(tool, args, &sandbox_a).await;
    }

    // A's job runs on, and B's attempt started none there.
    let list = a.ok("list_jobs", json!({"sandbox_id": sandbox_a})).await;
    let jobs = list.structured["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 1, "only A's job: {}", list.text);
    assert_eq!(jobs[0]["job_id"], job_id.as_str());
    assert_eq!(jobs[0]["running"], true, "B did not kill it: {}", list.text);
    assert!(alive(&a, &sandbox_a, pid).await, "its process is there");
}
