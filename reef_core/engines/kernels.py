"""The local engine's C kernels, on the CPU: products of float32 rows (one decode step, or a batch of them) with
packed weights, accumulated in float32, and a whole decode step through a Llama/Qwen2 model's layers.

Why: decoding one token reads every weight once, so on a CPU its time is set by memory traffic, not arithmetic
(SmolLM2-135M: 538 MB of float32 weights per token), and, once that traffic is cut, by the per-operation cost of
running a few hundred tiny tensor operations from Python (on 2 threads torch's SDPA alone took ~1 ms per layer).

* Packed weights: each weight is copied once into blocks of 16 rows (``[ceil(n / 16), k, 16]``), so one block is
  one sequential stream and every load of 16 weights feeds 16 outputs (measured ~2x the bandwidth of a row-by-row
  product on this machine). Weights that are *exactly* representable in bfloat16 (a checkpoint shipped in bf16 and
  loaded as float32, or a LoRA base that never changes) are stored in half the bytes with no loss: widening a bf16
  value to float32 is exact (a 16-bit shift), so ``y = W x`` from the bf16 copy with float32 products and sums
  equals the float32 product up to the order of the additions. Other weights (after a full-weight update) are packed
  in float32. torch's own bf16 kernels cannot be used: they round the activations to bf16 as well (a ~1e-3 relative
  error, far outside the 1e-4 log-prob contract).
* ``reef_decode_layers``: RMSNorm, the projections (with an adapter's LoRA term), rotary embedding, the KV-cache
  write, attention over the cache and the SiLU MLP of every layer for m generations in one call; the caller keeps
  the embedding, the final norm and the head (:mod:`reef_core.engines.decode`).

The source is compiled once per machine with the system C compiler (``cc -O3 -march=native``, cached under
``~/.cache/reef/kernels``) and called through :mod:`ctypes`. Without a compiler, or on a machine where the build
fails, :func:`kernel` and :func:`decode_layers` return None and decoding stays in torch over float32 weights.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float widen(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* Weights are packed in blocks of 16 output rows, ``wp[(blk * k + i) * 16 + r] = w[blk * 16 + r][i]`` (rows past n
   are zero), stored as bf16 bit patterns or as float32: a block is one sequential stream that the hardware
   prefetcher follows, and each load of 16 weights feeds 16 outputs at once (no horizontal sums). Per output, the
   products are summed in four partial sums (i mod 4), added as (s0 + s1) + (s2 + s3), then the bias. */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) __m512 load16(const void *wb, long i, const int F32) {
    if (F32) return _mm512_loadu_ps((const float *)wb + i * 16);
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)wb + i * 16))), 16));
}

/* One block against NR inputs (x0, x0 + k, ...): each loaded weight vector feeds NR inputs, and every input's sums
   are formed exactly as for NR = 1, so a batch gives bitwise what its rows give one by one. */
static inline __attribute__((always_inline)) void block(const float *x0, const void *wb, const float *b, float *y,
                                                        long j, long n, long k, const int NR, const int F32) {
    __m512 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
    long k4 = k & ~3L;
    for (long i = 0; i < k4; i += 4)
        for (int q = 0; q < 4; q++) {
            __m512 wv = load16(wb, i + q, F32);
            for (int r = 0; r < NR; r++) acc[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(x0[r * k + i + q]), wv, acc[r][q]);
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
    for (long blk = blk0; blk < blk1; blk++) {
        const void *wb = F32 ? (const void *)((const float *)w + blk * 16 * k)
                             : (const void *)((const uint16_t *)w + blk * 16 * k);
        long j = blk * 16, r = 0;
        for (; r + 4 <= m; r += 4) block(x + r * k, wb, b, y + r * n, j, n, k, 4, F32);
        if (r + 2 <= m) { block(x + r * k, wb, b, y + r * n, j, n, k, 2, F32); r += 2; }
        if (r < m) block(x + r * k, wb, b, y + r * n, j, n, k, 1, F32);
    }
}
#endif

/* y[r*n + j] = sum_i x[r*k + i] * w[j][i] (+ b[j]) for the blocks blk0 <= blk < blk1 and each of the m input rows r;
   float32 products and sums. Each (r, j)'s arithmetic does not depend on m or on how blocks are split between
   threads, while the weights are read from memory once per call (a block stays in L1 while the inputs pass). */
static void rows(const float *x, const void *w, int f32, const float *b, float *y, long blk0, long blk1, long n,
                 long k, long m) {
#ifdef __AVX512F__
    if (f32) blocks_of(x, w, b, y, blk0, blk1, n, k, m, 1);
    else blocks_of(x, w, b, y, blk0, blk1, n, k, m, 0);
#else
    for (long blk = blk0; blk < blk1; blk++) {
        long j = blk * 16;
        for (long r = 0; r < m; r++) {
            const float *xr = x + r * k;
            float acc[4][16] = {{0}};
            for (long i = 0; i < k; i++) {
                long at = (blk * k + i) * 16;
                int q = i < (k & ~3L) ? (int)(i & 3) : 0;
                for (int l = 0; l < 16; l++)
                    acc[q][l] += xr[i] * (f32 ? ((const float *)w)[at + l] : widen(((const uint16_t *)w)[at + l]));
            }
            for (int l = 0; l < 16 && j + l < n; l++) {
                float s = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
                y[r * n + j + l] = b ? s + b[j + l] : s;
            }
        }
    }
#endif
}

/* Worker threads. A product's blocks are claimed in chunks from one counter by whichever thread is running (the
   caller included), so a worker the OS has descheduled (a busy machine) delays nothing: the others take its chunks.
   The counter carries the job's epoch in its high half, so a claim for a finished job fails instead of reading the
   next job's fields. A block's arithmetic does not depend on the thread that computes it. Idle workers spin briefly
   for the next job (a decode step calls back within microseconds), then sleep on a condition variable. */
#include <pthread.h>
#include <sched.h>
#define MAX_THREADS 16
typedef struct { const float *x; const void *w; const float *b; float *y; long m, n, k, blocks, chunk; int f32; } job_t;
static job_t job;
static uint64_t ticket;                   /* (epoch << 32) | the next unclaimed block */
static long finished;                     /* blocks computed of the current job */
static uint32_t epoch_now;                /* the caller's (under `caller`) */
static int sleepers, nthreads = 1;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time (engines on other threads) */

/* Claim and compute chunks of job `e` until none is left. The fields are read before each claim and used only when
   the claim succeeds, which proves job `e` was still open (its fields not yet replaced). */
static void work(uint32_t e) {
    for (;;) {
        uint64_t t = __atomic_load_n(&ticket, __ATOMIC_ACQUIRE);
        if ((uint32_t)(t >> 32) != e) return;
        job_t j = job;
        long next = (long)(t & 0xFFFFFFFFu);
        if (next >= j.blocks) return;
        long end = next + j.chunk < j.blocks ? next + j.chunk : j.blocks;
        if (!__atomic_compare_exchange_n(&ticket, &t, ((uint64_t)e << 32) | (uint64_t)end, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        rows(j.x, j.w, j.f32, j.b, j.y, next, end, j.n, j.k, j.m);
        __atomic_fetch_add(&finished, end - next, __ATOMIC_RELEASE);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = 0;
    for (;;) {
        int spins = 0;
        while ((uint32_t)(__atomic_load_n(&ticket, __ATOMIC_ACQUIRE) >> 32) == seen) {
            if (++spins < 20000) continue;
            pthread_mutex_lock(&mu);
            __atomic_fetch_add(&sleepers, 1, __ATOMIC_SEQ_CST);  /* a full fence before reading the ticket again */
            while ((uint32_t)(__atomic_load_n(&ticket, __ATOMIC_ACQUIRE) >> 32) == seen) pthread_cond_wait(&cv, &mu);
            __atomic_fetch_sub(&sleepers, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&mu);
        }
        seen = (uint32_t)(__atomic_load_n(&ticket, __ATOMIC_ACQUIRE) >> 32);
        work(seen);
    }
    return 0;
}

/* A forked child has none of the workers: it computes alone (else it would wait for them forever). */
static void after_fork_in_child(void) {
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

/* y = x w^T (+ b) for m float32 rows x [m, k] and a packed weight w [n, k] (bf16, or float32 when f32). */
void reef_gemv(const float *x, const void *w, int f32, const float *b, float *y, long m, long n, long k) {
    long blocks = (n + 15) / 16;
    if (nthreads == 1 || n * k < 65536) { rows(x, w, f32, b, y, 0, blocks, n, k, m); return; }
    pthread_mutex_lock(&caller);
    uint32_t e = ++epoch_now;
    if (e == 0) e = ++epoch_now;  /* 0 is the workers' initial "seen" */
    long chunk = blocks / (nthreads * 4);
    job.x = x; job.w = w; job.f32 = f32; job.b = b; job.y = y; job.m = m; job.n = n; job.k = k;
    job.blocks = blocks; job.chunk = chunk > 0 ? chunk : 1;
    __atomic_store_n(&finished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&ticket, (uint64_t)e << 32, __ATOMIC_SEQ_CST);  /* publishes the fields; a full fence */
    if (__atomic_load_n(&sleepers, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&mu);
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
    work(e);
    for (int spins = 0; __atomic_load_n(&finished, __ATOMIC_ACQUIRE) < blocks; spins++)
        if (spins > 1000) sched_yield();
    pthread_mutex_unlock(&caller);
}

/* 1 when every one of the `count` float32 values is a bf16 value (its low 16 bits are zero). */
int reef_bf16_exact(const float *w, long count) {
    const uint32_t *u = (const uint32_t *)w;
    uint32_t low = 0;
    for (long i = 0; i < count; i++) low |= u[i] & 0xFFFFu;
    return low == 0;
}

/* Pack w [n, k] into the kernel's layout [ceil(n / 16), k, 16] (rows past n zero): bf16 bit patterns (the value's
   top half: exact when reef_bf16_exact said so) or float32. */
void reef_pack(const float *w, long n, long k, void *out, int f32) {
    long blocks = (n + 15) / 16;
    for (long blk = 0; blk < blocks; blk++)
        for (long r = 0; r < 16; r++) {
            long j = blk * 16 + r;
            for (long i = 0; i < k; i++) {
                float v = j < n ? w[j * k + i] : 0.0f;
                long at = (blk * k + i) * 16 + r;
                if (f32) ((float *)out)[at] = v;
                else { uint32_t u; memcpy(&u, &v, 4); ((uint16_t *)out)[at] = (uint16_t)(u >> 16); }
            }
        }
}

/* ---- The decoder layers of a Llama/Qwen2 model for one step of m generations (reef_core.engines.decode) ---- */

typedef struct {
    const void *w;      /* packed weight [n, k] */
    const float *b;     /* bias [n] or NULL */
    const float *a;     /* LoRA A [r, k] (row-major) or NULL */
    const float *bb;    /* LoRA B [n, r] */
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

static void rmsnorm(const float *x, const float *w, float eps, float *out, long m, long h) {
    for (long r = 0; r < m; r++) {
        const float *xr = x + r * h;
        float ss = dot(xr, xr, h);
        float inv = 1.0f / sqrtf(ss / (float)h + eps);
        for (long i = 0; i < h; i++) out[r * h + i] = w[i] * (xr[i] * inv);
    }
}

/* y = P x for m rows: the packed product, then the LoRA term scale * B (A x) when the projection has one. */
static void project(const proj_t *p, const float *x, float *y, long m, float *tmp) {
    reef_gemv(x, p->w, p->f32, p->b, y, m, p->n, p->k);
    if (!p->a) return;
    for (long r = 0; r < m; r++) {
        for (long s = 0; s < p->r; s++) tmp[s] = dot(p->a + s * p->k, x + r * p->k, p->k);
        for (long j = 0; j < p->n; j++) y[r * p->n + j] += dot(p->bb + j * p->r, tmp, p->r) * p->scale;
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
int reef_decode_layers(const layer_t *layers, long nl, float *h, long m, long H, long nh, long nkv, long hd,
                       float scale, const gen_t *gens) {
    long inter = layers[0].p[4].n, maxr = 0, maxlen = 0;
    for (long l = 0; l < nl; l++)
        for (int i = 0; i < 7; i++) if (layers[l].p[i].r > maxr) maxr = layers[l].p[i].r;
    for (long r = 0; r < m; r++) if (gens[r].pos + 1 > maxlen) maxlen = gens[r].pos + 1;
    long qn = nh * hd, kn = nkv * hd, groups = nh / nkv;
    long need = m * (H + qn + 2 * kn + qn + 2 * inter) + maxlen + maxr + 16;
    float *buf = malloc(sizeof(float) * need);
    if (!buf) return -1;
    float *x = buf, *q = x + m * H, *k = q + m * qn, *v = k + m * kn, *att = v + m * kn, *g = att + m * qn,
          *u = g + m * inter, *sc = u + m * inter, *tmp = sc + maxlen;
    for (long l = 0; l < nl; l++) {
        const layer_t *L = layers + l;
        rmsnorm(h, L->ln1, L->eps1, x, m, H);
        project(&L->p[0], x, q, m, tmp);
        project(&L->p[1], x, k, m, tmp);
        project(&L->p[2], x, v, m, tmp);
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
            for (long hq = 0; hq < nh; hq++) {
                long j = hq / groups;
                const float *qv = q + r * qn + hq * hd;
                const float *kc = G->k + (l * nkv + j) * G->len * hd, *vc = G->v + (l * nkv + j) * G->len * hd;
                float mx = -INFINITY, sum = 0.0f;
                for (long t = 0; t <= p; t++) {
                    sc[t] = dot(qv, kc + t * hd, hd) * scale;
                    if (sc[t] > mx) mx = sc[t];
                }
                for (long t = 0; t <= p; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
                float *out = att + r * qn + hq * hd;
                memset(out, 0, sizeof(float) * hd);
                for (long t = 0; t <= p; t++) axpy(out, sc[t] / sum, vc + t * hd, hd);
            }
        }
        project(&L->p[3], att, x, m, tmp);
        for (long i = 0; i < m * H; i++) h[i] += x[i];
        rmsnorm(h, L->ln2, L->eps2, x, m, H);
        project(&L->p[4], x, g, m, tmp);
        project(&L->p[5], x, u, m, tmp);
        for (long i = 0; i < m * inter; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        project(&L->p[6], g, x, m, tmp);
        for (long i = 0; i < m * H; i++) h[i] += x[i];
    }
    free(buf);
    return 0;
}
"""

