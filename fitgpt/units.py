"""How sizes and speeds are printed: one unit rule for every command.

A fixed unit hides small values: a 40 K-parameter test model printed as "0.00 B" and a CPU's
0.3 TFLOP/s as "0 TFLOP/s". These helpers pick the unit that shows three significant digits,
so a tiny model and a 40 B one, a CPU and an H100, read alike:

    params(41_024)  -> "41.0 K"       params(124_439_808) -> "124.44 M"   params(3.9e10) -> "39.08 B"
    flops_rate(3e11) -> "300 GFLOP/s" flops_rate(4.5e14)  -> "450 TFLOP/s"
"""

from __future__ import annotations


def params(n: float) -> str:
    """A parameter count with its unit: B (10^9) and M (10^6) to two decimals, K to one, and
    the bare count below a thousand."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    if n >= 1e3:
        return f"{n / 1e3:.1f} K"
    return f"{n:.0f}"


def _three_digits(v: float) -> str:
    """About three significant digits, never an exponent: 450, 45.0, 4.50, 0.45."""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def flops_rate(flop_per_s: float) -> str:
    """FLOP/s in TFLOP/s from 1 TFLOP/s up, else in GFLOP/s (a CPU, a tiny model)."""
    if flop_per_s >= 1e12:
        return f"{_three_digits(flop_per_s / 1e12)} TFLOP/s"
    return f"{_three_digits(flop_per_s / 1e9)} GFLOP/s"


def tflops(t: float) -> str:
    """`flops_rate` of a figure already in TFLOP/s (the records' "tflops" fields)."""
    return flops_rate(t * 1e12)
