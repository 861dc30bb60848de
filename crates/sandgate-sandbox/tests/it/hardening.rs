//! The hardening baseline of DESIGN §3, as the engine reports it and as seen from inside.

use bollard::query_parameters::InspectContainerOptions;
use sandgate_sandbox::{CommandOptions, ExecOptions, OciRuntime};

use crate::support::{self, TestEnv};

#[tokio::test]
async fn a_leased_container_carries_every_item_of_the_hardening_baseline() {
    let env = TestEnv::new("hardening", 0).await;
    let sandbox = env.lease().await;
    let inspect = support::docker()
        .inspect_container(sandbox.container_id(), None::<InspectContainerOptions>)
        .await
        .expect("the container can be inspected");
    let host = inspect.host_config.expect("host config");
    let config = inspect.config.expect("config");

    assert_eq!(host.network_mode.as_deref(), Some("none"), "network none");
    assert_eq!(
        host.cap_drop,
        Some(vec!["ALL".to_owned()]),
        "all capabilities dropped"
    );
    assert_eq!(
        host.cap_add,
        Some(vec![
            "CAP_SETUID".to_owned(),
            "CAP_SETGID".to_owned(),
            "CAP_KILL".to_owned()
        ]),
        "only the agent's three capabilities"
    );
    assert!(
        host.security_opt
            .unwrap_or_default()
            .iter()
            .any(|o| o == "no-new-privileges"),
        "no-new-privileges"
    );
    assert_eq!(host.readonly_rootfs, Some(true), "read-only root");
    let tmpfs = host.tmpfs.expect("tmpfs mounts");
    let tmp = &tmpfs["/tmp"];
    assert!(
        tmp.contains("size=64m") && tmp.contains("mode=1777"),
        "sized /tmp: {tmp}"
    );
    let home = &tmpfs["/home/user"];
    assert!(
        home.contains("size=512m") && home.contains("uid=1000") && home.contains("mode=0700"),
        "bounded /home/user owned by the user: {home}"
    );
    let packages = &tmpfs["/opt/packages"];
    assert!(
        packages.contains("size=256m")
            && packages.contains("uid=1000")
            && packages.contains("nosuid"),
        "bounded /opt/packages (pip's user installs) owned by the user: {packages}"
    );
    // The agent is root (with the three capabilities above); user code runs as uid 1000 with
    // none, which the probe below checks from inside.
    assert_eq!(config.user.as_deref(), Some("0:0"), "the agent's user");
    assert_eq!(host.pids_limit, Some(256), "pids limit");
    assert_eq!(
        host.memory,
        Some((512 + 64 + 512 + 256) << 20),
        "memory limit: memory + the tmpfs sizes"
    );
    assert_eq!(
        host.memory_swap, host.memory,
        "memory + swap = memory: no swap"
    );
    assert_eq!(host.nano_cpus, Some(1_000_000_000), "CPU quota");
    let nofile = host
        .ulimits
        .unwrap_or_default()
        .into_iter()
        .find(|u| u.name.as_deref() == Some("nofile"))
        .expect("a nofile ulimit");
    assert_eq!(
        (nofile.soft, nofile.hard),
        (Some(1024), Some(1024)),
        "nofile ulimit"
    );
    assert_eq!(host.init, Some(true), "an init process");
    assert!(host.binds.unwrap_or_default().is_empty(), "no binds");
    assert!(
        inspect.mounts.unwrap_or_default().is_empty(),
        "no volumes or binds from the host"
    );
    assert_eq!(
        host.log_config.and_then(|l| l.typ).as_deref(),
        Some("none"),
        "log driver off"
    );
    assert_eq!(
        host.runtime.as_deref(),
        Some(support::runtime().as_str()),
        "the profile's runtime"
    );
    assert_ne!(host.privileged, Some(true), "not privileged");
    let labels = config.labels.expect("labels");
    assert_eq!(labels["sandgate.managed"], "true");
    assert_eq!(labels["sandgate.instance"], env.instance);
    assert_eq!(labels["sandgate.profile"], "default");
    assert_eq!(labels["sandgate.sandbox_id"], sandbox.id());
    assert_eq!(config.tty, Some(false));
    assert_eq!(config.open_stdin, Some(true));
    assert_eq!(
        config.stdin_once,
        Some(false),
        "stdin survives a detach (adopt)"
    );

    // The same, seen from inside.
    let inside = sandbox
        .exec(
            "import os\n\
             status = open('/proc/self/status').read()\n\
             caps = [l.split()[1] for l in status.splitlines() if l.startswith('CapEff')][0]\n\
             nnp = ([l.split()[1] for l in status.splitlines() if l.startswith('NoNewPrivs')] or ['absent'])[0]\n\
             (os.getuid(), os.getgid(), caps, nnp, os.getcwd())",
            ExecOptions::default(),
            None,
        )
        .await
        .unwrap();
    let seen = inside
        .result
        .as_ref()
        .unwrap_or_else(|| panic!("the probe cell returned a value: {inside:?}"))["text/plain"]
        .clone();
    // gVisor's /proc has no NoNewPrivs line; the engine-side check above covers it there.
    let nnp = if support::runtime() == OciRuntime::Runsc && seen.contains("'absent'") {
        "absent"
    } else {
        "1"
    };
    assert_eq!(
        seen,
        format!("(1000, 1000, '0000000000000000', '{nnp}', '/home/user')")
    );
    // uid 1000 could not write to / anyway, so ask the kernel how the root is mounted.
    let root = sandbox
        .command(
            "awk '$2 == \"/\" {print $4}' /proc/mounts",
            CommandOptions::default(),
            None,
        )
        .await
        .unwrap();
    let options: Vec<&str> = root.stdout.trim().split(',').collect();
    assert!(
        options.contains(&"ro"),
        "the root file system is mounted read-only: {root:?}"
    );
    env.cleanup().await;
}
