//! The wire format of the sandbox agent protocol, version 2 (`agent/PROTOCOL.md`).
//!
//! Newline-delimited JSON in both directions. This module turns the agent's byte stream into
//! [`Inbound`] frames (bounded: no line is buffered beyond [`MAX_FRAME_BYTES`]) and builds request
//! lines. It knows nothing of requests in flight; [`crate::channel`] does the matching.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::{Map, Value};

/// The protocol version this gateway speaks; the agent's ready frame must name it.
pub const PROTOCOL_VERSION: u64 = 2;

/// Largest frame (one line) the gateway accepts from an agent. Legitimate frames are far smaller (a
/// file chunk is ~350 KB of base64, an output event at most 1 MiB); a longer one is dropped without
/// being buffered so that a misbehaving agent cannot make the gateway hold arbitrary amounts.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// Raw bytes per `chunk` frame of a file upload (PROTOCOL.md, `write_file`: ≤ 256 KiB).
pub const CHUNK_BYTES: usize = 256 * 1024;

/// The agent's start-up frame: it is ready to serve requests.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ReadyInfo {
    /// Protocol version the agent speaks.
    pub protocol: u64,
    /// The agent's process id inside the container.
    pub pid: u64,
    /// The process id of the kernel (the separate process that runs cells).
    #[serde(default)]
    pub kernel_pid: Option<u64>,
    /// Whether user code runs under another uid than the agent (always in a container; not when
    /// the agent is tested on a host).
    #[serde(default)]
    pub isolated: bool,
    /// Python version, e.g. `3.11.2`.
    #[serde(default)]
    pub python: String,
    /// Whether IPython is on the kernel's path (cells run in it unless it fails to load).
    #[serde(default)]
    pub ipython: bool,
    /// Modules of the data stack found on the path, being imported in the background.
    #[serde(default)]
    pub preloaded: Vec<String>,
}

/// An error answer of the agent: `{"kind", "message"}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct WireError {
    /// Machine-readable kind (`not_found`, `outside_home`, …).
    pub kind: String,
    /// Human text written by the agent.
    #[serde(default)]
    pub message: String,
}

/// One frame read from the agent.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    /// The agent started and is ready.
    Ready(ReadyInfo),
    /// An event of a running request (`stdout`, `stderr`, `display`, `chunk`).
    Event {
        /// The request it belongs to.
        id: u64,
        /// The event's name.
        event: String,
        /// The whole frame, for the event's fields.
        frame: Map<String, Value>,
    },
    /// The final answer of a request.
    Final {
        /// The request it answers.
        id: u64,
        /// `result` when `ok`, else the agent's error.
        outcome: Result<Value, WireError>,
    },
    /// An error the agent could not attribute to a request (`"id": null`).
    Unattributed(WireError),
    /// A line longer than [`MAX_FRAME_BYTES`]; dropped, only its start was looked at.
    Oversized {
        /// The request it seems to belong to (read from the start of the line).
        id: Option<u64>,
        /// Whether it looks like an event (else it is taken for a final answer).
        is_event: bool,
        /// Its length in bytes, as far as it was read (at least the limit).
        len: usize,
    },
    /// A line that is not a frame of this protocol.
    Garbage {
        /// Why it was rejected, with the start of the line.
        detail: String,
    },
}

