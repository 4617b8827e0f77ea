//! Ferry's lab: a cluster of hosts on one Linux machine.
//!
//! - [`topology`]: the addressing plan (198.18.0.0/15 only) and names — pure, unit-tested.
//! - [`net`]: makes and removes the namespaces, veth NICs, fabric switches,
//!   management bridge, link shaping (tbf) and link cuts, by running `ip`/`tc`.
//! - [`image`]: builds the guest (Debian kernel + busybox initramfs + workload) and caches it.
//! - [`cpio`]: the newc archive writer the initramfs is made with.
//! - [`console`]: reads the guest workload's serial console lines.
//! - [`cpuset`]: hosts with CPUs of their own (`ferry lab up --cpus`).
//!
//! Every host namespace runs one agent (`ferry agent`), started by `ferry lab up`.

pub mod console;
pub mod cpio;
pub mod cpuset;
pub mod debian;
pub mod image;
pub mod monitor;
pub mod net;
pub mod team;
pub mod topology;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("Command `{cmd}` failed: {stderr}")]
    Command { cmd: String, stderr: String },
    #[error("Cannot run `{cmd}`")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    #[error("I/O error on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot open {what}")]
    Socket {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("Invalid lab setting: {0}")]
    Invalid(String),
    #[error("No lab is up (run `ferry lab up`)")]
    NotUp,
    #[error("A lab is already up (use `ferry lab down` first, or `ferry lab up --replace`)")]
    AlreadyUp,
    #[error("Guest image: {0}")]
    Image(String),
}

impl LabError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LabError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Runs a command and returns its stdout; a non-zero exit becomes [`LabError::Command`].
pub fn run(cmd: &str, args: &[&str]) -> Result<String, LabError> {
    let shown = || format!("{cmd} {}", args.join(" "));
    let out = std::process::Command::new(cmd)
        .args(args)
        .output()
        .map_err(|source| LabError::Spawn {
            cmd: shown(),
            source,
        })?;
    if !out.status.success() {
        return Err(LabError::Command {
            cmd: shown(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Where lab state lives: `FERRY_RUN_DIR` or `/run/ferry`.
pub fn run_dir() -> PathBuf {
    std::env::var_os("FERRY_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/run/ferry".into())
}

/// Where built guest images are cached: `FERRY_CACHE_DIR` or `/var/cache/ferry`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("FERRY_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/var/cache/ferry".into())
}
