"""Products of float32 rows (one decode step, or a batch of them) with bfloat16-stored weights, accumulated in
float32, on the CPU.

Why: decoding one token reads every weight once, so on a CPU its time is set by memory traffic, not arithmetic
(SmolLM2-135M: 538 MB of float32 weights per token). Weights that are *exactly* representable in bfloat16 (a
checkpoint shipped in bf16 and loaded as float32, or a LoRA base that never changes) can be stored in half the
bytes with no loss: widening a bf16 value to float32 is exact (a 16-bit shift), so ``y = W x`` computed from the
bf16 copy with float32 products and sums equals the float32 product up to the order of the additions. torch's own
bf16 kernels cannot be used: they round the activations to bf16 as well (a ~1e-3 relative error, far outside the
1e-4 log-prob contract).

The kernel is a few lines of C compiled once per machine with the system C compiler (``cc -O3 -march=native``,
cached under ``~/.cache/reef/kernels``) and called through :mod:`ctypes`. Without a compiler, or on a non-x86/ARM
machine where the build fails, :func:`kernel` returns None and the caller keeps float32 weights.
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
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float widen(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

#ifdef __AVX512F__
/* Rows j..j+3 of w against NR inputs (x0, x0 + k, ...): each widened weight vector feeds NR products, so a batch
   costs fewer conversions per product than one input does; the sums per (input, row) are formed exactly as for
   NR = 1. */
static inline __attribute__((always_inline)) void block(const float *x0, const uint16_t *w, const float *b,
                                                        float *y, long j, long n, long k, const int NR) {
    long k16 = k & ~15L;
    const uint16_t *wr[4] = {w + j * k, w + (j + 1) * k, w + (j + 2) * k, w + (j + 3) * k};
    __m512 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
    for (long i = 0; i < k16; i += 16) {
        __m512 wv[4];
        for (int q = 0; q < 4; q++)
            wv[q] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wr[q] + i))), 16));
        for (int r = 0; r < NR; r++) {
            __m512 xv = _mm512_loadu_ps(x0 + r * k + i);
            for (int q = 0; q < 4; q++) acc[r][q] = _mm512_fmadd_ps(xv, wv[q], acc[r][q]);
        }
    }
    for (int r = 0; r < NR; r++) {
        const float *xr = x0 + r * k;
        for (int q = 0; q < 4; q++) {
            float s = _mm512_reduce_add_ps(acc[r][q]);
            for (long i = k16; i < k; i++) s += xr[i] * widen(wr[q][i]);
            y[r * n + j + q] = b ? s + b[j + q] : s;
        }
    }
}
#endif

/* y[r*n + j] = sum_i x[r*k + i] * w[j*k + i] (+ b[j]) for j0 <= j < j1 and each of the m input rows r; w holds
   bf16 bit patterns; float32 products and sums. Each (r, j)'s arithmetic does not depend on m or on how rows are
   split between threads: a batch of m inputs gives, bitwise, what m single products give, while the weights are
   read from memory once (a block of rows stays in L1 while every input passes over it). */
static void rows(const float *x, const uint16_t *w, const float *b, float *y, long j0, long j1, long n, long k,
                 long m) {
    long j = j0;
#ifdef __AVX512F__
    for (; j + 4 <= j1; j += 4) {  /* four rows share each load of x */
        long r = 0;
        for (; r + 4 <= m; r += 4) block(x + r * k, w, b, y + r * n, j, n, k, 4);
        if (r + 2 <= m) { block(x + r * k, w, b, y + r * n, j, n, k, 2); r += 2; }
        if (r < m) block(x + r * k, w, b, y + r * n, j, n, k, 1);
    }
#endif
    for (; j < j1; j++) {
        const uint16_t *row = w + j * k;
        for (long r = 0; r < m; r++) {
            const float *xr = x + r * k;
            float acc[16] = {0};
            long i = 0;
            for (; i + 16 <= k; i += 16)
                for (int l = 0; l < 16; l++) acc[l] += xr[i + l] * widen(row[i + l]);
            float s = 0.0f;
            for (int l = 0; l < 16; l++) s += acc[l];
            for (; i < k; i++) s += xr[i] * widen(row[i]);
            y[r * n + j] = b ? s + b[j] : s;
        }
    }
}

/* Worker threads: each takes a fixed share of the rows of every product. They spin briefly for the next job
   (the decode step calls back within microseconds), then sleep on a condition variable. */
#include <pthread.h>
#include <sched.h>
#define MAX_THREADS 16
static struct { const float *x; const uint16_t *w; const float *b; float *y; long m, n, k; } job;
static volatile int epoch, done, sleepers, nthreads = 1;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time (engines on other threads) */

static void share(int t, long n, long *lo, long *hi) {
    long per = ((n + nthreads - 1) / nthreads + 3) & ~3L;
    *lo = t * per < n ? t * per : n;
    *hi = (t + 1) * per < n ? (t + 1) * per : n;
}

static void *worker(void *arg) {
    int t = (int)(long)arg, seen = 0;
    for (;;) {
        int spins = 0;
        while (__atomic_load_n(&epoch, __ATOMIC_ACQUIRE) == seen) {
            if (++spins < 20000) continue;
            pthread_mutex_lock(&mu);
            __atomic_fetch_add(&sleepers, 1, __ATOMIC_SEQ_CST);  /* a full fence before reading epoch again */
            while (__atomic_load_n(&epoch, __ATOMIC_ACQUIRE) == seen) pthread_cond_wait(&cv, &mu);
            __atomic_fetch_sub(&sleepers, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&mu);
        }
        seen = __atomic_load_n(&epoch, __ATOMIC_ACQUIRE);
        long lo, hi;
        share(t, job.n, &lo, &hi);
        rows(job.x, job.w, job.b, job.y, lo, hi, job.n, job.k, job.m);
        __atomic_fetch_add(&done, 1, __ATOMIC_RELEASE);
    }
    return 0;
}

/* A forked child has none of the workers: it computes alone (else it would wait for them forever). */
static void after_fork_in_child(void) {
    nthreads = 1; epoch = 0; done = 0; sleepers = 0;
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

void reef_gemv_bf16(const float *x, const uint16_t *w, const float *b, float *y, long m, long n, long k) {
    if (nthreads == 1 || n * k < 65536) { rows(x, w, b, y, 0, n, n, k, m); return; }
    pthread_mutex_lock(&caller);
    job.x = x; job.w = w; job.b = b; job.y = y; job.m = m; job.n = n; job.k = k;
    __atomic_store_n(&done, 0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&epoch, 1, __ATOMIC_SEQ_CST);  /* a full fence before reading sleepers */
    if (__atomic_load_n(&sleepers, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&mu);
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
    long lo, hi;
    share(0, n, &lo, &hi);
    rows(x, w, b, y, lo, hi, n, k, m);
    for (int spins = 0; __atomic_load_n(&done, __ATOMIC_ACQUIRE) < nthreads - 1; spins++)
        if (spins > 1000) sched_yield();
    pthread_mutex_unlock(&caller);
}
"""

