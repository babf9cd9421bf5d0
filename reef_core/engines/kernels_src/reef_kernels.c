#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define REEF_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static inline float widen(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* Weights are packed in blocks of 16 output rows. bf16 weights: the inputs' dimension is padded with zeros to kp (a
   multiple of 32) and taken in pairs, ``wp[((blk * kp / 2 + i / 2) * 16 + r) * 2 + i % 2] = w[blk * 16 + r][i]``:
   32 bf16 values (64 bytes) per pair of inputs, which is also the layout of an AMX tile of 32 inputs x 16 outputs
   (16 such rows, 1 KiB). float32 weights: ``wp[(blk * k + i) * 16 + r]``. Rows past n are zero. A block is one
   sequential stream that the hardware prefetcher follows, and each load of weights feeds 16 outputs at once. */
static inline long padded_k(long k) { return (k + 31) & ~31L; }

#ifdef __AVX512F__
static inline __attribute__((always_inline)) __m512 load16(const void *wb, long i, const int F32) {
    if (F32) return _mm512_loadu_ps((const float *)wb + i * 16);
    __m512i pair = _mm512_loadu_si512((const uint16_t *)wb + (i >> 1) * 32);  /* inputs i & ~1 and i | 1 */
    return _mm512_castsi512_ps(i & 1 ? _mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u))
                                     : _mm512_slli_epi32(pair, 16));
}

/* One block against NR inputs (x0, x0 + k, ...) with AVX-512: per output, the products are summed in four partial
   sums (i mod 4), added as (s0 + s1) + (s2 + s3), then the bias. Each loaded weight vector feeds NR inputs, and
   every input's sums are formed exactly as for NR = 1, so a batch gives bitwise what its rows give one by one. */
static inline __attribute__((always_inline)) void block(const float *x0, const void *wb, const float *b, float *y,
                                                        long j, long n, long k, const int NR, const int F32) {
    __m512 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
    long k4 = k & ~3L;
    for (long i = 0; i < k4; i += 4) {
        /* Several inputs make a block's pass compute-bound, and the hardware prefetcher falls behind: ask for the
           weights 4 KiB ahead (20% off an 8-row step of SmolLM2 on an AVX-512 EPYC; a single input, bound by
           memory, ran no faster with it, so it keeps the plain stream). */
        if (!F32 && NR > 1) {
            const char *ahead = (const char *)wb + i * 32 + 4096;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
        }
        for (int q = 0; q < 4; q++) {
            __m512 wv = load16(wb, i + q, F32);
            for (int r = 0; r < NR; r++) acc[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(x0[r * k + i + q]), wv, acc[r][q]);
        }
    }
    for (long i = k4; i < k; i++) {
        __m512 wv = load16(wb, i, F32);
        for (int r = 0; r < NR; r++) acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(x0[r * k + i]), wv, acc[r][0]);
    }
    __mmask16 mask = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    for (int r = 0; r < NR; r++) {
        __m512 s = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
        if (b) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, b + j));
        _mm512_mask_storeu_ps(y + r * n + j, mask, s);
    }
}

static inline __attribute__((always_inline)) void blocks_of(const float *x, const void *w, const float *b, float *y,
                                                            long blk0, long blk1, long n, long k, long m,
                                                            const int F32) {
    long stride = F32 ? 16 * k : 16 * padded_k(k);  /* elements per block */
    for (long blk = blk0; blk < blk1; blk++) {
        const void *wb = F32 ? (const void *)((const float *)w + blk * stride)
                             : (const void *)((const uint16_t *)w + blk * stride);
        long j = blk * 16, r = 0;
        for (; r + 4 <= m; r += 4) block(x + r * k, wb, b, y + r * n, j, n, k, 4, F32);
        if (r + 2 <= m) { block(x + r * k, wb, b, y + r * n, j, n, k, 2, F32); r += 2; }
        if (r < m) block(x + r * k, wb, b, y + r * n, j, n, k, 1, F32);
    }
}
#endif

