//! What the host is, read from the kernel: its NICs and their networks,
//! its CPU time and idle share, a process's CPU from `/proc`. The floor
//! under everything that uses them (the VM registry, migrations, bandwidth
//! classes, validation): it uses none of them.

use std::path::PathBuf;
use std::time::Duration;

use ferry_api::NicInfo;
use ferry_transport::cpu::{cpu_ticks_of, own_cpus};

/// The host's idle CPU share over about the last second, kept by a sampler
/// (see [`IdleGauge::run`]) so a move's `auto` reads it at once instead of
/// watching the CPUs for a while first, and a drain's `GET /bandwidth`
/// (`cpu_busy`) reads the same second. It counts the CPUs this agent may run
/// on (its affinity: the host's cpuset when the host is given CPUs of its
/// own), the same set the choosers count as the host's CPUs: on a machine
/// that two hosts share, one host's idle core is not the other's to spend.
///
/// The sampler reads `/proc/stat` once a second; a reader takes one more
/// sample as it reads ([`IdleGauge::idle_now`]), so what it gets ends now
/// and spans `IdleGauge::WINDOW` or a little more. (Four samples a
/// second, each rendering `/proc/stat` with every interrupt's counters
/// twice, were two fifths of an idle pair of agents' CPU: 3.4 → 2.0 ms
/// per second in `bench/agent_cpu.py`.)
#[derive(Default)]
pub struct IdleGauge {
    /// (when, idle ticks, all ticks)
    samples: std::sync::Mutex<std::collections::VecDeque<(std::time::Instant, u64, u64)>>,
    /// the CPUs counted; `None`: every CPU (the `cpu` line)
    cpus: std::sync::OnceLock<Option<Vec<usize>>>,
    /// `/proc/stat`, kept open, and the buffer its text is read into
    stat: std::sync::Mutex<Option<(std::fs::File, Vec<u8>)>>,
}

impl IdleGauge {
    /// The span the idle share is taken over, at least.
    const WINDOW: Duration = Duration::from_millis(750);
    /// Below this no share is given (an agent just started: two samples
    /// milliseconds apart would be a tick or two): the sampler's old
    /// interval, the shortest span it ever gave.
    const SHORTEST: Duration = Duration::from_millis(250);
    /// Samples older than this (the newest two aside) are dropped.
    const KEEP_FOR: Duration = Duration::from_secs(3);
    const EVERY: Duration = Duration::from_secs(1);

    /// Takes one sample of `/proc/stat`'s text, read `at`.
    fn sample_at(&self, stat: &str, at: std::time::Instant) {
        let cpus = self.cpus.get_or_init(|| own_cpus(stat));
        if let Some((idle, all)) = cpu_ticks_of(stat, cpus.as_deref()) {
            let mut q = ferry_api::util::lock(&self.samples);
            q.push_back((at, idle, all));
            while q.len() > 2 && q.front().is_some_and(|f| at - f.0 > Self::KEEP_FOR) {
                q.pop_front();
            }
        }
    }

    /// Idle share from the newest sample back to the newest one at least
    /// `Self::WINDOW` older (the oldest if none is); `None` when that
    /// spans less than `Self::SHORTEST` (or no tick passed).
    pub fn idle(&self) -> Option<f64> {
        let q = ferry_api::util::lock(&self.samples);
        let b = q.back()?;
        let a = q
            .iter()
            .rev()
            .find(|a| b.0 - a.0 >= Self::WINDOW)
            .or(q.front())
            .filter(|a| b.0 - a.0 >= Self::SHORTEST)?;
        let all = b.2.saturating_sub(a.2);
        (all > 0).then(|| 1.0 - b.1.saturating_sub(a.1) as f64 / all as f64)
    }

    /// [`Self::idle`] with a sample taken now.
    pub fn idle_now(&self) -> Option<f64> {
        self.read();
        self.idle()
    }

