"""Grouped matrix products over the rows routed to each expert: torch's grouped GEMM or a loop.

Rows are sorted by expert; ``offs`` (int32, ``[E]``) holds the cumulative row counts, so the
rows of expert ``e`` are ``offs[e-1]:offs[e]`` (an expert without rows has an empty range).

* :func:`grouped_mm` ``(x [S, k], b [E, k, d]) -> [S, d]``: row ``s`` of expert ``e`` times
  ``b[e]`` (the forward and the input gradient of an experts layer).
* :func:`grouped_sketch` ``(g [S, d], xp [S, r]) -> [E, d, r]`` FP32: ``g_e^T xp_e`` per
  expert (the sketch of the weight gradient); an expert without rows gets exact zeros.

Both use ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` before torch 2.10) where it
accepts the operands, else one ``torch.mm`` per expert. What torch 2.13 accepts, measured on
its CPU build and read in its source (``GroupedMMUtils.h``): BF16, FP16 and FP32 operands of one
dtype, output in that same dtype (``out_dtype=torch.float32`` for BF16 inputs is refused on
every device), each operand row- or column-major with its leading stride a multiple of 16
bytes (and, off the CPU, its data pointer 16-byte aligned). On CUDA only BF16 on sm90/sm100
runs the fast kernel without a host synchronisation; other dtypes run torch's own loop.

The sketch is FP32: from BF16 or FP16 operands it is computed per expert on FP32 copies of that
expert's rows (one ``n_e x d`` and one ``n_e x r`` transient, never a copy of all rows), since
the grouped kernel cannot accumulate them into FP32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: ``'auto'`` (torch's grouped GEMM where it accepts the operands) or ``'loop'`` (one mm per
#: expert always). Tests set it to check both paths against the same reference.
MODE = "auto"


def _layout_ok(t: torch.Tensor) -> bool:
    """True if torch's grouped GEMM accepts ``t``'s dtype, strides and alignment."""
    if t.dtype not in _GROUPED_DTYPES:
        return False
    if t.device.type != "cpu" and t.data_ptr() % 16:
        return False
    align = 16 // t.element_size()
    strides, sizes = t.stride(), t.shape
    if strides[-2] == 1 and strides[-1] >= max(1, sizes[-2]):  # column-major
        return strides[-1] % align == 0
    if strides[-1] == 1 and strides[-2] >= max(1, sizes[-1]):  # row-major
        return strides[-2] % align == 0
    return False


def _device_ok(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return True
    if t.device.type == "cuda":
        return torch.cuda.get_device_capability(t.device) >= (8, 0)
    return False


def native_ok(*tensors: torch.Tensor) -> bool:
    """True if :func:`grouped_mm` / :func:`grouped_sketch` would call torch's grouped GEMM."""
    return (MODE == "auto" and _GROUPED_MM is not None
            and len({t.dtype for t in tensors}) == 1
            and all(_layout_ok(t) and _device_ok(t) for t in tensors))


def _ranges(offs: torch.Tensor):
    """``(expert, start, end)`` for every expert with rows (one host read of ``offs``)."""
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            yield e, start, end
        start = end


def _traced_native_ok(*tensors: torch.Tensor) -> bool:
    """:func:`native_ok`, and under torch.compile BF16 only: torch 2.13's meta kernel of the
    grouped GEMM refuses other dtypes that its CPU kernel runs."""
    return native_ok(*tensors) and (not torch.compiler.is_compiling()
                                    or tensors[0].dtype == torch.bfloat16)


def _expert_masks(offs: torch.Tensor, rows: int):
    """``(e, mask)`` per expert, ``mask`` [rows] true on its rows: static shapes, no host read
    (what torch.compile traces where the grouped GEMM is not available)."""
    index = torch.arange(rows, device=offs.device)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    for e in range(offs.shape[0]):
        yield e, (index >= starts[e]) & (index < offs[e])


def grouped_mm(x: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ b[e]``: ``x`` [S, k], ``b`` [E, k, d] -> [S, d].

    Same dtype for both operands and the result. Rows past ``offs[-1]`` are not written
    (zeros under torch.compile without the grouped GEMM, where every expert multiplies every
    row and a select keeps its own: E times the arithmetic, shapes static).
    """
    if _traced_native_ok(x, b):
        return _GROUPED_MM(x, b, offs=offs)
    if torch.compiler.is_compiling():
        out = x.new_zeros(x.shape[0], b.shape[-1])
        for e, mask in _expert_masks(offs, x.shape[0]):
            out = torch.where(mask[:, None], x @ b[e], out)
        return out
    out = x.new_empty(x.shape[0], b.shape[-1])
    for e, start, end in _ranges(offs):
        torch.mm(x[start:end], b[e], out=out[start:end])
    return out


def grouped_sketch(g: torch.Tensor, xp: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``C[e] = g[rows of e]^T @ xp[rows of e]`` in FP32: ``g`` [S, d], ``xp`` [S, r] -> [E, d, r].

    An expert without rows gets zeros. Contiguous result.
    """
    num_experts = offs.shape[0]
    if g.dtype == xp.dtype == torch.float32 and _traced_native_ok(g.t(), xp):
        return _GROUPED_MM(g.t(), xp, offs=offs).contiguous()
    if torch.compiler.is_compiling():
        g32, xp32 = g.to(torch.float32), xp.to(torch.float32)
        return torch.stack([torch.where(mask[:, None], g32, 0.0).t() @ xp32
                            for _, mask in _expert_masks(offs, g.shape[0])])
    out = torch.zeros(num_experts, g.shape[-1], xp.shape[-1], dtype=torch.float32,
                      device=g.device)
    for e, start, end in _ranges(offs):
        torch.mm(g[start:end].t().to(torch.float32), xp[start:end].to(torch.float32),
                 out=out[e])
    return out
