//! The report: the table, the ratios, the goals, the machine.

use super::*;

pub(crate) fn fmt(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) if v >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
        None => "—".into(),
    }
}

pub(crate) fn ratio(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 10.0 => format!("{v:.0}×"),
        Some(v) => format!("{v:.1}×"),
        None => String::new(),
    }
}

pub(crate) fn fill_ratios(rows: &mut [Row]) {
    let p: HashMap<String, (Option<f64>, Option<f64>)> = rows
        .iter()
        .map(|r| (r.id.clone(), (r.p50, r.p99)))
        .collect();
    for row in rows.iter_mut() {
        if let Some((Some(b50), b99)) = row.vs.as_ref().and_then(|v| p.get(v)) {
            row.ratio_p50 = row.p50.map(|v| v / b50);
            row.ratio_p99 = match (row.p99, b99) {
                (Some(a), Some(b)) => Some(a / b),
                _ => None,
            };
        }
    }
}

pub(crate) fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let mut section = "";
    out.push_str("| measured | n | p50 | p99 | errors | vs sandgate (p50 / p99) |\n");
    out.push_str("|---|---:|---:|---:|---:|---|\n");
    for r in rows {
        if r.section != section {
            section = &r.section;
            out.push_str(&format!("| **{section}** | | | | | |\n"));
        }
        let vs = match (&r.vs, r.ratio_p50) {
            (Some(v), Some(_)) => format!(
                "{} / {} slower than `{v}`",
                ratio(r.ratio_p50),
                ratio(r.ratio_p99)
            ),
            _ => String::new(),
        };
        let mut what = r.what.clone();
        if let Some(pm) = r.extra.get("per_minute").and_then(Value::as_f64) {
            what.push_str(&format!("; {pm:.1} conversations/min"));
        }
        out.push_str(&format!(
            "| `{}` {} | {} | {} {} | {} {} | {} | {} |\n",
            r.id,
            what,
            r.n,
            fmt(r.p50),
            r.unit,
            fmt(r.p99),
            r.unit,
            r.errors,
            vs
        ));
    }
    out
}

pub(crate) struct Goal {
    pub(crate) what: &'static str,
    pub(crate) value: Option<f64>,
    pub(crate) limit: f64,
    /// true: the value must be at most the limit; false: at least.
    pub(crate) at_most: bool,
    pub(crate) unit: &'static str,
}

pub(crate) fn goals(rows: &[Row]) -> Vec<Goal> {
    let mut goals = earlier_goals(rows);
    goals.extend(snapshot_goals(rows));
    goals.extend(pause_goals(rows));
    goals
}

