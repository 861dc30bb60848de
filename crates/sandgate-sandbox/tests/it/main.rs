//! Integration tests of the sandbox crate against the real Docker engine and the real sandbox
//! image (`SANDGATE_SANDBOX__IMAGE`, set by `scripts/stack.sh`).

mod image;
mod support;