_lock = threading.Lock()
_loaded: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable


def _cache_dir() -> Path:
    return Path(os.environ.get("REEF_KERNEL_CACHE") or Path.home() / ".cache" / "reef" / "kernels")


def _build() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        log.info("no C compiler: decoding keeps float32 weights")
        return None
    flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-shared", "-fPIC"]
    key = hashlib.sha256((_SOURCE + " ".join(flags) + cc + os.uname().machine).encode()).hexdigest()[:16]
    target = _cache_dir() / f"reef_gemv_{key}.so"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "gemv.c"
                src.write_text(_SOURCE)
                out = Path(tmp) / target.name
                subprocess.run([cc, *flags, str(src), "-o", str(out)], check=True, capture_output=True, timeout=120)
                os.replace(out, target)  # atomic: a concurrent builder finds a whole file or none
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("bf16 decode kernel did not build (%s %s): decoding keeps float32 weights", exc,
                        detail.decode(errors="replace")[:300])
            return None
    lib = ctypes.CDLL(str(target))
    fn = lib.reef_gemv_bf16
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_long, ctypes.c_long]
    fn.restype = None
    lib.reef_gemv_threads.argtypes = [ctypes.c_int]
    lib.reef_gemv_threads.restype = ctypes.c_int
    return lib


def kernel():
    """The C function ``reef_gemv_bf16`` (built on first use), or None when it cannot be built here."""
    global _loaded
    with _lock:
        if _loaded is False:
            _loaded = _build() if sys.platform.startswith("linux") or sys.platform == "darwin" else None
        return _loaded.reef_gemv_bf16 if _loaded else None


def set_threads(n: int) -> int:
    """Run the kernel on ``n`` threads (process-wide, like ``torch.set_num_threads``; worker threads are started once
    and never stopped, so this only grows). Returns the count in use; 1 without the kernel."""
    kernel()
    return int(_loaded.reef_gemv_threads(max(1, int(n)))) if _loaded else 1


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every element of float32 ``w`` is a bfloat16 value (its low 16 bits are zero)."""
    return w.dtype == torch.float32 and not bool((w.contiguous().view(torch.int32) & 0xFFFF).any())


class Bf16Matrix:
    """A bf16 copy of an exactly-representable float32 weight ``[n, k]``, multiplied into float32 rows."""

    __slots__ = ("w", "n", "k", "fn", "ptr")

    def __init__(self, w: torch.Tensor, fn):
        self.w = w.detach().to(torch.bfloat16).contiguous()
        self.n, self.k = w.shape
        self.fn, self.ptr = fn, self.w.data_ptr()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """``out[:] = x @ w.T + bias`` for float32 rows ``x`` ([m, k], contiguous); returns ``out`` ([m, n]). Each row's
        result is bitwise the same whatever m is (a batch equals its rows computed one by one)."""
        self.fn(x.data_ptr(), self.ptr, bias.data_ptr() if bias is not None else None, out.data_ptr(), x.shape[0],
                self.n, self.k)
        return out
