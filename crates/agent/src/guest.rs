//! The guest check's seam: what a guest's serial console says about it.
//!
//! The agent reads the tail of every guest's console (`console.log` in the
//! VM's directory) and asks a [`GuestCheck`] what it shows: a counter that
//! must keep advancing, and problems (integrity errors, panics). The
//! deployment plugs in the reader for its guests (the `ferry` binary plugs
//! in the workload guest's); [`NoWorkload`] knows no counter, so a guest is
//! checked by QEMU's run state alone.

/// A guest's progress as its console shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// A counter the guest advances while it runs.
    pub tick: u64,
    /// Completed verification passes over its memory.
    pub sweeps: u64,
    /// Integrity errors the guest found since boot.
    pub errors: u64,
}

/// What a console's tail says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reading {
    /// The newest progress line, if the guest prints any.
    pub last: Option<Progress>,
    /// Lines that mean the guest is not intact.
    pub problems: Vec<String>,
}

/// Reads a guest's console.
pub trait GuestCheck: Send + Sync {
    /// Whether this reader expects progress lines (a created VM is ready
    /// once the first one appears).
    fn has_progress(&self) -> bool;
    fn read(&self, console_tail: &str) -> Reading;
}

/// Guests whose console Ferry does not read.
pub struct NoWorkload;

impl GuestCheck for NoWorkload {
    fn has_progress(&self) -> bool {
        false
    }
    fn read(&self, _: &str) -> Reading {
        Reading::default()
    }
}

/// How large a guest's `console.log` grows before it is rotated (see
/// [`rotate`]), unless the agent's `console_log_max` says.
pub const CONSOLE_LOG_MAX: u64 = 8 << 20;

/// The previous generation of a rotated log: `console.log.1`.
fn older(path: &std::path::Path) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    p.into()
}

fn tail_of(path: &std::path::Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    if len > max {
        f.seek(SeekFrom::Start(len - max))?;
    }
    let mut buf = Vec::new();
    f.take(max).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Reads the last `max` bytes of a console log, reaching into its
/// previous generation when the log was rotated lately.
pub fn read_tail(path: &std::path::Path, max: u64) -> std::io::Result<String> {
    let now = tail_of(path, max)?;
    let mut buf = match (now.len() as u64) < max {
        true => tail_of(&older(path), max - now.len() as u64).unwrap_or_default(),
        false => Vec::new(),
    };
    buf.extend(now);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Keeps a console log within `max` bytes on disk, twice over: once the log
/// passes `max`, its content becomes `console.log.1` (replacing the one
/// before) and the log starts again empty. QEMU appends to it (`append=on`),
/// so its next line lands at the new start. True when it rotated.
pub fn rotate(path: &std::path::Path, max: u64) -> std::io::Result<bool> {
    if std::fs::metadata(path)?.len() <= max {
        return Ok(false);
    }
    let keep = tail_of(path, max)?;
    std::fs::write(older(path), keep)?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .set_len(0)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rotated_log_stays_bounded_and_its_tail_reads_across() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("console.log");
        std::fs::write(&p, "a".repeat(100) + "tick 1\n").unwrap();
        assert!(!rotate(&p, 1000).unwrap());
        assert!(rotate(&p, 50).unwrap());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 0);
        assert_eq!(std::fs::metadata(older(&p)).unwrap().len(), 50);
        // the newest line is still the tail's end, then after new writes
        assert!(read_tail(&p, 64).unwrap().ends_with("tick 1\n"));
        std::fs::write(&p, "tick 2\n").unwrap();
        let t = read_tail(&p, 20).unwrap();
        assert!(t.ends_with("tick 1\ntick 2\n") && t.len() == 20, "{t:?}");
    }

    #[test]
    fn a_tail_is_the_end_of_the_file() {
        let dir = std::env::temp_dir().join(format!("ferry-tail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("console.log");
        std::fs::write(&p, "first line\nsecond line\n").unwrap();
        assert_eq!(read_tail(&p, 12).unwrap(), "second line\n");
        assert_eq!(read_tail(&p, 1 << 20).unwrap(), "first line\nsecond line\n");
        assert!(read_tail(&dir.join("missing"), 10).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
