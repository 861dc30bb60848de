//! A thin rmcp client for the tests: connect in either protocol era with a bearer token, call a
//! tool with JSON arguments, and read the structured result, text and images.

use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, ContentBlock,
    Implementation, ProgressNotificationParam, ProtocolVersion,
};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{
    ClientHandler, ClientLifecycleMode, ClientServiceExt, RoleClient, ServiceError, ServiceExt,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// Which protocol era to speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Era {
    /// 2025-11-25: `initialize`, then `Mcp-Session-Id` on every request.
    Sessions,
    /// 2026-07-28: `server/discover`, every request self-contained.
    Stateless,
}

/// The test client's handler: records progress notifications.
#[derive(Debug, Clone)]
pub struct Handler {
    config: ClientConfig,
    progress: mpsc::UnboundedSender<ProgressNotificationParam>,
}

impl ClientHandler for Handler {
    fn get_info(&self) -> ClientConfig {
        self.config.clone()
    }

    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _ctx: NotificationContext<RoleClient>,
    ) {
        let _ = self.progress.send(params);
    }
}

/// A connected client.
pub struct Client {
    /// The rmcp service.
    pub service: RunningService<RoleClient, Handler>,
    /// Progress notifications received.
    pub progress: mpsc::UnboundedReceiver<ProgressNotificationParam>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

/// A tool result, unpacked.
#[derive(Debug)]
pub struct ToolResult {
    /// `isError`.
    pub is_error: bool,
    /// `structuredContent` (Null when absent).
    pub structured: Value,
    /// Every text block, joined.
    pub text: String,
    /// Each text block.
    pub texts: Vec<String>,
    /// Image blocks: (mime type, decoded bytes).
    pub images: Vec<(String, Vec<u8>)>,
    /// Embedded resources (blobs): (mime type, decoded bytes).
    pub blobs: Vec<(Option<String>, Vec<u8>)>,
}

impl From<CallToolResult> for ToolResult {
    fn from(result: CallToolResult) -> Self {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut text = String::new();
        let mut texts = Vec::new();
        let mut images = Vec::new();
        let mut blobs = Vec::new();
        for block in &result.content {
            match block {
                ContentBlock::Text(t) => {
                    text.push_str(&t.text);
                    text.push('\n');
                    texts.push(t.text.clone());
                }
                ContentBlock::Image(image) => images.push((
                    image.mime_type.clone(),
                    b64.decode(&image.data).expect("image data is base64"),
                )),
                ContentBlock::Resource(resource) => {
                    if let rmcp::model::ResourceContents::BlobResourceContents {
                        blob,
                        mime_type,
                        ..
                    } = &resource.resource
                    {
                        blobs.push((mime_type.clone(), b64.decode(blob).expect("blob is base64")));
                    }
                }
                _ => {}
            }
        }
        ToolResult {
            is_error: result.is_error == Some(true),
            structured: result.structured_content.unwrap_or(Value::Null),
            text,
            texts,
            images,
            blobs,
        }
    }
}

impl Client {
    /// Connects to `url` with `token` in `era`.
    pub async fn connect(url: &str, token: &str, era: Era) -> Result<Client, String> {
        let transport = StreamableHttpClientTransport::from_config(
            StreamableHttpClientTransportConfig::with_uri(url)
                .auth_header(token.to_owned())
                // rmcp holds back POSTs beyond 16 at once; the burst tests need more in flight.
                .max_concurrent_requests(1024),
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let mut config = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("sandgate-e2e", "0.1.0"),
        );
        if era == Era::Sessions {
            config = config.with_protocol_version(ProtocolVersion::V_2025_11_25);
        }
        let handler = Handler {
            config,
            progress: tx,
        };
        let service = match era {
            Era::Sessions => handler.serve(transport).await.map_err(|e| e.to_string())?,
            Era::Stateless => handler
                .serve_with_lifecycle(
                    transport,
                    ClientLifecycleMode::Discover {
                        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
                    },
                )
                .await
                .map_err(|e| e.to_string())?,
        };
        Ok(Client {
            service,
            progress: rx,
        })
    }

    /// The negotiated protocol version.
    pub fn protocol_version(&self) -> String {
        self.service
            .peer_info()
            .map(|info| info.protocol_version.to_string())
            .unwrap_or_default()
    }

    /// Calls a tool; `Err` is a JSON-RPC (protocol) error.
    pub async fn call(&self, tool: &str, args: Value) -> Result<ToolResult, ServiceError> {
        let args = args.as_object().cloned().unwrap_or_default();
        self.service
            .call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(args))
            .await
            .map(ToolResult::from)
    }

    /// Calls a tool that must succeed (not a protocol error, not `isError`).
    pub async fn ok(&self, tool: &str, args: Value) -> ToolResult {
        let result = self
            .call(tool, args.clone())
            .await
            .unwrap_or_else(|e| panic!("{tool} {args} failed at the protocol level: {e}"));
        assert!(
            !result.is_error,
            "{tool} {args} returned isError: {}",
            result.text
        );
        result
    }

    /// Plays the attacker: calls `tool` with `args` naming `foreign` (another tenant's sandbox)
    /// and naming a sandbox that does not exist, and asserts both answers are the same error.
    pub async fn assert_foreign_looks_missing(&self, tool: &str, args: Value, foreign: &str) {
        let random = format!("sbx_{}", uuid::Uuid::new_v4().simple());
        let with = |id: &str| {
            let mut args = args.clone();
            args["sandbox_id"] = json!(id);
            args
        };
        let foreign_answer = self.call(tool, with(foreign)).await.expect("a tool result");
        let missing = self.call(tool, with(&random)).await.expect("a tool result");
        assert!(
            foreign_answer.is_error && missing.is_error,
            "{tool} refuses both"
        );
        assert_eq!(
            foreign_answer.text.replace(foreign, "<id>"),
            missing.text.replace(&random, "<id>"),
            "{tool}: another tenant's sandbox answers exactly like a missing one"
        );
        assert_eq!(
            foreign_answer.structured, missing.structured,
            "{tool}: same structured content"
        );
    }
}