#: Digest of the kernel source: anything laid out for these kernels (packed weights) is tied to it.
SOURCE_DIGEST = hashlib.sha256(_SOURCE.encode()).hexdigest()

_lock = threading.Lock()
_loaded: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable


def cache_dir() -> Path:
    """Where compiled kernels (and, under ``packed/``, packed weights) are kept: ``$REEF_KERNEL_CACHE`` or
    ``~/.cache/reef/kernels``."""
    return Path(os.environ.get("REEF_KERNEL_CACHE") or Path.home() / ".cache" / "reef" / "kernels")


def _build() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        log.info("no C compiler: decoding keeps float32 weights")
        return None
    flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC"]
    libs = ["-lm"]
    key = hashlib.sha256((_SOURCE + " ".join(flags) + cc + os.uname().machine).encode()).hexdigest()[:16]
    target = cache_dir() / f"reef_gemv_{key}.so"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "gemv.c"
                src.write_text(_SOURCE)
                out = Path(tmp) / target.name
                subprocess.run([cc, *flags, str(src), "-o", str(out), *libs], check=True, capture_output=True, timeout=120)
                os.replace(out, target)  # atomic: a concurrent builder finds a whole file or none
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("bf16 decode kernel did not build (%s %s): decoding keeps float32 weights", exc,
                        detail.decode(errors="replace")[:300])
            return None
    lib = ctypes.CDLL(str(target))
    lib.reef_gemv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_long, ctypes.c_long, ctypes.c_long]
    lib.reef_gemv.restype = None
    lib.reef_gemv_threads.argtypes = [ctypes.c_int]
    lib.reef_gemv_threads.restype = ctypes.c_int
    lib.reef_decode_layers.argtypes = [ctypes.POINTER(Layer), ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                       ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_float,
                                       ctypes.POINTER(Gen)]
    lib.reef_decode_layers.restype = ctypes.c_int
    lib.reef_bf16_exact.argtypes = [ctypes.c_void_p, ctypes.c_long]
    lib.reef_bf16_exact.restype = ctypes.c_int
    lib.reef_pack.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    lib.reef_pack.restype = None
    return lib


