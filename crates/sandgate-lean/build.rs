//! Stamps the crate with a hash of its sources, so a node refuses a zygote that loaded a library
//! built from other sources (a stale `libsandgate_lean.so` next to a newer binary).

use std::hash::{DefaultHasher, Hasher};
use std::path::Path;

fn visit(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            visit(&path, files);
        } else {
            files.push(path);
        }
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    visit(&root.join("src"), &mut files);
    files.push(root.join("Cargo.toml"));
    files.sort();
    // DefaultHasher::new() has fixed keys: the same sources give the same stamp in every build.
    let mut hasher = DefaultHasher::new();
    for file in &files {
        hasher.write(
            file.strip_prefix(root)
                .unwrap_or(file)
                .to_string_lossy()
                .as_bytes(),
        );
        hasher.write(&std::fs::read(file).unwrap_or_default());
    }
    println!(
        "cargo:rustc-env=SANDGATE_LEAN_SOURCE_HASH={:016x}",
        hasher.finish()
    );
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=Cargo.toml");
}
