//! A client for qemu-guest-agent on a VM's virtio-serial channel
//! (`qga.sock` in the VM's directory), as the final check of a move uses it.
//!
//! The channel is a byte stream that may hold a reply to a command an
//! earlier client sent and never read, so every session starts with
//! `guest-sync` and a fresh id, and discards lines until that id comes back.
//! QEMU's chardev takes one client at a time: a session is opened for one
//! check and dropped after it.

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

#[derive(Debug, thiserror::Error)]
pub enum QgaError {
    #[error("cannot reach the guest agent at {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the guest agent did not answer {command} within {secs} s")]
    Timeout { command: String, secs: u64 },
    #[error("the guest agent's channel broke: {0}")]
    Io(#[from] std::io::Error),
    #[error("the guest agent refused {command}: {desc}")]
    Refused { command: String, desc: String },
    #[error("the guest agent's answer to {command} is not understood: {answer}")]
    Garbled { command: String, answer: String },
    /// A line longer than the limit: the guest is not trusted to end it.
    #[error("the guest agent's answer to {command} passed {max} bytes without ending (guest_agent_max_reply); the channel is dropped")]
    TooLong { command: String, max: usize },
}

/// The longest line read from a guest agent (its answers are one line
/// each; `guest-exec-status` output, base64, is the largest Ferry asks).
pub const MAX_REPLY: usize = 4 << 20;
static MAX_REPLY_SETTING: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(MAX_REPLY);

/// Sets the longest reply line this process takes (the agent's
/// `guest_agent_max_reply`; default [`MAX_REPLY`]).
pub fn set_max_reply(bytes: usize) {
    MAX_REPLY_SETTING.store(bytes, std::sync::atomic::Ordering::Relaxed);
}

pub struct Qga {
    rd: BufReader<tokio::net::unix::OwnedReadHalf>,
    wr: tokio::net::unix::OwnedWriteHalf,
}

/// What `guest-exec` reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub exit_code: i64,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Qga {
    /// Connects and synchronizes; fails if the guest agent does not answer
    /// within `wait`.
    pub async fn connect(path: &Path, wait: Duration) -> Result<Qga, QgaError> {
        let s = UnixStream::connect(path)
            .await
            .map_err(|source| QgaError::Connect {
                path: path.display().to_string(),
                source,
            })?;
        let (rd, wr) = s.into_split();
        let mut q = Qga {
            rd: BufReader::new(rd),
            wr,
        };
        let id: u32 = rand::random::<u32>() >> 1;
        let line = json!({"execute": "guest-sync", "arguments": {"id": id}}).to_string();
        q.wr.write_all(format!("{line}\n").as_bytes()).await?;
        let sync = async {
            loop {
                let v = q.read_line("guest-sync").await?;
                if v.get("return").and_then(Value::as_u64) == Some(u64::from(id)) {
                    return Ok::<_, QgaError>(());
                }
            }
        };
        tokio::time::timeout(wait, sync)
            .await
            .map_err(|_| QgaError::Timeout {
                command: "guest-sync".into(),
                secs: wait.as_secs(),
            })??;
        Ok(q)
    }

    async fn read_line(&mut self, command: &str) -> Result<Value, QgaError> {
        let max = MAX_REPLY_SETTING.load(std::sync::atomic::Ordering::Relaxed);
        self.read_line_within(command, max).await
    }

