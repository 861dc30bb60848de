//! `sandbox.pull`: a node whose engine lacks its sandbox image pulls it from a registry before it
//! serves. The registry is Debian's `docker-registry`, on the second engine's loopback (that
//! engine has a network namespace of its own, so the registry runs in it); the second engine
//! pushes the stack's image there under a repository of this run, forgets that reference, and
//! the node, configured with the image pinned by digest, pulls it and starts a sandbox from it.
//!
//! The engine forgets the image entirely (every tag, the stack's too) before the node starts,
//! so the node's pull fetches every layer; the stack's tag is given back at the end.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use sandgate_node::RemoteNode;
use sandgate_sandbox::{ExecOptions, SandboxProfile};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support;
use crate::support::node::{Engine, NodeStart, TlsFiles, sandbox_image};
use crate::support::scale_out::{SECOND_ENGINE, second_dockerd};

/// The registry's address inside the second engine's network namespace (only that engine's
/// dockerd lives there, so the port is free).
const REGISTRY: &str = "127.0.0.1:5000";

/// `docker-registry serve` in the network namespace of the second engine's dockerd; killed on
/// drop.
struct Registry {
    _child: tokio::process::Child,
}

impl Registry {
    async fn start() -> Registry {
        let pid = second_dockerd().expect("the second engine's dockerd runs (scripts/stack.sh up)");
        // Blobs are kept between runs (in the stack's cache), so a later run's push only
        // uploads a manifest.
        let storage = std::env::var_os("SANDGATE_CACHE")
            .map(|cache| PathBuf::from(cache).join("test-registry"))
            .unwrap_or_else(|| std::env::temp_dir().join("sandgate-test-registry"));
        std::fs::create_dir_all(&storage).expect("the registry's storage directory");
        let config = storage.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}\n  \
                 delete:\n    enabled: true\nhttp:\n  addr: {REGISTRY}\n",
                storage.join("data").display()
            ),
        )
        .expect("the registry's configuration");
        // `unshare --net` leaves the namespace's loopback down: up, or nothing reaches 127.0.0.1.
        let lo_up = std::process::Command::new("nsenter")
            .arg(format!("--net=/proc/{pid}/ns/net"))
            .args(["--", "ip", "link", "set", "lo", "up"])
            .status()
            .expect("nsenter and ip (iproute2) run");
        assert!(lo_up.success(), "the second engine's loopback comes up");
        let mut child = tokio::process::Command::new("nsenter")
            .arg(format!("--net=/proc/{pid}/ns/net"))
            .args(["--", "docker-registry", "serve"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("nsenter and docker-registry (Debian's, scripts/stack.sh installs it) run");
        let mut lines = BufReader::new(child.stderr.take().expect("piped")).lines();
        let listening = tokio::time::timeout(Duration::from_secs(30), async {
            let mut seen = Vec::new();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("listening on") {
                    return Ok(());
                }
                seen.push(line);
            }
            Err(seen.join("\n"))
        })
        .await
        .expect("docker-registry listens or exits within 30 s");
        if let Err(log) = listening {
            panic!("docker-registry exited before listening:\n{log}");
        }
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Registry { _child: child }
    }
}