#ifdef REEF_AMX
/* bf16 weights on AMX tiles. Each float32 input is split into three bf16 parts, x = hi + mid + lo (hi = x rounded to
   bf16, mid = the remainder rounded, lo = what is left rounded): for x's 24-bit significand the three parts are
   exact, and a bf16 weight times a bf16 part is exact in float32, so the tiles' float32 sums hold the float32
   product up to the order of the additions, as the AVX-512 path does (no rounding of the activations to bf16, which
   would cost ~1e-3 relative). The parts are rows of the A tiles: input row r's part p is split row 3r + p, 16 split
   rows a tile (rows past 3m zero). Each output is hi_sum + (mid_sum + lo_sum), then the bias; a split row's sums
   depend only on that row and the weights, so a batch gives bitwise what its rows give one by one (amx_rows says
   which tile holds what). */
static int amx_on;                          /* AMX usable in this process (reef_amx) */
static __thread int amx_configured;         /* this thread's tile configuration is loaded */

typedef struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg_t;

static inline void amx_configure(void) {
    if (amx_configured) return;
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
    amx_configured = 1;
}

/* xa [roundup(3m, 16), kp] bf16: the split rows of x [m, k] (inputs past k and rows past 3m zero). */
static void amx_split(const float *x, long m, long k, long kp, uint16_t *xa) {
    long rows = (3 * m + 15) & ~15L;
    memset(xa + 3 * m * kp, 0, sizeof(uint16_t) * (rows - 3 * m) * kp);
    for (long r = 0; r < m; r++) {
        uint16_t *part[3] = {xa + 3 * r * kp, xa + (3 * r + 1) * kp, xa + (3 * r + 2) * kp};
        for (long p = 0; p < 3; p++) memset(part[p] + k, 0, sizeof(uint16_t) * (kp - k));
        for (long i = 0; i < k; i += 16) {
            __mmask16 mask = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(mask, x + r * k + i);
            __m256bh hi = _mm512_cvtneps_pbh(v);
            __m512 rest = _mm512_sub_ps(v, _mm512_cvtpbh_ps(hi));
            __m256bh mid = _mm512_cvtneps_pbh(rest);
            __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(rest, _mm512_cvtpbh_ps(mid)));
            _mm256_mask_storeu_epi16(part[0] + i, mask, (__m256i)hi);
            _mm256_mask_storeu_epi16(part[1] + i, mask, (__m256i)mid);
            _mm256_mask_storeu_epi16(part[2] + i, mask, (__m256i)lo);
        }
    }
}

/* y for the output block at column j from the sums of its tiles of split rows (cs[t] [16, 16]). */
static inline void amx_finish(float cs[][16][16], long m, const float *b, float *y, long j, long n) {
    __mmask16 mask = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    __m512 bias = b ? _mm512_maskz_loadu_ps(mask, b + j) : _mm512_setzero_ps();
    for (long r = 0; r < m; r++) {
        long s = 3 * r;
        __m512 hi = _mm512_loadu_ps(cs[s >> 4][s & 15]), mid = _mm512_loadu_ps(cs[(s + 1) >> 4][(s + 1) & 15]),
               lo = _mm512_loadu_ps(cs[(s + 2) >> 4][(s + 2) & 15]);
        __m512 sum = _mm512_add_ps(hi, _mm512_add_ps(mid, lo));
        if (b) sum = _mm512_add_ps(sum, bias);
        _mm512_mask_storeu_ps(y + r * n + j, mask, sum);
    }
}

#define A_TILE(t, c) (xa + (long)(t) * 16 * kp + (c) * 32)
#define W_TILE(blk, c) (w + (blk) * 16 * kp + (c) * 512)

/* Blocks blk0 <= blk < blk1 on AMX, two blocks at a time and two tiles of split rows at a time (so every tile
   loaded is used twice): sums in tiles 0-3, activations in 4-5, weights in 6-7. With more than two tiles of split
   rows (m > 10: a prompt) the pair of blocks' weights is read again for each further two, from the cache. */