/// Parses one line (without its newline) into a frame.
pub fn parse_line(line: &[u8]) -> Inbound {
    let garbage = |why: &str| Inbound::Garbage {
        detail: format!("{why}: {}", preview(line)),
    };
    let Ok(Value::Object(mut frame)) = serde_json::from_slice::<Value>(line) else {
        return garbage("not a JSON object");
    };
    let id = match frame.get("id") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(id) => Some(id),
            None => return garbage("id is not an unsigned integer"),
        },
    };
    if let Some(event) = frame
        .get("event")
        .and_then(Value::as_str)
        .map(str::to_owned)
    {
        return match (event.as_str(), id) {
            ("ready", _) => match serde_json::from_value::<ReadyInfo>(Value::Object(frame)) {
                Ok(info) => Inbound::Ready(info),
                Err(_) => garbage("malformed ready frame"),
            },
            (_, Some(id)) => Inbound::Event { id, event, frame },
            (_, None) => garbage("event without id"),
        };
    }
    let ok = frame.get("ok").and_then(Value::as_bool);
    let error = || -> WireError {
        frame
            .get("error")
            .cloned()
            .and_then(|e| serde_json::from_value(e).ok())
            .unwrap_or_else(|| WireError {
                kind: "internal".into(),
                message: "the agent reported an error without a description".into(),
            })
    };
    match (id, ok) {
        (Some(id), Some(true)) => Inbound::Final {
            id,
            outcome: Ok(frame.remove("result").unwrap_or(Value::Null)),
        },
        (Some(id), Some(false)) => Inbound::Final {
            id,
            outcome: Err(error()),
        },
        (None, Some(false)) => Inbound::Unattributed(error()),
        _ => garbage("neither an event nor a final answer"),
    }
}

/// Looks at the start of an oversized line to attribute it: the agent writes `{"id":N,"event":…`
/// for events and `{"id":N,"ok":…` for final answers.
fn classify_oversized(head: &[u8], len: usize) -> Inbound {
    let text = String::from_utf8_lossy(head);
    let id = text.find("\"id\"").and_then(|at| {
        let rest = text[at + 4..].trim_start().strip_prefix(':')?.trim_start();
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    });
    Inbound::Oversized {
        id,
        is_event: text.contains("\"event\""),
        len,
    }
}

fn preview(line: &[u8]) -> String {
    let head = &line[..line.len().min(120)];
    let mut text = String::from_utf8_lossy(head).into_owned();
    if line.len() > head.len() {
        text.push('…');
    }
    text
}

/// Splits a byte stream into lines, holding at most `max` bytes of an unfinished line.
///
/// Docker's attach stream cuts the agent's output at arbitrary points, so a frame may arrive in
/// pieces or several frames in one piece.
#[derive(Debug)]
pub struct LineSplitter {
    buf: BytesMut,
    max: usize,
    /// Set while skipping the rest of an oversized line: its start and the length so far.
    skipping: Option<(Bytes, usize)>,
}

/// How much of an oversized line is kept to attribute it.
const HEAD_BYTES: usize = 256;

impl LineSplitter {
    /// A splitter that drops lines longer than `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max,
            skipping: None,
        }
    }

    /// Feeds a piece of the stream; returns the frames completed by it.
    pub fn push(&mut self, mut data: &[u8]) -> Vec<Inbound> {
        let mut out = Vec::new();
        while !data.is_empty() {
            let newline = data.iter().position(|b| *b == b'\n');
            if let Some((head, len)) = &mut self.skipping {
                match newline {
                    Some(at) => {
                        out.push(classify_oversized(head, *len + at));
                        self.skipping = None;
                        data = &data[at + 1..];
                    }
                    None => {
                        *len += data.len();
                        data = &[];
                    }
                }
                continue;
            }
            let take = newline.unwrap_or(data.len());
            if self.buf.len() + take > self.max {
                // Keep only the head, then skip to the end of this line (the next turn of the loop
                // finishes it when the newline is in this piece).
                let len = self.buf.len() + take;
                let mut head = std::mem::take(&mut self.buf);
                let room = HEAD_BYTES.saturating_sub(head.len());
                head.extend_from_slice(&data[..take.min(room)]);
                head.truncate(HEAD_BYTES);
                self.skipping = Some((head.freeze(), len));
                data = &data[take..];
                continue;
            }
            self.buf.extend_from_slice(&data[..take]);
            match newline {
                Some(at) => {
                    let line = self.buf.split();
                    if !line.iter().all(u8::is_ascii_whitespace) {
                        out.push(parse_line(&line));
                    }
                    data = &data[at + 1..];
                }
                None => data = &[],
            }
        }
        out
    }

    /// Bytes of an unfinished line currently held.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
}

