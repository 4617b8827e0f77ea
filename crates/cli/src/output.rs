//! Human output: aligned tables and progress bars; and JSON output.

pub fn print_json<T: serde::Serialize>(v: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    );
}

pub struct Table {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(head: &[&str]) -> Table {
        Table {
            head: head.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, r: Vec<String>) {
        self.rows.push(r);
    }

    pub fn render(&self) -> String {
        let mut w: Vec<usize> = self.head.iter().map(|h| h.len()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                if i < w.len() {
                    w[i] = w[i].max(c.chars().count());
                }
            }
        }
        let line = |cells: &[String]| {
            cells
                .iter()
                .enumerate()
                .map(|(i, c)| format!("{c:<width$}", width = w.get(i).copied().unwrap_or(0)))
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_string()
        };
        let mut out = line(&self.head);
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out
    }

    pub fn print(&self) {
        println!("{}", self.render());
    }
}

/// `text` cut to at most `max` characters, the last one `…` when cut.
pub fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut s: String = text.chars().take(max.saturating_sub(1)).collect();
    s.push('…');
    s
}

/// Bytes per second as Mbit/s.
pub fn mbit(bytes_per_sec: f64) -> String {
    format!("{:.0} Mbit/s", bytes_per_sec * 8.0 / 1e6)
}

/// The CLI's byte progress bar (`PREFIX [=====>    ] 1.2 GiB/2.0 GiB MSG`);
/// hidden under `--json`.
pub fn byte_bar(prefix: String, len: u64, hidden: bool) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressStyle};
    if hidden {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len.max(1));
    b.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {bytes}/{total_bytes} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b.set_prefix(prefix);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align() {
        let mut t = Table::new(&["A", "BB"]);
        t.row(vec!["long".into(), "x".into()]);
        assert_eq!(t.render(), "A     BB\nlong  x");
    }

    #[test]
    fn shorten_counts_characters_not_bytes() {
        assert_eq!(shorten("abc", 3), "abc");
        assert_eq!(shorten("abcd", 3), "ab…");
        // 4 characters, 8 bytes: kept whole
        assert_eq!(shorten("→→→→", 4), "→→→→");
        assert_eq!(shorten("→→→→→", 4), "→→→…");
    }
}
