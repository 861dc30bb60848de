//! Tiny pure-Python wheels for the package tests, built with the standard library's zipfile (a
//! wheel is a zip with a dist-info directory): no build backend, no index. Shared by the test
//! binaries that include this file with `#[path]`: sandgate-node's relay tests and the
//! end-to-end package tests.

use std::path::{Path, PathBuf};

/// Builds the wheels described on argv[2] (JSON) into the directory argv[1].
const MAKE_WHEELS: &str = r#"
import base64, hashlib, json, os, sys, zipfile
dest = sys.argv[1]
def wheel(name, version, source, requires=()):
    mod = name.replace("-", "_")
    dist = f"{mod}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{mod}.py": source,
        f"{dist}.dist-info/METADATA": meta,
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: sandgate-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(os.path.join(dest, f"{dist}-py3-none-any.whl"), "w") as z:
        for path, text in files.items():
            data = text.encode()
            z.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
        record.append(f"{dist}.dist-info/RECORD,,")
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
for w in json.loads(sys.argv[2]):
    wheel(w["name"], w["version"], w["source"], w["requires"])
"#;

/// One wheel to build: a module named after the project (dashes become underscores) whose
/// source is `source`, depending on `requires`.
#[derive(Debug, Clone, Copy)]
pub struct Wheel<'a> {
    /// The project's name (`sgdemo-dep`).
    pub name: &'a str,
    /// Its version (`1.0`).
    pub version: &'a str,
    /// The module's source.
    pub source: &'a str,
    /// Its `Requires-Dist` entries.
    pub requires: &'a [&'a str],
}

/// Builds `wheels` (`<module>-<version>-py3-none-any.whl` each) into a fresh directory named after
/// `prefix`, with the tests' Python (`SANDGATE_TEST_PYTHON`, else `python3`).
pub fn build(prefix: &str, wheels: &[Wheel<'_>]) -> TempDir {
    let dir = TempDir::new(prefix);
    let spec: Vec<serde_json::Value> = wheels
        .iter()
        .map(|w| {
            serde_json::json!({
                "name": w.name, "version": w.version, "source": w.source, "requires": w.requires,
            })
        })
        .collect();
    let python = std::env::var("SANDGATE_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let status = std::process::Command::new(&python)
        .args(["-c", MAKE_WHEELS])
        .arg(dir.path())
        .arg(serde_json::Value::Array(spec).to_string())
        .status()
        .expect("python runs");
    assert!(status.success(), "the test wheels are built");
    dir
}

/// A directory of its own under the system's temporary directory, removed when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A new, empty directory whose name starts with `prefix`.
    pub fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("{prefix}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        Self(dir)
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
