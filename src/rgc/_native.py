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
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

LANES = 16  # partial sums of the squared norm; element i of a call goes to lane i % LANES

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

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

_lock = threading.Lock()
_state: dict = {}


def _compile() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="rgc-native-") as tmp:
        src, lib = Path(tmp) / "rgc_native.c", Path(tmp) / "rgc_native.so"
        src.write_text(_SOURCE)
        # -ffp-contract=off: no fused multiply-add changes the sums; -march=native may be
        # refused by some compilers, hence the second try.
        base = [cc, "-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off"]
        for flags in (["-march=native"], []):
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
