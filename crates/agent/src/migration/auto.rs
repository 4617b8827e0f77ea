//! `auto`: which data path a migration takes, from what the source measures
//! (NIC pairs, MPTCP, a sample of guest memory, idle CPU).

use ferry_api::MigrationOption;

use crate::qemu::QemuVm;

/// `auto` reads this many chunks of guest memory, spread evenly over it, to
/// judge whether it compresses.
const SAMPLE_CHUNKS: u64 = 32;
const SAMPLE_CHUNK: u64 = 128 << 10;
/// A sample that LZ4 shrinks to this share or less counts as compressible.
pub const AUTO_COMPRESSES: f64 = 0.8;
/// What the agents' relay of Ferry's carriers costs beyond the handed-off
/// socket, CPU seconds per GiB carried, both hosts together (BENCHMARKS.md
/// "auto on random and compressible memory": 6.2 against 3.6).
pub const RELAY_CPU_S_PER_GIB: f64 = 2.5;
/// Memory that does not compress goes by Ferry's carriers only when the
/// idle CPU covers their relay at the links' full rate this many times.
pub const RELAY_MARGIN: f64 = 2.0;

/// `link_bits` per second in GiB per second.
fn gib_per_s(link_bits: u64) -> f64 {
    link_bits as f64 / 8.0 / (1u64 << 30) as f64
}

/// CPUs' worth compression may spend: the `idle` share of `cpus`, less the
/// [`MIN_IDLE`] share it keeps free.
///
/// [`MIN_IDLE`]: ferry_transport::compress::MIN_IDLE
fn spare_cpus(idle: f64, cpus: usize) -> f64 {
    (idle - ferry_transport::compress::MIN_IDLE).max(0.0) * cpus as f64
}

/// Room for the carriers' relay: idle CPUs (`idle` share of `cpus`) at
/// least [`RELAY_MARGIN`] × what relaying `link_bits` per second costs.
pub(super) fn relay_fits(idle: f64, cpus: usize, link_bits: u64) -> bool {
    link_bits > 0 && idle * cpus as f64 >= gib_per_s(link_bits) * RELAY_CPU_S_PER_GIB * RELAY_MARGIN
}

/// What `auto` picks over one NIC pair, and why: `compression` when a
/// memory sample compresses to [`AUTO_COMPRESSES`] or less (`ratio`) and
/// more than the [`MIN_IDLE`] share of the CPU is idle (`idle`), or to
/// [`BUSY_COMPRESSES`] or less however busy the CPU; else `tcp`,
/// QEMU's own stream. There is nothing to spread over, so the question is
/// only whether compressing pays: on a compressible guest over a 300 Mbit/s
/// link, `tcp` took 21.6 s where `compression` took 1.54 s (BENCHMARKS.md).
/// Memory that does not compress (or a sample of zero pages only, which
/// QEMU sends as a flag each) goes as it is, without a relay. What
/// `compression` then does with the link and the spare CPU (QEMU's zstd,
/// Ferry's frames, or QEMU's own channels when the link is faster than the
/// spare CPU compresses) it decides itself.
///
/// An encrypted move (`encrypted`, the cluster's default) never takes
/// `tcp`: QEMU's TLS seals its one stream in QEMU's one migration thread,
/// where Ferry's carriers seal each connection in parallel. Over one NIC
/// pair with random memory on pinned hosts, the sealed carriers took 0.93 ×
/// (1 Gbit/s) and 0.69 × (unshaped) `tcp`'s time, and 1.00 × and 1.06 ×
/// QEMU's multifd + zstd with TLS (BENCHMARKS.md, "One NIC pair, encrypted").
///
/// [`MIN_IDLE`]: ferry_transport::compress::MIN_IDLE
pub(super) fn auto_one_pair(
    ratio: Option<f64>,
    idle: Option<f64>,
    encrypted: bool,
) -> (MigrationOption, String) {
    let shown = ratio.map_or("all zero".to_string(), |r| format!("{r:.2}"));
    let idle_pct = idle.map_or(0.0, |i| i * 100.0);
    let min_idle = ferry_transport::compress::MIN_IDLE;
    match (ratio, idle) {
        (Some(r), Some(i)) if r <= AUTO_COMPRESSES && i >= min_idle => (
            MigrationOption::Compression,
            format!(
                "one NIC pair, and a memory sample compresses to {shown} with the CPU \
                 {idle_pct:.0}% idle: compressed"
            ),
        ),
        (Some(r), _) if r <= BUSY_COMPRESSES => (
            MigrationOption::Compression,
            format!(
                "one NIC pair, and a memory sample compresses to {shown}: compressed although \
                 the CPU is only {idle_pct:.0}% idle, since that costs less CPU than carrying \
                 the pages as they are"
            ),
        ),
        _ if encrypted => (
            MigrationOption::Compression,
            format!(
                "one NIC pair, encrypted: Ferry's sealed carriers (a memory sample compresses \
                 to {shown} with the CPU {idle_pct:.0}% idle; frames compressed only where that \
                 wins), since QEMU's TLS would seal its one stream in one thread"
            ),
        ),
        (Some(r), _) if r <= AUTO_COMPRESSES => (
            MigrationOption::Tcp,
            format!(
                "one NIC pair: QEMU's own stream; a memory sample compresses to {shown} but \
                 the CPU is only {idle_pct:.0}% idle, too little to compress"
            ),
        ),
        _ => (
            MigrationOption::Tcp,
            format!("one NIC pair: QEMU's own stream; a memory sample compresses to {shown} only"),
        ),
    }
}

