//! The C interface the zygote (Python, through `ctypes`) calls: it loads this library and calls
//! these functions, and holds no logic of its own for what they do. Each returns 0 on success, or
//! -1 with a message written (NUL-terminated, cut to fit) into the caller's `err` buffer.
#![allow(unsafe_code)] // An exported C interface: raw pointers from the caller, checked as stated.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::OnceLock;

use libc::{c_char, c_int};

use crate::child;
use crate::seccomp::SandboxFilter;
use crate::spec::{ABI_VERSION, EnterSpec};
use crate::sys;

/// What [`sg_lean_prepare`] made once per zygote: the compiled filter and the zygote's own pid
/// namespace (to return to after each fork).
struct Prepared {
    filter: SandboxFilter,
    own_pidns: OwnedFd,
}

static PREPARED: OnceLock<Prepared> = OnceLock::new();

fn report(err: *mut c_char, len: usize, message: &str) -> c_int {
    if !err.is_null() && len > 0 {
        let bytes = message.as_bytes();
        let n = bytes.len().min(len - 1);
        // SAFETY: the caller promises `err` points at `len` writable bytes; we write n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), err.cast::<u8>(), n);
            *err.add(n) = 0;
        }
    }
    -1
}

fn outcome(result: Result<(), String>, err: *mut c_char, len: usize) -> c_int {
    match result {
        Ok(()) => 0,
        Err(message) => report(err, len, &message),
    }
}

/// The version of this interface and of the spec ([`ABI_VERSION`]).
#[unsafe(no_mangle)]
pub extern "C" fn sg_lean_abi_version() -> u32 {
    ABI_VERSION
}

/// The hash of the sources this library was built from ([`crate::spec::SOURCE_HASH`]), a
/// NUL-terminated string that lives as long as the library.
#[unsafe(no_mangle)]
pub extern "C" fn sg_lean_source_hash() -> *const c_char {
    static HASH: OnceLock<std::ffi::CString> = OnceLock::new();
    HASH.get_or_init(|| std::ffi::CString::new(crate::spec::SOURCE_HASH).unwrap_or_default())
        .as_ptr()
}

/// Once per zygote, before its first fork: compiles the seccomp filter and keeps a descriptor of
/// the zygote's pid namespace.
#[unsafe(no_mangle)]
pub extern "C" fn sg_lean_prepare(err: *mut c_char, len: usize) -> c_int {
    let result = (|| {
        if PREPARED.get().is_some() {
            return Ok(());
        }
        let filter = SandboxFilter::compile().map_err(|e| e.to_string())?;
        let own_pidns = std::fs::File::open("/proc/self/ns/pid")
            .map_err(|e| format!("opening the zygote's pid namespace: {e}"))?;
        let _ = PREPARED.set(Prepared {
            filter,
            own_pidns: own_pidns.into(),
        });
        Ok(())
    })();
    outcome(result, err, len)
}

/// Before a fork: checks the zygote is single-threaded (a fork of a process with other threads
/// could copy a lock one of them held) and moves its next child into a new pid namespace, where
/// that child is pid 1.
#[unsafe(no_mangle)]
pub extern "C" fn sg_lean_before_fork(err: *mut c_char, len: usize) -> c_int {
    let result = (|| {
        let threads = sys::thread_count().map_err(|e| format!("counting threads: {e}"))?;
        if threads != 1 {
            return Err(format!(
                "the zygote has {threads} threads; it forks only when it has one"
            ));
        }
        if PREPARED.get().is_none() {
            return Err("sg_lean_prepare was not called".into());
        }
        sys::unshare(libc::CLONE_NEWPID).map_err(|e| format!("a new pid namespace: {e}"))
    })();
    outcome(result, err, len)
}

/// After a fork, in the zygote: its later children go back to its own pid namespace.
#[unsafe(no_mangle)]
pub extern "C" fn sg_lean_after_fork(err: *mut c_char, len: usize) -> c_int {
    let result = match PREPARED.get() {
        Some(prepared) => sys::setns(prepared.own_pidns.as_raw_fd(), libc::CLONE_NEWPID)
            .map_err(|e| format!("returning to the zygote's pid namespace: {e}")),
        None => Err("sg_lean_prepare was not called".into()),
    };
    outcome(result, err, len)
}

/// In the child: builds its container from the JSON [`EnterSpec`] at `spec`/`spec_len`
/// ([`child::enter`]). On -1 the caller must exit without running anything else.
///
/// # Safety
/// `spec` must point at `spec_len` readable bytes and `err` at `len` writable bytes (or be null),
/// both for the duration of the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sg_lean_enter(
    spec: *const u8,
    spec_len: usize,
    err: *mut c_char,
    len: usize,
) -> c_int {
    let result = (|| {
        let prepared = PREPARED.get().ok_or("sg_lean_prepare was not called")?;
        if spec.is_null() {
            return Err("no spec".to_owned());
        }
        // SAFETY: the caller promises `spec` points at `spec_len` readable bytes for the call.
        let bytes = unsafe { std::slice::from_raw_parts(spec, spec_len) };
        let spec: EnterSpec =
            serde_json::from_slice(bytes).map_err(|e| format!("a bad spec: {e}"))?;
        // The zygote's pid-namespace descriptor must not reach the sandbox.
        let mut spec = spec;
        spec.keep_fds
            .retain(|fd| *fd != prepared.own_pidns.as_raw_fd());
        child::enter(&spec, &prepared.filter).map_err(|e| e.to_string())
    })();
    outcome(result.map_err(|e: String| e), err, len)
}
