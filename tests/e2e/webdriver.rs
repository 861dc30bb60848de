//! A headless Chromium for the tests, driven through `chromedriver` (install both with
//! `scripts/ensure-chromium.sh`) with the `fantoccini` WebDriver client.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::json;
use tokio::process::{Child, Command};

/// How long an element may take to appear.
const FIND_TIMEOUT: Duration = Duration::from_secs(10);

/// A headless Chromium session. Dropping it ends the session and chromedriver (which ends the
/// browser).
pub struct Browser {
    client: Client,
    /// `DELETE` this to end the session; `None` once it was ended.
    session_url: Option<String>,
    _driver: Child,
    _profile: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Starts chromedriver on a free loopback port and waits until it answers `/status` as a
/// WebDriver; returns it and its address. The port is free when chosen but may be taken before
/// chromedriver binds it (other tests bind loopback ports all the time): a driver that exits,
/// or a port that answers as something else, is retried on another port.
async fn start_driver(driver: &str) -> (Child, std::net::SocketAddr) {
    let http = reqwest::Client::new();
    let mut last = String::new();
    for _ in 0..5 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
        let address = listener.local_addr().expect("a bound address");
        drop(listener);
        let mut child = Command::new(driver)
            .arg(format!("--port={}", address.port()))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver starts");
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            if let Ok(Some(status)) = child.try_wait() {
                last = format!("chromedriver on port {} exited: {status}", address.port());
                break;
            }
            let status = http
                .get(format!("http://{address}/status"))
                .timeout(Duration::from_secs(5))
                .send()
                .await;
            if let Ok(response) = status {
                match response.json::<serde_json::Value>().await {
                    Ok(body) if body["value"]["ready"].is_boolean() => return (child, address),
                    _ => {
                        last = format!("port {} answers, but not as chromedriver", address.port());
                        break;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if last.is_empty() {
            last = "chromedriver did not answer /status within 60 s".into();
        }
    }
    panic!("chromedriver did not start: {last}");
}

impl Browser {
    /// Starts chromedriver and a fresh headless Chromium with a phone-sized window.
    pub async fn start() -> Browser {
        let driver = which("chromedriver").unwrap_or_else(|| {
            panic!("chromedriver is not installed; run scripts/ensure-chromium.sh (apt-get install chromium chromium-driver)")
        });
        let chromium =
            which("chromium").expect("chromium is installed (scripts/ensure-chromium.sh)");
        let (child, address) = start_driver(&driver).await;
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
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("browserName".into(), json!("chrome"));
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({"binary": chromium, "args": args}),
        );
        // Only loopback is reached (chromedriver, the gateway): plain HTTP, no TLS stack.
        let client = ClientBuilder::new(HttpConnector::new())
            .capabilities(capabilities)
            .connect(&format!("http://{address}"))
            .await
            .unwrap_or_else(|err| panic!("a browser session starts: {err}"));
        let session = client.session_id().await.ok().flatten();
        Browser {
            client,
            session_url: session.map(|id| format!("http://{address}/session/{id}")),
            _driver: child,
            _profile: TempDir(profile),
        }
    }

    /// Navigates to `url` and waits for the page to load.
    pub async fn goto(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|err| panic!("navigating to {url}: {err}"));
    }

    /// The current URL.
    pub async fn url(&self) -> String {
        self.client
            .current_url()
            .await
            .expect("the current URL")
            .to_string()
    }

    /// The current document's title.
    pub async fn title(&self) -> String {
        self.client.title().await.expect("the page's title")
    }

    /// The element matching a CSS selector, waiting for it to appear.
    pub async fn find(&self, css: &str) -> fantoccini::elements::Element {
        self.client
            .wait()
            .at_most(FIND_TIMEOUT)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|err| panic!("element {css} within {FIND_TIMEOUT:?}: {err}"))
    }

    /// Types into an element.
    pub async fn type_into(&self, css: &str, text: &str) {
        self.find(css)
            .await
            .send_keys(text)
            .await
            .unwrap_or_else(|err| panic!("typing into {css}: {err}"));
    }

    /// Clicks an element.
    pub async fn click(&self, css: &str) {
        self.find(css)
            .await
            .click()
            .await
            .unwrap_or_else(|err| panic!("clicking {css}: {err}"));
    }

    /// The visible text of an element.
    pub async fn text(&self, css: &str) -> String {
        self.find(css)
            .await
            .text()
            .await
            .unwrap_or_else(|err| panic!("the text of {css}: {err}"))
    }

    /// The visible text of the first element matching a CSS selector now, `None` when there is
    /// none (or the page is between two documents): for polling, where [`Browser::text`] would
    /// wait and panic.
    pub async fn text_now(&self, css: &str) -> Option<String> {
        let element = self.client.find(Locator::Css(css)).await.ok()?;
        element.text().await.ok()
    }

    /// Resizes the window (e.g. a desktop size for a screenshot).
    pub async fn resize(&self, width: u32, height: u32) {
        self.client
            .set_window_size(width, height)
            .await
            .expect("the window resizes");
    }

    /// Scrolls the first element matching `css` into view (through WebDriver, not the page).
    pub async fn scroll_to(&self, css: &str) {
        let element = self.find(css).await;
        let arg = serde_json::to_value(&element).expect("an element reference");
        self.client
            .execute("arguments[0].scrollIntoView();", vec![arg])
            .await
            .unwrap_or_else(|err| panic!("scrolling to {css}: {err}"));
    }

    /// A PNG screenshot of the viewport.
    pub async fn screenshot(&self) -> Vec<u8> {
        self.client.screenshot().await.expect("a screenshot")
    }

    /// Ends the browser session (the browser process exits).
    pub async fn quit(mut self) {
        self.session_url = None;
        let _ = self.client.clone().close().await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // A test that panicked did not quit, and the runtime that would run fantoccini's own
        // close on drop is going away with it: end the session synchronously (best effort) so
        // no orphaned Chromium outlives the test; the driver is killed on drop anyway.
        let Some(url) = self.session_url.take() else {
            return;
        };
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
