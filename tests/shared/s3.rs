//! An S3-compatible server on loopback for the S3 snapshot store's tests: moto in server mode
//! (`moto[server]` in tests/python-requirements.txt, so in the venv `SANDGATE_TEST_PYTHON`
//! names), started on 127.0.0.1 with a port the kernel picks, its buckets made before it is
//! handed over, and killed when dropped. Shared by the test binaries that include this file with
//! `#[path]`: sandgate-service's store tests and the end-to-end pause tests.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;

/// The region every test bucket is in.
pub const REGION: &str = "us-east-1";
/// The credentials the tests sign with (moto takes any unless it enforces them).
pub const ACCESS_KEY_ID: &str = "sandgate-test";
pub const SECRET_ACCESS_KEY: &str = "sandgate-test-secret";

/// Starts the server on a free loopback port, makes the buckets on argv[2:], prints the port and
/// serves until stdin closes (the test ends, or dies). argv[1] is how many requests go
/// unauthenticated before moto checks credentials ("inf": never checks).
const MOTO: &str = r#"
import os, sys
os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = sys.argv[1]
import boto3
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
port = server.get_host_and_port()[1]
s3 = boto3.client(
    "s3",
    endpoint_url=f"http://127.0.0.1:{port}",
    region_name="us-east-1",
    aws_access_key_id="sandgate-test",
    aws_secret_access_key="sandgate-test-secret",
)
for bucket in sys.argv[2:]:
    s3.create_bucket(Bucket=bucket)
print(port, flush=True)
sys.stdin.read()
server.stop()
"#;

/// A running moto server; killed on drop.
pub struct Moto {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
}

/// The test venv's Python. A hard failure when unset, like python_sdk.rs.
fn python() -> String {
    std::env::var("SANDGATE_TEST_PYTHON").expect(
        "SANDGATE_TEST_PYTHON is not set: it must name the venv from scripts/py-venv.sh \
         (tests/python-requirements.txt has moto[server])",
    )
}

impl Moto {
    /// A server with `buckets` made, accepting any credentials.
    pub fn start(buckets: &[&str]) -> Self {
        Self::spawn("inf", buckets)
    }

    /// A server with `buckets` made that refuses any credentials it does not know (moto's IAM
    /// checks on: the tests' keys are unknown to it).
    pub fn start_checking_credentials(buckets: &[&str]) -> Self {
        // The bucket creations themselves go unchecked.
        Self::spawn(&buckets.len().to_string(), buckets)
    }

    fn spawn(unchecked: &str, buckets: &[&str]) -> Self {
        let mut child = Command::new(python())
            .arg("-c")
            .arg(MOTO)
            .arg(unchecked)
            .args(buckets)
            // Loopback only, whatever the environment says about proxies.
            .env("NO_PROXY", "127.0.0.1")
            .env_remove("HTTP_PROXY")
            .env_remove("HTTPS_PROXY")
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("moto starts (the venv of scripts/py-venv.sh has moto[server])");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("its stdout"))
            .read_line(&mut line)
            .expect("moto prints its port");
        let port: u16 = line.trim().parse().unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("moto printed {line:?}, not its port: is moto[server] in the venv?")
        });
        Self {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        }
    }

    /// A client of `bucket` of its own, to look at what the service stored (the S3 API, not
    /// the service's store).
    pub fn bucket(&self, bucket: &str) -> Arc<dyn ObjectStore> {
        Arc::new(
            AmazonS3Builder::new()
                .with_bucket_name(bucket)
                .with_region(REGION)
                .with_endpoint(&self.endpoint)
                .with_access_key_id(ACCESS_KEY_ID)
                .with_secret_access_key(SECRET_ACCESS_KEY)
                .with_allow_http(true)
                .build()
                .expect("an S3 client"),
        )
    }

    /// The keys of every object in `bucket`.
    pub async fn keys(&self, bucket: &str) -> Vec<String> {
        use futures::TryStreamExt;
        let listed: Vec<_> = self
            .bucket(bucket)
            .list(None)
            .try_collect()
            .await
            .expect("the bucket is listed");
        listed.into_iter().map(|m| m.location.to_string()).collect()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
