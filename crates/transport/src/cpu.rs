//! The CPUs this process may run on and their time, from `/proc/stat`.
//!
//! A host given CPUs of its own (a cpuset, or an affinity) spends and
//! gauges only those: on a machine two hosts share, one host's idle core
//! is not the other's to spend. The agents' idle gauge and the compression
//! chooser ([`crate::compress`]) both count through here.

/// The CPUs this process may run on, when that is fewer than the CPUs
/// `stat` lists; `None` when it may run on all of them (or its affinity
/// cannot be read).
pub fn own_cpus(stat: &str) -> Option<Vec<usize>> {
    // SAFETY: `cpu_set_t` is plain bits, zero is a valid value, and
    // sched_getaffinity writes at most the size it is given.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return None;
    }
    let listed = stat.lines().filter_map(cpu_number).count();
    // SAFETY: CPU_ISSET reads the set within CPU_SETSIZE.
    let own: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
        .collect();
    (!own.is_empty() && own.len() < listed).then_some(own)
}

/// N of a `/proc/stat` line `cpuN …`; `None` for any other line (the
/// all-CPU `cpu` line among them).
fn cpu_number(line: &str) -> Option<usize> {
    // `cpu  100 …` (all CPUs): what follows `cpu` is a space, not N
    line.strip_prefix("cpu")?
        .split(char::is_whitespace)
        .next()?
        .parse()
        .ok()
}

/// (busy, total) jiffies of the CPUs `cpus` (their `cpuN` lines, summed), or
/// of every CPU (the `cpu` line) with `None`: idle and iowait are not busy.
pub fn cpu_ticks_of(stat: &str, cpus: Option<&[usize]>) -> Option<(u64, u64)> {
    let Some(cpus) = cpus else {
        return ticks_of_line(stat.lines().find(|l| l.starts_with("cpu "))?);
    };
    let mut sum: Option<(u64, u64)> = None;
    for line in stat.lines() {
        if cpu_number(line).is_some_and(|n| cpus.contains(&n)) {
            if let Some((b, a)) = ticks_of_line(line) {
                let (sb, sa) = sum.unwrap_or((0, 0));
                sum = Some((sb + b, sa + a));
            }
        }
    }
    sum
}

/// (busy, total) of one `cpu…` line.
fn ticks_of_line(line: &str) -> Option<(u64, u64)> {
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 5 {
        return None;
    }
    let all: u64 = v.iter().sum();
    Some((all - v[3] - v[4], all))
}

/// `(busy, total)` ticks since boot of the CPUs this process may run on
/// (every CPU when it may run on all of them), read now.
pub fn own_ticks() -> Option<(u64, u64)> {
    static OWN: std::sync::OnceLock<Option<Vec<usize>>> = std::sync::OnceLock::new();
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let own = OWN.get_or_init(|| own_cpus(&stat));
    cpu_ticks_of(&stat, own.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_count_idle_and_iowait_as_not_busy() {
        let stat = "cpu  100 5 50 800 40 3 2 0 0 0\ncpu0 50 2 25 400 20 1 1 0 0 0\nintr 1\n";
        assert_eq!(cpu_ticks_of(stat, None), Some((160, 1000)));
        assert_eq!(cpu_ticks_of("cpu0 1 2 3 4 5\n", None), None);
        assert_eq!(cpu_ticks_of("cpu  1 2\n", None), None);
    }

    #[test]
    fn cpus_of_its_own_count_only_those() {
        // two CPUs: cpu0 (another host's) busy, cpu1 (this one's) idle
        let stat = "cpu  10 0 0 10 0 0 0 0\ncpu0 10 0 0 0 0 0 0 0\ncpu1 0 0 0 10 0 0 0 0\n";
        assert_eq!(cpu_ticks_of(stat, Some(&[1])), Some((0, 10)));
        assert_eq!(cpu_ticks_of(stat, Some(&[0, 1])), Some((10, 20)));
        assert_eq!(cpu_ticks_of(stat, Some(&[7])), None);
        // the all-CPU line's first figure is not a CPU's number
        assert_eq!(cpu_ticks_of(stat, Some(&[10])), None);
        assert_eq!(cpu_number("cpu  10 0 0 10"), None);
        assert_eq!(cpu_number("cpu12 1 2"), Some(12));
        // this process's own affinity: every CPU the test may run on is one
        // /proc/stat lists, and its ticks read
        let real = std::fs::read_to_string("/proc/stat").unwrap();
        if let Some(cpus) = own_cpus(&real) {
            assert!(!cpus.is_empty());
            assert!(cpu_ticks_of(&real, Some(&cpus)).is_some());
        }
        let (busy, all) = own_ticks().expect("this process's CPUs' ticks");
        assert!(busy <= all && all > 0);
    }
}