/// What `auto` picks over more than one NIC pair, and why.
///
/// Ferry's carriers are the kind that can compress (per frame, with idle
/// CPU, when the link is the bottleneck); a guest whose memory compresses
/// crosses link-bound fabrics several times faster on them. They also fill
/// a link fuller (0.95 of a shaped MTU-1500 link against 0.938 for MPTCP
/// subflows, whose every segment carries a DSS option), for the CPU of the
/// agents' relay ([`RELAY_CPU_S_PER_GIB`]): memory that does not compress
/// takes them when the idle CPU has room for that relay at the links' rate
/// (`relay_room`, see [`relay_fits`]). Otherwise the handed-off MPTCP socket
/// wins: QEMU writes straight into the kernel and no byte passes through an
/// agent, so the move costs no more CPU than QEMU over MPTCP. BENCHMARKS.md
/// has the runs. A kernel without MPTCP needs Ferry's frames. An encrypted
/// move (`encrypted`, the cluster's default) takes them too: over the
/// handed-off socket QEMU's TLS encrypts in QEMU's one migration thread,
/// which held 2 × 1 Gbit/s moves to 0.55-0.6 of their clear speed, where
/// the carriers, sealing per connection in parallel, kept 0.97-1.00
/// (BENCHMARKS.md, "Encryption by default").
pub(super) fn auto_choice(
    mptcp: bool,
    encrypted: bool,
    ratio: Option<f64>,
    idle: Option<f64>,
    relay_room: Option<u64>,
) -> (MigrationOption, String) {
    let carriers = MigrationOption::Multichannel;
    if !mptcp {
        return (
            carriers,
            "Ferry's carriers (this kernel has no MPTCP)".into(),
        );
    }
    if encrypted {
        return (
            carriers,
            "Ferry's carriers, sealed: they encrypt on every NIC in parallel, where QEMU's TLS \
             on a handed-off socket encrypts in one thread"
                .into(),
        );
    }
    let shown = ratio.map_or("all zero".to_string(), |r| format!("{r:.2}"));
    let idle_pct = idle.map_or(0.0, |i| i * 100.0);
    let min_idle = ferry_transport::compress::MIN_IDLE;
    match (ratio, idle) {
        (Some(r), Some(i)) if r <= AUTO_COMPRESSES && i >= min_idle => (
            carriers,
            format!(
                "Ferry's carriers: a memory sample compresses to {shown} and the CPU is \
                 {idle_pct:.0}% idle, so frames are compressed when the link is the bottleneck"
            ),
        ),
        (Some(r), _) if r <= AUTO_COMPRESSES => (
            MigrationOption::Mptcp,
            format!(
                "QEMU handed an MPTCP socket: memory compresses to {shown} but the CPU is \
                 only {idle_pct:.0}% idle, too little to compress; no byte passes through an agent"
            ),
        ),
        _ if relay_room.is_some() => (
            carriers,
            format!(
                "Ferry's carriers: a memory sample compresses to {shown} only, and the CPU is \
                 {idle_pct:.0}% idle, room for the agents' relay at the links' {} Mbit/s; \
                 their frames fill a link fuller than MPTCP subflows",
                relay_room.unwrap_or(0) / 1_000_000
            ),
        ),
        _ => (
            MigrationOption::Mptcp,
            format!(
                "QEMU handed an MPTCP socket: a memory sample compresses to {shown} only, \
                 so no byte passes through an agent"
            ),
        ),
    }
}

