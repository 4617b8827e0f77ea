/*
 * ferry-workload: the guest side of Ferry's lab.
 *
 * Runs as the only program of a lab guest (started by /init). It fills a
 * configurable amount of memory with a deterministic, non-zero pattern, then
 * keeps dirtying pages at a configurable rate while re-verifying every page in
 * a rolling sweep. Every page's content is a pure function of (seed, page
 * index, generation); the generation of each page lives in guest memory too,
 * so a page a migration failed to resend shows up as a mismatch.
 *
 * Parameters come from the kernel command line:
 *   ferry.fill=768M    bytes to fill (K/M/G suffixes)
 *   ferry.dirty=20M    bytes per second to rewrite
 *   ferry.verify=32M   bytes per second to re-verify
 *   ferry.seed=N       pattern seed
 *   ferry.compressible=1  memory that compresses (~7x) instead of not at all
 *
 * Output on the console (the serial port), five lines per second:
 *   FERRY tick=<n> ms=<monotonic> fill=<bytes> dirtied=<pages> verified=<pages> sweeps=<n> errors=<n>
 * and for the first mismatches:
 *   FERRY-ERROR page=<i> word=<w> gen=<g> expected=<hex> got=<hex>
 * The host reads these lines; the format is part of Ferry's lab contract
 * (see crates/lab/src/console.rs).
 *
 * Disks: a second process watches for virtio disks /dev/vda../dev/vdd (they
 * may be hot-plugged at any time). On each it owns the 4 KiB block number
 * (seed % 64): twice a second it writes a new generation of that block
 * (header "FERRYDSK", seed, sequence, then a pattern of the three), with
 * O_DIRECT|O_DSYNC, reads it back, and reads every other slot, verifying any
 * block another guest wrote. Once a second, per disk:
 *   FERRY-DISK dev=vda seq=<n> errors=<n> size=<bytes> peers=<seed>:<seq>,...
 * so a test can see one guest's writes read by another on a shared disk.
 * Each write also goes to the guest's journal ring: block
 * SLOTS + slot * RING + seq % RING (on disks of at least JOURNAL_MIN bytes),
 * so after an outage the last RING acknowledged writes can be read from
 * outside: a ring holding seq-RING+1..seq, every block intact, where seq is
 * at least the last one the console reported, lost no acknowledged write.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PAGE 4096UL
#define WORDS (PAGE / 8)
#define TICKS_PER_SEC 10
#define REPORTS_PER_SEC 5

static uint64_t parse_size(const char *s) {
    char *end;
    uint64_t v = strtoull(s, &end, 10);
    switch (*end) {
    case 'k': case 'K': v <<= 10; break;
    case 'm': case 'M': v <<= 20; break;
    case 'g': case 'G': v <<= 30; break;
    }
    return v;
}

static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static uint64_t seed = 1;

static inline uint64_t page_base(uint64_t page, uint32_t gen) {
    return mix(seed ^ (page << 24) ^ gen) | 1; /* odd: never an all-zero word run */
}

/* ferry.compressible=1: one word in 64 varies, the rest repeat one byte of
 * the page's base (still a function of seed, page and generation, so every
 * check stays as strict), which compresses ~7x like real guest memory with
 * runs; else every word differs (incompressible). */
static int compressible = 0;

static inline uint64_t word(uint64_t b, uint64_t w) {
    if (compressible && (w & 63) != 0)
        return (b & 0xff) * 0x0101010101010101ULL;
    return b + w * 0xD6E8FEB86659FD93ULL;
}

static void write_page(uint64_t *p, uint64_t page, uint32_t gen) {
    uint64_t b = page_base(page, gen);
    for (uint64_t w = 0; w < WORDS; w++)
        p[w] = word(b, w);
}

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

#define SLOTS 64
#define DISKS 4
#define RING 32
#define JOURNAL_MIN ((SLOTS + SLOTS * RING) * PAGE)

