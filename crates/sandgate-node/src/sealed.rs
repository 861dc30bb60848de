//! Sealed checkpoints and restores over the node RPC (issue 26): the data key travels in the
//! request, is held in memory for the one call and zeroized after; the sealed bytes stream back
//! to the gateway (checkpoint) or from it (restore). The node keeps nothing of a snapshot: its
//! plaintext lives on the engine's tmpfs for the call, and its ciphertext only in flight.

use futures::stream::{BoxStream, StreamExt};
use sandgate_sandbox::{
    DataKey, Sandbox, SandboxError, SandboxManager, SealedHeader, SealedSnapshot, SnapshotAad,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tonic::Status;
use zeroize::Zeroize as _;

use crate::proto;
use crate::remote::RemoteNode;
use crate::status::to_status;

/// Bytes per message of a sealed stream on the wire.
const PIECE_BYTES: usize = 256 * 1024;
/// Messages in flight each way.
const IN_FLIGHT: usize = 4;

impl From<&SnapshotAad> for proto::SnapshotBinding {
    fn from(aad: &SnapshotAad) -> Self {
        Self {
            tenant_id: aad.tenant_id.clone(),
            sandbox_id: aad.sandbox_id.clone(),
            snapshot_id: aad.snapshot_id.clone(),
        }
    }
}

impl From<proto::SnapshotBinding> for SnapshotAad {
    fn from(b: proto::SnapshotBinding) -> Self {
        Self {
            tenant_id: b.tenant_id,
            sandbox_id: b.sandbox_id,
            snapshot_id: b.snapshot_id,
        }
    }
}

/// The data key and binding of a request; the request's copy of the key is zeroized.
fn key_and_binding(
    data_key: &mut Vec<u8>,
    binding: Option<proto::SnapshotBinding>,
) -> Result<(DataKey, SnapshotAad), Status> {
    let key = DataKey::from_slice(data_key);
    data_key.zeroize();
    let key = key.ok_or_else(|| Status::invalid_argument("a data key is 32 bytes"))?;
    let binding =
        binding.ok_or_else(|| Status::invalid_argument("the request binds no snapshot"))?;
    Ok((key, binding.into()))
}

/// Copies `reader` to the channel in pieces until its end.
async fn pump_out(
    mut reader: impl AsyncRead + Unpin,
    out: &mpsc::Sender<Result<proto::SealedOut, Status>>,
) {
    loop {
        let mut piece = vec![0u8; PIECE_BYTES];
        match reader.read(&mut piece).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                piece.truncate(n);
                let message = proto::SealedOut {
                    out: Some(proto::sealed_out::Out::Chunk(piece)),
                };
                if out.send(Ok(message)).await.is_err() {
                    // The gateway went away: dropping the reader fails the sealing.
                    return;
                }
            }
        }
    }
}

/// The node's side of `CheckpointSealed`: checkpoints and seals `sandbox`, streaming the sealed
/// bytes back, then what was sealed.
pub(crate) fn serve_checkpoint(
    manager: SandboxManager,
    sandbox: Sandbox,
    mut req: proto::CheckpointSealedRequest,
) -> Result<BoxStream<'static, Result<proto::SealedOut, Status>>, Status> {
    let (key, aad) = key_and_binding(&mut req.data_key, req.binding.take())?;
    let (sender, receiver) = mpsc::channel(IN_FLIGHT);
    tokio::spawn(async move {
        let (writer, reader) = tokio::io::duplex(PIECE_BYTES);
        let sealing = manager.checkpoint_sealed(&sandbox, req.leave_running, &key, &aad, writer);
        let (sealed, ()) = tokio::join!(sealing, pump_out(reader, &sender));
        drop(key);
        let last = sealed
            .map_err(|e| to_status(&e))
            .map(|info| proto::SealedOut {
                out: Some(proto::sealed_out::Out::Done(proto::SealedInfo {
                    header_json: serde_json::to_string(&info.header).expect("a header serializes"),
                    sealed_bytes: info.sealed_bytes,
                    chunks: info.chunks,
                })),
            });
        let _ = sender.send(last).await;
    });
    Ok(tokio_stream::wrappers::ReceiverStream::new(receiver).boxed())
}

/// The node's side of `RestoreSealed`: the request, then the sealed stream into a restore.
pub(crate) async fn serve_restore(
    manager: &SandboxManager,
    mut inputs: tonic::Streaming<proto::RestoreSealedInput>,
) -> Result<Sandbox, Status> {
    let first = inputs
        .message()
        .await?
        .and_then(|i| i.input)
        .ok_or_else(|| Status::invalid_argument("a restore's first message is its request"))?;
    let proto::restore_sealed_input::Input::Start(mut start) = first else {
        return Err(Status::invalid_argument(
            "a restore's first message is its request",
        ));
    };
    let (key, aad) = key_and_binding(&mut start.data_key, start.binding.take())?;
    let (mut writer, reader) = tokio::io::duplex(PIECE_BYTES);
    let pump = async move {
        // Ends the stream (EOF) when the gateway's does: a cut stream then fails to open.
        while let Ok(Some(input)) = inputs.message().await {
            let Some(proto::restore_sealed_input::Input::Chunk(piece)) = input.input else {
                break;
            };
            if writer.write_all(&piece).await.is_err() {
                break;
            }
        }
    };
    let (restored, ()) = tokio::join!(
        manager.restore_sealed(reader, &key, &aad, start.keep_sandbox_id),
        pump
    );
    drop(key);
    restored.map_err(|e| to_status(&e))
}

