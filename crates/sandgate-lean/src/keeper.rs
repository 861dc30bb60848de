//! The keeper: a small process per node that holds the node's ends of every lean sandbox's
//! protocol socket and stderr pipe, so that a node restart (planned, a crash, an upgrade) does not
//! close them. A sandbox's agent ends when its protocol input ends; with the keeper holding a copy
//! of the node's end, it never does while the node is away, and the restarted node takes the
//! descriptors back (the Docker engine's containerd-shim does this for containers).
//!
//! It listens on a `SOCK_SEQPACKET` socket at a path only root can reach (the node's lean
//! directory, mode 0700) and keeps nothing but descriptors under sandbox names: no data passes
//! through it. Messages are JSON, one per packet: `{"op": "put", "id"}` with descriptors attached,
//! `{"op": "get", "id"}` answered `{"ok": true}` with copies attached (or `{"ok": false}`),
//! `{"op": "drop", "id"}` answered `{"ok": true}`.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::sys;

const MAX_MESSAGE: usize = 4096;

#[derive(Debug, Serialize, Deserialize)]
struct Request {
    op: String,
    id: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Answer {
    ok: bool,
}

type Kept = Arc<Mutex<HashMap<String, Vec<OwnedFd>>>>;

/// Serves at `path` for ever (a thread per connection). Returns at once when another keeper
/// already serves there: two nodes starting together on one directory start one keeper between
/// them, never one that replaces the other's socket and strands what it holds.
pub fn serve(path: &Path) -> io::Result<()> {
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path.with_extension("lock"))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(()),
        Err(std::fs::TryLockError::Error(e)) => return Err(e),
    }
    // The lock is held for the process's life: `lock` is never dropped (the loop never ends).
    let _ = std::fs::remove_file(path);
    let listener = sys::seqpacket_listen(path)?;
    let kept: Kept = Arc::default();
    loop {
        let conn = sys::seqpacket_accept(listener.as_fd())?;
        // Root only (the node), whatever the socket's directory allows.
        if sys::peer_uid(conn.as_fd()).ok() != Some(0) {
            continue;
        }
        let kept = kept.clone();
        std::thread::spawn(move || {
            let _ = serve_connection(&conn, &kept);
        });
    }
}

fn serve_connection(conn: &OwnedFd, kept: &Kept) -> io::Result<()> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let (n, fds) = sys::recv_message(conn.as_fd(), &mut buf)?;
        if n == 0 {
            return Ok(());
        }
        let Ok(req) = serde_json::from_slice::<Request>(&buf[..n]) else {
            continue;
        };
        let mut map = kept.lock().unwrap_or_else(|e| e.into_inner());
        match req.op.as_str() {
            "put" => {
                map.insert(req.id, fds);
                reply(conn, true, &[])?;
            }
            "get" => match map.get(&req.id) {
                Some(fds) => {
                    let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
                    reply(conn, true, &borrowed)?;
                }
                None => reply(conn, false, &[])?,
            },
            "drop" => {
                map.remove(&req.id);
                reply(conn, true, &[])?;
            }
            _ => reply(conn, false, &[])?,
        }
    }
}

fn reply(conn: &OwnedFd, ok: bool, fds: &[std::os::fd::BorrowedFd<'_>]) -> io::Result<()> {
    let body = serde_json::to_vec(&Answer { ok }).map_err(io::Error::other)?;
    sys::send_message(conn.as_fd(), &body, fds)
}

/// A node's connection to its keeper (blocking calls; each is one local round trip).
#[derive(Debug)]
pub struct Keeper {
    path: PathBuf,
    conn: Mutex<OwnedFd>,
}

impl Keeper {
    /// Connects to the keeper at `path`, starting `binary` (detached, in a session of its own)
    /// when none answers there.
    pub fn connect_or_start(binary: &Path, path: &Path) -> io::Result<Self> {
        if let Ok(conn) = sys::seqpacket_connect(path) {
            return Ok(Self {
                path: path.to_owned(),
                conn: Mutex::new(conn),
            });
        }
        crate::host::spawn_detached(binary, &[path.as_os_str()])?;
        let mut last = None;
        for _ in 0..500 {
            match sys::seqpacket_connect(path) {
                Ok(conn) => {
                    return Ok(Self {
                        path: path.to_owned(),
                        conn: Mutex::new(conn),
                    });
                }
                Err(e) => last = Some(e),
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Err(last.unwrap_or_else(|| io::Error::other("the keeper did not start")))
    }

    fn call(
        &self,
        op: &str,
        id: &str,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> io::Result<(bool, Vec<OwnedFd>)> {
        let body = serde_json::to_vec(&Request {
            op: op.to_owned(),
            id: id.to_owned(),
        })
        .map_err(io::Error::other)?;
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let attempt = |conn: &OwnedFd| -> io::Result<(bool, Vec<OwnedFd>)> {
            sys::send_message(conn.as_fd(), &body, fds)?;
            let mut buf = vec![0u8; MAX_MESSAGE];
            let (n, got) = sys::recv_message(conn.as_fd(), &mut buf)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the keeper is gone",
                ));
            }
            let answer: Answer = serde_json::from_slice(&buf[..n]).map_err(io::Error::other)?;
            Ok((answer.ok, got))
        };
        match attempt(&conn) {
            Ok(answer) => Ok(answer),
            Err(_) => {
                // The keeper restarted (what it kept is gone, but new calls work): reconnect once.
                *conn = sys::seqpacket_connect(&self.path)?;
                attempt(&conn)
            }
        }
    }

    /// Keeps copies of `fds` under `id`.
    pub fn put(&self, id: &str, fds: &[std::os::fd::BorrowedFd<'_>]) -> io::Result<()> {
        self.call("put", id, fds).map(|_| ())
    }

    /// Copies of what is kept under `id`; `None` when nothing is.
    pub fn get(&self, id: &str) -> io::Result<Option<Vec<OwnedFd>>> {
        let (ok, fds) = self.call("get", id, &[])?;
        Ok(ok.then_some(fds))
    }

    /// Forgets `id` (its copies close).
    pub fn forget(&self, id: &str) -> io::Result<()> {
        self.call("drop", id, &[]).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second keeper on a directory that has one leaves: the first keeps its socket and what
    /// it holds (two nodes starting at once on one directory once made two, the second
    /// stranding the first's descriptors).
    #[test]
    fn a_second_keeper_on_one_directory_leaves_the_first_serving() {
        let dir = std::env::temp_dir().join(format!("sg-keeper-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("keeper.sock");
        let first = path.clone();
        std::thread::spawn(move || serve(&first));
        let keeper = (0..500)
            .find_map(|_| {
                std::thread::sleep(std::time::Duration::from_millis(10));
                sys::seqpacket_connect(&path).ok()
            })
            .map(|conn| Keeper {
                path: path.clone(),
                conn: Mutex::new(conn),
            })
            .expect("the first keeper listens");
        let (mine, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        keeper.put("sbx", &[mine.as_fd()]).unwrap();

        // The second returns at once, without touching the socket.
        serve(&path).expect("a second keeper leaves without an error");

        let again = Keeper {
            path: path.clone(),
            conn: Mutex::new(sys::seqpacket_connect(&path).expect("the socket is the first's")),
        };
        let kept = again.get("sbx").unwrap();
        assert_eq!(
            kept.map(|fds| fds.len()),
            Some(1),
            "the first keeper still holds what was put"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
