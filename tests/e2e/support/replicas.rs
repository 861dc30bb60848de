//! Several replicas of one deployment: `spawn_replica` (the one place replicas are launched) and
//! a round-robin HTTP load balancer on loopback with no stickiness, like one an operator would put
//! in front of them.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sqlx::Connection;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::Gateway;

/// What every replica of one deployment shares: the database, the instance (container labels),
/// `keys.secret`, and the public URL when a load balancer is in front.
#[derive(Debug, Clone)]
pub struct Deployment {
    /// The Postgres URL.
    pub database: String,
    /// The `instance` name.
    pub instance: String,
    /// `keys.secret`.
    pub secret: String,
    /// `public_url` (the load balancer's), when set.
    pub public_url: Option<String>,
}

impl Deployment {
    /// A new deployment on a fresh database, with a secret of its own.
    pub async fn new() -> Deployment {
        Deployment {
            database: super::fresh_database().await,
            instance: format!("e2e-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            secret: format!(
                "{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            ),
            public_url: None,
        }
    }

    /// The same deployment served at `lb`'s URL (tokens name it as their audience).
    pub fn behind(mut self, lb: &RoundRobin) -> Deployment {
        self.public_url = Some(lb.base_url());
        self
    }
}

/// Starts replica `index` of `deployment` with its database, instance, secret and public URL,
/// `extra_env` added. Every multi-replica test launches replicas here only. Replica 0 is a whole
/// `sandgate serve` whose node (the engine's one node: a second on the same engine is refused)
/// serves the node RPC on loopback; the others are `serve --gateway-only` replicas reaching its
/// sandboxes over the RPC.
pub async fn spawn_replica(
    index: usize,
    deployment: &Deployment,
    extra_env: &[(&str, &str)],
) -> Gateway {
    let mut env: Vec<(&str, &str)> = vec![("SANDGATE_KEYS__SECRET", &deployment.secret)];
    if let Some(url) = &deployment.public_url {
        env.push(("SANDGATE_PUBLIC_URL", url));
    }
    env.extend_from_slice(extra_env);
    if index == 0 {
        Gateway::start_instance(&deployment.database, &deployment.instance, &env).await
    } else {
        Gateway::start_gateway_only(&deployment.database, &deployment.instance, &env).await
    }
}

/// A round-robin HTTP load balancer: each request goes to the next upstream, whatever
/// connection or session it belongs to; a request an upstream does not accept (connection
/// refused: the replica is gone) goes to the next one, like a load balancer's passive health
/// check. Responses (server-sent events too) stream through; the Host header is kept.
pub struct RoundRobin {
    /// Where clients connect.
    pub addr: SocketAddr,
    upstreams: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

#[derive(Clone)]
struct Balancer {
    upstreams: Arc<Mutex<Vec<String>>>,
    next: Arc<AtomicUsize>,
    client: Client<HttpConnector, Body>,
}

impl RoundRobin {
    /// Binds a free loopback port; no upstream yet (requests get 502 until [`Self::route`]).
    pub async fn start() -> RoundRobin {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let addr = listener.local_addr().expect("bound");
        let upstreams = Arc::new(Mutex::new(Vec::new()));
        let balancer = Balancer {
            upstreams: upstreams.clone(),
            next: Arc::default(),
            client: Client::builder(TokioExecutor::new()).build_http(),
        };
        let app = axum::Router::new().fallback(forward).with_state(balancer);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        RoundRobin {
            addr,
            upstreams,
            task,
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The MCP endpoint behind it.
    pub fn mcp_url(&self) -> String {
        format!("{}/mcp", self.base_url())
    }

    /// Sends requests to these gateways from now on, in turn.
    pub fn route(&self, gateways: &[&Gateway]) {
        *self.upstreams.lock().expect("upstreams") =
            gateways.iter().map(|g| g.base_url.clone()).collect();
    }
}

impl Drop for RoundRobin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(State(lb): State<Balancer>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    // MCP requests are small; buffered so a refused one can go to the next upstream.
    let Ok(body) = axum::body::to_bytes(body, 64 << 20).await else {
        return (StatusCode::PAYLOAD_TOO_LARGE, "request too large").into_response();
    };
    let upstreams = lb.upstreams.lock().expect("upstreams").clone();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    for _ in 0..upstreams.len() {
        let upstream = &upstreams[lb.next.fetch_add(1, Ordering::Relaxed) % upstreams.len()];
        let mut request = Request::from_parts(parts.clone(), Body::from(body.clone()));
        *request.uri_mut() = format!("{upstream}{path}")
            .parse::<Uri>()
            .expect("a valid upstream URI");
        match lb.client.request(request).await {
            Ok(response) => return response.map(Body::new),
            Err(err) if err.is_connect() => continue,
            Err(err) => {
                return (StatusCode::BAD_GATEWAY, format!("upstream failed: {err}"))
                    .into_response();
            }
        }
    }
    (StatusCode::BAD_GATEWAY, "no upstream answers").into_response()
}

/// Whether Postgres and the engine agree for `instance`: every container labelled with it is
/// a live (warm or leased) row's, and no container serves two live rows. Returns what differs.
pub async fn ownership_problems(database: &str, instance: &str) -> Vec<String> {
    let mut conn = sqlx::PgConnection::connect(database)
        .await
        .expect("the test database answers");
    let live: Vec<(String, String)> =
        sqlx::query_as("SELECT id, container_id FROM sandboxes WHERE state IN ('warm', 'leased')")
            .fetch_all(&mut conn)
            .await
            .expect("rows");
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    for (id, container) in &live {
        if !seen.insert(container.clone()) {
            problems.push(format!(
                "container {container} is owned twice (also by {id})"
            ));
        }
    }
    let containers: HashSet<String> = super::containers_of(instance).into_iter().collect();
    for orphan in containers.difference(&seen) {
        problems.push(format!("container {orphan} has no live row (an orphan)"));
    }
    for (id, container) in &live {
        if !containers.contains(container) {
            problems.push(format!("live sandbox {id} has no container"));
        }
    }
    problems
}