/// The zstd level QEMU compresses with when it compresses: its fastest.
/// Guest memory that compresses gains nothing from level 3 (the workload's
/// pages: 1.44 MB at 3 against 1.33 MB at 1 per 64 MiB, `zstd -b`), and on
/// the target the cost is the same at any level.
pub const QEMU_ZSTD_LEVEL: u8 = 1;

/// Whether QEMU compresses guest memory itself, in its multifd channels,
/// before Ferry's carriers take it (a move that may compress, whose memory
/// sample compressed to `ratio`, with `idle` CPU of `cpus`, over links of
/// `link_bits` per second, 0 unknown); the zstd level, and why.
///
/// QEMU compresses every page in place in its multifd threads; Ferry's
/// frames would first copy each raw byte through both agents (QEMU → agent
/// → carrier → agent → QEMU). With both hosts on two cores the copies are
/// what limits a compressible guest's move: 512 MiB took 2.2 CPU-s
/// compressed by QEMU against 3.4 by Ferry's frames (BENCHMARKS.md
/// "Compression: …"). QEMU's codec is fixed for the whole migration, so it
/// is chosen for memory that compresses ([`AUTO_COMPRESSES`]) with the CPU
/// idle enough to start compressing, and for memory whose sample does not
/// compress only when the spare CPU covers QEMU's zstd on every page on top
/// of loading and relaying them at the links' full rate ([`zstd_fits`]): a
/// sample's average hides the parts that compress (a guest's kernel and
/// tables beside its data), which then cross the relay already small, and
/// zstd costs little on pages that do not shrink. Ferry's per-frame chooser
/// still runs on top of it (QEMU's packet headers and page lists compress,
/// its compressed pages go as they are) and alone for the rest.
pub(super) fn qemu_compresses(
    ratio: Option<f64>,
    idle: Option<f64>,
    cpus: usize,
    link_bits: u64,
) -> (Option<u8>, String) {
    let min_idle = ferry_transport::compress::MIN_IDLE;
    let idle_pct = idle.map_or(0.0, |i| i * 100.0);
    match (ratio, idle) {
        (Some(r), Some(i)) if r <= AUTO_COMPRESSES && i >= min_idle => (
            Some(QEMU_ZSTD_LEVEL),
            format!(
                "QEMU compresses with zstd {QEMU_ZSTD_LEVEL} in its multifd channels: a memory \
                 sample compresses to {r:.2} and the CPU is {idle_pct:.0}% idle"
            ),
        ),
        (Some(r), _) if r <= BUSY_COMPRESSES => (
            Some(QEMU_ZSTD_LEVEL),
            format!(
                "QEMU compresses with zstd {QEMU_ZSTD_LEVEL} in its multifd channels although the \
                 CPU is only {idle_pct:.0}% idle: a memory sample compresses to {r:.2}, and \
                 compressing costs less CPU than carrying the pages as they are"
            ),
        ),
        (Some(r), _) if r <= AUTO_COMPRESSES => (
            None,
            format!(
                "QEMU sends pages as they are: memory compresses to {r:.2} but the CPU is only \
                 {idle_pct:.0}% idle; Ferry compresses frames if it becomes idle"
            ),
        ),
        (Some(r), Some(i)) if zstd_fits(i, cpus, link_bits) => (
            Some(QEMU_ZSTD_LEVEL),
            format!(
                "QEMU compresses with zstd {QEMU_ZSTD_LEVEL} in its multifd channels although a \
                 memory sample compresses to {r:.2} only: the spare CPU ({idle_pct:.0}% idle of \
                 {cpus}) loads, relays and compresses at the links' {} Mbit/s, and what compresses \
                 then crosses the agents already small",
                link_bits / 1_000_000
            ),
        ),
        (Some(r), _) => (
            None,
            format!(
                "QEMU sends pages as they are: a memory sample compresses to {r:.2} only; \
                 Ferry compresses the frames that gain"
            ),
        ),
        (None, _) => (
            None,
            "QEMU sends pages as they are: the memory sample was all zero (QEMU sends no zero \
             page) or could not be read"
                .into(),
        ),
    }
}