    /// Reads `/proc/stat` and samples it. It is read in place: it never
    /// waits for a device, and a hand-off to the blocking pool would cost
    /// more wake-ups than the read. It stays open: each read from offset 0
    /// renders it anew.
    fn read(&self) {
        let mut kept = ferry_api::util::lock(&self.stat);
        if kept.is_none() {
            *kept = std::fs::File::open("/proc/stat")
                .ok()
                .map(|f| (f, Vec::new()));
        }
        let Some((f, buf)) = kept.as_mut() else {
            return;
        };
        if let Some(s) = read_whole(f, buf)
            .ok()
            .and_then(|t| std::str::from_utf8(t).ok())
        {
            self.sample_at(s, std::time::Instant::now());
        }
    }

    /// Samples every `Self::EVERY` (on the agent's [`tick`] grid) until
    /// the process ends.
    pub async fn run(&self) {
        loop {
            self.read();
            tick(Self::EVERY).await;
        }
    }
}

/// Waits for the next multiple of `every` since the agent's first tick:
/// the agent's periodic work (the idle gauge, the storage and bandwidth
/// watchers, the reaper, dirty-rate sampling, the lease's once-a-second
/// look) wakes on one grid, so work of the same period shares one wake-up
/// of the runtime instead of one each at phases of its own (idle agents:
/// 0.8 × the CPU, BENCHMARKS).
pub async fn tick(every: Duration) {
    static EPOCH: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(tokio::time::Instant::now);
    tokio::time::sleep_until(epoch + next_on_grid(epoch.elapsed(), every)).await;
}

/// The first multiple of `every` after `since` (`every` at least 1 ms).
fn next_on_grid(since: Duration, every: Duration) -> Duration {
    let step = every.max(Duration::from_millis(1)).as_nanos();
    let n = since.as_nanos() / step + 1;
    Duration::from_nanos(u64::try_from(n * step).unwrap_or(u64::MAX))
}

/// All of an open `/proc` file's text, read from offset 0 into `buf`. A
/// read that returns less than asked is the end: `/proc` renders a file
/// whole and hands out what fits, and a read past the start renders it
/// again to find its place (a final empty read doubled the cost).
fn read_whole<'a>(f: &std::fs::File, buf: &'a mut Vec<u8>) -> std::io::Result<&'a [u8]> {
    use std::os::unix::fs::FileExt as _;
    const CHUNK: usize = 16384;
    buf.clear();
    loop {
        let at = buf.len();
        buf.resize(at + CHUNK, 0);
        let n = f.read_at(&mut buf[at..], at as u64)?;
        buf.truncate(at + n);
        if n < CHUNK {
            return Ok(&buf[..]);
        }
    }
}

/// The CPUs this agent may use (its affinity and its cgroup's quota), read
/// once: the host's CPU set is given when the agent starts, and reading it
/// again is five files per heartbeat.
pub fn host_cpus() -> usize {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A number in a `/sys` attribute (a NIC's MTU, carrier, byte counters);
/// 0 when there is none.
pub(crate) fn read_u64(path: PathBuf) -> u64 {
    read_attribute(path)
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// `/sys` attribute files kept open. Each read from offset 0 renders the
/// value anew, and a heartbeat and each progress event read four per NIC:
/// opening them was most of what that cost.
static ATTRIBUTES: std::sync::Mutex<std::collections::BTreeMap<PathBuf, std::fs::File>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());
/// Files kept open at most (the VMs' tap devices come and go).
const ATTRIBUTES_OPEN: usize = 256;

/// An attribute's text, from its open file, or opened now: a file whose
/// read fails (its interface removed, perhaps another of the same name
/// since) is opened again.
fn read_attribute(path: PathBuf) -> Option<String> {
    use std::os::unix::fs::FileExt as _;
    let mut buf = [0u8; 64];
    let mut open = ferry_api::util::lock(&ATTRIBUTES);
    if let Some(f) = open.get(&path) {
        if let Ok(n) = f.read_at(&mut buf, 0) {
            return Some(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        open.remove(&path);
    }
    let f = std::fs::File::open(&path).ok()?;
    let n = f.read_at(&mut buf, 0).ok()?;
    if open.len() >= ATTRIBUTES_OPEN {
        open.clear();
    }
    open.insert(path, f);
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// An IPv4 network, `10.10.0.0/24`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Net {
    pub addr: std::net::Ipv4Addr,
    pub prefix: u8,
}

impl Ipv4Net {
    pub fn mask(prefix: u8) -> u32 {
        if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(prefix.min(32)))
        }
    }

    pub fn contains(&self, ip: std::net::Ipv4Addr) -> bool {
        let m = Self::mask(self.prefix);
        u32::from(ip) & m == u32::from(self.addr) & m
    }

    /// The network `ip` is on with `prefix` bits.
    pub fn of(ip: std::net::Ipv4Addr, prefix: u8) -> Ipv4Net {
        Ipv4Net {
            addr: (u32::from(ip) & Self::mask(prefix)).into(),
            prefix,
        }
    }
}

impl std::fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl std::str::FromStr for Ipv4Net {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s
            .split_once('/')
            .ok_or_else(|| format!("'{s}' is not a network (ADDRESS/PREFIX, e.g. 10.10.0.0/24)"))?;
        let addr = a
            .parse()
            .map_err(|_| format!("'{a}' in '{s}' is not an IPv4 address"))?;
        let prefix: u8 = p
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| format!("'/{p}' in '{s}' is not a prefix length 0..32"))?;
        Ok(Ipv4Net { addr, prefix })
    }
}

