//! Between the sandbox crate's types and the RPC's messages, both ways. Lossless for everything
//! a gateway shows to a model.

use std::time::Duration;

use sandgate_sandbox as sb;

use crate::proto;

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl From<&sb::ContainerFate> for proto::ContainerFate {
    fn from(fate: &sb::ContainerFate) -> Self {
        use proto::container_fate::Fate;
        let fate = match fate {
            sb::ContainerFate::Running => Fate::Running(proto::Empty {}),
            sb::ContainerFate::OomKilled { memory_limit_bytes } => {
                Fate::OomKilled(proto::OomKilled {
                    memory_limit_bytes: *memory_limit_bytes,
                })
            }
            sb::ContainerFate::Exited { code } => Fate::Exited(*code),
            sb::ContainerFate::Missing => Fate::Missing(proto::Empty {}),
        };
        Self { fate: Some(fate) }
    }
}

impl From<proto::ContainerFate> for sb::ContainerFate {
    fn from(fate: proto::ContainerFate) -> Self {
        use proto::container_fate::Fate;
        match fate.fate {
            Some(Fate::Running(_)) => Self::Running,
            Some(Fate::OomKilled(o)) => Self::OomKilled {
                memory_limit_bytes: o.memory_limit_bytes,
            },
            Some(Fate::Exited(code)) => Self::Exited { code },
            Some(Fate::Missing(_)) | None => Self::Missing,
        }
    }
}

impl From<sb::Display> for proto::Display {
    fn from(d: sb::Display) -> Self {
        Self {
            png: d.png,
            data: d.data.into_iter().collect(),
            path: d.path,
        }
    }
}

impl From<proto::Display> for sb::Display {
    fn from(d: proto::Display) -> Self {
        Self {
            png: d.png,
            data: d.data.into_iter().collect(),
            path: d.path,
        }
    }
}

impl From<sb::OutputEvent> for proto::OutputEvent {
    fn from(e: sb::OutputEvent) -> Self {
        use proto::output_event::Event;
        let event = match e {
            sb::OutputEvent::Stdout(s) => Event::Stdout(s),
            sb::OutputEvent::Stderr(s) => Event::Stderr(s),
            sb::OutputEvent::Display(d) => Event::Display(d.into()),
        };
        Self { event: Some(event) }
    }
}

impl proto::OutputEvent {
    /// The event, unless the message was empty.
    pub(crate) fn into_event(self) -> Option<sb::OutputEvent> {
        use proto::output_event::Event;
        Some(match self.event? {
            Event::Stdout(s) => sb::OutputEvent::Stdout(s),
            Event::Stderr(s) => sb::OutputEvent::Stderr(s),
            Event::Display(d) => sb::OutputEvent::Display(d.into()),
        })
    }
}

impl From<sb::ExecOutcome> for proto::ExecOutcome {
    fn from(o: sb::ExecOutcome) -> Self {
        Self {
            stdout: o.stdout,
            stderr: o.stderr,
            result: o.result.map(|data| proto::MimeBundle {
                data: data.into_iter().collect(),
            }),
            error: o.error.map(|e| proto::CellError {
                name: e.name,
                value: e.value,
                traceback: e.traceback,
            }),
            execution_count: o.execution_count,
            displays: o.displays.into_iter().map(Into::into).collect(),
            truncated: o.truncated,
            timed_out: o.timed_out,
            state_lost: o.state_lost,
            state_lost_reason: o.state_lost_reason,
            duration_ms: ms(o.duration),
        }
    }
}

impl From<proto::ExecOutcome> for sb::ExecOutcome {
    fn from(o: proto::ExecOutcome) -> Self {
        Self {
            stdout: o.stdout,
            stderr: o.stderr,
            result: o.result.map(|b| b.data.into_iter().collect()),
            error: o.error.map(|e| sb::CellError {
                name: e.name,
                value: e.value,
                traceback: e.traceback,
            }),
            execution_count: o.execution_count,
            displays: o.displays.into_iter().map(Into::into).collect(),
            truncated: o.truncated,
            timed_out: o.timed_out,
            state_lost: o.state_lost,
            state_lost_reason: o.state_lost_reason,
            duration: Duration::from_millis(o.duration_ms),
        }
    }
}

impl From<sb::CommandOutcome> for proto::CommandOutcome {
    fn from(o: sb::CommandOutcome) -> Self {
        Self {
            stdout: o.stdout,
            stderr: o.stderr,
            exit_code: o.exit_code,
            signal: o.signal,
            timed_out: o.timed_out,
            truncated: o.truncated,
            duration_ms: ms(o.duration),
        }
    }
}

impl From<proto::CommandOutcome> for sb::CommandOutcome {
    fn from(o: proto::CommandOutcome) -> Self {
        Self {
            stdout: o.stdout,
            stderr: o.stderr,
            exit_code: o.exit_code,
            signal: o.signal,
            timed_out: o.timed_out,
            truncated: o.truncated,
            duration: Duration::from_millis(o.duration_ms),
        }
    }
}

impl From<sb::Space> for proto::Space {
    fn from(s: sb::Space) -> Self {
        Self {
            total: s.total,
            used: s.used,
            free: s.free,
        }
    }
}

impl From<proto::Space> for sb::Space {
    fn from(s: proto::Space) -> Self {
        Self {
            total: s.total,
            used: s.used,
            free: s.free,
        }
    }
}