/// Memory whose sample compresses to this or less is compressed by QEMU
/// even when the CPU is busy: carrying a GiB as it is costs the hosts
/// [`RELAY_CPU_S_PER_GIB`] (sealed and relayed by the agents, or through
/// QEMU's TLS), and compressing it first costs at most
/// [`QEMU_ZSTD_CPU_S_PER_GIB`] (zstd's cost on pages that do not shrink)
/// plus carrying what is left: below 1 − 1.5 ÷ 2.5 = 0.4 compressing is the
/// cheaper of the two. Measured on hosts of one core each (BENCHMARKS.md
/// "Compression on hosts with CPUs of their own"): the workload's memory
/// (0.06) sent as it was took 5.9 CPU-s and 5.6 s unshaped, compressed 1.7
/// CPU-s and 1.25 s.
pub const BUSY_COMPRESSES: f64 = 1.0 - QEMU_ZSTD_CPU_S_PER_GIB / RELAY_CPU_S_PER_GIB;

/// QEMU's zstd over pages that do not shrink, CPU seconds per GiB of guest
/// memory (its multifd send threads; loading what zstd left as it was costs
/// the target no more than raw pages): the random-memory guest of
/// `bench/compression.py` at 1 Gbit/s, 0.52 GiB of pages, took 0.56-0.74
/// CPU-s in QEMU's send threads and its moves 0.6 CPU-s more in all
/// (BENCHMARKS.md "Compression at 1 Gbit/s: QEMU compresses memory whose
/// sample does not").
pub const QEMU_ZSTD_CPU_S_PER_GIB: f64 = 1.5;

/// Room for QEMU's zstd on every page: the spare CPU (`idle` share of
/// `cpus`, less the [`MIN_IDLE`] share kept free) covers loading
/// ([`LOAD_CPU_S_PER_GIB`]), the agents' relay ([`RELAY_CPU_S_PER_GIB`])
/// and zstd ([`QEMU_ZSTD_CPU_S_PER_GIB`]) at the links' full rate.
///
/// [`MIN_IDLE`]: ferry_transport::compress::MIN_IDLE
pub(super) fn zstd_fits(idle: f64, cpus: usize, link_bits: u64) -> bool {
    link_bits > 0
        && spare_cpus(idle, cpus)
            >= gib_per_s(link_bits)
                * (LOAD_CPU_S_PER_GIB + RELAY_CPU_S_PER_GIB + QEMU_ZSTD_CPU_S_PER_GIB)
}

/// QEMU's own CPU to send and load a GiB of guest memory, both hosts
/// together: the source's multifd send threads, and the target's receive
/// threads, most of it the kernel clearing each fresh page they write. In
/// this lab's moves 2.0 CPU-s for 0.57 GiB of pages, compressed or not
/// (BENCHMARKS.md "Compression: QEMU's own channels …").
pub const LOAD_CPU_S_PER_GIB: f64 = 3.5;

