//! Property tests standing in for fuzzing (cargo-fuzz needs nightly; CI has stable): bounded
//! numbers of generated cases run in every `cargo test`. Targets: the JSON-RPC request path in
//! front of rmcp (what `/mcp` reads from a POST body and the 2026-07-28 headers before rmcp),
//! the tool-argument parsing (every tool's argument struct and `limits::check_tool_arguments`),
//! and the download-link decoder. A failure prints the minimal case; each crash found became a
//! named regression test below.

use axum::http::{HeaderMap, HeaderValue};
use proptest::prelude::*;
use sandgate_gateway::files::{DownloadLinks, LinkOwner, OpenedLink};
use sandgate_gateway::mcp::auth::{header_tool_name, tool_named_in};
use sandgate_gateway::mcp::limits::{
    MAX_CONVERSATION_ID_BYTES, MAX_SANDBOX_ID_BYTES, check_tool_arguments,
};
use sandgate_gateway::mcp::tools::{self, ToolName};
use serde_json::{Map, Value, json};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(".{0,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A tool's arguments: its real field names with values of any type, plus strangers.
fn tool_arguments() -> impl Strategy<Value = Map<String, Value>> {
    let field = prop_oneof![
        Just("sandbox_id".to_owned()),
        Just("conversation_id".to_owned()),
        Just("code".to_owned()),
        Just("command".to_owned()),
        Just("path".to_owned()),
        Just("content_base64".to_owned()),
        Just("content".to_owned()),
        Just("overwrite".to_owned()),
        Just("timeout_seconds".to_owned()),
        Just("keep_alive_seconds".to_owned()),
        Just("background".to_owned()),
        Just("job_id".to_owned()),
        Just("format".to_owned()),
        Just("cwd".to_owned()),
        ".{0,12}",
    ];
    let value = prop_oneof![
        3 => json_value(),
        1 => (0usize..5000).prop_map(|n| Value::String("c".repeat(n))),
        1 => "[\\x00-\\x1f\\u{7f}-\\u{9f}a-z]{0,20}".prop_map(Value::String),
    ];
    proptest::collection::btree_map(field, value, 0..8).prop_map(|m| m.into_iter().collect())
}

/// A JSON-RPC message as a client might send it, with the tool named or not.
fn json_rpc() -> impl Strategy<Value = Value> {
    let method = prop_oneof![
        4 => Just("tools/call".to_owned()),
        1 => Just("tools/list".to_owned()),
        1 => Just("initialize".to_owned()),
        1 => ".{0,16}",
    ];
    let name = prop_oneof![
        4 => proptest::sample::select(ToolName::ALL.map(ToolName::as_str).to_vec()).prop_map(str::to_owned),
        1 => ".{0,20}",
    ];
    (method, name, tool_arguments(), any::<u32>()).prop_map(|(method, name, arguments, id)| {
        json!({"jsonrpc": "2.0", "id": id, "method": method, "params": {"name": name, "arguments": arguments}})
    })
}

/// The same JSON text with some characters written as JSON escapes (`\/`, `\u00XX`): a valid
/// encoding of the same message, which a parser must read the same.
fn escaped(text: &str, every: usize, slash: bool) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    let mut in_string = false;
    let mut escape_next = false;
    for (i, c) in text.chars().enumerate() {
        if in_string && !escape_next && c == '/' && slash {
            out.push_str("\\/");
        } else if in_string && !escape_next && c.is_ascii_lowercase() && i % every == 0 {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
        if escape_next {
            escape_next = false;
        } else if c == '\\' {
            escape_next = true;
        } else if c == '"' {
            in_string = !in_string;
        }
    }
    out
}

/// What the body names, read the long way (the reference the fast path must agree with).
fn reference_tool(body: &[u8]) -> Option<ToolName> {
    let value: Value = serde_json::from_slice(body).ok()?;
    if value.get("method")?.as_str()? != "tools/call" {
        return None;
    }
    ToolName::parse(value.get("params")?.get("name")?.as_str()?)
}

/// Deserializes `arguments` into every tool's argument struct (rmcp does this for the tool
/// called): none may panic.
fn parse_every_tool(arguments: &Map<String, Value>) {
    let value = Value::Object(arguments.clone());
    let _ = serde_json::from_value::<tools::CreateSandboxArgs>(value.clone());
    let _ = serde_json::from_value::<tools::ExecuteCodeArgs>(value.clone());
    let _ = serde_json::from_value::<tools::RunTerminalCommandArgs>(value.clone());
    let _ = serde_json::from_value::<tools::ListJobsArgs>(value.clone());
    let _ = serde_json::from_value::<tools::KillJobArgs>(value.clone());
    let _ = serde_json::from_value::<tools::UploadFileArgs>(value.clone());
    let _ = serde_json::from_value::<tools::GetFileArgs>(value.clone());
    let _ = serde_json::from_value::<tools::ListFilesArgs>(value.clone());
    let _ = serde_json::from_value::<tools::CloseSandboxArgs>(value.clone());
    let _ = serde_json::from_value::<tools::ExportTranscriptArgs>(value);
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn the_tool_a_body_names_is_read_as_rmcp_would_read_it(
        message in json_rpc(),
        every in 1usize..6,
        slash in any::<bool>(),
    ) {
        let plain = serde_json::to_string(&message).unwrap();
        for text in [plain.clone(), escaped(&plain, every, slash)] {
            prop_assert_eq!(
                tool_named_in(text.as_bytes()),
                reference_tool(text.as_bytes()),
                "body {}", text
            );
        }
    }

    #[test]
    fn any_body_bytes_are_read_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = tool_named_in(&bytes);
    }

    #[test]
    fn any_mcp_headers_are_read_without_panicking(method in ".{0,20}", name in ".{0,60}", b64 in "[A-Za-z0-9+/=]{0,40}") {
        for m in [method.as_str(), "tools/call"] {
            for raw in [name.clone(), format!("=?base64?{b64}?="), format!("=?base64?{name}?=")] {
                let mut headers = HeaderMap::new();
                if let Ok(v) = HeaderValue::from_str(m) {
                    headers.insert("mcp-method", v);
                }
                if let Ok(v) = HeaderValue::from_str(&raw) {
                    headers.insert("mcp-name", v);
                }
                let _ = header_tool_name(&headers);
            }
        }
    }

    #[test]
    fn tool_arguments_are_checked_and_parsed_without_panicking(arguments in tool_arguments()) {
        let checked = check_tool_arguments(Some(&arguments));
        if checked.is_ok() {
            for (name, max) in [("conversation_id", MAX_CONVERSATION_ID_BYTES), ("sandbox_id", MAX_SANDBOX_ID_BYTES)] {
                if let Some(s) = arguments.get(name).and_then(Value::as_str) {
                    prop_assert!(s.len() <= max, "{name} of {} bytes passed", s.len());
                    prop_assert!(!s.chars().any(char::is_control), "{name} with a control character passed");
                }
            }
        }
        parse_every_tool(&arguments);
    }

    #[test]
    fn any_link_token_is_refused_unless_sealed_by_us(token in ".{0,400}") {
        let links = DownloadLinks::new(b"fuzzing secret of at least 32 characters", "http://127.0.0.1:1");
        prop_assert!(links.open(&token).is_none());
    }

    #[test]
    fn a_sealed_link_changed_anywhere_is_refused(
        tenant in any::<u128>(),
        sandbox in "sbx_[0-9a-f]{32}",
        path in "/home/user/.{0,40}",
        at in any::<prop::sample::Index>(),
        with in "[A-Za-z0-9_-]",
    ) {
        let links = DownloadLinks::new(b"fuzzing secret of at least 32 characters", "http://127.0.0.1:1");
        let owner = LinkOwner::session(uuid::Uuid::from_u128(tenant));
        let (url, _) = links.mint(owner, &sandbox, &path);
        let token = url.rsplit('/').next().unwrap().to_owned();
        let opened: OpenedLink = links.open(&token).expect("a fresh link opens");
        prop_assert_eq!(&opened.claims.p, &path);
        let i = at.index(token.len());
        let mut changed = token.clone();
        changed.replace_range(i..=i, &with);
        if changed != token {
            // A change in the last character's unused low bits may decode to the same bytes.
            let same = links.open(&changed).map(|o| o.claims);
            prop_assert!(same.is_none() || same.as_ref() == Some(&opened.claims));
        }
    }
}

/// Found by `the_tool_a_body_names_is_read_as_rmcp_would_read_it`: a method written with a JSON
/// escape (`"tools\/call"`) was not recognised (the method was borrowed as `&str`, which an
/// escape cannot be), so the bearer layer did not check the tool's scope before rmcp ran it.
#[test]
fn regression_an_escaped_method_still_names_the_tool() {
    let body = br#"{"jsonrpc":"2.0","id":1,"method":"tools\/call","params":{"name":"execute_code","arguments":{}}}"#;
    assert_eq!(tool_named_in(body), Some(ToolName::ExecuteCode));
    let body =
        br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"execute\u005fcode"}}"#;
    assert_eq!(tool_named_in(body), Some(ToolName::ExecuteCode));
}