static void amx_rows(const uint16_t *xa, const uint16_t *w, const float *b, float *y, long blk0, long blk1, long n,
                     long kp, long m) {
    amx_configure();
    long nt = (3 * m + 15) >> 4, chunks = kp / 32, lda = kp * 2;
    float cs[2][6][16][16];
    for (long blk = blk0; blk < blk1; blk += 2) {
        int two = blk + 1 < blk1;
        for (long t = 0; t < nt; t += 2) {
            int both = t + 1 < nt;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (long c = 0; c < chunks; c++) {
                _tile_loadd(6, W_TILE(blk, c), 64);
                if (two) _tile_loadd(7, W_TILE(blk + 1, c), 64);
                _tile_loadd(4, A_TILE(t, c), lda);
                _tile_dpbf16ps(0, 4, 6);
                if (two) _tile_dpbf16ps(1, 4, 7);
                if (both) {
                    _tile_loadd(5, A_TILE(t + 1, c), lda);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, cs[0][t], 64);
            if (two) _tile_stored(1, cs[1][t], 64);
            if (both) _tile_stored(2, cs[0][t + 1], 64);
            if (two && both) _tile_stored(3, cs[1][t + 1], 64);
        }
        amx_finish(cs[0], m, b, y, blk * 16, n);
        if (two) amx_finish(cs[1], m, b, y, (blk + 1) * 16, n);
    }
}
#undef A_TILE
#undef W_TILE
#endif

/* Turn the AMX path on (`want` 1: where the CPU has the tiles, CPUID leaf 7's AMX-TILE and AMX-BF16, the kernel
   was built for them and Linux grants the tile state, arch_prctl ARCH_REQ_XCOMP_PERM) or off (0); returns whether it
   is on. Never called while a product runs. */
int reef_amx(int want) {
#ifdef REEF_AMX
    unsigned a, b, c, d;
    if (!want) amx_on = 0;
    else if (!amx_on && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1))
        amx_on = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_on;
#else
    (void)want;
    return 0;
#endif
}

/* What computes the bf16 products here: 2 AMX tiles, 1 AVX-512, 0 portable C (which the compiler vectorises as
   it can: slow enough that long prompts are better left to torch's matrix products). */