def _lib():
    global _loaded
    with _lock:
        if _loaded is False:
            _loaded = _build() if sys.platform.startswith("linux") or sys.platform == "darwin" else None
        return _loaded or None


def kernel():
    """The C function ``reef_gemv`` (built on first use), or None when it cannot be built here."""
    lib = _lib()
    return lib.reef_gemv if lib else None


def decode_layers():
    """The C function ``reef_decode_layers`` (one decode step through every decoder layer), or None."""
    lib = _lib()
    return lib.reef_decode_layers if lib else None


def set_threads(n: int) -> int:
    """Run the kernel on ``n`` threads (process-wide, like ``torch.set_num_threads``; worker threads are started once
    and never stopped, so this only grows). Returns the count in use; 1 without the kernel."""
    lib = _lib()
    return int(lib.reef_gemv_threads(max(1, int(n)))) if lib else 1


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every element of float32 ``w`` is a bfloat16 value (its low 16 bits are zero)."""
    if w.dtype != torch.float32:
        return False
    w = w.detach().contiguous()
    lib = _lib() if w.device.type == "cpu" else None
    if lib:  # one pass, no temporaries (torch's version takes seconds for SmolLM2's weights on 2 busy cores)
        return bool(lib.reef_bf16_exact(w.data_ptr(), w.numel()))
    return not bool((w.view(torch.int32) & 0xFFFF).any())


class PackedMatrix:
    """A copy of a float32 weight ``[n, k]`` in the kernel's layout (blocks of 16 rows, ``[ceil(n / 16), k, 16]``,
    rows past n zero), stored in bf16 when every element is a bf16 value (half the bytes, no loss) and in float32
    otherwise; multiplied into float32 rows with float32 products and sums."""

    __slots__ = ("w", "n", "k", "f32", "fn", "ptr")

    def __init__(self, w: torch.Tensor, fn):
        self.n, self.k = w.shape
        w = w.detach().contiguous()
        self.f32 = not bf16_exact(w)
        self.w = torch.empty(-(-self.n // 16), self.k, 16, dtype=torch.float32 if self.f32 else torch.bfloat16)
        _lib().reef_pack(w.data_ptr(), self.n, self.k, self.w.data_ptr(), int(self.f32))
        self.fn, self.ptr = fn, self.w.data_ptr()

    @classmethod
    def adopt(cls, packed: torch.Tensor, n: int, fn) -> "PackedMatrix":
        """A matrix over ``packed``, a copy already in the kernel's layout (``[ceil(n / 16), k, 16]``, bf16 or float32,
        as :attr:`w` holds it) of a weight with ``n`` rows: nothing is checked or reordered."""
        if packed.dim() != 3 or packed.shape[2] != 16 or packed.shape[0] != -(-n // 16) \
                or packed.dtype not in (torch.bfloat16, torch.float32) or not packed.is_contiguous():
            raise ValueError(f"not a packed weight of {n} rows: {packed.dtype} {tuple(packed.shape)}")
        self = cls.__new__(cls)
        self.n, self.k = n, int(packed.shape[1])
        self.f32 = packed.dtype == torch.float32
        self.w, self.fn, self.ptr = packed, fn, packed.data_ptr()
        return self

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """``out[:] = x @ w.T + bias`` for float32 rows ``x`` ([m, k], contiguous); returns ``out`` ([m, n]). Each row's
        result is bitwise the same whatever m is (a batch equals its rows computed one by one)."""
        self.fn(x.data_ptr(), self.ptr, int(self.f32), bias.data_ptr() if bias is not None else None, out.data_ptr(),
                x.shape[0], self.n, self.k)
        return out


# The C structures of reef_decode_layers (field for field).
class Proj(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("b", ctypes.c_void_p), ("a", ctypes.c_void_p), ("bb", ctypes.c_void_p),
                ("n", ctypes.c_long), ("k", ctypes.c_long), ("r", ctypes.c_long), ("scale", ctypes.c_float),
                ("f32", ctypes.c_int)]


class Layer(ctypes.Structure):
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("p", Proj * 7)]


class Gen(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("len", ctypes.c_long), ("pos", ctypes.c_long),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]
