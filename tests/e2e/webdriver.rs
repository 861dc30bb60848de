//! A small W3C WebDriver client over reqwest, driving Debian's headless Chromium through
//! `chromedriver` (install both with `scripts/ensure-chromium.sh`).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use base64::Engine;
use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::support::eventually;

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A headless Chromium session. Dropping it ends chromedriver (which ends the browser).
pub struct Browser {
    http: reqwest::Client,
    session: String,
    base: String,
    _driver: Child,
    _profile: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

impl Browser {
    /// Starts chromedriver and a fresh headless Chromium with a phone-sized window.
    pub async fn start() -> Browser {
        let driver = which("chromedriver").unwrap_or_else(|| {
            panic!("chromedriver is not installed; run scripts/ensure-chromium.sh (apt-get install chromium chromium-driver)")
        });
        let chromium =
            which("chromium").expect("chromium is installed (scripts/ensure-chromium.sh)");
        let port = free_port();
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver starts");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        eventually(
            Duration::from_secs(20),
            "chromedriver to be ready",
            || async {
                let status: Value = http
                    .get(format!("{base}/status"))
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                (status["value"]["ready"] == true).then_some(())
            },
        )
        .await;
        let profile = std::env::temp_dir().join(format!(
            "sandgate-chromium-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&profile).expect("a profile directory");
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=412,915",
            &format!("--user-data-dir={}", profile.display()),
        ];
        let created: Value = http
            .post(format!("{base}/session"))
            .json(&json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": chromium, "args": args},
            }}}))
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("JSON");
        let session = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a browser session starts: {created}"))
            .to_owned();
        Browser {
            http,
            session,
            base,
            _driver: child,
            _profile: TempDir(profile),
        }
    }

    async fn command(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut request = self.http.request(method, &url);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let answer: Value = request
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("JSON");
        if answer["value"].get("error").is_some() {
            panic!("WebDriver {path} failed: {answer}");
        }
        answer["value"].clone()
    }

    /// Navigates to `url` and waits for the page to load.
    pub async fn goto(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", Some(json!({"url": url})))
            .await;
    }

    /// The current URL.
    pub async fn url(&self) -> String {
        self.command(reqwest::Method::GET, "/url", None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The current document's title.
    pub async fn title(&self) -> String {
        self.command(reqwest::Method::GET, "/title", None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The element matching a CSS selector, waiting up to 10 s for it to appear.
    pub async fn find(&self, css: &str) -> String {
        let url = format!("{}/session/{}/element", self.base, self.session);
        eventually(
            Duration::from_secs(10),
            &format!("element {css}"),
            || async {
                let answer: Value = self
                    .http
                    .post(&url)
                    .json(&json!({"using": "css selector", "value": css}))
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                answer["value"][ELEMENT].as_str().map(str::to_owned)
            },
        )
        .await
    }

    /// Types into an element.
    pub async fn type_into(&self, css: &str, text: &str) {
        let element = self.find(css).await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{element}/value"),
            Some(json!({"text": text})),
        )
        .await;
    }

    /// Clicks an element.
    pub async fn click(&self, css: &str) {
        let element = self.find(css).await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{element}/click"),
            Some(json!({})),
        )
        .await;
    }

    /// The visible text of an element.
    pub async fn text(&self, css: &str) -> String {
        let element = self.find(css).await;
        self.command(
            reqwest::Method::GET,
            &format!("/element/{element}/text"),
            None,
        )
        .await
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    /// A PNG screenshot of the viewport.
    pub async fn screenshot(&self) -> Vec<u8> {
        let b64 = self
            .command(reqwest::Method::GET, "/screenshot", None)
            .await;
        base64::engine::general_purpose::STANDARD
            .decode(b64.as_str().unwrap_or_default())
            .expect("a base64 PNG")
    }
}

impl Browser {
    /// Ends the browser session (the browser process exits).
    pub async fn quit(mut self) {
        let url = format!("{}/session/{}", self.base, self.session);
        let _ = self.http.delete(&url).send().await;
        self.session.clear();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // A test that panicked did not quit: ask chromedriver to close the browser (best effort)
        // so no orphaned Chromium outlives the test; the driver is killed on drop anyway.
        if self.session.is_empty() {
            return;
        }
        let url = format!("{}/session/{}", self.base, self.session);
        let _ = std::thread::spawn(move || {
            let _ = std::process::Command::new("curl")
                .args(["-s", "-m", "5", "-X", "DELETE", &url])
                .output();
        })
        .join();
    }
}

fn which(name: &str) -> Option<String> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| format!("{dir}/{name}"))
        .find(|path| std::path::Path::new(path).is_file())
}

/// Where test artifacts go: `$CARGO_TARGET_DIR/artifacts`, else the workspace's
/// `target/artifacts`.
pub fn artifacts_dir() -> PathBuf {
    let dir = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(target) => PathBuf::from(target).join("artifacts"),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/artifacts"),
    };
    std::fs::create_dir_all(&dir).expect("the artifacts directory can be made");
    dir
}
