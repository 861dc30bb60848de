//! An image's root filesystem, unpacked once per image version for the lean engine: exported from
//! the Docker engine's image store (where the image arrived as today: built offline, or pulled and
//! verified by digest), under `<dir>/images/<image id>/rootfs`.

use std::io;
use std::path::{Path, PathBuf};

use bollard::Docker;
use bollard::models::ContainerCreateBody;
use bollard::query_parameters::{CreateContainerOptions, RemoveContainerOptions};
use futures::StreamExt as _;
use tokio::io::AsyncWriteExt as _;

use sandgate_lean::spec::STAGING_DIR;

/// Mount points a sandbox needs that an image may lack (the agent's packages directory).
const MOUNT_POINTS: [&str; 7] = [
    "tmp",
    "proc",
    "sys",
    "dev",
    "home/user",
    "opt/packages",
    "etc",
];

/// An unpacked image.
#[derive(Debug, Clone)]
pub struct RootFs {
    /// The engine's id of the image (`sha256:…`).
    pub image_id: String,
    /// The unpacked tree.
    pub path: PathBuf,
    /// The image's environment (`Config.Env`), which a container of it would get.
    pub env: Vec<(String, String)>,
}

/// Unpacks `image` under `dir` unless this version already is; returns it.
pub async fn ensure(docker: &Docker, dir: &Path, image: &str) -> io::Result<RootFs> {
    let inspect = docker
        .inspect_image(image)
        .await
        .map_err(|e| io::Error::other(format!("inspecting the image {image}: {e}")))?;
    let image_id = inspect
        .id
        .ok_or_else(|| io::Error::other(format!("the engine gave no id for {image}")))?;
    let env = inspect
        .config
        .and_then(|c| c.env)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.to_owned(), v.to_owned()))
        })
        .collect();
    let version = image_id.trim_start_matches("sha256:");
    let base = dir.join("images").join(version);
    let path = base.join("rootfs");
    if !base.exists() {
        // Unpacked beside and renamed into place: a node (or another process of this machine)
        // unpacking the same version at the same time never sees a half-made tree.
        let temp = dir.join("images").join(format!(
            ".{version}.{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ));
        unpack(docker, image, &temp, &temp.join("rootfs")).await?;
        if let Err(err) = tokio::fs::rename(&temp, &base).await {
            let _ = tokio::fs::remove_dir_all(&temp).await;
            if !base.exists() {
                return Err(err);
            }
        }
    }
    Ok(RootFs {
        image_id,
        path,
        env,
    })
}

async fn unpack(docker: &Docker, image: &str, base: &Path, path: &Path) -> io::Result<()> {
    tracing::info!(image, dir = %base.display(), "unpacking the sandbox image for the lean engine");
    tokio::fs::create_dir_all(base).await?;
    let tarball = base.join("export.tar");
    let name = format!(
        "sandgate-lean-export-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let created = docker
        .create_container(
            Some(CreateContainerOptions {
                name: Some(name.clone()),
                ..Default::default()
            }),
            ContainerCreateBody {
                image: Some(image.to_owned()),
                cmd: Some(vec!["/bin/true".into()]),
                network_disabled: Some(true),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| io::Error::other(format!("creating a container to export {image}: {e}")))?;
    let exported = async {
        let mut file = tokio::fs::File::create(&tarball).await?;
        let mut stream = docker.export_container(&created.id);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| io::Error::other(format!("exporting {image}: {e}")))?;
            file.write_all(&chunk).await?;
        }
        file.flush().await
    }
    .await;
    let _ = docker
        .remove_container(
            &created.id,
            Some(RemoveContainerOptions {
                force: true,
                ..Default::default()
            }),
        )
        .await;
    exported?;
    let (tarball2, path2) = (tarball.clone(), path.to_owned());
    tokio::task::spawn_blocking(move || extract(&tarball2, &path2))
        .await
        .map_err(io::Error::other)??;
    tokio::fs::remove_file(&tarball).await?;
    Ok(())
}

fn extract(tarball: &Path, path: &Path) -> io::Result<()> {
    std::fs::create_dir_all(path)?;
    let mut archive = tar::Archive::new(std::fs::File::open(tarball)?);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_unpack_xattrs(false);
    archive.set_overwrite(true);
    for entry in archive.entries()? {
        let mut entry = entry?;
        // Device nodes and fifos of the image are never used: a sandbox's /dev is its own.
        if matches!(
            entry.header().entry_type(),
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo
        ) {
            continue;
        }
        entry.unpack_in(path)?;
    }
    for dir in MOUNT_POINTS {
        std::fs::create_dir_all(path.join(dir))?;
    }
    // The staging directory a child binds the root at (never visible inside a sandbox: the root
    // is bound over it and then pivoted into).
    std::fs::create_dir_all(path.join(STAGING_DIR.trim_start_matches('/')))?;
    Ok(())
}
