//! The lean engine's privileged steps, in one small crate.
//!
//! A lean sandbox is a fork of a zygote (a root-owned Python in the sandbox image that has imported
//! the data stack) that builds its own container before the first line of tenant code runs. What
//! runs between that fork and tenant code is here, in Rust:
//!
//! - [`spec`]: what the node tells a child about its container ([`spec::EnterSpec`]), and the
//!   fixed lists (masked paths, devices, the agent's capabilities).
//! - [`child`]: [`child::enter`], the child building its own container, step by step.
//! - [`seccomp`]: the sandbox's seccomp allowlist (at least as strict as Docker's default profile),
//!   compiled to BPF once per zygote and installed in every child.
//! - [`ffi`]: the C interface the zygote calls (`sg_lean_*`).
//! - [`host`]: the node's side: starting a zygote inside an image's root filesystem.
//! - [`keeper`]: the process that holds lean sandboxes' descriptors across node restarts.
//!
//! Only Linux is supported: the lean engine needs namespaces, cgroups and seccomp.

pub mod child;
pub mod ffi;
pub mod host;
pub mod keeper;
pub mod seccomp;
pub mod spec;
mod sys;
