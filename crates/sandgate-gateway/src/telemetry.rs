//! Logging: human text on a terminal, JSON lines otherwise.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};

/// Installs the global tracing subscriber. `RUST_LOG`, when set, overrides the configured filter.
/// Logs go to stderr so stdout stays free for what a command prints (tokens, ids).
pub fn init(log: &LogConfig) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&log.filter))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let json = match log.format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // try_init: a second call (tests) keeps the first subscriber instead of panicking.
    let _ = if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init()
    } else {
        builder.try_init()
    };
}