int reef_isa(void) {
#ifdef REEF_AMX
    if (amx_on) return 2;
#endif
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* y[r*n + j] = sum_i x[r*k + i] * w[j][i] (+ b[j]) for the blocks blk0 <= blk1 and each of the m input rows r;
   float32 products and sums (xa: x's split rows, for AMX). Each (r, j)'s arithmetic does not depend on m or on how
   blocks are split between threads, while the weights are read from memory once per call (a block stays in L1
   while the inputs pass). */
static void rows(const float *x, const uint16_t *xa, const void *w, int f32, const float *b, float *y, long blk0,
                 long blk1, long n, long k, long m) {
#ifdef REEF_AMX
    if (xa) { amx_rows(xa, (const uint16_t *)w, b, y, blk0, blk1, n, padded_k(k), m); return; }
#endif
#ifdef __AVX512F__
    if (f32) blocks_of(x, w, b, y, blk0, blk1, n, k, m, 1);
    else blocks_of(x, w, b, y, blk0, blk1, n, k, m, 0);
#else
    (void)xa;
    long kp = padded_k(k);
    for (long blk = blk0; blk < blk1; blk++) {
        long j = blk * 16;
        for (long r = 0; r < m; r++) {
            const float *xr = x + r * k;
            float acc[4][16] = {{0}};
            for (long i = 0; i < k; i++) {
                int q = i < (k & ~3L) ? (int)(i & 3) : 0;
                for (int l = 0; l < 16; l++)
                    acc[q][l] += xr[i] * (f32 ? ((const float *)w)[(blk * k + i) * 16 + l]
                                              : widen(((const uint16_t *)w)[((blk * kp + (i & ~1L)) * 16 + l * 2)
                                                                            + (i & 1)]));
            }
            for (int l = 0; l < 16 && j + l < n; l++) {
                float s = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
                y[r * n + j + l] = b ? s + b[j + l] : s;
            }
        }
    }
#endif
}

/* Worker threads. A job is a range of items (a product's blocks, a step's attention heads) claimed in chunks from
   one counter by whichever thread is running (the caller included), so a worker the OS has descheduled (a busy
   machine) delays nothing: the others take its chunks. The counter carries the job's epoch in its high half, so a
   claim for a finished job fails instead of reading the next job's fields. An item's arithmetic does not depend on
   the thread that computes it. Idle workers spin for the next job for up to SPIN_NS (the jobs of a decode step come
   microseconds apart, and waking a sleeping thread costs a system call on each side), then sleep on a condition
   variable until the next step. */
#include <pthread.h>
#include <sched.h>
#include <time.h>
#define MAX_THREADS 16
#define SPIN_NS 300000L
typedef void (*task_fn)(const void *ctx, long i0, long i1, int thread);
typedef struct { task_fn fn; const void *ctx; long items, chunk; } job_t;
static job_t job;
static uint64_t ticket;                   /* (epoch << 32) | the next unclaimed item */
static long finished;                     /* items done of the current job */
static uint32_t epoch_now;                /* the caller's (under `caller`) */
static int sleepers, nthreads = 1;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time (engines on other threads) */

/* Claim and run chunks of job `e` until none is left. The fields are read between loading the ticket and claiming
   from it, and used only when the claim succeeds: the caller moves the ticket to the next epoch (CLOSED) before it
   writes a job's fields, so a successful claim proves they are job `e`'s, untouched (and what its context points to
   still valid: the caller waits for every claimed item). */
#define CLOSED 0xFFFFFFFFu
static void work(uint32_t e, int thread) {
    for (;;) {
        uint64_t t = __atomic_load_n(&ticket, __ATOMIC_ACQUIRE);
        if ((uint32_t)(t >> 32) != e) return;
        long next = (long)(t & 0xFFFFFFFFu);
        if (next == CLOSED) continue;  /* the fields are being written */
        job_t j = job;
        if (next >= j.items) return;
        long end = next + j.chunk < j.items ? next + j.chunk : j.items;
        if (!__atomic_compare_exchange_n(&ticket, &t, ((uint64_t)e << 32) | (uint64_t)end, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        j.fn(j.ctx, next, end, thread);
        __atomic_fetch_add(&finished, end - next, __ATOMIC_RELEASE);
    }
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *worker(void *arg) {
    int thread = (int)(long)arg;
    uint32_t seen = 0;
    for (;;) {
        long spins = 0, until = 0;
        while ((uint32_t)(__atomic_load_n(&ticket, __ATOMIC_ACQUIRE) >> 32) == seen) {
            if (++spins % 256) continue;
            long t = now_ns();
            if (!until) until = t + SPIN_NS;
            if (t < until) continue;
            pthread_mutex_lock(&mu);
            __atomic_fetch_add(&sleepers, 1, __ATOMIC_SEQ_CST);  /* a full fence before reading the ticket again */
            while ((uint32_t)(__atomic_load_n(&ticket, __ATOMIC_ACQUIRE) >> 32) == seen) pthread_cond_wait(&cv, &mu);
            __atomic_fetch_sub(&sleepers, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&mu);
        }
        seen = (uint32_t)(__atomic_load_n(&ticket, __ATOMIC_ACQUIRE) >> 32);
        work(seen, thread);
    }
    return 0;
}

/* fn(ctx, i0, i1, thread) over the items [0, items) in chunks of `chunk`, on every thread (the caller is thread 0);
   returns when all are done. */
static void parallel(task_fn fn, const void *ctx, long items, long chunk) {
    if (nthreads == 1 || items <= chunk) { fn(ctx, 0, items, 0); return; }
    pthread_mutex_lock(&caller);
    uint32_t e = ++epoch_now;
    if (e == 0) e = ++epoch_now;  /* 0 is the workers' initial "seen" */
    __atomic_store_n(&ticket, ((uint64_t)e << 32) | CLOSED, __ATOMIC_SEQ_CST);  /* no claim succeeds from here */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    job.fn = fn; job.ctx = ctx; job.items = items; job.chunk = chunk;
    __atomic_store_n(&finished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&ticket, (uint64_t)e << 32, __ATOMIC_SEQ_CST);  /* publishes the fields; a full fence */
    if (__atomic_load_n(&sleepers, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&mu);
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
    work(e, 0);
    for (int spins = 0; __atomic_load_n(&finished, __ATOMIC_ACQUIRE) < items; spins++)
        if (spins > 1000) sched_yield();
    pthread_mutex_unlock(&caller);
}

/* A forked child has none of the workers: it computes alone (else it would wait for them forever). */
static void after_fork_in_child(void) {
#ifdef REEF_AMX
    amx_configured = 0;  /* reload the tile configuration rather than trust what the child inherited */
#endif
    nthreads = 1; ticket = 0; finished = 0; epoch_now = 0; sleepers = 0;
    pthread_mutex_init(&mu, 0); pthread_cond_init(&cv, 0); pthread_mutex_init(&caller, 0);
}

/* Use `n` threads in all (the caller's plus n - 1 workers, started once; never fewer than already started). */
int reef_gemv_threads(int n) {
    static int registered;
    if (!registered) { pthread_atfork(0, 0, after_fork_in_child); registered = 1; }
    if (n > MAX_THREADS) n = MAX_THREADS;
    for (int t = nthreads; t < n; t++) {
        pthread_t th;
        if (pthread_create(&th, 0, worker, (void *)(long)t)) break;
        pthread_detach(th);
        nthreads = t + 1;
    }
    return nthreads;
}

/* x's split rows for the AMX products (NULL: the AVX-512 path), in a buffer of the calling thread's that grows. */
static const uint16_t *split_rows(const float *x, int f32, long m, long k) {
#ifdef REEF_AMX
    static __thread uint16_t *buf;
    static __thread long cap;
    if (!amx_on || f32) return NULL;
    long kp = padded_k(k), need = ((3 * m + 15) & ~15L) * kp;
    if (need > cap) {
        uint16_t *grown = realloc(buf, sizeof(uint16_t) * need);
        if (!grown) return NULL;  /* no memory for it: the AVX-512 path, same weights */
        buf = grown; cap = need;
    }
    amx_split(x, m, k, kp, buf);
    return buf;
#else
    (void)x; (void)f32; (void)m; (void)k;
    return NULL;
#endif
}

/* One job over up to 3 weights that multiply the same rows (a layer's q, k and v; its gate and up): the rows are
   split once, and the threads share one counter over every weight's blocks (each weight's counted to an even
   number, so blocks pair up on AMX from the start of each). */
#define MAX_FUSED 3
typedef struct {
    const float *x; const uint16_t *xa; long m, k, count;
    const void *w[MAX_FUSED]; const float *b[MAX_FUSED]; float *y[MAX_FUSED]; long n[MAX_FUSED]; int f32[MAX_FUSED];
    long first[MAX_FUSED + 1];  /* item of each weight's first block */
} gemv_t;

static void gemv_task(const void *ctx, long i0, long i1, int thread) {
    const gemv_t *g = ctx;
    (void)thread;
    for (long i = 0; i < g->count; i++) {
        long blocks = (g->n[i] + 15) / 16, lo = i0 > g->first[i] ? i0 - g->first[i] : 0, hi = i1 - g->first[i];
        if (hi > blocks) hi = blocks;
        if (lo < hi)
            rows(g->x, g->f32[i] ? NULL : g->xa, g->w[i], g->f32[i], g->b[i], g->y[i], lo, hi, g->n[i], g->k, g->m);
    }
}

static void gemv_run(gemv_t *g) {
    int all_f32 = 1;
    long items = 0, weights = 0;
    for (long i = 0; i < g->count; i++) {
        g->first[i] = items;
        items += ((g->n[i] + 15) / 16 + 1) & ~1L;
        weights += g->n[i] * g->k;
        all_f32 &= g->f32[i];
    }
    g->first[g->count] = items;
    g->xa = split_rows(g->x, all_f32, g->m, g->k);
    if (weights < 65536) { gemv_task(g, 0, items, 0); return; }
    long chunk = items / (nthreads * 4);
    parallel(gemv_task, g, items, chunk > 2 ? chunk & ~1L : 2);  /* even chunks: blocks go in pairs on AMX */
}

/* y = x w^T (+ b) for m float32 rows x [m, k] and a packed weight w [n, k] (bf16, or float32 when f32). */
void reef_gemv(const float *x, const void *w, int f32, const float *b, float *y, long m, long n, long k) {
    gemv_t g = {.x = x, .m = m, .k = k, .count = 1, .w = {w}, .b = {b}, .y = {y}, .n = {n}, .f32 = {f32}};
    gemv_run(&g);
}

/* 1 when every one of the `count` float32 values is a bf16 value (its low 16 bits are zero). */
int reef_bf16_exact(const float *w, long count) {
    const uint32_t *u = (const uint32_t *)w;
    uint32_t low = 0;
    for (long i = 0; i < count; i++) low |= u[i] & 0xFFFFu;
    return low == 0;
}

/* Pack w [n, k] into the kernel's layout (rows past n zero): bf16 bit patterns (the value's top half: exact when
   reef_bf16_exact said so) in pairs of inputs, k padded to a multiple of 32 with zeros, or float32. */
void reef_pack(const float *w, long n, long k, void *out, int f32) {
    long blocks = (n + 15) / 16, kp = padded_k(k);
    for (long blk = 0; blk < blocks; blk++)
        for (long r = 0; r < 16; r++) {
            long j = blk * 16 + r;
            for (long i = 0; i < (f32 ? k : kp); i++) {
                float v = j < n && i < k ? w[j * k + i] : 0.0f;
                if (f32) { ((float *)out)[(blk * k + i) * 16 + r] = v; continue; }
                uint32_t u;
                memcpy(&u, &v, 4);
                ((uint16_t *)out)[(blk * kp + (i & ~1L)) * 16 + r * 2 + (i & 1)] = (uint16_t)(u >> 16);
            }
        }
}

/* ---- The decoder layers of a Llama/Qwen2 model for one step of m generations (reef_core.engines.decode) ---- */

typedef struct {
    const void *w;      /* packed weight [n, k] */
    const float *b;     /* bias [n] or NULL */
    const float *a;     /* LoRA A [r, k] (row-major) or NULL */
    const float *bt;    /* LoRA B transposed, [r, n] (row-major) */
    long n, k, r;
    float scale;        /* LoRA scale */
    int f32;            /* w holds float32 (else bf16) */
} proj_t;

typedef struct {
    const float *ln1, *ln2;  /* RMSNorm weights [H] */
    float eps1, eps2;
    proj_t p[7];             /* q, k, v, o, gate, up, down */
} layer_t;

typedef struct {
    float *k, *v;            /* this generation's cache [layers, nkv, len, hd] */
    long len, pos;           /* cache length; position of the token this step computes */
    const float *cos, *sin;  /* rotary tables [len, hd] */
} gen_t;

static float dot(const float *a, const float *b, long n) {
    long i = 0;
    float s;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#else
    s = 0.0f;
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy(float *y, float a, const float *x, long n) {
    long i = 0;
#ifdef __AVX512F__
    __m512 av = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

#ifdef __AVX512F__
/* e^x for 16 floats (Cephes' expf polynomial, within 2 ulp; 0 or inf past float's range; NaN stays NaN). Every lane
   is computed alike, so a value's exponential does not depend on its neighbours or on where a loop's tail falls. */
static inline __m512 exp16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* g = silu(g) * u for n values. */
static void silu_mul(float *g, const float *u, long n) {
    long i = 0;
#ifdef __AVX512F__
    for (; i < n; i += 16) {
        __mmask16 mask = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(mask, g + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        __m512 y = _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(e, _mm512_set1_ps(1.0f))),
                                 _mm512_maskz_loadu_ps(mask, u + i));
        _mm512_mask_storeu_ps(g + i, mask, y);
    }
#endif
    for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Attention of the `groups` query heads q [groups, hd] that share one KV head, over positions 0..p of that head's
   cache (kc, vc [len, hd]), into out [groups, hd]: softmax(q k^T * scale) v. sc: room for groups * (p + 1) floats.
   With AVX-512 (hd a multiple of 16, at most 256): each cached key and value is read once for all the group's
   heads, the weighted values summed in registers. */
static void attend(const float *q, const float *kc, const float *vc, long p, long groups, long hd, float scale,
                   float *sc, float *out) {
    long T = p + 1;
#ifdef __AVX512F__
    if (hd % 16 == 0 && hd <= 256 && groups <= 16) {
        long c16 = hd / 16;
        for (long t = 0; t < T; t++)
            for (long g = 0; g < groups; g++) {
                __m512 acc = _mm512_setzero_ps();
                for (long c = 0; c < c16; c++)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * hd + c * 16), _mm512_loadu_ps(kc + t * hd + c * 16),
                                          acc);
                sc[g * T + t] = _mm512_reduce_add_ps(acc) * scale;
            }
        float inv[16];
        for (long g = 0; g < groups; g++) {
            float *s = sc + g * T;
            __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
            for (long t = 0; t < T; t += 16) {
                __mmask16 mask = T - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (T - t)) - 1);
                mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask, s + t));
            }
            __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            for (long t = 0; t < T; t += 16) {
                __mmask16 mask = T - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (T - t)) - 1);
                __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), top)));
                _mm512_mask_storeu_ps(s + t, mask, e);
                sum = _mm512_add_ps(sum, e);
            }
            inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
        }
        for (long g = 0; g < groups; g++) {
            __m512 acc[16];
            for (long c = 0; c < c16; c++) acc[c] = _mm512_setzero_ps();
            const float *s = sc + g * T;
            for (long t = 0; t < T; t++) {
                __m512 w = _mm512_set1_ps(s[t]);
                for (long c = 0; c < c16; c++)
                    acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vc + t * hd + c * 16), acc[c]);
            }
            __m512 iv = _mm512_set1_ps(inv[g]);
            for (long c = 0; c < c16; c++) _mm512_storeu_ps(out + g * hd + c * 16, _mm512_mul_ps(acc[c], iv));
        }
        return;
    }
