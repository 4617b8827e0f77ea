//! Small helpers every crate needs, written once: an error with its causes
//! on one line, a lock that survives a panicked holder, a command whose
//! stderr becomes its error, and link rates as `tc` writes them.

use std::sync::{Mutex, MutexGuard};

/// The error and its sources on one line, for messages that cross the wire.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Locks `m`; a holder that panicked does not poison it for everyone else
/// (the data is plain state, valid between statements).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `prog args…`: its stdout, or an error naming the command and
/// carrying its stderr.
pub fn run_command(prog: &str, args: &[&str]) -> Result<String, String> {
    let shown = || format!("{prog} {}", args.join(" "));
    match std::process::Command::new(prog).args(args).output() {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(o) => Err(format!(
            "{}: {}",
            shown(),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("cannot run {}: {e}", shown())),
    }
}

/// A rate as `tc` writes it (`1gbit`, `500mbit`, `100kbit`, `8000bit`, or
/// plain bits per second), in bits per second; None if it is not one.
pub fn parse_rate_bits(t: &str) -> Option<u64> {
    let t = t.trim().to_ascii_lowercase();
    let (num, scale) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
        .iter()
        .find_map(|(suf, k)| t.strip_suffix(suf).map(|n| (n, *k)))
        .unwrap_or((t.as_str(), 1.0));
    let v: f64 = num.trim().parse().ok()?;
    (v.is_finite() && v > 0.0).then_some((v * scale) as u64)
}

/// Bytes as lowercase hex, two digits each.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Hex digits (either case, two per byte) as bytes; `None` for anything
/// else, an odd count included. The inverse of [`hex`].
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.as_bytes()
        .chunks(2)
        .map(|p| {
            let d = |c: u8| (c as char).to_digit(16);
            Some((d(p[0])? << 4 | d(p[1])?) as u8)
        })
        .collect()
}

/// Unix time now, milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The time of day of Unix time `ms`, `HH:MM:SS UTC`.
pub fn clock_utc(ms: u64) -> String {
    let s = ms / 1000 % 86_400;
    format!("{:02}:{:02}:{:02} UTC", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_unhex_are_inverses_and_unhex_takes_only_hex_digits() {
        let b = [0x00, 0x1f, 0xa0, 0xff];
        assert_eq!(unhex(&hex(&b)), Some(b.to_vec()));
        assert_eq!(unhex("0A1b"), Some(vec![0x0a, 0x1b]));
        assert_eq!(unhex(""), Some(vec![]));
        for bad in ["a", "0g", "+f", "-1", " 1", "1\n"] {
            assert_eq!(unhex(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn rates_parse_and_bad_ones_do_not() {
        assert_eq!(parse_rate_bits("1gbit"), Some(1_000_000_000));
        assert_eq!(parse_rate_bits("500MBIT"), Some(500_000_000));
        assert_eq!(parse_rate_bits("2.5kbit"), Some(2_500));
        assert_eq!(parse_rate_bits("8000"), Some(8_000));
        for bad in ["", "fast", "-1mbit", "0gbit", "nanbit"] {
            assert_eq!(parse_rate_bits(bad), None, "{bad}");
        }
    }

    #[test]
    fn commands_carry_their_stderr() {
        assert_eq!(run_command("echo", &["hi"]).unwrap(), "hi\n");
        let e = run_command("ls", &["/no/such/path"]).unwrap_err();
        assert!(e.starts_with("ls /no/such/path: ") && e.len() > 20, "{e}");
        assert!(run_command("/no/such/binary", &[])
            .unwrap_err()
            .contains("cannot run"));
    }

    #[test]
    fn a_poisoned_lock_still_locks() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("holder dies");
        })
        .join();
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
