//! Integration tests of the sandbox crate against the real Docker engine and the real sandbox
//! image (`SANDGATE_SANDBOX_IMAGE`, set by `scripts/stack.sh`). Each test of `kernel`, `files`,
//! `limits`, `hardening`, `pool` shows one "Done when" item of issue 3.

mod contain;
mod files;
mod hardening;
mod image;
mod kernel;
mod lean;
mod limits;
mod name_conflict;
mod pool;
mod snapshot;
mod snapshot_faults;
mod support;
mod template;
