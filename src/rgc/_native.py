"""Compiled CPU loops: the counter hash of :mod:`rgc.rounding`, stochastic rounding, the
Gaussians and the CholeskyQR of :mod:`rgc.projection`. Compiled on first use.

C (unsigned 32-bit arithmetic, so the hash is exactly the one of :mod:`rgc.rounding` on every
machine; only IEEE operations in a fixed order, so float results do not depend on the
compiler's vector width) is compiled once per process with the system C compiler (``$CC``,
else ``cc``) into a temporary shared library and called through ``ctypes``. Without a
compiler, or with ``RGC_NATIVE=0`` in the environment, :func:`library` returns ``None`` and
the callers use their numpy/torch paths: the same bits for the hash, the rounding and the
Gaussians; torch's BLAS rounding for the CholeskyQR (see :mod:`rgc.projection`).

Why: the numpy path makes about 20 passes over each block (every ufunc is one); the loops
here make one, and the rounding loop also returns the sum of squares of the values it
stored. The CholeskyQR exploits the symmetric Gram and the triangular ``R^-1`` and runs in a
reused buffer: 0.48-0.75x the time of the same steps through torch
(benchmarks/projection_cpu.py).
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

LANES = 16  # partial sums of the squared norm; element i of a call goes to lane i % LANES

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}

/* Hash of flat index lo0 + i: the low word is lo0 + i (mod 2^32), the high-word key is hi0 + s_hi
   before element `wrap` (where the low word wraps) and hi1 + s_hi from there. */
static inline uint32_t bits_at(int64_t i, uint32_t lo0, uint32_t s_lo, uint32_t k0, uint32_t k1,
                               int64_t wrap) {
    return mix32(mix32((lo0 + (uint32_t)i) ^ s_lo) ^ (i < wrap ? k0 : k1));
}

void rgc_hash_words(uint32_t *out, int64_t n, uint32_t lo0, uint32_t s_lo, uint32_t k0,
                    uint32_t k1, int64_t wrap) {
    for (int64_t i = 0; i < n; i++) out[i] = bits_at(i, lo0, s_lo, k0, k1, wrap);
}

/* out[i] = ((float)(bits >> 8) + add) * mul: two IEEE float operations (no contraction), so
   torch computes the same values from the same words. */
void rgc_hash_grid(float *out, int64_t n, uint32_t lo0, uint32_t s_lo, uint32_t k0, uint32_t k1,
                   int64_t wrap, float add, float mul) {
    for (int64_t i = 0; i < n; i++)
        out[i] = ((float)(int32_t)(bits_at(i, lo0, s_lo, k0, k1, wrap) >> 8) + add) * mul;
}

/* Box-Muller Gaussians from the hash of indices m and K + m (K = k h, keyed s_lo, s_hi; the
   caller ensures 2 K < 2^32), written as G[i][c] (cosine) and G[i][h + c] (sine), m = i h + c,
   G row-major k x 2h with rows ldg >= 2h floats apart (columns 2h..ldg-1 set to zero). Only
   IEEE float operations in a fixed order: rgc.projection's numpy twin computes the same bits.
   The constants come from Python (BOX_MULLER_CONSTANTS). */
void rgc_gaussian(float *g, int64_t k, int64_t h, int64_t ldg, uint32_t s_lo, uint32_t s_hi) {
    const uint32_t big = (uint32_t)(k * h);
    for (int64_t i = 0; i < k; i++) {
        float *row = g + i * ldg;
        for (int64_t c = 2 * h; c < ldg; c++) row[c] = 0.0f;
        for (int64_t c = 0; c < h; c++) {
            uint32_t m = (uint32_t)(i * h + c);
            uint32_t w0 = mix32(mix32(m ^ s_lo) ^ s_hi) >> 8;
            uint32_t w1 = mix32(mix32((big + m) ^ s_lo) ^ s_hi) >> 8;
            /* -2 ln u, u = (w0 + 1) 2^-24 = 2^(e - 24) f, f in [sqrt(1/2), sqrt(2)) */
            float n = (float)(int32_t)(w0 + 1u);
            uint32_t nb;
            memcpy(&nb, &n, sizeof nb);
            int32_t e = (int32_t)(nb >> 23) - 127;
            uint32_t fb = (nb & 0x007FFFFFu) | 0x3F800000u;
            /* f > sqrt(2): halve f (one less in the exponent field, exact) and add 1 to e; in
               integers, which every vector instruction set selects without a branch */
            uint32_t big_f = fb > BM_SQRT2_BITS;
            fb -= big_f << 23;
            e += (int32_t)big_f;
            float f;
            memcpy(&f, &fb, sizeof f);
            float s = (f - 1.0f) / (f + 1.0f);
            float z = s * s;
            float p = BM_L4;
            p = p * z + BM_L3; p = p * z + BM_L2; p = p * z + BM_L1; p = p * z + 1.0f;
            float ln_u = (float)(e - 24) * BM_LN2 + (2.0f * s) * p;
            float rho = sqrtf(-2.0f * ln_u);
            /* angle: quadrant q and x in [0, pi/2) */
            uint32_t q = w1 >> 22;
            float x = (float)(int32_t)(w1 & 0x3FFFFFu) * BM_XSTEP;
            float y = x * x;
            float sp = BM_S6;
            sp = sp * y + BM_S5; sp = sp * y + BM_S4; sp = sp * y + BM_S3; sp = sp * y + BM_S2;
            sp = sp * y + BM_S1; sp = sp * y + 1.0f;
            float sn = x * sp;
            float cs = BM_C7;
            cs = cs * y + BM_C6; cs = cs * y + BM_C5; cs = cs * y + BM_C4; cs = cs * y + BM_C3;
            cs = cs * y + BM_C2; cs = cs * y + BM_C1; cs = cs * y + 1.0f;
            float cq = q == 0 ? cs : q == 1 ? -sn : q == 2 ? -cs : sn;
            float sq = q == 0 ? sn : q == 1 ? cs : q == 2 ? -sn : -cs;
            row[c] = rho * cq;
            row[h + c] = rho * sq;
        }
    }
}

/* BF16 pattern of FP32 pattern v with random bits h; a NaN stays a (quiet) NaN of its sign. */
static inline uint16_t round1(uint32_t v, uint32_t h) {
    uint16_t r = (uint16_t)((v + (h & 0xFFFFu)) >> 16);
    uint16_t q = (uint16_t)((v >> 16) | 0x40u);
    return (v & 0x7FFFFFFFu) > 0x7F800000u ? q : r;
}

static inline double square_of_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return (double)f * (double)f;  /* exact: 8 significant bits squared fit a double */
}

/* out[i] = stochastic rounding of x[i] with the bits of index i (see bits_at). If lanes is not
   NULL, lanes[i % 16] += out[i]^2 in increasing i (a fixed order, whatever the vector width). */
void rgc_round_bf16(const uint32_t *x, uint16_t *out, int64_t n, uint32_t lo0, uint32_t s_lo,
                    uint32_t k0, uint32_t k1, int64_t wrap, double *lanes) {
    if (!lanes) {
        for (int64_t i = 0; i < n; i++) out[i] = round1(x[i], bits_at(i, lo0, s_lo, k0, k1, wrap));
        return;
    }
    double acc[16];
    for (int j = 0; j < 16; j++) acc[j] = lanes[j];
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int j = 0; j < 16; j++) {
            uint16_t b = round1(x[i + j], bits_at(i + j, lo0, s_lo, k0, k1, wrap));
            out[i + j] = b;
            acc[j] += square_of_bf16(b);
        }
    }
    for (int j = 0; i + j < n; j++) {
        uint16_t b = round1(x[i + j], bits_at(i + j, lo0, s_lo, k0, k1, wrap));
        out[i + j] = b;
        acc[j] += square_of_bf16(b);
    }
    for (int j = 0; j < 16; j++) lanes[j] = acc[j];
}

/* ---- CholeskyQR of a Gaussian matrix (rgc.projection) --------------------------------------
   One SIMD type per instruction set; every lane computes the same IEEE operations (a fused
   multiply-add rounds once everywhere, fmaf/fma in the scalar build), so the vector width
   changes the speed, never the bits. */
#if defined(__AVX512F__) && !defined(RGC_SCALAR)
#include <immintrin.h>
typedef __m512 vf;
typedef __m512d vd;
enum { VF = 16, VD = 8, GRAM_ROWS = 8, PROD_ROWS = 8, PROD_COLS = 32 };
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_set1 _mm512_set1_ps
#define vf_fma _mm512_fmadd_ps
#define vd_load _mm512_loadu_pd
#define vd_store _mm512_storeu_pd
#define vd_set1 _mm512_set1_pd
#define vd_fma _mm512_fmadd_pd
#define vd_from_floats(p) _mm512_cvtps_pd(_mm256_loadu_ps(p))
#elif defined(__AVX2__) && defined(__FMA__) && !defined(RGC_SCALAR)
#include <immintrin.h>
typedef __m256 vf;
typedef __m256d vd;
enum { VF = 8, VD = 4, GRAM_ROWS = 4, PROD_ROWS = 4, PROD_COLS = 16 };
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_set1 _mm256_set1_ps
#define vf_fma _mm256_fmadd_ps
#define vd_load _mm256_loadu_pd
#define vd_store _mm256_storeu_pd
#define vd_set1 _mm256_set1_pd
#define vd_fma _mm256_fmadd_pd
#define vd_from_floats(p) _mm256_cvtps_pd(_mm_loadu_ps(p))
#elif defined(__aarch64__) && !defined(RGC_SCALAR)
#include <arm_neon.h>
typedef float32x4_t vf;
typedef float64x2_t vd;
enum { VF = 4, VD = 2, GRAM_ROWS = 4, PROD_ROWS = 4, PROD_COLS = 16 };
#define vf_load vld1q_f32
#define vf_store vst1q_f32
#define vf_set1 vdupq_n_f32
#define vf_fma(a, b, c) vfmaq_f32(c, a, b)
#define vd_load vld1q_f64
#define vd_store vst1q_f64
#define vd_set1 vdupq_n_f64
#define vd_fma(a, b, c) vfmaq_f64(c, a, b)
#define vd_from_floats(p) vcvt_f64_f32(vld1_f32(p))
#else
typedef float vf;
typedef double vd;
enum { VF = 1, VD = 1, GRAM_ROWS = 8, PROD_ROWS = 8, PROD_COLS = 16 };
#define vf_load(p) (*(p))
#define vf_store(p, v) (*(p) = (v))
#define vf_set1(x) (x)
#define vf_fma fmaf
#define vd_load(p) (*(p))
#define vd_store(p, v) (*(p) = (v))
#define vd_set1(x) (x)
#define vd_fma fma
#define vd_from_floats(p) ((double)*(p))
#endif

/* Register blocks (sized to each instruction set's registers): GRAM_ROWS x COLS entries of the
   Gram, PROD_ROWS x PROD_COLS of the product. CHUNK: rows of G per pass of the Gram. */
enum { COLS = 16, CHUNK = 128 };

static inline int64_t round_up16(int64_t x) { return (x + 15) & ~(int64_t)15; }

/* out (ld x ld float64, ld = round_up16(r), zero on entry) += the Gram matrix G^T G, G k x r
   row-major with rows ldg >= ld floats apart. Every entry is one chain of fused multiply-adds
   over the rows of G in order 0..k-1, in FP32 (wide = 0) or float64 (wide = 1: the FP32
   products are then exact). The upper triangle is exact to that definition; entries below the
   diagonal and in the padding are not meaningful. FP32 sums live in out's first half. */
static void gram(const float *g, int64_t k, int64_t r, int64_t ldg, int wide, double *out) {
    const int64_t ld = round_up16(r);
    float *outf = (float *)out;
    for (int64_t i0 = 0; i0 < k; i0 += CHUNK) {
        const int64_t i1 = k - i0 < CHUNK ? k : i0 + CHUNK;
        for (int64_t a0 = 0; a0 < r; a0 += GRAM_ROWS) {
            for (int64_t b0 = a0 & ~(int64_t)15; b0 < ld; b0 += COLS) {
                if (!wide) {
                    vf acc[GRAM_ROWS][COLS / VF];
                    for (int j = 0; j < GRAM_ROWS; j++)
                        for (int v = 0; v < COLS / VF; v++)
                            acc[j][v] = vf_load(outf + (a0 + j) * ld + b0 + v * VF);
                    for (int64_t i = i0; i < i1; i++) {
                        const float *gi = g + i * ldg;
                        for (int v = 0; v < COLS / VF; v++) {
                            vf y = vf_load(gi + b0 + v * VF);
                            for (int j = 0; j < GRAM_ROWS; j++)
                                acc[j][v] = vf_fma(vf_set1(gi[a0 + j]), y, acc[j][v]);
                        }
                    }
                    for (int j = 0; j < GRAM_ROWS; j++)
                        for (int v = 0; v < COLS / VF; v++)
                            vf_store(outf + (a0 + j) * ld + b0 + v * VF, acc[j][v]);
                } else {
                    vd acc[GRAM_ROWS][COLS / VD];
                    for (int j = 0; j < GRAM_ROWS; j++)
                        for (int v = 0; v < COLS / VD; v++)
                            acc[j][v] = vd_load(out + (a0 + j) * ld + b0 + v * VD);
                    for (int64_t i = i0; i < i1; i++) {
                        const float *gi = g + i * ldg;
                        for (int v = 0; v < COLS / VD; v++) {
                            vd y = vd_from_floats(gi + b0 + v * VD);
                            for (int j = 0; j < GRAM_ROWS; j++)
                                acc[j][v] = vd_fma(vd_set1((double)gi[a0 + j]), y, acc[j][v]);
                        }
                    }
                    for (int j = 0; j < GRAM_ROWS; j++)
                        for (int v = 0; v < COLS / VD; v++)
                            vd_store(out + (a0 + j) * ld + b0 + v * VD, acc[j][v]);
                }
            }
        }
    }
    if (!wide)  /* widen in place, last entry first */
        for (int64_t n = ld * ld - 1; n >= 0; n--) out[n] = outf[n];
}

/* dst[c] = fma(-v, row[c], dst[c]) for whole vectors covering [from, ld). */
static inline void subtract_row(double *dst, const double *row, double v, int64_t from,
                                int64_t ld) {
    const vd m = vd_set1(-v);
    for (int64_t c = from - from % VD; c < ld; c += VD)
        vd_store(dst + c, vd_fma(m, vd_load(row + c), vd_load(dst + c)));
}

/* a (r x r, leading dimension ld = round_up16(r), upper triangle read): overwritten with its
   upper Cholesky factor R (right-looking); x (same layout) = scale R^-1 (backward
   substitution), zero below the diagonal and in the padding. row: ld doubles. Returns 1 (and
   stops) if a is not positive definite, else 0. */
static int inverse_cholesky(double *a, double *x, int64_t r, double scale, double *row) {
    const int64_t ld = round_up16(r);
    for (int64_t j = 0; j < r; j++) {
        double *aj = a + j * ld;
        if (!(aj[j] > 0.0)) return 1;
        const double d = sqrt(aj[j]);
        aj[j] = d;
        for (int64_t c = j + 1; c < ld; c++) row[c] = aj[c] = aj[c] / d;
        for (int64_t i = j + 1; i < r; i++) subtract_row(a + i * ld, row, row[i], i, ld);
    }
    memset(x, 0, sizeof(double) * r * ld);
    for (int64_t i = 0; i < r; i++) x[i * ld + i] = scale;
    for (int64_t i = r - 1; i >= 0; i--) {
        double *xi = x + i * ld;
        const double d = a[i * ld + i];
        for (int64_t c = i - i % VD; c < i; c++) row[c] = 0.0;
        for (int64_t c = i; c < ld; c++) row[c] = xi[c] = xi[c] / d;
        for (int64_t m = 0; m < i; m++) subtract_row(x + m * ld, row, a[m * ld + i], i, ld);
    }
    return 0;
}

static inline uint16_t bf16_nearest_even(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* out (k x r row-major, FP32, or BF16 rounded to nearest even) = G inv; inv r x ldp FP32
   (ldp = r rounded up to PROD_COLS), upper triangular, zero below the diagonal and in the
   padding. Every entry is one chain of fused multiply-adds over i = 0, 1, ... to the end of
   its PROD_COLS-column block; the terms past its own column are exact zeros, which leave it
   unchanged (so the block size does not change the result). */
static void product(const float *g, int64_t k, int64_t r, int64_t ldg, const float *inv,
                    int64_t ldp, void *out, int out_bf16) {
    float block[PROD_ROWS][PROD_COLS];
    for (int64_t r0 = 0; r0 < k; r0 += PROD_ROWS) {
        const int64_t rows = k - r0 < PROD_ROWS ? k - r0 : PROD_ROWS;
        const float *g0 = g + r0 * ldg;
        for (int64_t c0 = 0; c0 < r; c0 += PROD_COLS) {
            vf acc[PROD_ROWS][PROD_COLS / VF];
            for (int j = 0; j < PROD_ROWS; j++)
                for (int v = 0; v < PROD_COLS / VF; v++) acc[j][v] = vf_set1(0.0f);
            const int64_t iend = c0 + PROD_COLS < r ? c0 + PROD_COLS : r;
            for (int64_t i = 0; i < iend; i++) {
                for (int v = 0; v < PROD_COLS / VF; v++) {
                    vf y = vf_load(inv + i * ldp + c0 + v * VF);
                    for (int j = 0; j < PROD_ROWS; j++)  /* rows past k repeat row k-1, unused */
                        acc[j][v] = vf_fma(vf_set1(g0[(j < rows ? j : rows - 1) * ldg + i]),
                                           y, acc[j][v]);
                }
            }
            for (int j = 0; j < PROD_ROWS; j++)
                for (int v = 0; v < PROD_COLS / VF; v++) vf_store(&block[j][v * VF], acc[j][v]);
            const int64_t cols = r - c0 < PROD_COLS ? r - c0 : PROD_COLS;
            for (int64_t j = 0; j < rows; j++) {
                if (out_bf16) {
                    uint16_t *o = (uint16_t *)out + (r0 + j) * r + c0;
                    for (int64_t l = 0; l < cols; l++) o[l] = bf16_nearest_even(block[j][l]);
                } else {
                    memcpy((float *)out + (r0 + j) * r + c0, block[j], sizeof(float) * cols);
                }
            }
        }
    }
}

/* 1 when this build has vector code with hardware fused multiply-adds (without them, fmaf runs
   in software and the CholeskyQR below is about 30x slower; with RGC_SCALAR it is scalar):
   rgc.projection then uses torch instead. */
int rgc_fast_fma(void) {
#if (defined(__FMA__) || defined(__AVX512F__) || defined(__aarch64__)) && !defined(RGC_SCALAR)
    return 1;
#else
    return 0;
#endif
}

/* P = scale G R^-1 (k x r row-major, FP32 or BF16) for the upper Cholesky factor R of the
   Gram G^T G (FP32 sums when wide = 0, float64 when 1); G k x r, rows ldg >= round_up16(r)
   floats apart, finite. work: 2 ld^2 + ld doubles, then r (ld + 16) floats, ld = round_up16(r).
   Returns 0, or 1 if the Gram is not positive definite (then out is untouched). */
int rgc_cholesky_qr(const float *g, int64_t k, int64_t r, int64_t ldg, int wide, double scale,
                    void *out, int out_bf16, double *work) {
    const int64_t ld = round_up16(r), ldp = (r + PROD_COLS - 1) / PROD_COLS * PROD_COLS;
    double *a = work, *x = work + ld * ld, *row = work + 2 * ld * ld;
    float *inv = (float *)(row + ld);
    memset(a, 0, sizeof(double) * ld * ld);
    gram(g, k, r, ldg, wide, a);
    if (inverse_cholesky(a, x, r, scale, row)) return 1;
    memset(inv, 0, sizeof(float) * r * ldp);
    for (int64_t i = 0; i < r; i++)
        for (int64_t c = i; c < r; c++) inv[i * ldp + c] = (float)x[i * ld + c];
    product(g, k, r, ldg, inv, ldp, out, out_bf16);
    return 0;
}
"""