/// Runs `docker <args>` on `engine`, panicking with its output when it fails; its stdout.
fn docker_ok(engine: &Engine, args: &[&str]) -> String {
    let output = engine
        .docker()
        .args(args)
        .output()
        .expect("the docker CLI runs");
    assert!(
        output.status.success(),
        "docker {args:?} on {}: {}{}",
        engine.host,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Whether `engine` has `image`.
fn has_image(engine: &Engine, image: &str) -> bool {
    engine
        .docker()
        .args(["image", "inspect", image])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("the docker CLI runs")
        .success()
}

#[tokio::test]
async fn a_node_pulls_its_image_pinned_by_digest_from_a_registry_and_serves_a_sandbox() {
    // Other tests stop the second engine; not while this one uses it.
    let _engine = SECOND_ENGINE.lock().await;
    let engine = Engine::second();
    engine.ensure_image(&sandbox_image());
    let _registry = Registry::start().await;

    // Push the stack's image under a repository of this run, then forget every reference to
    // that repository on the engine: only the registry has it under that name.
    let run = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let repository = format!("{REGISTRY}/sandgate-sandbox-e2e-{run}");
    let tagged = format!("{repository}:0.1.0");
    docker_ok(&engine, &["tag", &sandbox_image(), &tagged]);
    let pushed = docker_ok(&engine, &["push", &tagged]);
    let digest = pushed
        .split_whitespace()
        .skip_while(|word| *word != "digest:")
        .nth(1)
        .unwrap_or_else(|| panic!("docker push prints the digest, got:\n{pushed}"))
        .to_owned();
    let pinned = format!("{repository}@{digest}");
    // Then the engine forgets the image itself: every tag of it (the stack's too, given back
    // below), so the node's pull must fetch every layer from the registry.
    let image_id = docker_ok(
        &engine,
        &["image", "inspect", "--format", "{{.Id}}", &tagged],
    )
    .trim()
    .to_owned();
    // Whatever happens below, the stack's tag comes back (from the pull, else from the first
    // engine) for the other tests of this engine.
    struct GiveBack(Engine, String);
    impl Drop for GiveBack {
        fn drop(&mut self) {
            let _ = self
                .0
                .docker()
                .args(["tag", &self.1, &sandbox_image()])
                .output();
            self.0.ensure_image(&sandbox_image());
        }
    }
    let _give_back = GiveBack(engine.clone(), pinned.clone());
    let tags = docker_ok(
        &engine,
        &[
            "image",
            "inspect",
            "--format",
            "{{join .RepoTags \"\\n\"}}\n{{join .RepoDigests \"\\n\"}}",
            &image_id,
        ],
    );
    // Every name of the image, tags and digests alike (a digest a killed run of this test left
    // behind keeps the image on the engine as surely as a tag).
    for tag in tags.lines().filter(|t| !t.is_empty()) {
        let _ = engine.docker().args(["rmi", tag]).output();
    }
    let _ = engine.docker().args(["rmi", &pinned]).output();
    assert!(
        !has_image(&engine, &pinned) && !has_image(&engine, &image_id),
        "neither {pinned} nor any image of its id is on the engine before the node starts"
    );

    let database = support::fresh_database().await;
    let instance = format!("e2e-pull-{run}");
    let tls = TlsFiles::new(&instance);

    // A digest the registry does not have: the start fails, naming the image and the setting.
    let missing = format!("{repository}@sha256:{}", "0".repeat(64));
    let refused = NodeStart::new(&database, &format!("{instance}-missing"))
        .engine(&engine)
        .without_copying_the_image()
        .tls(&tls)
        .env([
            ("SANDGATE_SANDBOX__IMAGE", missing.as_str()),
            ("SANDGATE_SANDBOX__PULL", "if_missing"),
        ])
        .try_start()
        .await
        .expect_err("a node whose image cannot be pulled must not start");
    assert!(
        refused.contains("pulling sandbox image") && refused.contains(&missing),
        "the refusal names the image it could not pull, got: {refused}"
    );
    // `if_missing` with a tag that may move is refused before anything is pulled.
    let unpinned = NodeStart::new(&database, &format!("{instance}-tag"))
        .without_migrating()
        .engine(&engine)
        .without_copying_the_image()
        .tls(&tls)
        .env([
            ("SANDGATE_SANDBOX__IMAGE", tagged.as_str()),
            ("SANDGATE_SANDBOX__PULL", "if_missing"),
        ])
        .try_start()
        .await
        .expect_err("if_missing with an image not pinned by digest must be refused");
    assert!(
        unpinned.contains("sandbox.image") && unpinned.contains("pinned by digest"),
        "the refusal names the key and asks for a digest, got: {unpinned}"
    );

    let node = NodeStart::new(&database, &instance)
        .engine(&engine)
        .without_copying_the_image()
        .tls(&tls)
        .env([
            ("SANDGATE_SANDBOX__IMAGE", pinned.as_str()),
            ("SANDGATE_SANDBOX__PULL", "if_missing"),
        ])
        .start()
        .await;
    assert!(
        has_image(&engine, &pinned),
        "the node pulled {pinned} before it served"
    );

    let gateway = RemoteNode::connect_lazy(&node.url, &tls.pki().tls()).expect("a client");
    let profile = SandboxProfile {
        image: String::new(),
        ..SandboxProfile::default()
    };
    let sandbox = tokio::time::timeout(Duration::from_secs(180), gateway.launch(&profile))
        .await
        .expect("a launch within 180 s")
        .expect("the node starts a sandbox from the pulled image");
    let outcome = sandbox
        .exec(
            "import sys; sys.version_info[0]",
            ExecOptions::default(),
            None,
        )
        .await
        .expect("the cell runs");
    assert_eq!(
        outcome
            .result
            .and_then(|b| b.get("text/plain").cloned())
            .as_deref(),
        Some("3"),
        "the sandbox of the pulled image runs Python"
    );
    let image = engine.docker_out(&[
        "inspect",
        "--format",
        "{{.Config.Image}}",
        sandbox.container_id(),
    ]);
    assert_eq!(
        image, pinned,
        "the sandbox's container runs the pinned image"
    );
    gateway
        .remove(sandbox.container_id())
        .await
        .expect("the node removes the container");
    drop(node);
    let _ = engine.docker().args(["rmi", &pinned]).output();
}