    async fn read_line_within(&mut self, command: &str, max: usize) -> Result<Value, QgaError> {
        use tokio::io::AsyncReadExt;
        let mut line = String::new();
        loop {
            line.clear();
            let n = (&mut self.rd)
                .take(max as u64 + 1)
                .read_line(&mut line)
                .await?;
            if n == 0 {
                return Err(QgaError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            if n > max && !line.ends_with('\n') {
                return Err(QgaError::TooLong {
                    command: command.into(),
                    max,
                });
            }
            // a reply may be preceded by the 0xff a delimited sync sends
            let t = line.trim_matches(|c: char| c.is_whitespace() || c == '\u{fffd}');
            if t.is_empty() {
                continue;
            }
            return serde_json::from_str(t).map_err(|_| QgaError::Garbled {
                command: command.into(),
                answer: t.chars().take(200).collect(),
            });
        }
    }

    /// Runs one command; its `return` value.
    pub async fn execute(&mut self, command: &str, args: Value) -> Result<Value, QgaError> {
        let mut msg = json!({"execute": command});
        if !args.is_null() {
            msg["arguments"] = args;
        }
        self.wr.write_all(format!("{msg}\n").as_bytes()).await?;
        let wait = Duration::from_secs(10);
        let v = tokio::time::timeout(wait, self.read_line(command))
            .await
            .map_err(|_| QgaError::Timeout {
                command: command.into(),
                secs: wait.as_secs(),
            })??;
        if let Some(e) = v.get("error") {
            return Err(QgaError::Refused {
                command: command.into(),
                desc: e
                    .get("desc")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .to_string(),
            });
        }
        v.get("return").cloned().ok_or_else(|| QgaError::Garbled {
            command: command.into(),
            answer: v.to_string(),
        })
    }

    /// Asks the guest to power itself off (`guest-shutdown`, mode
    /// `powerdown`): the guest's own orderly shutdown. The guest agent
    /// answers nothing when it accepts, so nothing is awaited.
    pub async fn shutdown(&mut self) -> Result<(), QgaError> {
        let msg = json!({"execute": "guest-shutdown", "arguments": {"mode": "powerdown"}});
        self.wr.write_all(format!("{msg}\n").as_bytes()).await?;
        self.wr.flush().await?;
        Ok(())
    }

    pub async fn ping(&mut self) -> Result<(), QgaError> {
        self.execute("guest-ping", Value::Null).await.map(|_| ())
    }

    /// The guest's clock, nanoseconds since the epoch.
    pub async fn time_ns(&mut self) -> Result<u64, QgaError> {
        let v = self.execute("guest-get-time", Value::Null).await?;
        v.as_u64().ok_or_else(|| QgaError::Garbled {
            command: "guest-get-time".into(),
            answer: v.to_string(),
        })
    }

    /// Runs a program in the guest and waits (up to `wait`) for it to end.
    pub async fn exec(
        &mut self,
        path: &str,
        args: &[&str],
        wait: Duration,
    ) -> Result<ExecOutput, QgaError> {
        let v = self
            .execute(
                "guest-exec",
                json!({"path": path, "arg": args, "capture-output": true}),
            )
            .await?;
        let pid = v
            .get("pid")
            .and_then(Value::as_i64)
            .ok_or_else(|| QgaError::Garbled {
                command: "guest-exec".into(),
                answer: v.to_string(),
            })?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let st = self
                .execute("guest-exec-status", json!({"pid": pid}))
                .await?;
            if st.get("exited").and_then(Value::as_bool) == Some(true) {
                let b64 = |k: &str| {
                    st.get(k)
                        .and_then(Value::as_str)
                        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
                        .unwrap_or_default()
                };
                return Ok(ExecOutput {
                    exit_code: st.get("exitcode").and_then(Value::as_i64).unwrap_or(-1),
                    stdout: b64("out-data"),
                    stderr: b64("err-data"),
                });
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(QgaError::Timeout {
                    command: format!("guest-exec {path}"),
                    secs: wait.as_secs(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Our end of a guest-agent channel, and the guest's.
    fn channel() -> (Qga, UnixStream) {
        let (ours, guest) = UnixStream::pair().unwrap();
        let (rd, wr) = ours.into_split();
        let q = Qga {
            rd: BufReader::new(rd),
            wr,
        };
        (q, guest)
    }

    #[tokio::test]
    async fn an_endless_line_from_the_guest_is_cut_off() {
        let (mut q, mut guest) = channel();
        let writer = tokio::spawn(async move {
            let chunk = vec![b'a'; 64 << 10];
            // far past the limit, never a newline
            for _ in 0..64 {
                if guest.write_all(&chunk).await.is_err() {
                    break;
                }
            }
        });
        let e = q.read_line_within("guest-exec-status", 1 << 20).await;
        assert!(
            matches!(e, Err(QgaError::TooLong { max, .. }) if max == 1 << 20),
            "{e:?}"
        );
        drop(q);
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn answers_within_the_limit_are_read() {
        let (mut q, mut guest) = channel();
        guest.write_all(b"{\"return\": 7}\n").await.unwrap();
        let v = q.read_line_within("guest-sync", 64).await.unwrap();
        assert_eq!(v["return"], 7);
    }
}
