//! What a person does in a conversation's sandbox from the console: run a cell or a command
//! (its output streamed back as server-sent events on the POST's answer), interrupt the
//! sandbox's running calls, upload a file, confirm their password. Each goes through the
//! service's operations as a tool call would (admission under the tenant's quotas, the audit
//! trail under `user:<email>`, the transcript entry naming the person).
//!
//! Every action checks, in order: a session (else the login page), the request's origin and
//! the session's CSRF token (else "form expired"), the conversation is the tenant's (else the
//! missing-conversation page, the same as for one that does not exist), the takeover role and
//! a recent sign-in.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Form, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use chrono::Utc;
use sandgate_service::audit::{AuditEvent, Outcome};
use sandgate_service::domain::OutputEvent;
use sandgate_service::grants::Session;
use sandgate_service::sandboxes::{Caller, CommandLine, RunLimits, ServiceError, Target};
use serde::Deserialize;
use tokio::sync::mpsc;

use super::pages::{Found, Read, conversation_url, find};
use super::{error_page, refusal_to_act, same_origin, signed_in, unavailable};
use crate::AppState;
use crate::oauth::html::see_other;
use crate::oauth::ratelimit::ClientAddress;
use crate::oauth::session;

/// What a person runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Cell,
    Command,
}

/// The run form.
#[derive(Debug, Deserialize)]
pub struct RunForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    conversation: String,
    #[serde(default)]
    kind: String,
    #[serde(default)]
    code: String,
}

/// The checks every action makes before it acts (see the module docs): the session and what
/// the console knows of the conversation.
pub(super) async fn admitted(
    state: &AppState,
    headers: &HeaderMap,
    csrf: Option<&str>,
    conversation: &str,
) -> Result<(Session, Found), Response> {
    let here = conversation_url(conversation);
    let session = signed_in(state, headers, &here).await?;
    if !same_origin(state, headers) || !session::csrf_ok(&session, csrf) {
        return Err(session::form_expired());
    }
    let found = find(state, &session, conversation.trim(), Read::Existence).await?;
    Ok((session, found))
}

/// The checks of an action that changes the sandbox: [`admitted`]'s, then the takeover role
/// and a recent sign-in ([`refusal_to_act`]).
pub(super) async fn acting(
    state: &AppState,
    headers: &HeaderMap,
    csrf: Option<&str>,
    conversation: &str,
) -> Result<(Session, Found), Response> {
    let (session, found) = admitted(state, headers, csrf, conversation).await?;
    match refusal_to_act(&session) {
        Some(refusal) => Err(refusal),
        None => Ok((session, found)),
    }
}

/// `POST /console/run`: runs the form's cell or command in the conversation's sandbox (its
/// live one, else a new one leased for it), answering with `text/event-stream`: `stdout`,
/// `stderr` and `display` (a base64 PNG) events as the output comes, then `done`.
pub async fn run(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<RunForm>,
) -> Response {
    let conversation = form.conversation.trim().to_owned();
    let (session, found) = match acting(&state, &headers, form.csrf.as_deref(), &conversation).await
    {
        Ok(ok) => ok,
        Err(r) => return r,
    };
    let kind = match form.kind.as_str() {
        "cell" => Kind::Cell,
        "command" => Kind::Command,
        _ => return bad_request("Choose a Python cell or a shell command."),
    };
    if form.code.trim().is_empty() {
        return bad_request("Nothing to run: write a cell or a command first.");
    }
    let caller = match person(&state, &session).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let permit = match state.sandboxes.admit(&caller).await {
        Ok(p) => p,
        Err(err) => return refused(&err),
    };
    // Within the connection's idle timeout (validated longer than this), as /mcp's streams.
    let keep_alive = Duration::from_secs(state.config.mcp.sse_keep_alive_seconds.max(1));
    let (events, stream) = mpsc::channel::<Event>(64);
    let live = found.live.map(|row| row.id);
    tokio::spawn(async move {
        let job = Job {
            state,
            caller,
            conversation,
            live,
            events,
        };
        job.run(kind, &form.code).await;
        drop(permit);
    });
    let stream = futures::stream::unfold(stream, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

/// A person's run, behind the streamed answer.
struct Job {
    state: AppState,
    caller: Caller,
    conversation: String,
    live: Option<String>,
    events: mpsc::Sender<Event>,
}

impl Job {
    /// Runs the cell or command to its end (whether or not the browser still listens), then
    /// says how it ended, and audits it.
    async fn run(self, kind: Kind, code: &str) {
        let started = Instant::now();
        let (output, forward) = self.forwarder();
        let target = Target {
            sandbox_id: self.live.as_deref(),
            conversation: Some(&self.conversation),
            keep_alive: None,
        };
        let limits = self.limits();
        let service = &self.state.sandboxes;
        let transcripts = &self.state.transcripts;
        let (tool, ran) = match kind {
            Kind::Cell => {
                let ran = service
                    .run_cell(
                        &self.caller,
                        target,
                        transcripts,
                        code,
                        limits,
                        Some(output),
                    )
                    .await;
                let ran = ran.map(|(r, o)| (r.row.id.clone(), cell_summary(&o)));
                ("console_execute_code", ran)
            }
            Kind::Command => {
                let line = CommandLine {
                    command: code,
                    cwd: None,
                };
                let ran = service
                    .run_command(
                        &self.caller,
                        target,
                        transcripts,
                        line,
                        limits,
                        Some(output),
                    )
                    .await;
                let ran = ran.map(|(r, o)| (r.row.id.clone(), command_summary(&o)));
                ("console_run_command", ran)
            }
        };
        let _ = forward.await;
        let (sandbox, outcome, done) = match ran {
            Ok((sandbox, (outcome, text))) => (Some(sandbox), outcome, text),
            Err(err) => (self.live.clone(), Outcome::Failed, err.public_message()),
        };
        let _ = self
            .events
            .send(Event::default().event("done").data(done))
            .await;
        self.audit(tool, sandbox, outcome, started.elapsed());
    }

    /// Where the call's output goes: each event forwarded to the stream as it comes.
    fn forwarder(&self) -> (mpsc::Sender<OutputEvent>, tokio::task::JoinHandle<()>) {
        let (output, mut rx) = mpsc::channel::<OutputEvent>(64);
        let events = self.events.clone();
        let forward = tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                let event = match event {
                    OutputEvent::Stdout(text) => Event::default().event("stdout").data(text),
                    OutputEvent::Stderr(text) => Event::default().event("stderr").data(text),
                    OutputEvent::Display(display) => match display.png {
                        Some(png) => Event::default()
                            .event("display")
                            .data(base64::engine::general_purpose::STANDARD.encode(png)),
                        None => continue,
                    },
                };
                // The browser went away: the call still runs to its end.
                let _ = events.send(event).await;
            }
        });
        (output, forward)
    }

    fn limits(&self) -> RunLimits {
        let limits = &self.state.config.limits;
        RunLimits {
            timeout: Duration::from_secs(u64::from(limits.max_call_timeout_seconds)),
            output_limit: limits.output_limit_bytes,
        }
    }

    fn audit(&self, tool: &str, sandbox: Option<String>, outcome: Outcome, took: Duration) {
        audit(
            &self.state,
            &self.caller,
            &self.conversation,
            tool,
            sandbox,
            outcome,
            took,
        );
    }
}