/// Builds a request line: `{"id": id, "op": op, …fields}` plus the newline.
pub fn request_line(id: u64, op: &str, fields: Map<String, Value>) -> Bytes {
    let mut frame = Map::with_capacity(fields.len() + 2);
    frame.insert("id".into(), id.into());
    frame.insert("op".into(), op.into());
    frame.extend(fields);
    let mut line = serde_json::to_vec(&Value::Object(frame)).expect("a JSON map always serialises");
    line.push(b'\n');
    line.into()
}

/// Builds one `chunk` frame of an upload without copying the payload through a `Value`.
pub fn chunk_line(id: u64, data_b64: &str, last: bool) -> Bytes {
    // base64 never needs JSON escaping.
    let mut line = Vec::with_capacity(data_b64.len() + 64);
    line.extend_from_slice(format!("{{\"id\":{id},\"op\":\"chunk\",\"data\":\"").as_bytes());
    line.extend_from_slice(data_b64.as_bytes());
    line.extend_from_slice(format!("\",\"last\":{last}}}\n").as_bytes());
    line.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn frames_split_across_pieces_and_joined_in_one_piece_are_both_parsed() {
        let mut s = LineSplitter::new(1024);
        assert!(s.push(br#"{"id":1,"ok":tr"#).is_empty());
        let frames = s.push(
            b"ue,\"result\":{\"pong\":true}}\n{\"id\":2,\"event\":\"stdout\",\"data\":\"hi\"}\n\n",
        );
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert_eq!(
            frames[0],
            Inbound::Final {
                id: 1,
                outcome: Ok(json!({"pong": true}))
            }
        );
        assert!(matches!(&frames[1], Inbound::Event { id: 2, event, .. } if event == "stdout"));
        assert_eq!(s.buffered(), 0);
    }

    #[test]
    fn ready_error_and_unattributed_frames_are_recognised() {
        let ready = parse_line(
            br#"{"event":"ready","protocol":1,"pid":7,"python":"3.11.2","ipython":true,"preloaded":["numpy"]}"#,
        );
        assert!(matches!(
            ready,
            Inbound::Ready(ReadyInfo {
                protocol: 1,
                pid: 7,
                ..
            })
        ));
        let err = parse_line(br#"{"id":4,"ok":false,"error":{"kind":"not_found","message":"x"}}"#);
        assert!(
            matches!(err, Inbound::Final { id: 4, outcome: Err(WireError { ref kind, .. }) } if kind == "not_found")
        );
        let unattributed =
            parse_line(br#"{"id":null,"ok":false,"error":{"kind":"bad_request","message":"?"}}"#);
        assert!(matches!(unattributed, Inbound::Unattributed(_)));
        assert!(matches!(
            parse_line(b"Traceback (most"),
            Inbound::Garbage { .. }
        ));
    }

    #[test]
    fn an_oversized_line_is_dropped_attributed_and_never_buffered_whole() {
        let mut s = LineSplitter::new(64);
        let mut frames = s.push(br#"{"id":9,"ok":true,"result":{"text/plain":"'"#);
        for _ in 0..100 {
            frames.extend(s.push(&[b'x'; 1000]));
            assert!(s.buffered() <= 64, "held {} bytes", s.buffered());
        }
        frames.extend(s.push(b"'\"}}\n{\"id\":10,\"ok\":true,\"result\":null}\n"));
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert!(
            matches!(frames[0], Inbound::Oversized { id: Some(9), is_event: false, len } if len > 100_000),
            "{:?}",
            frames[0]
        );
        assert!(matches!(frames[1], Inbound::Final { id: 10, .. }));
    }

    #[test]
    fn an_oversized_event_in_one_piece_is_attributed_as_event() {
        let mut s = LineSplitter::new(16);
        let mut line = br#"{"id":3,"event":"display","data":""#.to_vec();
        line.extend_from_slice(&[b'A'; 100]);
        line.extend_from_slice(b"\"}\n");
        let frames = s.push(&line);
        assert!(matches!(
            frames[..],
            [Inbound::Oversized {
                id: Some(3),
                is_event: true,
                ..
            }]
        ));
    }

    #[test]
    fn request_lines_are_single_json_lines() {
        let mut fields = Map::new();
        fields.insert("code".into(), "print('a\\nb')\n".into());
        let line = request_line(5, "exec", fields);
        assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
        let v: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["id"], 5);
        assert_eq!(v["op"], "exec");
        let chunk = chunk_line(6, "QUJD", true);
        let v: Value = serde_json::from_slice(&chunk).unwrap();
        assert_eq!(
            v,
            json!({"id": 6, "op": "chunk", "data": "QUJD", "last": true})
        );
    }
}

/// Property tests ("fuzzing" that runs in `cargo test` on stable, bounded cases): whatever a
/// hostile sandbox writes to its stdout, the frame parser neither panics nor buffers beyond its
/// bound, and a stream cut at any points parses to the same frames as in one piece.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    /// Lines that look like frames (so the parser's deeper branches run), and raw bytes.
    fn line() -> impl Strategy<Value = Vec<u8>> {
        let json_ish = prop_oneof![
            Just(r#"{"id":1,"ok":true,"result":{}}"#.to_owned()),
            Just(r#"{"id":2,"event":"stdout","text":"hi"}"#.to_owned()),
            Just(r#"{"id":null,"ok":false,"error":{"kind":"x","message":"y"}}"#.to_owned()),
            Just(r#"{"event":"ready","protocol":1}"#.to_owned()),
            "\\{\"id\":[0-9-]{0,25},\"(ok|event)\":(true|false|\"[a-z]{0,8}\"|null|\\[\\]|\\{\\})[,}]{0,2}",
            "[ -~]{0,80}",
        ];
        // Long frames, over the splitter's bound in the test below: the attribution of an
        // oversized line reads its start.
        let long = (
            prop_oneof![
                Just(r#"{"id":3,"event":"stdout","text":""#),
                Just(r#"{"id":4,"ok":true,"result":""#)
            ],
            200usize..900,
        )
            .prop_map(|(head, n)| format!("{head}{}\"}}", "x".repeat(n)).into_bytes());
        prop_oneof![
            2 => json_ish.prop_map(String::into_bytes),
            2 => proptest::collection::vec(any::<u8>(), 0..200),
            1 => long,
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn any_line_parses_to_some_frame_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_line(&bytes);
        }

        #[test]
        fn framed_lines_parse_without_panicking(bytes in line()) {
            let _ = parse_line(&bytes);
            let _ = classify_oversized(&bytes, bytes.len());
        }

        #[test]
        fn a_stream_cut_anywhere_gives_the_same_frames_and_stays_bounded(
            lines in proptest::collection::vec(line(), 0..12),
            cuts in proptest::collection::vec(1usize..64, 0..40),
            // At least the head kept from an oversized line (as in production, 16 MiB): below
            // it, where a line is cut changes how much of its start is kept.
            max in HEAD_BYTES..600,
        ) {
            let stream: Vec<u8> = lines
                .iter()
                .flat_map(|l| l.iter().copied().filter(|b| *b != b'\n').chain([b'\n']))
                .collect();
            let mut whole = LineSplitter::new(max);
            let expected = whole.push(&stream);
            let mut pieces = LineSplitter::new(max);
            let mut got = Vec::new();
            let mut rest = &stream[..];
            for cut in cuts.iter().copied().chain(std::iter::repeat(7)) {
                if rest.is_empty() {
                    break;
                }
                let (piece, tail) = rest.split_at(cut.min(rest.len()));
                got.extend(pieces.push(piece));
                prop_assert!(pieces.buffered() <= max, "buffered {} > {max}", pieces.buffered());
                rest = tail;
            }
            prop_assert_eq!(got, expected);
        }
    }

    #[test]
    fn an_oversized_line_with_invalid_utf8_before_the_id_is_still_attributed() {
        // A lossy-decoded head with a replacement character before `"id"` must not be sliced
        // off a char boundary.
        let mut line = vec![0xff; 10];
        line.extend_from_slice(br#""id": 7, "event":"x""#);
        assert!(matches!(
            classify_oversized(&line, 1 << 30),
            Inbound::Oversized {
                id: Some(7),
                is_event: true,
                ..
            }
        ));
    }
}
