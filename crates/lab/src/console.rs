//! The guest workload's console contract (see `guest/workload.c`).
//!
//! Lines the workload prints five times a second:
//! `FERRY tick=<n> ms=<ms> fill=<bytes> dirtied=<pages> verified=<pages> sweeps=<n> errors=<n>`
//! and on a mismatch `FERRY-ERROR page=… word=… …`. A kernel panic or oops
//! shows up as its usual kernel lines. This module parses a console log into
//! the latest tick and the problem lines; the agent turns that into a check.

/// One `FERRY tick=…` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tick {
    pub tick: u64,
    pub ms: u64,
    pub fill: u64,
    pub dirtied: u64,
    pub verified: u64,
    pub sweeps: u64,
    pub errors: u64,
}

/// Parses one tick line; `None` for anything else.
pub fn parse_tick(line: &str) -> Option<Tick> {
    let rest = line.trim().strip_prefix("FERRY tick=")?;
    let mut t = Tick::default();
    let mut fields = 0;
    for (i, kv) in std::iter::once(("tick", rest.split(' ').next()?))
        .chain(rest.split(' ').skip(1).filter_map(|kv| kv.split_once('=')))
        .enumerate()
    {
        let v: u64 = kv.1.parse().ok()?;
        match kv.0 {
            "tick" => t.tick = v,
            "ms" => t.ms = v,
            "fill" => t.fill = v,
            "dirtied" => t.dirtied = v,
            "verified" => t.verified = v,
            "sweeps" => t.sweeps = v,
            "errors" => t.errors = v,
            _ => continue,
        }
        fields = i + 1;
    }
    (fields >= 7).then_some(t)
}

/// What a console log says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsoleState {
    pub last: Option<Tick>,
    pub ready: bool,
    /// Integrity errors, fatal workload errors, kernel panics and oopses (first 20).
    pub problems: Vec<String>,
}

const PROBLEM_MARKERS: [&str; 5] = [
    "FERRY-ERROR",
    "FERRY-FATAL",
    "Kernel panic",
    "BUG:",
    "Oops:",
];

pub fn parse_log(text: &str) -> ConsoleState {
    let mut s = ConsoleState::default();
    for line in text.lines() {
        if let Some(t) = parse_tick(line) {
            s.last = Some(t);
        } else if line.contains("FERRY ready") {
            s.ready = true;
        } else if PROBLEM_MARKERS.iter().any(|m| line.contains(m)) && s.problems.len() < 20 {
            s.problems.push(line.trim().to_string());
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str =
        "FERRY tick=25 ms=24905 fill=805306368 dirtied=128000 verified=204750 sweeps=1 errors=0";

    #[test]
    fn parses_a_tick_line() {
        let t = parse_tick(LINE).unwrap();
        assert_eq!((t.tick, t.ms, t.sweeps, t.errors), (25, 24905, 1, 0));
        assert_eq!(t.fill, 805306368);
    }

    #[test]
    fn rejects_truncated_or_garbled_lines() {
        assert!(parse_tick("FERRY tick=25 ms=24905 fill=8053").is_none());
        assert!(
            parse_tick("FERRY tick=x ms=1 fill=1 dirtied=1 verified=1 sweeps=1 errors=0").is_none()
        );
        assert!(parse_tick("random kernel line").is_none());
    }

    #[test]
    fn log_keeps_latest_tick_and_problems() {
        let log = format!(
            "FERRY filling pages=3\nFERRY ready fill=12288\n{LINE}\nFERRY-ERROR page=3 word=0 gen=1 expected=1 got=2\n{}\n[ 1.0] Kernel panic - not syncing\n",
            LINE.replace("tick=25", "tick=26")
        );
        let s = parse_log(&log);
        assert!(s.ready);
        assert_eq!(s.last.unwrap().tick, 26);
        assert_eq!(s.problems.len(), 2);
    }

    #[test]
    fn a_partial_last_line_is_ignored() {
        let s = parse_log(&format!("{LINE}\nFERRY tick=26 ms=2"));
        assert_eq!(s.last.unwrap().tick, 25);
    }
}
