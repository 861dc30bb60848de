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
        let mut read = FileRead::start(self, path, max_bytes).await?;
        let mut content = Vec::new();
        while let Some(piece) = read.next_chunk().await {
            content.extend_from_slice(&piece?);
        }
        let info = read.info.take().ok_or_else(|| ChannelError::Protocol {
            detail: "read_file ended without its result".into(),
        })?;
        Ok((content, info))
    }

    /// Reads a file under /home/user chunk by chunk, as the agent sends them, holding at most
    /// one chunk and the call's queue in memory: for a download streamed to an HTTP body.
    /// Returns the first chunk (empty for an empty file; enough to sniff a MIME type) once it
    /// has arrived, so that a refusal (missing, too large, a directory) comes back here as an
    /// error; then the rest. The stream checks the agent's checksum at its end and yields an
    /// error instead of ending cleanly when it does not match. Dropping the stream abandons
    /// the read.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn read_file_stream(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<(Bytes, FileChunks), ChannelError> {
        let mut read = FileRead::start(self, path, max_bytes).await?;
        let first = match read.next_chunk().await {
            Some(first) => first?,
            None => Bytes::new(),
        };
        let rest = futures::stream::unfold(read, |mut read| async move {
            read.next_chunk().await.map(|chunk| (chunk, read))
        });
        Ok((first, rest.fuse().boxed()))
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

/// The chunks of a file being read ([`AgentChannel::read_file_stream`]).
pub type FileChunks = BoxStream<'static, Result<Bytes, ChannelError>>;

/// One `read_file` call in progress: chunks as they come, the checksum kept along.
struct FileRead {
    call: Call,
    stall: Duration,
    max_bytes: u64,
    received: u64,
    hasher: Sha256,
    /// The agent's final answer, once checked.
    info: Option<FileInfo>,
    done: bool,
}

impl FileRead {
    async fn start(
        channel: &AgentChannel,
        path: &str,
        max_bytes: u64,
    ) -> Result<Self, ChannelError> {
        let call = channel
            .start("read_file", json!({"path": path, "max_bytes": max_bytes}))
            .await?;
        Ok(Self {
            call,
            stall: channel.inner.config.call_timeout,
            max_bytes,
            received: 0,
            hasher: Sha256::new(),
            info: None,
            done: false,
        })
    }

    /// The next chunk; `None` once the agent's checked final answer arrived (then in `info`) or
    /// after an error was returned.
    async fn next_chunk(&mut self) -> Option<Result<Bytes, ChannelError>> {
        if self.done {
            return None;
        }
        let next = self.step().await;
        if !matches!(next, Some(Ok(_))) {
            self.done = true;
        }
        next
    }

    async fn step(&mut self) -> Option<Result<Bytes, ChannelError>> {
        loop {
            let delivery = match tokio::time::timeout(self.stall, self.call.next()).await {
                Err(_) => {
                    return Some(Err(ChannelError::Unresponsive {
                        op: "read_file",
                        waited: self.stall,
                    }));
                }
                Ok(Err(err)) => return Some(Err(err)),
                Ok(Ok(delivery)) => delivery,
            };
            match delivery {
                Delivery::Event { event, frame } if event == "chunk" => {
                    return Some(self.chunk(&frame));
                }
                Delivery::Event { event, .. } => {
                    tracing::debug!(event, "unexpected read_file event ignored");
                }
                Delivery::Oversized { len, .. } => {
                    return Some(Err(ChannelError::FrameTooLarge {
                        len,
                        limit: MAX_FRAME_BYTES,
                    }));
                }
                Delivery::Final(outcome) => return self.finish(outcome).err().map(Err),
            }
        }
    }

    fn chunk(&mut self, frame: &Map<String, Value>) -> Result<Bytes, ChannelError> {
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
        if self.received + piece.len() as u64 > self.max_bytes {
            return Err(ChannelError::Protocol {
                detail: format!(
                    "the agent sent more than the {} bytes asked for",
                    self.max_bytes
                ),
            });
        }
        self.received += piece.len() as u64;
        self.hasher.update(&piece);
        Ok(Bytes::from(piece))
    }

    fn finish(&mut self, outcome: Result<Value, WireError>) -> Result<(), ChannelError> {
        let result = outcome.map_err(|e| AgentError::from_wire(e, self.max_bytes))?;
        let info: FileInfo = decode("read_file", result)?;
        let sha256 = hex::encode(std::mem::take(&mut self.hasher).finalize());
        if info.size != self.received || info.sha256 != sha256 {
            return Err(ChannelError::TransferCorrupted {
                path: info.path,
                detail: format!(
                    "received {} bytes with sha256 {sha256}, the sandbox announced {} bytes with sha256 {}",
                    self.received, info.size, info.sha256
                ),
            });
        }
        self.info = Some(info);
        Ok(())
    }
}