fn earlier_goals(rows: &[Row]) -> Vec<Goal> {
    let get = |id: &str| rows.iter().find(|r| r.id == id);
    let p50 = |id: &str| get(id).and_then(|r| r.p50);
    let p99 = |id: &str| get(id).and_then(|r| r.p99);
    let ratio = |id: &str| get(id).and_then(|r| r.ratio_p50);
    let errors = |id: &str| get(id).map(|r| r.errors as f64);
    vec![
        Goal {
            what: "warm create_sandbox p50 (MCP)",
            value: p50("mcp.create_warm"),
            limit: 10.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "warm create_sandbox p99 (MCP)",
            value: p99("mcp.create_warm"),
            limit: 40.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "execute_code 1+1 p50 (MCP)",
            value: p50("mcp.exec_1p1"),
            limit: 3.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "errors in 50 concurrent conversations",
            value: errors("mcp.conversation_x50"),
            limit: 0.0,
            at_most: true,
            unit: "",
        },
        Goal {
            what: "idle sandbox memory p50 (cgroup, 50 live)",
            value: p50("mem.sandbox_at_50"),
            limit: 110.0,
            at_most: true,
            unit: "MB",
        },
        Goal {
            what: "errors reaching 150 live sandboxes",
            value: get("mem.sandbox_at_150")
                .map(|_| errors("mem.create_under_load").unwrap_or(0.0)),
            limit: 0.0,
            at_most: true,
            unit: "",
        },
        Goal {
            what: "gateway RSS with 50 sandboxes",
            value: p50("mem.gateway_rss_at_50"),
            limit: 100.0,
            at_most: true,
            unit: "MB",
        },
        // Issue 16's goals (the SDK series and the cold start).
        Goal {
            what: "back-to-back create_sandbox p50 / execute_code 1+1 p50 (SDK)",
            value: p50("sdk.b2b_create")
                .zip(p50("sdk.exec_1p1"))
                .map(|(c, e)| c / e),
            limit: 3.0,
            at_most: true,
            unit: "×",
        },
        Goal {
            what: "back-to-back create_sandbox p99 (SDK)",
            value: p99("sdk.b2b_create"),
            limit: 300.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "cold create_sandbox p50 (MCP, pool empty)",
            value: p50("mcp.create_cold"),
            limit: 250.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "close_sandbox p50 (SDK, back to back)",
            value: p50("sdk.b2b_close"),
            limit: 5.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "execute_code 1+1 p50 (MCP) / ipykernel over ZMQ p50",
            value: p50("mcp.exec_1p1")
                .zip(p50("ipykernel_zmq.exec_1p1"))
                .map(|(m, z)| m / z),
            limit: 0.5,
            at_most: true,
            unit: "×",
        },
        Goal {
            what: "highest open-loop rate with 0 errors and p99 < 2 s (SDK)",
            value: highest_sustained(rows, "sdk.").or_else(|| {
                rows.iter()
                    .any(|r| r.id.starts_with("sdk.open_loop_"))
                    .then_some(0.0)
            }),
            limit: 240.0,
            at_most: false,
            unit: "/min",
        },
        Goal {
            what: "50 concurrent conversations p99",
            value: p99("mcp.conversation_x50"),
            limit: 5000.0,
            at_most: true,
            unit: "ms",
        },
        Goal {
            what: "llm-sandbox open+run+close / ours (p50)",
            value: ratio("llm_sandbox.open_run_close"),
            limit: 20.0,
            at_most: false,
            unit: "×",
        },
        Goal {
            what: "llm-sandbox repeated run / ours (p50)",
            value: ratio("llm_sandbox.run"),
            limit: 10.0,
            at_most: false,
            unit: "×",
        },
        Goal {
            what: "llm-sandbox interactive run / ours (p50)",
            value: ratio("llm_sandbox.interactive_run"),
            limit: 10.0,
            at_most: false,
            unit: "×",
        },
    ]
}

pub(crate) fn goal_table(goals: &[Goal]) -> String {
    let mut out = String::from("| goal | target | this run | |\n|---|---:|---:|---|\n");
    for g in goals {
        let target = format!(
            "{} {}{}",
            if g.at_most { "≤" } else { "≥" },
            g.limit,
            g.unit
        );
        let (value, verdict) = match g.value {
            None => ("not measured".to_owned(), String::new()),
            Some(v) => {
                let met = if g.at_most {
                    v <= g.limit
                } else {
                    v >= g.limit
                };
                let verdict = if met {
                    "met".to_owned()
                } else if g.limit > 0.0 {
                    let by = if g.at_most { v / g.limit } else { g.limit / v };
                    format!("**missed** ({by:.1}× off)")
                } else {
                    "**missed**".to_owned()
                };
                (format!("{}{}", fmt(Some(v)), g.unit), verdict)
            }
        };
        out.push_str(&format!(
            "| {} | {target} | {value} | {verdict} |\n",
            g.what
        ));
    }
    out
}

pub(crate) fn machine() -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_default();
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0 / 1024.0);
    m.insert("cpu".into(), json!(cpu));
    m.insert(
        "cores".into(),
        json!(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0)
        ),
    );
    m.insert("memory_gib".into(), json!(mem_gib));
    m.insert(
        "kernel".into(),
        json!(
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
        ),
    );
    m
}