/// Records a person's action in the audit trail, under `user:<email>`.
pub(super) fn audit(
    state: &AppState,
    caller: &Caller,
    conversation: &str,
    tool: &str,
    sandbox: Option<String>,
    outcome: Outcome,
    took: Duration,
) {
    state.audit.record(AuditEvent {
        at: Utc::now(),
        tenant_id: caller.tenant,
        token_id: Some(caller.token_id.clone()),
        subject: Some(caller.subject.clone()),
        conversation_id: Some(conversation.to_owned()),
        sandbox_id: sandbox,
        tool: tool.to_owned(),
        outcome,
        error_kind: None,
        duration_ms: i32::try_from(took.as_millis()).unwrap_or(i32::MAX),
    });
}

/// How a cell ended, for the audit trail and the `done` event.
fn cell_summary(outcome: &sandgate_service::domain::ExecOutcome) -> (Outcome, String) {
    match &outcome.error {
        Some(e) => (Outcome::UserError, format!("{}: {}", e.name, e.value)),
        None if outcome.timed_out => (Outcome::UserError, "interrupted at its timeout".into()),
        None => (
            Outcome::Ok,
            format!("finished in {} ms", outcome.duration.as_millis()),
        ),
    }
}

/// How a command ended, for the audit trail and the `done` event.
fn command_summary(outcome: &sandgate_service::domain::CommandOutcome) -> (Outcome, String) {
    match (outcome.exit_code, outcome.signal) {
        (Some(0), _) => (Outcome::Ok, "exit code 0".into()),
        (Some(code), _) => (Outcome::UserError, format!("exit code {code}")),
        (None, Some(sig)) => (Outcome::UserError, format!("killed by signal {sig}")),
        (None, None) => (Outcome::UserError, "no exit code".into()),
    }
}

pub(super) async fn person(state: &AppState, session: &Session) -> Result<Caller, Response> {
    state
        .sandboxes
        .person_caller(session.tenant_id, session.user_id, &session.email)
        .await
        .map_err(|_| unavailable())
}

pub(super) fn bad_request(message: &str) -> Response {
    error_page(StatusCode::BAD_REQUEST, "Cannot do that", message)
}

/// A refusal by the service (a quota, a limit, an ended sandbox), as a page.
pub(super) fn refused(err: &ServiceError) -> Response {
    let status = match err.kind() {
        sandgate_service::ErrorKind::QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
        sandgate_service::ErrorKind::Unavailable | sandgate_service::ErrorKind::Internal => {
            return unavailable();
        }
        _ => StatusCode::CONFLICT,
    };
    error_page(status, "Refused", &err.public_message())
}

/// The interrupt form.
#[derive(Debug, Deserialize)]
pub struct InterruptForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    conversation: String,
}