#endif
    for (long g = 0; g < groups; g++) {
        const float *qv = q + g * hd;
        float *s = sc + g * T, mx = -INFINITY, sum = 0.0f;
        for (long t = 0; t < T; t++) {
            s[t] = dot(qv, kc + t * hd, hd) * scale;
            if (s[t] > mx) mx = s[t];
        }
        for (long t = 0; t < T; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }
        float *o = out + g * hd;
        memset(o, 0, sizeof(float) * hd);
        for (long t = 0; t < T; t++) axpy(o, s[t] / sum, vc + t * hd, hd);
    }
}

static void rmsnorm(const float *x, const float *w, float eps, float *out, long m, long h) {
    for (long r = 0; r < m; r++) {
        const float *xr = x + r * h;
        float ss = dot(xr, xr, h);
        float inv = 1.0f / sqrtf(ss / (float)h + eps);
        for (long i = 0; i < h; i++) out[r * h + i] = w[i] * (xr[i] * inv);
    }
}

/* y[j] += scale * sum_s bt[s][j] * t[s] for j < n: a LoRA adapter's B (transposed, [r, n]) times its A x. */
static void lora_up(const float *bt, const float *t, long r, long n, float scale, float *y) {
    long j = 0;
#ifdef __AVX512F__
    for (; j < n; j += 16) {
        __mmask16 mask = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 acc = _mm512_setzero_ps();
        for (long s = 0; s < r; s++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(t[s]), _mm512_maskz_loadu_ps(mask, bt + s * n + j), acc);
        __m512 out = _mm512_fmadd_ps(acc, _mm512_set1_ps(scale), _mm512_maskz_loadu_ps(mask, y + j));
        _mm512_mask_storeu_ps(y + j, mask, out);
    }
#endif
    for (; j < n; j++) {
        float acc = 0.0f;
        for (long s = 0; s < r; s++) acc += bt[s * n + j] * t[s];
        y[j] += acc * scale;
    }
}

