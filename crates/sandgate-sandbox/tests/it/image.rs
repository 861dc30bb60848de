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
    let script = "import os, socket, numpy, pandas, matplotlib, IPython, openpyxl\n\
                  import matplotlib.pyplot as plt\n\
                  assert int(pandas.__version__.split('.')[0]) >= 2, pandas.__version__\n\
                  print('uid', os.getuid(), 'home', os.path.expanduser('~'))\n\
                  print('interfaces', sorted(n for _, n in socket.if_nameindex()))\n\
                  print('backend', matplotlib.get_backend())\n";
    let (status, output) = run_in_image(script).await;
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

/// Every package the image promises (deploy/sandbox/README.md, requirements.in) imports in one
/// interpreter, as the sandbox user, on a read-only root with no network; and pip is there.
#[tokio::test]
async fn every_package_the_image_lists_imports_in_one_interpreter() {
    let script = "import importlib, subprocess, sys\n\
                  names = ['pandas', 'numpy', 'scipy', 'sklearn', 'statsmodels.api', 'matplotlib.pyplot',\n\
                           'seaborn', 'plotly.express', 'pyarrow', 'pyarrow.parquet', 'openpyxl', 'xlrd',\n\
                           'requests', 'bs4', 'lxml.etree', 'sympy', 'PIL.Image', 'tabulate', 'dateutil',\n\
                           'pytz', 'IPython', 'jinja2', 'html5lib', 'numexpr', 'bottleneck', 'pip']\n\
                  modules = [importlib.import_module(name) for name in names]\n\
                  print('imported', len(names))\n\
                  out = subprocess.run([sys.executable, '-m', 'pip', '--version'], capture_output=True, text=True)\n\
                  print('pip', out.returncode, out.stdout.split(' ')[:2], out.stderr)\n";
    let (status, output) = run_in_image(script).await;
    assert_eq!(
        status, 0,
        "every listed package should import; output:\n{output}"
    );
    assert!(
        output.contains("imported 26"),
        "all 26 modules imported:\n{output}"
    );
    assert!(
        output.contains("pip 0 ['pip',"),
        "pip runs in the image:\n{output}"
    );
}

/// Runs `python3 -c script` in the image the way a sandbox does (uid 1000, read-only root, no
/// network, no capabilities, a small /tmp) and returns its exit status and output.
async fn run_in_image(script: &str) -> (i64, String) {
    let docker = support::docker();
    let body = ContainerCreateBody {
        image: Some(support::image()),
        cmd: Some(vec!["python3".into(), "-c".into(), script.into()]),
        host_config: Some(HostConfig {
            network_mode: Some("none".into()),
            readonly_rootfs: Some(true),
            tmpfs: Some([("/tmp".to_string(), "size=64m".to_string())].into()),
            cap_drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        labels: Some([("sandgate.test".to_string(), "image".to_string())].into()),
        ..Default::default()
    };
    let id = docker
        .create_container(Some(CreateContainerOptionsBuilder::default().build()), body)
        .await
        .expect("the sandbox image can be instantiated")
        .id;
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
    (status, output)
}
