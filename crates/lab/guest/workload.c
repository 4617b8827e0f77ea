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
 *
 * Output on the console (the serial port), five lines per second:
 *   FERRY tick=<n> ms=<monotonic> fill=<bytes> dirtied=<pages> verified=<pages> sweeps=<n> errors=<n>
 * and for the first mismatches:
 *   FERRY-ERROR page=<i> word=<w> gen=<g> expected=<hex> got=<hex>
 * The host reads these lines; the format is part of Ferry's lab contract
 * (see crates/lab/src/console.rs).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
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

static void write_page(uint64_t *p, uint64_t page, uint32_t gen) {
    uint64_t b = page_base(page, gen);
    for (uint64_t w = 0; w < WORDS; w++)
        p[w] = b + w * 0xD6E8FEB86659FD93ULL;
}

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
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
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
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
                uint64_t want = b + w * 0xD6E8FEB86659FD93ULL;
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
