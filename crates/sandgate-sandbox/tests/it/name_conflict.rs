//! A sandbox started again under its id while its earlier container still holds the name
//! `sandgate-<id>` (a resume racing the pause's removal): the earlier container of the same
//! instance and sandbox goes and the launch succeeds; a container of that name that is not such
//! an earlier container is left alone and the launch fails.

use sandgate_sandbox::SandboxBackend;
use sandgate_sandbox::backend::LaunchSpec;

use crate::support;

fn spec(instance: &str, sandbox_id: &str) -> LaunchSpec {
    LaunchSpec {
        profile: support::profile(),
        instance: instance.to_owned(),
        sandbox_id: sandbox_id.to_owned(),
    }
}

#[tokio::test]
async fn a_sandbox_started_again_under_its_id_replaces_its_earlier_container_and_nothing_else() {
    let backend = support::backend().await;
    let instance = format!(
        "it-name-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let sandbox_id = format!("sbx_{}", uuid::Uuid::new_v4().simple());

    // The earlier container, still there (as after a checkpoint, before its removal).
    let first = backend
        .launch(&spec(&instance, &sandbox_id))
        .await
        .expect("first launch");
    assert!(
        backend
            .inspect(&first.container_id)
            .await
            .unwrap()
            .is_some()
    );
    // Started again under the same id: the earlier one goes, the new one holds the name.
    let second = backend
        .launch(&spec(&instance, &sandbox_id))
        .await
        .expect("a launch under the same id replaces the earlier container");
    assert_ne!(first.container_id, second.container_id);
    assert!(
        backend
            .inspect(&first.container_id)
            .await
            .unwrap()
            .is_none(),
        "the earlier container was removed"
    );
    let named = backend
        .inspect(&format!("sandgate-{sandbox_id}"))
        .await
        .unwrap()
        .expect("the name is held");
    assert_eq!(named.sandbox_id, sandbox_id);

    // Another instance's launch under that id is not an earlier container of its own: refused,
    // and the holder stays.
    let other = backend
        .launch(&spec("it-name-someone-else", &sandbox_id))
        .await;
    assert!(other.is_err(), "another instance's container is left alone");
    assert!(
        backend
            .inspect(&second.container_id)
            .await
            .unwrap()
            .is_some(),
        "the holder of the name stays"
    );
    backend.remove(&second.container_id).await.unwrap();
}