/// `POST /console/interrupt`: interrupts every running call of the conversation's live sandbox
/// (the bot's too: its result then says a person interrupted it).
pub async fn interrupt(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<InterruptForm>,
) -> Response {
    let conversation = form.conversation.trim().to_owned();
    let (session, found) = match acting(&state, &headers, form.csrf.as_deref(), &conversation).await
    {
        Ok(ok) => ok,
        Err(r) => return r,
    };
    let Some(row) = found.live else {
        return see_other(&conversation_url(&conversation));
    };
    let started = Instant::now();
    let caller = match person(&state, &session).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    match state
        .sandboxes
        .interrupt_calls(session.tenant_id, &row.id, &session.email)
        .await
    {
        Ok(_) => {
            let took = started.elapsed();
            audit(
                &state,
                &caller,
                &conversation,
                "console_interrupt",
                Some(row.id),
                Outcome::Ok,
                took,
            );
            see_other(&conversation_url(&conversation))
        }
        Err(err) => refused(&err),
    }
}

/// The upload's query.
#[derive(Debug, Deserialize)]
pub struct UploadQuery {
    #[serde(default)]
    conversation: String,
    #[serde(default)]
    name: String,
}

/// `POST /console/upload?conversation=…&name=…`: the body becomes `/home/user/<name>` in the
/// conversation's sandbox (replacing a file of that name). The CSRF token comes in the
/// `x-sandgate-csrf` header (the page's script sends the file as the body).
pub async fn upload(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(query): Query<UploadQuery>,
    body: Bytes,
) -> Response {
    let csrf = headers
        .get("x-sandgate-csrf")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let conversation = query.conversation.trim().to_owned();
    let (session, found) = match acting(&state, &headers, csrf.as_deref(), &conversation).await {
        Ok(ok) => ok,
        Err(r) => return r,
    };
    let name = query.name.trim();
    if name.is_empty() || name.contains('/') || name.starts_with('.') || name.len() > 255 {
        return bad_request("Give the file a plain name (no slashes, not starting with a dot).");
    }
    let caller = match person(&state, &session).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let permit = match state.sandboxes.admit(&caller).await {
        Ok(p) => p,
        Err(err) => return refused(&err),
    };
    let started = Instant::now();
    let live = found.live.as_ref().map(|r| r.id.as_str());
    let target = Target {
        sandbox_id: live,
        conversation: Some(&conversation),
        keep_alive: None,
    };
    let path = format!("/home/user/{name}");
    let uploaded = state
        .sandboxes
        .upload_file(&caller, target, &path, &body, true)
        .await;
    drop(permit);
    match uploaded {
        Ok((resolved, info)) => {
            let mut entry = sandgate_service::transcripts::file_entry(&info, false);
            entry.set_by(&session.email);
            state.transcripts.record(&resolved.row, entry);
            let took = started.elapsed();
            let sandbox = Some(resolved.row.id.clone());
            audit(
                &state,
                &caller,
                &conversation,
                "console_upload_file",
                sandbox,
                Outcome::Ok,
                took,
            );
            see_other(&conversation_url(&conversation))
        }
        Err(err) => refused(&err),
    }
}

/// The password confirmation form.
#[derive(Debug, Deserialize)]
pub struct ConfirmForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    conversation: String,
    #[serde(default)]
    password: String,
}

/// `POST /console/confirm`: checks the password again (under the sign-in limits), so the
/// session may run code for [`super::RECENT_SIGN_IN`]; back to the conversation.
pub async fn confirm(
    State(state): State<AppState>,
    extensions: axum::http::Extensions,
    headers: HeaderMap,
    Form(form): Form<ConfirmForm>,
) -> Response {
    let conversation = form.conversation.trim().to_owned();
    let (session, _) = match admitted(&state, &headers, form.csrf.as_deref(), &conversation).await {
        Ok(ok) => ok,
        Err(r) => return r,
    };
    reconfirmed(
        &state,
        &extensions,
        &headers,
        &session,
        form.password,
        &conversation_url(&conversation),
    )
    .await
}

/// Checks `session`'s password again (under the sign-in limits) and sends the browser `back`,
/// or says why not.
pub(super) async fn reconfirmed(
    state: &AppState,
    extensions: &axum::http::Extensions,
    headers: &HeaderMap,
    session: &Session,
    password: String,
    back: &str,
) -> Response {
    let peer = extensions
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0);
    let address = ClientAddress::resolve(peer, headers, &state.config.http.client_address_header);
    let app = state.oauth_app();
    match session::reconfirm(&app, headers, address, session, password).await {
        Ok(()) => see_other(back),
        Err(session::Unconfirmed::Wrong) => error_page(
            StatusCode::UNAUTHORIZED,
            "Wrong password",
            "That is not your password. Go back and try again.",
        ),
        Err(session::Unconfirmed::Limited(limited)) => {
            let mut response =
                error_page(limited.status(), "Too many attempts", &limited.message());
            limited.stamp(&mut response);
            response
        }
        Err(session::Unconfirmed::Unavailable) => unavailable(),
    }
}
