//! Documented length limits on attacker-chosen strings in tool arguments (issue 11). Beyond
//! them a call is a JSON-RPC `-32602` invalid-params error that names the limit, before anything
//! reaches Postgres (a conversation id of a few KB used to overflow an index and come back as
//! an internal error) or is echoed in an error text.

/// Longest `conversation_id`, bytes.
pub const MAX_CONVERSATION_ID_BYTES: usize = 256;
/// Longest `sandbox_id`, bytes (ours are `sbx_` and 32 hex digits).
pub const MAX_SANDBOX_ID_BYTES: usize = 64;

/// Checks the string arguments with a documented limit; `Err` is the invalid-params message.
pub fn check_tool_arguments(
    arguments: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Result<(), String> {
    let Some(arguments) = arguments else {
        return Ok(());
    };
    for (name, max) in [
        ("conversation_id", MAX_CONVERSATION_ID_BYTES),
        ("sandbox_id", MAX_SANDBOX_ID_BYTES),
    ] {
        if let Some(value) = arguments.get(name).and_then(|v| v.as_str()) {
            if value.len() > max {
                return Err(format!(
                    "{name} is {} bytes long; at most {max} bytes are accepted. Use a shorter id \
                     (a ticket number or a hash of the conversation)",
                    value.len()
                ));
            }
            if value.chars().any(char::is_control) {
                return Err(format!("{name} must not contain control characters"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(value: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        value.as_object().expect("an object").clone()
    }

    #[test]
    fn ids_within_their_limits_pass_and_longer_ones_are_named() {
        let ok = args(
            serde_json::json!({"conversation_id": "ticket-1234", "code": "x".repeat(100_000)}),
        );
        assert_eq!(check_tool_arguments(Some(&ok)), Ok(()));
        let long = args(serde_json::json!({"conversation_id": "c".repeat(4096)}));
        let err = check_tool_arguments(Some(&long)).unwrap_err();
        assert!(
            err.contains("conversation_id is 4096 bytes") && err.contains("256"),
            "{err}"
        );
        let sandbox = args(serde_json::json!({"sandbox_id": "s".repeat(65)}));
        assert!(
            check_tool_arguments(Some(&sandbox))
                .unwrap_err()
                .contains("sandbox_id")
        );
        let control = args(serde_json::json!({"conversation_id": "a\u{0}b"}));
        assert!(check_tool_arguments(Some(&control)).is_err());
        assert_eq!(check_tool_arguments(None), Ok(()));
    }
}
