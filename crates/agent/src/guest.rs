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

/// Reads the last `max` bytes of a console log.
pub fn read_tail(path: &std::path::Path, max: u64) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    if len > max {
        f.seek(SeekFrom::Start(len - max))?;
    }
    let mut buf = Vec::new();
    f.take(max).read_to_end(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

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