/// Which interfaces carry live migrations: by name, by network, or (both
/// empty) every interface with an IPv4 address but loopback.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NicSelection {
    pub names: Vec<String>,
    pub networks: Vec<Ipv4Net>,
}

/// A selection that names what this host does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NicSelectionError {
    #[error("no interface named '{name}' on this host (it has: {have})")]
    NoSuchNic { name: String, have: String },
    #[error("interface '{name}' has no IPv4 address")]
    NoAddress { name: String },
    #[error("{network} matches no address of this host (it has: {have})")]
    NoMatch { network: Ipv4Net, have: String },
}

impl NicSelection {
    fn selects(&self, name: &str, ip: std::net::Ipv4Addr) -> bool {
        if self.names.is_empty() && self.networks.is_empty() {
            return !ip.is_loopback();
        }
        self.names.iter().any(|n| n == name) || self.networks.iter().any(|n| n.contains(ip))
    }

    /// Refuses a selection naming an interface this host lacks, or a
    /// network none of its addresses is on.
    pub fn check(&self) -> Result<(), NicSelectionError> {
        self.check_against(&ipv4_addrs(), &interface_names())
    }

    fn check_against(
        &self,
        addrs: &[(String, std::net::Ipv4Addr, u8)],
        names: &[String],
    ) -> Result<(), NicSelectionError> {
        for name in &self.names {
            if !names.contains(name) {
                return Err(NicSelectionError::NoSuchNic {
                    name: name.clone(),
                    have: names.join(", "),
                });
            }
            if !addrs.iter().any(|(n, _, _)| n == name) {
                return Err(NicSelectionError::NoAddress { name: name.clone() });
            }
        }
        for net in &self.networks {
            if !addrs.iter().any(|(_, ip, _)| net.contains(*ip)) {
                let have: Vec<String> = addrs
                    .iter()
                    .map(|(n, ip, p)| format!("{n} {ip}/{p}"))
                    .collect();
                return Err(NicSelectionError::NoMatch {
                    network: *net,
                    have: have.join(", "),
                });
            }
        }
        Ok(())
    }
}

/// Every network interface's name (`/sys/class/net`).
fn interface_names() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A fabric's number: NICs of different hosts whose IPv4 networks are the
/// same share it (two hosts' NICs reach each other directly on it).
pub fn fabric_of(net: Ipv4Net) -> u32 {
    u32::from(net.addr) | u32::from(net.prefix)
}

