"""Single-pass CPU loops for the counter hash of :mod:`rgc.rounding`, compiled on first use.

A few lines of C (unsigned 32-bit arithmetic, so the hash is exactly the one of
:mod:`rgc.rounding` on every machine) are compiled once per process with the system C compiler
(``$CC``, else ``cc``) into a temporary shared library and called through ``ctypes``. Without a
compiler, or with ``RGC_NATIVE=0`` in the environment, :func:`library` returns ``None`` and the
callers use their numpy/torch paths, which give the same bits.

Why: the numpy path makes about 20 passes over each block (every ufunc is one); the loop here
makes one, and also returns the sum of squares of the values it stored.
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
        out[i] = ((float)(bits_at(i, lo0, s_lo, k0, k1, wrap) >> 8) + add) * mul;
}

/* Box-Muller Gaussians from the hash of indices m and K + m (K = k h, keyed s_lo, s_hi; the
   caller ensures 2 K < 2^32), written as G[i][c] (cosine) and G[i][h + c] (sine), m = i h + c,
   G row-major k x 2h. Only IEEE float operations in a fixed order: rgc.projection's numpy twin
   computes the same bits. The constants come from Python (BOX_MULLER_CONSTANTS). */
void rgc_gaussian(float *g, int64_t k, int64_t h, uint32_t s_lo, uint32_t s_hi) {
    const uint32_t big = (uint32_t)(k * h);
    for (int64_t i = 0; i < k; i++) {
        float *row = g + i * 2 * h;
        for (int64_t c = 0; c < h; c++) {
            uint32_t m = (uint32_t)(i * h + c);
            uint32_t w0 = mix32(mix32(m ^ s_lo) ^ s_hi) >> 8;
            uint32_t w1 = mix32(mix32((big + m) ^ s_lo) ^ s_hi) >> 8;
            /* -2 ln u, u = (w0 + 1) 2^-24 = 2^(e - 24) f, f in [sqrt(1/2), sqrt(2)) */
            float n = (float)(w0 + 1u);
            uint32_t nb;
            memcpy(&nb, &n, sizeof nb);
            int32_t e = (int32_t)(nb >> 23) - 127;
            uint32_t fb = (nb & 0x007FFFFFu) | 0x3F800000u;
            float f;
            memcpy(&f, &fb, sizeof f);
            int big_f = f > BM_SQRT2;
            f = big_f ? f * 0.5f : f;
            e = big_f ? e + 1 : e;
            float s = (f - 1.0f) / (f + 1.0f);
            float z = s * s;
            float p = BM_L4;
            p = p * z + BM_L3; p = p * z + BM_L2; p = p * z + BM_L1; p = p * z + 1.0f;
            float ln_u = (float)(e - 24) * BM_LN2 + (2.0f * s) * p;
            float rho = sqrtf(-2.0f * ln_u);
            /* angle: quadrant q and x in [0, pi/2) */
            uint32_t q = w1 >> 22;
            float x = (float)(w1 & 0x3FFFFFu) * BM_XSTEP;
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
    return "".join(f"#define BM_{name} {float(np.float32(v)).hex()}f\n"
                   for name, v in BOX_MULLER_CONSTANTS.items())


_lock = threading.Lock()
_state: dict = {}


def _compile() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="rgc-native-") as tmp:
        src, lib = Path(tmp) / "rgc_native.c", Path(tmp) / "rgc_native.so"
        src.write_text(_c_constants() + _SOURCE)
        # -ffp-contract=off: no fused multiply-add changes a result (only IEEE operations in
        # a fixed order, so the flags below change the speed, never the bits). 512-bit vectors
        # made the Gaussian loop 20% faster on an AVX-512 CPU (no effect elsewhere); some
        # compilers refuse these options, hence the fallbacks. Without -march=native the
        # Gaussian loop was 7x slower (no vector blends).
        base = [cc, "-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off",
                "-fno-math-errno"]
        for flags in (["-march=native", "-mprefer-vector-width=512"], ["-march=native"], []):
            done = subprocess.run([*base, *flags, str(src), "-o", str(lib)],
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
    handle.rgc_gaussian.argtypes = [ptr, i64, i64, u32, u32]
    handle.rgc_gaussian.restype = None
    handle.rgc_round_bf16.argtypes = [ptr, ptr, i64, u32, u32, u32, u32, i64, ptr]
    handle.rgc_round_bf16.restype = None
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