impl From<sb::FileInfo> for proto::FileInfo {
    fn from(f: sb::FileInfo) -> Self {
        Self {
            path: f.path,
            size: f.size,
            sha256: f.sha256,
            space: f.space.map(Into::into),
        }
    }
}

impl From<proto::FileInfo> for sb::FileInfo {
    fn from(f: proto::FileInfo) -> Self {
        Self {
            path: f.path,
            size: f.size,
            sha256: f.sha256,
            space: f.space.map(Into::into),
        }
    }
}

impl From<sb::DirEntry> for proto::DirEntry {
    fn from(e: sb::DirEntry) -> Self {
        let kind = match e.kind {
            sb::EntryKind::File => proto::EntryKind::File,
            sb::EntryKind::Dir => proto::EntryKind::Dir,
            sb::EntryKind::Symlink => proto::EntryKind::Symlink,
            sb::EntryKind::Other => proto::EntryKind::Other,
        };
        Self {
            name: e.name,
            kind: kind.into(),
            size: e.size,
            modified: e.modified,
        }
    }
}

impl From<proto::DirEntry> for sb::DirEntry {
    fn from(e: proto::DirEntry) -> Self {
        let kind = match proto::EntryKind::try_from(e.kind).unwrap_or(proto::EntryKind::Other) {
            proto::EntryKind::File => sb::EntryKind::File,
            proto::EntryKind::Dir => sb::EntryKind::Dir,
            proto::EntryKind::Symlink => sb::EntryKind::Symlink,
            proto::EntryKind::Other => sb::EntryKind::Other,
        };
        Self {
            name: e.name,
            kind,
            size: e.size,
            modified: e.modified,
        }
    }
}

impl From<sb::Listing> for proto::Listing {
    fn from(l: sb::Listing) -> Self {
        Self {
            entries: l.entries.into_iter().map(Into::into).collect(),
            space: l.space.map(Into::into),
        }
    }
}

impl From<proto::Listing> for sb::Listing {
    fn from(l: proto::Listing) -> Self {
        Self {
            entries: l.entries.into_iter().map(Into::into).collect(),
            space: l.space.map(Into::into),
        }
    }
}

impl From<sb::Job> for proto::Job {
    fn from(j: sb::Job) -> Self {
        Self {
            id: j.id,
            pid: j.pid,
            command: j.command,
            log: j.log,
            started: j.started,
            running: j.running,
            exit_code: j.exit_code,
            signal: j.signal,
        }
    }
}

impl From<proto::Job> for sb::Job {
    fn from(j: proto::Job) -> Self {
        Self {
            id: j.id,
            pid: j.pid,
            command: j.command,
            log: j.log,
            started: j.started,
            running: j.running,
            exit_code: j.exit_code,
            signal: j.signal,
        }
    }
}

impl From<sb::PingInfo> for proto::PingInfo {
    fn from(p: sb::PingInfo) -> Self {
        Self {
            pid: p.pid,
            busy: p.busy,
            kernel_pid: p.kernel_pid,
        }
    }
}

impl From<proto::PingInfo> for sb::PingInfo {
    fn from(p: proto::PingInfo) -> Self {
        Self {
            pid: p.pid,
            busy: p.busy,
            kernel_pid: p.kernel_pid,
        }
    }
}

impl From<sb::PoolStats> for proto::PoolStatsReply {
    fn from(s: sb::PoolStats) -> Self {
        Self {
            known: true,
            ready: s.ready as u64,
            starting: s.starting as u64,
            cold_starting: s.cold_starting as u64,
            target: s.target as u64,
            start_limit: s.start_limit as u64,
            start_time_ms: ms(s.start_time),
            lease_rate: s.lease_rate,
        }
    }
}

impl proto::PoolStatsReply {
    /// The pool's numbers, unless the node has no pool for the profile.
    pub(crate) fn into_stats(self) -> Option<sb::PoolStats> {
        let n = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        self.known.then(|| sb::PoolStats {
            ready: n(self.ready),
            starting: n(self.starting),
            cold_starting: n(self.cold_starting),
            target: n(self.target),
            start_limit: n(self.start_limit),
            start_time: Duration::from_millis(self.start_time_ms),
            lease_rate: self.lease_rate,
        })
    }
}

impl From<sb::EgressEnvInfo> for proto::EgressEnvReply {
    fn from(i: sb::EgressEnvInfo) -> Self {
        Self {
            proxy: i.proxy,
            port: i.port.map(u32::from),
            kernel_applied: i.kernel_applied,
            placeholders: i.placeholders,
        }
    }
}

impl From<proto::EgressEnvReply> for sb::EgressEnvInfo {
    fn from(r: proto::EgressEnvReply) -> Self {
        Self {
            proxy: r.proxy,
            port: r.port.and_then(|p| u16::try_from(p).ok()),
            kernel_applied: r.kernel_applied,
            placeholders: r.placeholders,
        }
    }
}

impl From<proto::SetEgressEnvRequest> for sb::EgressEnv {
    fn from(r: proto::SetEgressEnvRequest) -> Self {
        Self {
            proxy: r.proxy,
            ca_pem: r.ca_pem,
            placeholders: r.placeholders.into_iter().collect(),
        }
    }
}