/// Whether `compression` hands a move to QEMU's own multifd channels,
/// straight from the source's QEMU to the target's, and why: when QEMU
/// sends the pages as they are (it was not asked to compress them) and the
/// link (`link_bits`, 0 unknown) delivers them faster than the spare CPU
/// (`idle` share of `cpus`, less the [`MIN_IDLE`] share compression keeps
/// free) can load them ([`LOAD_CPU_S_PER_GIB`]). Then the CPU, not the
/// link, is the limit: Ferry's frames would gain little (the pages do not
/// compress, or there is no CPU to compress them) and each CPU-second the
/// agents' relay takes (QEMU → agent → carrier → agent → QEMU) is one the
/// hosts do not spend loading. Not for memory QEMU compresses: its
/// compressed pages outrun the target's loading, and only Ferry's stream
/// windows keep that backlog (the switch-over's wait) small. Not for a
/// move that is `encrypted` either: QEMU's channels would then seal every
/// page in QEMU's TLS, one channel per thread, which on hosts of one core
/// each took 3.12 s where Ferry's sealed carriers took 2.50 s for the same
/// random memory (BENCHMARKS.md, "Compression's own channels in clear
/// only").
///
/// [`MIN_IDLE`]: ferry_transport::compress::MIN_IDLE
pub(super) fn own_channels(
    ratio: Option<f64>,
    idle: Option<f64>,
    cpus: usize,
    link_bits: u64,
    encrypted: bool,
) -> Option<String> {
    let idle = idle?;
    if link_bits == 0 || encrypted {
        return None;
    }
    let gib = (1u64 << 30) as f64;
    let loads = spare_cpus(idle, cpus) / LOAD_CPU_S_PER_GIB * gib * 8.0;
    if (link_bits as f64) <= loads {
        return None;
    }
    let shown = ratio.map_or("all zero".to_string(), |r| format!("{r:.2}"));
    Some(format!(
        "QEMU's own multifd channels carry it, no agent relays a byte: its pages go as they are \
         (a memory sample compresses to {shown}) and the link's {} Mbit/s outruns what the \
         spare CPU ({:.0}% idle of {cpus}) loads, {:.0} Mbit/s: the CPU is the limit",
        link_bits / 1_000_000,
        idle * 100.0,
        loads / 1e6
    ))
}

