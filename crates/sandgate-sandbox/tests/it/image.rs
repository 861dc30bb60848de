//! The sandbox image itself: the data stack imports as uid 1000 with no network.

use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, LogsOptionsBuilder, RemoveContainerOptionsBuilder,
    WaitContainerOptions,
};
use futures::StreamExt;

use crate::support;

#[tokio::test]
async fn the_data_stack_imports_as_uid_1000_without_network() {
    let docker = support::docker();
    let script = "import os, socket, numpy, pandas, matplotlib, IPython, openpyxl\n\
                  import matplotlib.pyplot as plt\n\
                  print('uid', os.getuid(), 'home', os.path.expanduser('~'))\n\
                  print('interfaces', sorted(n for _, n in socket.if_nameindex()))\n\
                  print('backend', matplotlib.get_backend())\n";
    let body = ContainerCreateBody {
        image: Some(support::image()),
        cmd: Some(vec!["python3".into(), "-c".into(), script.into()]),
        host_config: Some(HostConfig {
            network_mode: Some("none".into()),
            readonly_rootfs: Some(true),
            tmpfs: Some([("/tmp".to_string(), "size=16m".to_string())].into()),
            cap_drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        labels: Some([("sandgate.test".to_string(), "image".to_string())].into()),
        ..Default::default()
    };
    let created = docker
        .create_container(Some(CreateContainerOptionsBuilder::default().build()), body)
        .await
        .expect("the sandbox image can be instantiated");
    let id = created.id;
    docker
        .start_container(&id, None)
        .await
        .expect("container starts");
    let exit = docker
        .wait_container(&id, None::<WaitContainerOptions>)
        .next()
        .await
        .expect("wait yields a status");
    let mut logs = docker.logs(
        &id,
        Some(
            LogsOptionsBuilder::default()
                .stdout(true)
                .stderr(true)
                .build(),
        ),
    );
    let mut output = String::new();
    while let Some(chunk) = logs.next().await {
        output.push_str(&chunk.expect("logs are readable").to_string());
    }
    docker
        .remove_container(
            &id,
            Some(RemoveContainerOptionsBuilder::default().force(true).build()),
        )
        .await
        .expect("container is removed");

    let status = match exit {
        Ok(response) => response.status_code,
        Err(bollard::errors::Error::DockerContainerWaitError { code, .. }) => code,
        Err(e) => panic!("waiting for the container failed: {e}"),
    };
    assert_eq!(status, 0, "imports should succeed; output:\n{output}");
    assert!(
        output.contains("uid 1000 home /home/user"),
        "runs as uid 1000 in /home/user:\n{output}"
    );
    assert!(
        output.contains("interfaces ['lo']"),
        "only loopback, no network:\n{output}"
    );
    assert!(
        output.to_lowercase().contains("backend agg"),
        "matplotlib uses Agg:\n{output}"
    );
}
