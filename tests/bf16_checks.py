"""Comparisons of BF16 results shared by the kernel tests."""

import torch

# Kernel vs float64 reference: every element within one BF16 ulp, and at most this fraction
# of elements differing at all (a differing FP32 summation order moves a value across a
# rounding threshold only rarely: none in 4 x 10^5 elements of the interpreter tests' shapes).
MAX_MISMATCH = 1e-3


def bits16(x: torch.Tensor) -> torch.Tensor:
    """The BF16 bit patterns of ``x`` as int32."""
    return x.contiguous().view(torch.int16).to(torch.int32)


def bf16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of BF16 values between a and b (0 = identical; +0 and -0 count as equal)."""
    def key(x):
        bits = bits16(x)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (key(a) - key(b)).abs()


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(out.float()).any()
    dist = bf16_ulp_distance(out, ref)
    assert int(dist.max()) <= 1
    assert (dist != 0).double().mean().item() <= MAX_MISMATCH
