//! Sealed checkpoints and restores over the node RPC: the data key travels in the call, the
//! sealed bytes come back to the gateway and go to the node again; the node keeps neither.

use std::time::Duration;

use sandgate_node::RemoteSandbox;
use sandgate_sandbox::{
    DataKey, ExecOptions, OciRuntime, SandboxError, SandboxProfile, SealError, SnapshotAad,
};

use crate::support::{TestNode, profile, within};

const LIMIT: Duration = Duration::from_secs(180);

async fn value(sandbox: &RemoteSandbox, code: &str) -> String {
    let outcome = within(
        LIMIT,
        "a cell",
        sandbox.exec(code, ExecOptions::default(), None),
    )
    .await
    .expect("the cell runs");
    assert!(outcome.error.is_none(), "the cell failed: {outcome:?}");
    outcome
        .result
        .and_then(|b| b.get("text/plain").cloned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_sealed_over_the_rpc_comes_back_from_its_bytes_alone() {
    let snap = SandboxProfile {
        name: "snap".into(),
        runtime: OciRuntime::Runsc2024,
        ..profile()
    };
    let node = TestNode::start_snapshotting("sealed", vec![snap.clone()]).await;
    let client = node.client();
    let sandbox = within(LIMIT, "a launch", client.launch(&snap))
        .await
        .expect("a runsc2024 sandbox");
    value(
        &sandbox,
        "kept = 'over the wire'\nopen('/home/user/f', 'w').write('file')",
    )
    .await;

    let key = DataKey::generate();
    let aad = SnapshotAad {
        tenant_id: "tenant-a".into(),
        sandbox_id: sandbox.id().to_owned(),
        snapshot_id: format!("snap_{}", uuid::Uuid::now_v7().simple()),
    };
    let call = sandgate_node::proto::SandboxCall {
        sandbox_id: sandbox.id().to_owned(),
        container_id: sandbox.container_id().to_owned(),
    };
    let mut sealed = Vec::new();
    let info = within(
        LIMIT,
        "a sealed checkpoint",
        client.checkpoint_sealed(call, true, &key, &aad, &mut sealed),
    )
    .await
    .expect("the sandbox is checkpointed and sealed");
    assert_eq!(info.sealed_bytes as usize, sealed.len());
    assert_eq!(info.header.snapshot_id, aad.snapshot_id);
    assert!(sealed.starts_with(b"SGSNAPv1"));
    assert_eq!(
        value(&sandbox, "kept").await,
        "'over the wire'",
        "left running"
    );

    let other = SnapshotAad {
        tenant_id: "tenant-b".into(),
        ..aad.clone()
    };
    let refused = within(
        LIMIT,
        "a refused restore",
        client.restore_sealed(&sealed[..], &key, &other, false),
    )
    .await
    .expect_err("another tenant's binding opens nothing");
    assert!(
        matches!(&refused, SandboxError::Seal { source, .. }
            if matches!(**source, SealError::Unauthentic { chunk: 0 })),
        "the refusal crosses typed: {refused:?}"
    );
    let refused = within(
        LIMIT,
        "a refused restore",
        client.restore_sealed(&sealed[..sealed.len() / 2], &key, &aad, false),
    )
    .await
    .expect_err("a stream cut short opens nothing");
    assert!(
        matches!(&refused, SandboxError::Seal { source, .. }
            if matches!(**source, SealError::Unauthentic { .. } | SealError::Truncated { .. })),
        "the refusal crosses typed: {refused:?}"
    );

    let restored = within(
        LIMIT,
        "a sealed restore",
        client.restore_sealed(&sealed[..], &key, &aad, false),
    )
    .await
    .expect("the sealed bytes restore");
    assert_ne!(restored.id(), sandbox.id());
    assert_eq!(
        value(&restored, "(kept, open('/home/user/f').read())").await,
        "('over the wire', 'file')"
    );
    node.cleanup().await;
}