/// This host's migration NICs (`sel`) with an IPv4 address, read from
/// `getifaddrs` and sysfs in the agent's own network namespace (no process
/// spawned: progress reads them every tick).
pub fn nics(sel: &NicSelection) -> Vec<NicInfo> {
    let mut out: Vec<NicInfo> = ipv4_addrs()
        .into_iter()
        .filter(|(name, ip, _)| sel.selects(name, *ip))
        .map(|(name, ip, prefix)| {
            let sys = PathBuf::from("/sys/class/net").join(&name);
            let net = Ipv4Net::of(ip, prefix);
            NicInfo {
                fabric: fabric_of(net),
                network: net.to_string(),
                address: ip.to_string(),
                mtu: read_u64(sys.join("mtu")) as u32,
                up: read_u64(sys.join("carrier")) == 1,
                tx_bytes: read_u64(sys.join("statistics/tx_bytes")),
                rx_bytes: read_u64(sys.join("statistics/rx_bytes")),
                name,
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The IPv4 address of interface `name` (any interface, not only a
/// migration NIC).
pub fn interface_address(name: &str) -> Option<std::net::Ipv4Addr> {
    ipv4_addrs()
        .into_iter()
        .find(|(n, _, _)| n == name)
        .map(|(_, ip, _)| ip)
}

/// The interfaces' IPv4 addresses as last read, and a `NETLINK_ROUTE`
/// socket that hears every link and address change: read again only after
/// one (a heartbeat a second asked the kernel for every link and address).
struct Addresses {
    /// Opened at the first read, before it, so no change falls between.
    changes: Option<ferry_transport::mptcp::paths::LinkEvents>,
    opened: bool,
    read: Option<Vec<(String, std::net::Ipv4Addr, u8)>>,
}

impl Addresses {
    const fn new() -> Addresses {
        Addresses {
            changes: None,
            opened: false,
            read: None,
        }
    }

    fn get(&mut self) -> Vec<(String, std::net::Ipv4Addr, u8)> {
        if !self.opened {
            self.opened = true;
            self.changes = ferry_transport::mptcp::paths::LinkEvents::open().ok();
        }
        // no socket to hear changes with: the kernel is asked each time
        let Some(changes) = &self.changes else {
            return read_ipv4_addrs();
        };
        if changes.changed() || self.read.is_none() {
            self.read = Some(read_ipv4_addrs());
        }
        self.read.clone().unwrap_or_default()
    }
}

static ADDRESSES: std::sync::Mutex<Addresses> = std::sync::Mutex::new(Addresses::new());

/// Every interface with an IPv4 address, with its first one and its prefix
/// length; as last read while nothing changed (see [`Addresses`]).
fn ipv4_addrs() -> Vec<(String, std::net::Ipv4Addr, u8)> {
    ferry_api::util::lock(&ADDRESSES).get()
}

/// Every interface with an IPv4 address, as the kernel has them now.
fn read_ipv4_addrs() -> Vec<(String, std::net::Ipv4Addr, u8)> {
    let mut out: Vec<(String, std::net::Ipv4Addr, u8)> = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: on success `list` heads a list getifaddrs allocated; it is read
    // only until the freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of that list; an IPv4 `ifa_addr` (and its
        // `ifa_netmask`) points to a sockaddr_in and `ifa_name` to a
        // NUL-terminated name.
        unsafe {
            let i = &*cur;
            if !i.ifa_addr.is_null() && i32::from((*i.ifa_addr).sa_family) == libc::AF_INET {
                let sin = &*(i.ifa_addr as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                let name = std::ffi::CStr::from_ptr(i.ifa_name)
                    .to_string_lossy()
                    .into_owned();
                let prefix = if i.ifa_netmask.is_null() {
                    32
                } else {
                    let m = &*(i.ifa_netmask as *const libc::sockaddr_in);
                    u32::from_be(m.sin_addr.s_addr).count_ones() as u8
                };
                if !out.iter().any(|(n, _, _)| *n == name) {
                    out.push((name, ip, prefix));
                }
            }
            cur = i.ifa_next;
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// User + system CPU time of a process (every thread), from `/proc/PID/stat`;
/// `None` once it is gone.
pub fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_of_stat(&stat)
}

/// This agent's own CPU time.
pub fn own_cpu() -> Duration {
    process_cpu(std::process::id()).unwrap_or_default()
}

/// The fields of a `/proc/PID/stat` line after the command name (which may
/// itself contain spaces and parentheses): `[0]` is field 3, the state.
pub fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    Some(stat.rsplit_once(')')?.1.split_whitespace().collect())
}

/// CPU time of those of `pid`'s live threads whose name starts with
/// `prefix` (QEMU names its threads with `debug-threads=on`, e.g.
/// `mig/src/send_0`); threads that have exited are not counted.
pub fn threads_cpu(pid: u32, prefix: &str) -> Duration {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Duration::ZERO;
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            let name = stat.split_once('(')?.1.rsplit_once(')')?.0;
            name.starts_with(prefix)
                .then(|| cpu_of_stat(&stat))
                .flatten()
        })
        .sum()
}

/// utime + stime (fields 14 and 15) of a `/proc/PID/stat` line.
pub fn cpu_of_stat(stat: &str) -> Option<Duration> {
    let f = stat_fields(stat)?;
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a constant of the running system
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_micros(ticks * 1_000_000 / hz))
}

#[cfg(test)]
mod cpu_tests {
    use super::*;

    #[test]
    fn periodic_work_of_one_period_lands_on_the_same_instants() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // whenever in a second two loops of 1 s ask, they wake together
        assert_eq!(next_on_grid(ms(30), s(1)), s(1));
        assert_eq!(next_on_grid(ms(970), s(1)), s(1));
        // on a grid instant itself: the next one, never now
        assert_eq!(next_on_grid(s(3), s(1)), s(4));
        // a 2 s loop wakes on every other instant of the 1 s loops
        assert_eq!(next_on_grid(ms(2500), s(2)), s(4));
        assert_eq!(next_on_grid(ms(2500), s(1)), s(3));
        // no zero period
        assert_eq!(next_on_grid(Duration::ZERO, Duration::ZERO), ms(1));
    }

    #[tokio::test(start_paused = true)]
    async fn two_ticks_asked_apart_end_together() {
        tick(Duration::from_secs(1)).await;
        let a = tokio::spawn(async {
            tick(Duration::from_secs(1)).await;
            tokio::time::Instant::now()
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        let b = tokio::spawn(async {
            tick(Duration::from_secs(1)).await;
            tokio::time::Instant::now()
        });
        assert_eq!(a.await.unwrap(), b.await.unwrap());
    }

    #[test]
    fn an_attribute_kept_open_is_read_anew_and_a_missing_one_reads_zero() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tx_bytes");
        std::fs::write(&f, "1500\n").unwrap();
        assert_eq!(read_u64(f.clone()), 1500);
        // the same file, its value changed in place: the open file reads it
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .and_then(|mut w| std::io::Write::write_all(&mut w, b"9000\n"))
            .unwrap();
        assert_eq!(read_u64(f.clone()), 9000);
        assert_eq!(read_u64(dir.path().join("missing")), 0);
        // a real attribute, read twice through its open file
        let lo = PathBuf::from("/sys/class/net/lo/mtu");
        if lo.exists() {
            let mtu = read_u64(lo.clone());
            assert!(mtu > 0);
            assert_eq!(read_u64(lo), mtu);
        }
    }

    #[test]
    fn an_open_file_is_read_whole_from_its_start_each_time() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big");
        let text: String = (0..5000).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&p, &text).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        let mut buf = Vec::new();
        assert_eq!(read_whole(&f, &mut buf).unwrap(), text.as_bytes());
        assert_eq!(
            read_whole(&f, &mut buf).unwrap(),
            text.as_bytes(),
            "again, whole"
        );
        let stat = std::fs::File::open("/proc/stat").unwrap();
        for _ in 0..2 {
            let s = std::str::from_utf8(read_whole(&stat, &mut buf).unwrap()).unwrap();
            assert!(
                cpu_ticks_of(s, None).is_some(),
                "/proc/stat rendered anew: {s:.80}"
            );
        }
    }

    #[test]
    fn a_host_with_cpus_of_its_own_gauges_only_those() {
        // two CPUs: cpu0 (another host's) busy, cpu1 (this one's) idle
        let stat = |t: u64| {
            format!(
                "cpu  {} 0 0 {} 0 0 0 0\ncpu0 {t} 0 0 0 0 0 0 0\ncpu1 0 0 0 {t} 0 0 0 0\n",
                t, t
            )
        };
        let own = IdleGauge::default();
        own.cpus.set(Some(vec![1])).unwrap();
        let all = IdleGauge::default();
        all.cpus.set(None).unwrap();
        let t0 = std::time::Instant::now();
        for t in [100, 200] {
            // a second apart
            let at = t0 + Duration::from_millis(t * 10);
            own.sample_at(&stat(t), at);
            all.sample_at(&stat(t), at);
        }
        assert_eq!(own.idle(), Some(1.0));
        assert_eq!(all.idle(), Some(0.5));
    }

    #[test]
    fn the_idle_gauge_takes_the_last_window_back_from_its_newest_sample() {
        let g = IdleGauge::default();
        let stat = |user: u64, idle: u64| format!("cpu  {user} 0 0 {idle} 0 0 0 0\n");
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(g.idle(), None, "no sample yet");
        g.sample_at(&stat(0, 0), at(0));
        assert_eq!(g.idle(), None, "one sample is no interval");
        let short = IdleGauge::default();
        short.sample_at(&stat(0, 0), at(0));
        short.sample_at(&stat(1, 9), at(100));
        assert_eq!(short.idle(), None, "100 ms is too short a span");
        // busy for a second
        g.sample_at(&stat(100, 0), at(1000));
        assert_eq!(g.idle(), Some(0.0));
        // then idle: a sample 400 ms later is too close to the last one, so
        // the share runs back to the one before (1400 ms: 100 busy, 40 idle)
        g.sample_at(&stat(100, 40), at(1400));
        assert_eq!(g.idle(), Some(40.0 / 140.0));
        // 800 ms after the second: from it only, all idle
        g.sample_at(&stat(100, 80), at(1800));
        assert_eq!(g.idle(), Some(1.0));
        g.sample_at("garbage", at(1900));
        assert_eq!(g.idle(), Some(1.0), "an unreadable sample is skipped");
        // old samples go, the newest two stay
        g.sample_at(&stat(100, 500), at(9000));
        assert_eq!(ferry_api::util::lock(&g.samples).len(), 2);
        assert_eq!(g.idle(), Some(1.0));
    }

    #[test]
    fn the_idle_gauge_reads_the_host_now() {
        let g = IdleGauge::default();
        g.read();
        // past the shortest span: thirty ticks of every CPU at 100 Hz
        std::thread::sleep(Duration::from_millis(300));
        let i = g.idle_now().unwrap();
        assert!((0.0..=1.0).contains(&i), "{i}");
        assert_eq!(ferry_api::util::lock(&g.samples).len(), 2);
    }

    #[test]
    fn threads_are_counted_by_name() {
        let me = std::process::id();
        let busy = std::thread::Builder::new()
            .name("ferry-test-spin".into())
            .spawn(|| {
                let t = std::time::Instant::now();
                let mut x = 0u64;
                while t.elapsed() < Duration::from_millis(300) {
                    x = x.wrapping_add(std::hint::black_box(1));
                }
                std::thread::sleep(Duration::from_millis(500));
                x
            })
            .unwrap();
        std::thread::sleep(Duration::from_millis(400));
        let spun = threads_cpu(me, "ferry-test-sp");
        assert!(spun >= Duration::from_millis(100), "{spun:?}");
        assert_eq!(threads_cpu(me, "no-such-thread"), Duration::ZERO);
        busy.join().unwrap();
    }

    #[test]
    fn interface_addresses_come_from_getifaddrs() {
        let all = ipv4_addrs();
        assert!(
            all.iter()
                .any(|(n, ip, p)| n == "lo" && *ip == std::net::Ipv4Addr::LOCALHOST && *p == 8),
            "lo with 127.0.0.1 missing from {all:?}"
        );
    }

    #[test]
    #[ignore = "needs root: a network namespace of its own"]
    fn an_address_added_or_removed_is_seen_at_the_next_read() {
        std::thread::spawn(|| {
            // this thread only (and what it starts) in a namespace of its own
            // SAFETY: unshare(2) with a flag; it changes only this thread.
            let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(
                r,
                0,
                "unshare(CLONE_NEWNET): {} (root needed)",
                std::io::Error::last_os_error()
            );
            let ip = |args: &[&str]| {
                let out = std::process::Command::new("ip")
                    .args(args)
                    .output()
                    .unwrap();
                assert!(out.status.success(), "ip {args:?}: {out:?}");
            };
            let named = |all: &[(String, std::net::Ipv4Addr, u8)], n: &str| {
                all.iter()
                    .find(|a| a.0 == n)
                    .map(|a| (a.1.to_string(), a.2))
            };
            let mut a = Addresses::new();
            assert_eq!(named(&a.get(), "ft0"), None);
            ip(&["link", "add", "ft0", "type", "veth", "peer", "name", "ft1"]);
            ip(&["addr", "add", "198.18.250.1/30", "dev", "ft0"]);
            assert_eq!(
                named(&a.get(), "ft0"),
                Some(("198.18.250.1".to_string(), 30))
            );
            assert_eq!(named(&a.get(), "ft0").unwrap().1, 30, "unchanged: as read");
            ip(&["addr", "del", "198.18.250.1/30", "dev", "ft0"]);
            ip(&["addr", "add", "198.18.250.5/31", "dev", "ft0"]);
            assert_eq!(
                named(&a.get(), "ft0"),
                Some(("198.18.250.5".to_string(), 31))
            );
            ip(&["link", "del", "ft0"]);
            assert_eq!(named(&a.get(), "ft0"), None);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_selection_names_what_the_host_lacks() {
        let ip = |s: &str| s.parse::<std::net::Ipv4Addr>().unwrap();
        let addrs = vec![
            ("lo".to_string(), ip("127.0.0.1"), 8),
            ("ens1f0".to_string(), ip("10.10.0.5"), 24),
            ("ens1f1".to_string(), ip("10.20.0.5"), 24),
        ];
        let names: Vec<String> = ["ens1f0", "ens1f1", "ens2", "lo"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let by_name = |n: &[&str]| NicSelection {
            names: n.iter().map(|s| s.to_string()).collect(),
            networks: vec![],
        };
        assert_eq!(by_name(&["ens1f0"]).check_against(&addrs, &names), Ok(()));
        assert!(matches!(
            by_name(&["eth9"]).check_against(&addrs, &names),
            Err(NicSelectionError::NoSuchNic { name, .. }) if name == "eth9"
        ));
        assert!(matches!(
            by_name(&["ens2"]).check_against(&addrs, &names),
            Err(NicSelectionError::NoAddress { name }) if name == "ens2"
        ));
        let net = |s: &str| NicSelection {
            names: vec![],
            networks: vec![s.parse().unwrap()],
        };
        assert_eq!(net("10.20.0.0/16").check_against(&addrs, &names), Ok(()));
        let e = net("10.30.0.0/24")
            .check_against(&addrs, &names)
            .unwrap_err();
        assert!(
            e.to_string().starts_with("10.30.0.0/24 matches no address"),
            "{e}"
        );
        assert!(NicSelection::default().selects("eth0", ip("10.0.0.1")));
        assert!(!NicSelection::default().selects("lo", ip("127.0.0.1")));
        assert!(net("10.20.0.0/24").selects("x", ip("10.20.0.9")));
        assert!(!net("10.20.0.0/24").selects("x", ip("10.21.0.9")));
    }

    #[test]
    fn networks_parse_and_name_their_fabric() {
        let n: Ipv4Net = "198.18.1.13/24".parse().unwrap();
        assert_eq!(Ipv4Net::of(n.addr, n.prefix).to_string(), "198.18.1.0/24");
        assert!("10.0.0.0".parse::<Ipv4Net>().is_err());
        assert!("10.0.0.0/33".parse::<Ipv4Net>().is_err());
        assert!("10.0.0/8".parse::<Ipv4Net>().is_err());
        let a = Ipv4Net::of("10.1.0.7".parse().unwrap(), 24);
        let b = Ipv4Net::of("10.1.0.9".parse().unwrap(), 24);
        let c = Ipv4Net::of("10.2.0.9".parse().unwrap(), 24);
        assert_eq!(fabric_of(a), fabric_of(b));
        assert_ne!(fabric_of(a), fabric_of(c));
        assert_eq!(Ipv4Net::mask(0), 0);
        assert_eq!(Ipv4Net::mask(32), u32::MAX);
    }

    #[test]
    fn stat_lines_with_odd_names_parse() {
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        let line = format!(
            "42 (qemu (x) y) S 1 42 42 0 -1 4194560 100 0 0 0 {} {} 0 0 20 0 1 0",
            3 * hz,
            hz
        );
        assert_eq!(cpu_of_stat(&line), Some(Duration::from_secs(4)));
        assert_eq!(cpu_of_stat("garbage"), None);
        assert!(process_cpu(std::process::id()).is_some());
    }
}
