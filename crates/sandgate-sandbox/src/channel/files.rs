//! File transfer and listing.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

impl AgentChannel {
    /// Writes `data` to `path` under /home/user (parents created), in chunks of at most 256 KiB.
    /// The agent's checksum is compared with the gateway's.
    pub async fn write_file(
        &self,
        path: &str,
        data: &[u8],
        overwrite: bool,
    ) -> Result<FileInfo, ChannelError> {
        let mut call = self
            .start(
                "write_file",
                json!({"path": path, "overwrite": overwrite, "size": data.len()}),
            )
            .await?;
        let mut hasher = Sha256::new();
        let mut chunks = data.chunks(CHUNK_BYTES).peekable();
        if chunks.peek().is_none() {
            self.send(protocol::chunk_line(call.id, "", true)).await?;
        }
        while let Some(chunk) = chunks.next() {
            // A refusal (`exists`, `outside_home`) arrives before any data is needed: stop sending.
            if let Ok(delivery) = call.rx.try_recv() {
                if let Delivery::Final(Err(err)) = delivery {
                    return Err(AgentError::from_wire(err, 0).into());
                }
                return Err(ChannelError::Protocol {
                    detail: "write_file answered before its last chunk".into(),
                });
            }
            hasher.update(chunk);
            let last = chunks.peek().is_none();
            self.send(protocol::chunk_line(call.id, &BASE64.encode(chunk), last))
                .await?;
        }
        let result = call
            .finish("write_file", self.inner.config.call_timeout)
            .await?;
        let info: FileInfo = decode("write_file", result)?;
        let sha256 = hex::encode(hasher.finalize());
        if info.size != data.len() as u64 || info.sha256 != sha256 {
            return Err(ChannelError::TransferCorrupted {
                path: info.path,
                detail: format!(
                    "sent {} bytes with sha256 {sha256}, the sandbox stored {} bytes with sha256 {}",
                    data.len(),
                    info.size,
                    info.sha256
                ),
            });
        }
        Ok(info)
    }

    /// Reads a file under /home/user; refused with [`AgentError::TooLarge`] when it is larger than
    /// `max_bytes`. The content is checked against the agent's checksum.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn read_file(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, FileInfo), ChannelError> {
        let mut call = self
            .start("read_file", json!({"path": path, "max_bytes": max_bytes}))
            .await?;
        let stall = self.inner.config.call_timeout;
        let mut content = Vec::new();
        let mut hasher = Sha256::new();
        loop {
            let delivery = tokio::time::timeout(stall, call.next())
                .await
                .map_err(|_| ChannelError::Unresponsive {
                    op: "read_file",
                    waited: stall,
                })??;
            match delivery {
                Delivery::Event { event, frame } if event == "chunk" => {
                    let piece = frame
                        .get("data")
                        .and_then(Value::as_str)
                        .map(|b64| BASE64.decode(b64))
                        .ok_or_else(|| ChannelError::Protocol {
                            detail: "chunk without data".into(),
                        })?
                        .map_err(|e| ChannelError::Protocol {
                            detail: format!("chunk is not base64: {e}"),
                        })?;
                    if (content.len() + piece.len()) as u64 > max_bytes {
                        return Err(ChannelError::Protocol {
                            detail: format!(
                                "the agent sent more than the {max_bytes} bytes asked for"
                            ),
                        });
                    }
                    hasher.update(&piece);
                    content.extend_from_slice(&piece);
                }
                Delivery::Event { event, .. } => {
                    tracing::debug!(event, "unexpected read_file event ignored");
                }
                Delivery::Oversized { len, .. } => {
                    return Err(ChannelError::FrameTooLarge {
                        len,
                        limit: MAX_FRAME_BYTES,
                    });
                }
                Delivery::Final(outcome) => {
                    let result = outcome.map_err(|e| AgentError::from_wire(e, max_bytes))?;
                    let info: FileInfo = decode("read_file", result)?;
                    let sha256 = hex::encode(hasher.finalize());
                    if info.size != content.len() as u64 || info.sha256 != sha256 {
                        return Err(ChannelError::TransferCorrupted {
                            path: info.path,
                            detail: format!(
                                "received {} bytes with sha256 {sha256}, the sandbox announced {} bytes with sha256 {}",
                                content.len(),
                                info.size,
                                info.sha256
                            ),
                        });
                    }
                    return Ok((content, info));
                }
            }
        }
    }

    /// Lists a directory under /home/user (`""` or `"."` for the home itself), sorted by name.
    pub async fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>, ChannelError> {
        Ok(self.list(path).await?.entries)
    }

    /// Lists a directory under /home/user with the space used and left there.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn list(&self, path: &str) -> Result<Listing, ChannelError> {
        let path = if path.is_empty() { "." } else { path };
        let mut call = self.start("list_dir", json!({"path": path})).await?;
        let result = call
            .finish("list_dir", self.inner.config.call_timeout)
            .await?;
        decode("list_dir", result)
    }
}