impl RemoteNode {
    /// Checkpoints the node's sandbox `sandbox` and seals it under `key`, bound to `aad`,
    /// writing the sealed stream to `out` (see [`SandboxManager::checkpoint_sealed`]).
    pub async fn checkpoint_sealed(
        &self,
        sandbox: proto::SandboxCall,
        leave_running: bool,
        key: &DataKey,
        aad: &SnapshotAad,
        mut out: impl AsyncWrite + Unpin,
    ) -> Result<SealedSnapshot, SandboxError> {
        let req = proto::CheckpointSealedRequest {
            sandbox: Some(sandbox),
            leave_running,
            data_key: key.expose().to_vec(),
            binding: Some(aad.into()),
        };
        let mut request = tonic::Request::new(req);
        request.set_timeout(crate::remote::CALL_DEADLINE);
        let mut stream = self
            .client()
            .checkpoint_sealed(request)
            .await
            .map_err(|s| self.error(&s))?
            .into_inner();
        let written = |source| SandboxError::Seal {
            snapshot_id: aad.snapshot_id.clone(),
            source: Box::new(sandgate_sandbox::SealError::Io {
                what: "writing the sealed snapshot",
                source,
            }),
        };
        while let Some(message) = stream.message().await.map_err(|s| self.error(&s))? {
            match message.out {
                Some(proto::sealed_out::Out::Chunk(piece)) => {
                    out.write_all(&piece).await.map_err(written)?;
                }
                Some(proto::sealed_out::Out::Done(info)) => {
                    out.flush().await.map_err(written)?;
                    let header: SealedHeader = serde_json::from_str(&info.header_json)
                        .map_err(|err| self.malformed(&format!("a sealed header ({err})")))?;
                    return Ok(SealedSnapshot {
                        header,
                        sealed_bytes: info.sealed_bytes,
                        chunks: info.chunks,
                    });
                }
                None => return Err(self.malformed("an empty message")),
            }
        }
        Err(self.malformed("a sealed stream without its end"))
    }

    /// Restores the sealed snapshot read from `sealed` on the node (see
    /// [`SandboxManager::restore_sealed`]).
    pub async fn restore_sealed(
        &self,
        mut sealed: impl AsyncRead + Unpin,
        key: &DataKey,
        aad: &SnapshotAad,
        keep_id: bool,
    ) -> Result<crate::RemoteSandbox, SandboxError> {
        let (sender, receiver) = mpsc::channel(IN_FLIGHT);
        let start = proto::RestoreSealedInput {
            input: Some(proto::restore_sealed_input::Input::Start(
                proto::RestoreSealedRequest {
                    data_key: key.expose().to_vec(),
                    binding: Some(aad.into()),
                    keep_sandbox_id: keep_id,
                },
            )),
        };
        sender.try_send(start).expect("an empty channel has room");
        let mut request =
            tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(receiver));
        request.set_timeout(crate::remote::CALL_DEADLINE);
        let pump = async move {
            loop {
                let mut piece = vec![0u8; PIECE_BYTES];
                match sealed.read(&mut piece).await {
                    Ok(0) => return Ok(()),
                    Ok(n) => {
                        piece.truncate(n);
                        let input = proto::RestoreSealedInput {
                            input: Some(proto::restore_sealed_input::Input::Chunk(piece)),
                        };
                        if sender.send(input).await.is_err() {
                            return Ok(());
                        }
                    }
                    // Dropping the sender cuts the stream short: the node refuses it.
                    Err(err) => return Err(err),
                }
            }
        };
        let mut client = self.client();
        let (answer, pumped) = tokio::join!(client.restore_sealed(request), pump);
        let sandbox = answer.map_err(|s| self.error(&s))?.into_inner();
        pumped.map_err(|source| SandboxError::Seal {
            snapshot_id: aad.snapshot_id.clone(),
            source: Box::new(sandgate_sandbox::SealError::Io {
                what: "reading the sealed snapshot",
                source,
            }),
        })?;
        Ok(self.sandbox(sandbox))
    }

    fn malformed(&self, what: &str) -> SandboxError {
        SandboxError::NodeFailed {
            node: self.url().to_owned(),
            incident: format!("none: the node sent {what}"),
            starting: false,
        }
    }
}