# The constants of rgc_gaussian, rounded to float32 (C gets them as exact hex literals); the
# numpy twin in rgc.projection uses the same. Series: ln f = 2 s (1 + s^2/3 + ... + s^8/9) with
# s = (f-1)/(f+1), |s| <= 0.172 (error < 1e-9); Taylor series of sin to x^13 and cos to x^14
# on [0, pi/2) (error < 1e-9). XSTEP = fl32(pi/2) / 2^22, exact.
BOX_MULLER_CONSTANTS: dict[str, float] = {
    "SQRT2": math.sqrt(2.0), "LN2": math.log(2.0),
    **{f"L{j}": 1.0 / (2 * j + 1) for j in range(1, 5)},
    "XSTEP": float(np.float32(math.pi / 2)) * 2.0**-22,
    **{f"S{j}": (-1.0) ** j / math.factorial(2 * j + 1) for j in range(1, 7)},
    **{f"C{j}": (-1.0) ** j / math.factorial(2 * j) for j in range(1, 8)},
}


def _c_constants() -> str:
    sqrt2_bits = int(np.float32(BOX_MULLER_CONSTANTS["SQRT2"]).view(np.uint32))
    return f"#define BM_SQRT2_BITS {sqrt2_bits:#x}u\n" + "".join(
        f"#define BM_{name} {float(np.float32(v)).hex()}f\n"
        for name, v in BOX_MULLER_CONSTANTS.items())