/* ys[i] = ps[i] x for m rows and `count` projections of the same input (at most MAX_FUSED): the packed products in
   one job, then each LoRA term scale * B (A x) where the projection has one. */
static void project(const proj_t *const *ps, int count, const float *x, float *const *ys, long m, float *tmp) {
    gemv_t g = {.x = x, .m = m, .k = ps[0]->k, .count = count};
    for (int i = 0; i < count; i++) {
        g.w[i] = ps[i]->w; g.b[i] = ps[i]->b; g.y[i] = ys[i]; g.n[i] = ps[i]->n; g.f32[i] = ps[i]->f32;
    }
    gemv_run(&g);
    for (int i = 0; i < count; i++) {
        const proj_t *p = ps[i];
        if (!p->a) continue;
        for (long r = 0; r < m; r++) {
            for (long s = 0; s < p->r; s++) tmp[s] = dot(p->a + s * p->k, x + r * p->k, p->k);
            lora_up(p->bt, tmp, p->r, p->n, p->scale, ys[i] + r * p->n);
        }
    }
}

static void rope(float *x, const float *cos, const float *sin, long heads, long hd) {
    long half = hd / 2;
    for (long h = 0; h < heads; h++) {
        float *v = x + h * hd;
        for (long i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* Run the m rows of hidden states ``h`` [m, H] (one token of each generation, at gens[r].pos) through the decoder
   layers, in place, writing each generation's new key and value into its cache. Returns 0, or -1 when out of
   memory (nothing is half-written then: the caller falls back). */
typedef struct {
    const float *q; float *att, *sc; const gen_t *gens;
    long l, nkv, groups, hd, qn, scstride; float scale;
} attn_t;

/* Attention items i0 <= i < i1: generation i / nkv, KV head i % nkv (the scratch scores per thread). */
static void attn_task(const void *ctx, long i0, long i1, int thread) {
    const attn_t *a = ctx;
    for (long i = i0; i < i1; i++) {
        long r = i / a->nkv, j = i % a->nkv;
        const gen_t *G = a->gens + r;
        long at = (a->l * a->nkv + j) * G->len * a->hd, off = r * a->qn + j * a->groups * a->hd;
        attend(a->q + off, G->k + at, G->v + at, G->pos, a->groups, a->hd, a->scale, a->sc + thread * a->scstride,
               a->att + off);
    }
}

int reef_decode_layers(const layer_t *layers, long nl, float *h, long m, long H, long nh, long nkv, long hd,
                       float scale, const gen_t *gens) {
    long inter = layers[0].p[4].n, maxr = 0, maxlen = 0;
    for (long l = 0; l < nl; l++)
        for (int i = 0; i < 7; i++) if (layers[l].p[i].r > maxr) maxr = layers[l].p[i].r;
    for (long r = 0; r < m; r++) if (gens[r].pos + 1 > maxlen) maxlen = gens[r].pos + 1;
    long qn = nh * hd, kn = nkv * hd, groups = nh / nkv, scstride = groups * maxlen + 16;
    long need = m * (H + qn + 2 * kn + qn + 2 * inter) + nthreads * scstride + maxr + 16;
    float *buf = malloc(sizeof(float) * need);
    if (!buf) return -1;  /* before anything is written: the caller falls back */
    float *x = buf, *q = x + m * H, *k = q + m * qn, *v = k + m * kn, *att = v + m * kn, *g = att + m * qn,
          *u = g + m * inter, *sc = u + m * inter, *tmp = sc + nthreads * scstride;
    attn_t at = {q, att, sc, gens, 0, nkv, groups, hd, qn, scstride, scale};
    for (long l = 0; l < nl; l++) {
        const layer_t *L = layers + l;
        rmsnorm(h, L->ln1, L->eps1, x, m, H);
        project((const proj_t *[]){&L->p[0], &L->p[1], &L->p[2]}, 3, x, (float *[]){q, k, v}, m, tmp);
        /* Every row's key and value go into its cache first: rows of one generation (a prompt) then attend to the
           rows before them, each only up to its own position. */
        for (long r = 0; r < m; r++) {
            const gen_t *G = gens + r;
            long p = G->pos;
            const float *cs = G->cos + p * hd, *sn = G->sin + p * hd;
            rope(q + r * qn, cs, sn, nh, hd);
            rope(k + r * kn, cs, sn, nkv, hd);
            for (long j = 0; j < nkv; j++) {
                memcpy(G->k + ((l * nkv + j) * G->len + p) * hd, k + r * kn + j * hd, sizeof(float) * hd);
                memcpy(G->v + ((l * nkv + j) * G->len + p) * hd, v + r * kn + j * hd, sizeof(float) * hd);
            }
        }
        at.l = l;
        if (m > 1) parallel(attn_task, &at, m * nkv, 1);
        else attn_task(&at, 0, nkv, 0);
        project((const proj_t *[]){&L->p[3]}, 1, att, (float *[]){x}, m, tmp);
        for (long i = 0; i < m * H; i++) h[i] += x[i];
        rmsnorm(h, L->ln2, L->eps2, x, m, H);
        project((const proj_t *[]){&L->p[4], &L->p[5]}, 2, x, (float *[]){g, u}, m, tmp);
        silu_mul(g, u, m * inter);
        project((const proj_t *[]){&L->p[6]}, 1, g, (float *[]){x}, m, tmp);
        for (long i = 0; i < m * H; i++) h[i] += x[i];
    }
    free(buf);
    return 0;
}
