//! Byte sizes as users write them: `512`, `64K`, `768M`, `1G`, `1.5G`.
//!
//! Binary units (K = 1024). Used for memory, fill and dirty rates (per second).

use crate::ApiError;

/// Parses a size such as `1G`, `768M`, `1.5G`, `4096`. `what` names the
/// argument in the error, e.g. `"--memory"`.
pub fn parse_size(what: &str, s: &str) -> Result<u64, ApiError> {
    let bad = || ApiError::InvalidArgument {
        field: what.to_string(),
        reason: format!("'{s}' is not a size (examples: 512M, 1G, 1.5G)"),
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(bad());
    }
    let t = t.strip_suffix(['b', 'B']).unwrap_or(t);
    let t = t.strip_suffix(['i']).unwrap_or(t);
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1u64 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1u64 << 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 1u64 << 40),
        _ => (t, 1),
    };
    let v: f64 = num.parse().map_err(|_| bad())?;
    if !v.is_finite() || v < 0.0 {
        return Err(bad());
    }
    let bytes = v * mult as f64;
    if bytes > u64::MAX as f64 / 2.0 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// Formats bytes with a binary unit, e.g. `1.0 GiB`.
pub fn human_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// Parses a duration such as `500ms`, `30s`, `5m`, `1h` or `90` (seconds).
/// `what` names the setting in the error.
pub fn parse_duration(what: &str, s: &str) -> Result<std::time::Duration, ApiError> {
    let bad = || ApiError::InvalidArgument {
        field: what.to_string(),
        reason: format!("'{s}' is not a duration (examples: 500ms, 30s, 5m, 1h)"),
    };
    let t = s.trim();
    let (num, unit_ms) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1e3)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60e3)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600e3)
    } else {
        (t, 1e3)
    };
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    if !v.is_finite() || v < 0.0 || v * unit_ms > 1e12 {
        return Err(bad());
    }
    Ok(std::time::Duration::from_micros((v * unit_ms * 1e3) as u64))
}

/// Formats a duration the way [`parse_duration`] reads it back: `250ms`,
/// `42s`, `30m`, `1.5h`.
pub fn human_duration(d: std::time::Duration) -> String {
    let ms = d.as_millis() as u64;
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 120_000 {
        format!("{}s", ms / 1000)
    } else if ms < 7_200_000 {
        format!("{}m", ms / 60_000)
    } else {
        format!("{:.1}h", ms as f64 / 3_600_000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_units() {
        assert_eq!(parse_size("x", "1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("x", "768M").unwrap(), 768 << 20);
        assert_eq!(parse_size("x", "1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("x", "4096").unwrap(), 4096);
        assert_eq!(parse_size("x", "64KiB").unwrap(), 64 << 10);
    }

    #[test]
    fn rejects_garbage_naming_the_field() {
        for bad in ["", "G", "-1G", "abc", "1X", "nanM"] {
            let e = parse_size("--memory", bad).unwrap_err();
            assert!(e.to_string().contains("--memory"), "{e}");
        }
    }

    #[test]
    fn human_bytes_picks_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1 << 30), "1.0 GiB");
    }
}

#[cfg(test)]
mod duration_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn durations_parse_with_their_units() {
        assert_eq!(
            parse_duration("x", "500ms").unwrap(),
            Duration::from_millis(500)
        );
        assert_eq!(parse_duration("x", "30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("x", "5m").unwrap(), Duration::from_secs(300));
        assert_eq!(
            parse_duration("x", "1.5h").unwrap(),
            Duration::from_secs(5400)
        );
        assert_eq!(parse_duration("x", "90").unwrap(), Duration::from_secs(90));
        for bad in ["", "s", "-1s", "5 parsecs", "1e30h"] {
            let e = parse_duration("storage_pause_max", bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains("storage_pause_max"), "{bad}: {e}");
        }
        assert_eq!(human_duration(Duration::from_secs(1800)), "30m");
        assert_eq!(human_duration(Duration::from_millis(250)), "250ms");
    }
}