def cholesky_qr_work_floats(r: int) -> int:
    """FP32 elements of the work space ``rgc_cholesky_qr`` needs at rank r: 2 ld^2 + ld
    doubles, then r (ld + 16) floats, ld = r rounded up to 16 (an upper bound, at most
    5 ld^2 + 18 ld)."""
    ld = -(-r // 16) * 16
    return 5 * ld * ld + 18 * ld


_lock = threading.Lock()
_state: dict = {}


# Tried in order until one compiles. 512-bit vectors made the Gaussian loop 20% faster on an
# AVX-512 CPU (no effect elsewhere); some compilers refuse these options, hence the fallbacks.
# Without -march=native the Gaussian loop was 7x slower (no vector blends).
FLAG_SETS = (("-march=native", "-mprefer-vector-width=512"), ("-march=native",), ())


def _compile(flag_sets=FLAG_SETS) -> ctypes.CDLL | None:
    """Compile the loops with the first of ``flag_sets`` the compiler accepts (None if none)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="rgc-native-") as tmp:
        src, lib = Path(tmp) / "rgc_native.c", Path(tmp) / "rgc_native.so"
        src.write_text(_c_constants() + _SOURCE)
        # -ffp-contract=off: the compiler fuses no multiply-add on its own (only IEEE
        # operations in a fixed order, the explicit fused ones included, so the flags change
        # the speed, never the bits).
        base = [cc, "-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off",
                "-fno-math-errno"]
        # Last resort: the CholeskyQR's vector code left out (RGC_SCALAR), so that a compiler
        # refusing its intrinsics still gets the hash and rounding loops (the CholeskyQR then
        # runs through torch, see rgc_fast_fma).
        attempts = [*flag_sets, *[(*flags, "-DRGC_SCALAR") for flags in flag_sets]]
        for flags in attempts:
            done = subprocess.run([*base, *flags, str(src), "-o", str(lib), "-lm"],
                                  capture_output=True, timeout=120)
            if done.returncode == 0:
                break
        else:
            return None
        handle = ctypes.CDLL(str(lib))  # stays mapped after the file is removed
    u32, i64, ptr = ctypes.c_uint32, ctypes.c_int64, ctypes.c_void_p
    handle.rgc_hash_words.argtypes = [ptr, i64, u32, u32, u32, u32, i64]
    handle.rgc_hash_words.restype = None
    flt = ctypes.c_float
    handle.rgc_hash_grid.argtypes = [ptr, i64, u32, u32, u32, u32, i64, flt, flt]
    handle.rgc_hash_grid.restype = None
    handle.rgc_gaussian.argtypes = [ptr, i64, i64, i64, u32, u32]
    handle.rgc_gaussian.restype = None
    handle.rgc_round_bf16.argtypes = [ptr, ptr, i64, u32, u32, u32, u32, i64, ptr]
    handle.rgc_round_bf16.restype = None
    handle.rgc_cholesky_qr.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ctypes.c_double, ptr,
                                       ctypes.c_int, ptr]
    handle.rgc_cholesky_qr.restype = ctypes.c_int
    handle.rgc_fast_fma.restype = ctypes.c_int
    handle.fast_fma = bool(handle.rgc_fast_fma())
    return handle


def library() -> ctypes.CDLL | None:
    """The compiled loops, or ``None`` (no C compiler, or ``RGC_NATIVE=0``). Compiled once."""
    if os.environ.get("RGC_NATIVE", "1") == "0":
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                try:
                    _state["lib"] = _compile()
                except (OSError, subprocess.SubprocessError):
                    _state["lib"] = None
    return _state["lib"]