static void disk_block(uint64_t *b, uint64_t s, uint64_t seq) {
    memcpy(b, "FERRYDSK", 8);
    b[1] = s;
    b[2] = seq;
    for (uint64_t w = 3; w < WORDS; w++) b[w] = mix(s ^ (seq << 20) ^ w);
}

static int disk_block_ok(const uint64_t *b) {
    uint64_t want[WORDS];
    disk_block(want, b[1], b[2]);
    return memcmp(b, want, PAGE) == 0;
}

/* The disk prober: runs forever in its own process. */
static void disk_loop(void) {
    uint64_t *buf, *all;
    if (posix_memalign((void **)&buf, PAGE, PAGE) || posix_memalign((void **)&all, PAGE, PAGE * SLOTS))
        _exit(1);
    int fd[DISKS], journal[DISKS] = {0};
    uint64_t seq[DISKS] = {0}, errors[DISKS] = {0};
    for (int d = 0; d < DISKS; d++) fd[d] = -1;
    uint64_t slot = seed % SLOTS, round = 0;
    for (;; round++) {
        for (int d = 0; d < DISKS; d++) {
            char dev[16];
            snprintf(dev, sizeof dev, "/dev/vd%c", 'a' + d);
            if (fd[d] < 0) {
                fd[d] = open(dev, O_RDWR | O_DIRECT | O_DSYNC);
                if (fd[d] < 0) continue;
                journal[d] = lseek(fd[d], 0, SEEK_END) >= (off_t)JOURNAL_MIN;
            }
            seq[d]++;
            disk_block(buf, seed, seq[d]);
            if (journal[d] && pwrite(fd[d], buf, PAGE, (SLOTS + slot * RING + seq[d] % RING) * PAGE) != (ssize_t)PAGE) {
                errors[d]++;
                continue;
            }
            if (pwrite(fd[d], buf, PAGE, slot * PAGE) != (ssize_t)PAGE) { errors[d]++; continue; }
            memset(buf, 0, PAGE);
            if (pread(fd[d], buf, PAGE, slot * PAGE) != (ssize_t)PAGE || buf[2] != seq[d] || !disk_block_ok(buf)) {
                if (errors[d] < 5) printf("FERRY-DISK-ERROR dev=vd%c own block seq=%llu\n", 'a' + d, (unsigned long long)seq[d]);
                errors[d]++;
            }
            if (round % 2) continue;
            if (pread(fd[d], all, PAGE * SLOTS, 0) != (ssize_t)(PAGE * SLOTS)) { errors[d]++; continue; }
            char peers[1024] = {0};
            size_t len = 0;
            for (uint64_t s = 0; s < SLOTS; s++) {
                uint64_t *b = all + s * WORDS;
                if (s == slot || memcmp(b, "FERRYDSK", 8)) continue;
                if (!disk_block_ok(b)) {
                    /* a block being rewritten as we read: look again once */
                    if (pread(fd[d], buf, PAGE, s * PAGE) != (ssize_t)PAGE || !disk_block_ok(buf)) {
                        if (errors[d] < 5) printf("FERRY-DISK-ERROR dev=vd%c slot=%llu\n", 'a' + d, (unsigned long long)s);
                        errors[d]++;
                        continue;
                    }
                    b = buf;
                }
                if (len < sizeof peers - 48)
                    len += snprintf(peers + len, sizeof peers - len, "%s%llu:%llu", len ? "," : "",
                                    (unsigned long long)b[1], (unsigned long long)b[2]);
            }
            off_t size = lseek(fd[d], 0, SEEK_END);
            printf("FERRY-DISK dev=vd%c seq=%llu errors=%llu size=%lld peers=%s\n", 'a' + d,
                   (unsigned long long)seq[d], (unsigned long long)errors[d], (long long)size, peers);
        }
        usleep(500 * 1000);
    }
}

