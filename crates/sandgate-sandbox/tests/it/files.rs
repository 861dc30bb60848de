//! File transfer and path confinement.

use sandgate_sandbox::{AgentError, ChannelError, CommandOptions, SandboxError};
use sha2::{Digest, Sha256};

use crate::support::{self, TestEnv};

#[tokio::test]
async fn a_10_mib_binary_file_round_trips_with_the_same_sha256() {
    let _heavy = support::MEMORY_HEAVY.lock().await;
    let env = TestEnv::new("files", 0).await;
    let sandbox = env.lease().await;
    let data = support::noise(10 << 20, 0x5eed);
    let sha256 = hex::encode(Sha256::digest(&data));

    let written = sandbox
        .write_file("data/blob.bin", &data, false)
        .await
        .expect("the upload succeeds");
    assert_eq!(written.path, "/home/user/data/blob.bin");
    assert_eq!(written.size, data.len() as u64);
    assert_eq!(written.sha256, sha256, "the sandbox stored what was sent");

    let (read, info) = sandbox
        .read_file("/home/user/data/blob.bin", 64 << 20)
        .await
        .expect("the download succeeds");
    assert_eq!(info.sha256, sha256);
    assert_eq!(
        hex::encode(Sha256::digest(&read)),
        sha256,
        "the same bytes came back"
    );

    let again = sandbox.write_file("data/blob.bin", b"x", false).await;
    assert!(
        matches!(
            again,
            Err(SandboxError::Channel(ChannelError::Agent(
                AgentError::Exists { .. }
            )))
        ),
        "no silent overwrite: {again:?}"
    );
    let too_large = sandbox.read_file("data/blob.bin", 1024).await;
    match too_large {
        Err(SandboxError::Channel(ChannelError::Agent(AgentError::TooLarge {
            size,
            limit,
            ..
        }))) => {
            assert_eq!((size, limit), (Some(10 << 20), 1024));
        }
        other => panic!("a read over the limit is refused: {other:?}"),
    }
    env.cleanup().await;
}

fn assert_outside_home<T: std::fmt::Debug>(what: &str, result: Result<T, SandboxError>) {
    match result {
        Err(SandboxError::Channel(ChannelError::Agent(err @ AgentError::OutsideHome { .. }))) => {
            assert!(
                err.to_string().contains("/home/user"),
                "the message tells where files may go: {err}"
            );
        }
        other => panic!("{what} must be refused as outside /home/user, got {other:?}"),
    }
}

#[tokio::test]
async fn paths_that_leave_home_are_refused() {
    let env = TestEnv::new("paths", 0).await;
    let sandbox = env.lease().await;

    assert_outside_home(
        "../etc/passwd",
        sandbox.read_file("../etc/passwd", 1 << 20).await,
    );
    assert_outside_home(
        "/etc/passwd",
        sandbox.read_file("/etc/passwd", 1 << 20).await,
    );

    let link = sandbox
        .command(
            "ln -s /etc /home/user/etc-link",
            CommandOptions::default(),
            None,
        )
        .await
        .expect("a symlink can be made");
    assert_eq!(link.exit_code, Some(0), "{link:?}");
    assert_outside_home(
        "a file through a symlink to /etc",
        sandbox.read_file("etc-link/passwd", 1 << 20).await,
    );
    assert_outside_home("the symlink itself", sandbox.list_dir("etc-link").await);
    assert_outside_home(
        "a write through the symlink",
        sandbox.write_file("etc-link/evil", b"x", true).await,
    );

    // Home itself is fine, and lists the symlink without following it.
    let entries = sandbox.list_dir("").await.expect("home can be listed");
    assert!(
        entries
            .iter()
            .any(|e| e.name == "etc-link" && e.kind == sandgate_sandbox::EntryKind::Symlink),
        "{entries:?}"
    );
    env.cleanup().await;
}