/// LZ4's ratio on [`SAMPLE_CHUNKS`] chunks of the guest's memory (QMP
/// `pmemsave` into the VM's directory); `None` if it is all zero or cannot be read.
pub(super) async fn sample_memory(vm: &QemuVm, memory: u64) -> Option<f64> {
    // below 2 GiB guest-physical addresses are RAM on q35 whatever the size
    let span = memory.min(2 << 30);
    let step = span / SAMPLE_CHUNKS;
    let file = vm.dir.join("auto-sample.bin");
    let mut sample = Vec::with_capacity((SAMPLE_CHUNKS * SAMPLE_CHUNK) as usize);
    for i in 0..SAMPLE_CHUNKS {
        let addr = (step * i + step / 2) & !4095;
        let size = SAMPLE_CHUNK.min(span.saturating_sub(addr));
        if vm.qmp.pmemsave(addr, size, &file).await.is_err() {
            break;
        }
        match tokio::fs::read(&file).await {
            Ok(b) => sample.extend(b),
            Err(_) => break,
        }
    }
    let _ = tokio::fs::remove_file(&file).await;
    ferry_transport::compress::sample_ratio(&sample)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_over_one_nic_pair_compresses_only_what_compresses_with_cpu_to_spare() {
        let (o, why) = auto_one_pair(Some(0.06), Some(0.9), false);
        assert_eq!(o, MigrationOption::Compression, "{why}");
        assert!(why.contains("compresses to 0.06"), "{why}");
        // random memory: QEMU's own stream, whatever the CPU
        assert_eq!(
            auto_one_pair(Some(1.0), Some(0.9), false).0,
            MigrationOption::Tcp
        );
        // a sample of zero pages: QEMU sends each as a flag
        assert_eq!(
            auto_one_pair(None, Some(0.9), false).0,
            MigrationOption::Tcp
        );
        // compressible, but the CPU is busy: compressing would slow the move
        let (o, why) = auto_one_pair(Some(0.6), Some(0.1), false);
        assert_eq!(o, MigrationOption::Tcp);
        assert!(why.contains("too little to compress"), "{why}");
        // no idle figure: no compression on a guess
        assert_eq!(
            auto_one_pair(Some(0.6), None, false).0,
            MigrationOption::Tcp
        );
        // ... unless it compresses so well that compressing costs less CPU
        // than carrying it as it is, busy or not
        let (o, why) = auto_one_pair(Some(0.06), Some(0.1), false);
        assert_eq!(o, MigrationOption::Compression, "{why}");
        assert!(why.contains("less CPU"), "{why}");
        assert_eq!(
            auto_one_pair(Some(0.06), None, false).0,
            MigrationOption::Compression
        );
        // encrypted: never QEMU's TLS on its one stream, whatever the memory
        for (ratio, idle) in [
            (Some(1.0), Some(0.9)),
            (None, Some(0.9)),
            (Some(0.6), Some(0.1)),
        ] {
            let (o, why) = auto_one_pair(ratio, idle, true);
            assert_eq!(o, MigrationOption::Compression, "{ratio:?} {idle:?}: {why}");
            assert!(why.contains("sealed carriers"), "{why}");
        }
        // what compresses keeps its own reason
        let (_, why) = auto_one_pair(Some(0.06), Some(0.9), true);
        assert!(why.contains("compresses to 0.06 with the CPU"), "{why}");
    }

    #[test]
    fn qemu_compresses_memory_that_compresses_while_the_cpu_is_idle() {
        // recorded samples: the workload's compressible pages (0.06 with
        // zstd), random pages (1.0), a guest kernel's pages (0.3)
        assert_eq!(
            qemu_compresses(Some(0.06), Some(0.5), 2, 0).0,
            Some(QEMU_ZSTD_LEVEL)
        );
        assert_eq!(
            qemu_compresses(Some(0.3), Some(0.9), 2, 0).0,
            Some(QEMU_ZSTD_LEVEL)
        );
        // random memory over a link the spare CPU cannot also compress at
        // (two cores, 10 Gbit/s): Ferry's frames decide
        let (level, why) = qemu_compresses(Some(1.0), Some(0.9), 2, 10_000_000_000);
        assert_eq!(level, None);
        assert!(why.contains("1.00 only"), "{why}");
        // the same memory over 1 Gbit/s with the CPU idle: QEMU's zstd on
        // every page fits, and catches the parts the sample's average hides
        let (level, why) = qemu_compresses(Some(1.0), Some(0.9), 2, 1_000_000_000);
        assert_eq!(level, Some(QEMU_ZSTD_LEVEL));
        assert!(
            why.contains("1.00 only") && why.contains("1000 Mbit/s"),
            "{why}"
        );
        // ... but not with half the CPU busy, nor over two such links, nor
        // over a link of unknown rate
        assert_eq!(
            qemu_compresses(Some(1.0), Some(0.5), 2, 1_000_000_000).0,
            None
        );
        assert_eq!(
            qemu_compresses(Some(1.0), Some(0.9), 2, 2_000_000_000).0,
            None
        );
        assert_eq!(qemu_compresses(Some(1.0), Some(0.9), 2, 0).0, None);
        // a busy CPU: memory that compresses well is still compressed (it
        // costs less CPU than carrying it as it is) ...
        let (level, why) = qemu_compresses(Some(0.06), Some(0.05), 2, 1_000_000_000);
        assert_eq!(level, Some(QEMU_ZSTD_LEVEL));
        assert!(why.contains("5% idle") && why.contains("less CPU"), "{why}");
        assert_eq!(
            qemu_compresses(Some(0.06), None, 2, 1_000_000_000).0,
            Some(QEMU_ZSTD_LEVEL)
        );
        assert!((BUSY_COMPRESSES - 0.4).abs() < 1e-9);
        // ... and memory that compresses less is not fixed for the whole move
        let (level, why) = qemu_compresses(Some(0.6), Some(0.05), 2, 1_000_000_000);
        assert_eq!(level, None);
        assert!(why.contains("5% idle"), "{why}");
        assert_eq!(qemu_compresses(Some(0.6), None, 2, 1_000_000_000).0, None);
        // all zero, or no sample
        assert_eq!(qemu_compresses(None, Some(0.9), 2, 1_000_000_000).0, None);
    }

    #[test]
    fn auto_compresses_on_carriers_only_what_compresses_with_idle_cpu() {
        let pick = |mptcp, ratio, idle| auto_choice(mptcp, false, ratio, idle, None).0;
        // compressible memory and idle CPU: the kind that compresses
        assert_eq!(
            pick(true, Some(0.3), Some(0.9)),
            MigrationOption::Multichannel
        );
        // random memory, or no CPU to spare, or all zero: the handed-off socket
        assert_eq!(pick(true, Some(0.99), Some(0.9)), MigrationOption::Mptcp);
        assert_eq!(pick(true, Some(0.3), Some(0.05)), MigrationOption::Mptcp);
        assert_eq!(pick(true, None, Some(0.9)), MigrationOption::Mptcp);
        // the edge counts as compressible
        assert_eq!(
            pick(true, Some(AUTO_COMPRESSES), Some(0.5)),
            MigrationOption::Multichannel
        );
        // an encrypted move takes the sealed carriers whatever the memory
        for (ratio, idle) in [
            (Some(0.99), Some(0.9)),
            (Some(0.3), Some(0.05)),
            (None, None),
        ] {
            assert_eq!(
                auto_choice(true, true, ratio, idle, None).0,
                MigrationOption::Multichannel
            );
        }
        // a kernel without MPTCP needs Ferry's frames
        assert_eq!(
            pick(false, Some(0.99), Some(0.9)),
            MigrationOption::Multichannel
        );
        // the reason names what was measured
        let (_, why) = auto_choice(true, false, Some(0.97), Some(0.8), None);
        assert!(why.contains("0.97") && why.contains("MPTCP"), "{why}");
        assert!(!why.contains("  "), "{why}");
    }

    #[test]
    fn compression_takes_qemus_own_channels_only_when_the_cpu_is_the_limit() {
        // recorded at the start of moves in the lab: random memory (1.0),
        // 90% idle on 2 CPUs: 1.4 CPUs spare load ~3.4 Gbit/s of pages
        let unshaped = 10_000_000_000;
        let why =
            own_channels(Some(1.0), Some(0.9), 2, unshaped, false).expect("unshaped: QEMU's own");
        assert!(
            why.contains("1.00") && why.contains("10000 Mbit/s") && why.contains("90% idle"),
            "{why}"
        );
        // a link the spare CPU keeps up with: Ferry's carriers and frames
        assert_eq!(
            own_channels(Some(1.0), Some(0.9), 2, 1_000_000_000, false),
            None
        );
        assert_eq!(
            own_channels(Some(1.0), Some(0.9), 2, 200_000_000, false),
            None
        );
        // many CPUs keep up with 10 Gbit/s
        assert_eq!(
            own_channels(Some(1.0), Some(0.9), 16, unshaped, false),
            None
        );
        // no spare CPU at all: even 1 Gbit/s is more than it loads
        assert!(own_channels(Some(1.0), Some(0.15), 2, 1_000_000_000, false).is_some());
        // nothing measured: no guess
        assert_eq!(own_channels(Some(1.0), None, 2, unshaped, false), None);
        assert_eq!(own_channels(Some(1.0), Some(0.9), 2, 0, false), None);
        // an encrypted move keeps Ferry's sealed carriers: QEMU's TLS is dearer
        assert_eq!(own_channels(Some(1.0), Some(0.9), 2, unshaped, true), None);
        assert_eq!(
            own_channels(Some(1.0), Some(0.15), 2, 1_000_000_000, true),
            None
        );
    }

    #[test]
    fn random_memory_takes_the_carriers_only_with_room_for_their_relay() {
        // 2 × 1 Gbit/s: 0.23 GiB/s × 2.5 CPU-s/GiB × 2 = 1.16 CPUs idle needed
        let links = 2_000_000_000;
        assert!(relay_fits(0.9, 2, links));
        assert!(!relay_fits(0.5, 2, links));
        assert!(relay_fits(0.5, 4, links));
        // 2 × 10 Gbit/s needs more than most hosts have idle; an unknown rate never fits
        assert!(!relay_fits(0.9, 8, 20_000_000_000));
        assert!(!relay_fits(1.0, 2, 0));
        let (o, why) = auto_choice(true, false, Some(0.97), Some(0.9), Some(links));
        assert_eq!(o, MigrationOption::Multichannel);
        assert!(
            why.contains("0.97") && why.contains("90% idle") && why.contains("2000 Mbit/s"),
            "{why}"
        );
        // compressible memory with too little idle CPU still goes by MPTCP
        assert_eq!(
            auto_choice(true, false, Some(0.3), Some(0.05), Some(links)).0,
            MigrationOption::Mptcp
        );
    }
}