int main(void) {
    uint64_t fill = 64UL << 20, dirty = 1UL << 20, verify = 32UL << 20;
    char cmdline[4096] = {0};
    FILE *f = fopen("/proc/cmdline", "r");
    if (f) {
        if (!fgets(cmdline, sizeof cmdline, f)) cmdline[0] = 0;
        fclose(f);
    }
    for (char *t = strtok(cmdline, " \n"); t; t = strtok(NULL, " \n")) {
        if (!strncmp(t, "ferry.fill=", 11)) fill = parse_size(t + 11);
        else if (!strncmp(t, "ferry.dirty=", 12)) dirty = parse_size(t + 12);
        else if (!strncmp(t, "ferry.verify=", 13)) verify = parse_size(t + 13);
        else if (!strncmp(t, "ferry.seed=", 11)) seed = strtoull(t + 11, NULL, 10);
        else if (!strncmp(t, "ferry.compressible=", 19)) compressible = atoi(t + 19);
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (fork() == 0) disk_loop();
    uint64_t pages = fill / PAGE;
    if (pages == 0) pages = 1;
    uint64_t *mem = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    uint32_t *gen = calloc(pages, sizeof *gen);
    if (mem == MAP_FAILED || !gen) {
        printf("FERRY-FATAL cannot allocate %llu bytes\n", (unsigned long long)(pages * PAGE));
        for (;;) pause();
    }
    printf("FERRY filling pages=%llu\n", (unsigned long long)pages);
    for (uint64_t i = 0; i < pages; i++) write_page(mem + i * WORDS, i, 0);

    uint64_t dirty_per_tick = dirty / PAGE / TICKS_PER_SEC;
    uint64_t verify_per_tick = verify / PAGE / TICKS_PER_SEC;
    if (verify_per_tick == 0) verify_per_tick = 1;
    uint64_t dcur = 0, vcur = 0, dirtied = 0, verified = 0, sweeps = 0, errors = 0, tick = 0;
    uint64_t rng = seed;
    uint64_t start = now_ms(), next = start;
    printf("FERRY ready fill=%llu\n", (unsigned long long)(pages * PAGE));
    for (;;) {
        for (uint64_t k = 0; k < dirty_per_tick; k++) {
            /* stride through memory pseudo-randomly so dirtying is spread */
            rng = mix(rng);
            dcur = rng % pages;
            gen[dcur]++;
            write_page(mem + dcur * WORDS, dcur, gen[dcur]);
            dirtied++;
        }
        for (uint64_t k = 0; k < verify_per_tick; k++) {
            uint64_t *p = mem + vcur * WORDS;
            uint64_t b = page_base(vcur, gen[vcur]);
            for (uint64_t w = 0; w < WORDS; w++) {
                uint64_t want = word(b, w);
                if (p[w] != want) {
                    if (errors < 20)
                        printf("FERRY-ERROR page=%llu word=%llu gen=%u expected=%016llx got=%016llx\n",
                               (unsigned long long)vcur, (unsigned long long)w, gen[vcur],
                               (unsigned long long)want, (unsigned long long)p[w]);
                    errors++;
                    break;
                }
            }
            verified++;
            if (++vcur == pages) { vcur = 0; sweeps++; }
        }
        tick++;
        if (tick % (TICKS_PER_SEC / REPORTS_PER_SEC) == 0)
            printf("FERRY tick=%llu ms=%llu fill=%llu dirtied=%llu verified=%llu sweeps=%llu errors=%llu\n",
                   (unsigned long long)(tick / (TICKS_PER_SEC / REPORTS_PER_SEC)), (unsigned long long)(now_ms() - start),
                   (unsigned long long)(pages * PAGE), (unsigned long long)dirtied,
                   (unsigned long long)verified, (unsigned long long)sweeps, (unsigned long long)errors);
        next += 1000 / TICKS_PER_SEC;
        uint64_t n = now_ms();
        if (next > n) usleep((next - n) * 1000);
        else next = n; /* behind schedule: do not try to catch up in a burst */
    }
}
