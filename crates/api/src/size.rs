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
