"""The OpenCL sources the benchmarks build. Deterministic: same names, same sources every run.

Every kernel has the signature ``(const float *a, const float *b, float *c)`` and
repeats one statement ``c[gid] = <expr>;`` N times, so its result is ``<expr>`` and
its compile time grows with N (pocl 3.1, 2 cores: N=50 0.06 s, N=200 0.24 s,
N=600 2.5 s, N=1000 5.3 s for the first launch). Sources are distinct by kernel
name, so no two programs share pocl's kernel cache entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: Work items of every checked launch (as in probe/warm.py).
WORK_ITEMS = 50_000

Expected = Callable[[np.ndarray, np.ndarray], np.ndarray]

#: name -> (OpenCL expression in a[gid], b[gid]; numpy reference)
OPS: dict[str, tuple[str, Expected]] = {
    "add": ("a[gid] + b[gid]", lambda a, b: a + b),
    "sub": ("a[gid] - b[gid]", lambda a, b: a - b),
    "mul": ("a[gid] * b[gid]", lambda a, b: a * b),
    "max": ("fmax(a[gid], b[gid])", np.maximum),
    "min": ("fmin(a[gid], b[gid])", np.minimum),
    "mad": ("a[gid] * b[gid] + a[gid]", lambda a, b: a * b + a),
    "avg": ("0.5f * (a[gid] + b[gid])", lambda a, b: 0.5 * (a + b)),
}
OP_NAMES = list(OPS)


@dataclass(frozen=True)
class Kern:
    name: str
    op: str
    n: int

    def source(self) -> str:
        expr = OPS[self.op][0]
        body = f"c[gid] = {expr};" * self.n
        return (
            f"__kernel void {self.name}(__global const float *a, __global const float *b, "
            f"__global float *c){{ int gid = get_global_id(0);{body}}}"
        )

    def expected(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return OPS[self.op][1](a, b)


@dataclass(frozen=True)
class Prog:
    kernels: tuple[Kern, ...]
    #: the seed program uses probe/warm.py's exact source
    raw: str | None = None

    def source(self) -> str:
        if self.raw is not None:
            return self.raw
        return "\n\n".join(k.source() for k in self.kernels)

    @property
    def statements(self) -> int:
        return sum(k.n for k in self.kernels)


def seed(n: int = 1000) -> list[Prog]:
    """probe/warm.py's kernel: ``c[gid] = a[gid] + b[gid];`` repeated n times."""
    src = (
        "__kernel void sum(__global const float *a, __global const float *b, __global float *c)"
        "{ int gid = get_global_id(0);" + "c[gid] = a[gid] + b[gid];" * n + "}"
    )
    return [Prog((Kern("sum", "add", n),), raw=src)]


#: Sizes of the multi-program workload's kernels, cycled; a few large ones are
#: placed explicitly (index -> N) so the mix is mostly small with some heavy programs.
_MULTI_SIZES = (50, 60, 80, 100, 50, 120, 70, 150, 60, 90)
_MULTI_LARGE = {7: 600, 25: 300, 44: 200}


def multi(programs: int = 20) -> list[Prog]:
    """``programs`` programs of 2-4 kernels each (N 50..600, mixed ops); about 60 kernels."""
    out = []
    idx = 0
    for i in range(programs):
        kernels = []
        for j in range(2 + i % 3):
            n = _MULTI_LARGE.get(idx, _MULTI_SIZES[idx % len(_MULTI_SIZES)])
            op = OP_NAMES[(i + 2 * j) % len(OP_NAMES)]
            kernels.append(Kern(f"m{i}_k{j}_{op}", op, n))
            idx += 1
        out.append(Prog(tuple(kernels)))
    return out


_TP_SIZES = (10, 20, 40, 60, 30, 80, 15, 120, 50, 25, 100, 160)


def throughput(programs: int = 200, start: int = 0) -> list[Prog]:
    """Short-lived programs ``start .. start+programs-1``: 1-2 small-to-medium kernels each."""
    out = []
    for i in range(start, start + programs):
        kernels = []
        for j in range(1 + (i % 4 == 3)):
            n = _TP_SIZES[(i * 5 + j * 7) % len(_TP_SIZES)]
            op = OP_NAMES[(i + j) % len(OP_NAMES)]
            kernels.append(Kern(f"t{i}_k{j}_{op}", op, n))
        out.append(Prog(tuple(kernels)))
    return out


def small() -> Prog:
    """A tiny, cheap kernel whose launches probe the pocl lock (measurement 2b)."""
    return Prog((Kern("small", "add", 1),))


#: The header every ``suite`` program includes (``#include "suite.h"``, ``-I`` its folder).
SUITE_HEADER = """inline float sq(float x) { return x * x; }
inline float lerp(float a, float b, float t) { return a + t * (b - a); }
inline float clampish(float x) { return fmin(fmax(x, -4.0f), 4.0f); }
"""
_SUITE_OPS: dict[str, tuple[str, Expected]] = {
    "add": ("a[gid] + b[gid]", lambda a, b: a + b),
    "mul": ("a[gid] * b[gid]", lambda a, b: a * b),
    "sqd": ("sq(a[gid]) - b[gid]", lambda a, b: a * a - b),
    "lerp": ("lerp(a[gid], b[gid], 0.25f)", lambda a, b: a + 0.25 * (b - a)),
    "clamp": ("clampish(a[gid] * 8.0f - b[gid])", lambda a, b: np.clip(a * 8 - b, -4, 4)),
}
_SUITE_SIZES = (8, 16, 24, 40, 12, 60, 20, 30)


@dataclass(frozen=True)
class SuiteProg(Prog):
    """A ``suite`` program: its kernels include :data:`SUITE_HEADER`."""

    def source(self) -> str:
        body = "\n\n".join(
            f"__kernel void {k.name}(__global const float *a, __global const float *b, "
            f"__global float *c){{ int gid = get_global_id(0);{f'c[gid] = {_SUITE_OPS[k.op][0]};' * k.n}}}"
            for k in self.kernels)
        return '#include "suite.h"\n' + body

    def check(self, name: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return _SUITE_OPS[next(k.op for k in self.kernels if k.name == name)][1](a, b)


def suite(programs: int = 40) -> list[Prog]:
    """A test suite's programs (pyopencl's, loopy's): ``programs`` programs of 1-3 small
    kernels that include a header (``suite.h``, found through ``-I``)."""
    ops = list(_SUITE_OPS)
    out: list[Prog] = []
    for i in range(programs):
        kernels = tuple(
            Kern(f"s{i}_k{j}_{ops[(i + j) % len(ops)]}", ops[(i + j) % len(ops)],
                 _SUITE_SIZES[(i * 3 + j * 5) % len(_SUITE_SIZES)])
            for j in range(1 + i % 3))
        out.append(SuiteProg(kernels))
    return out


WORKLOADS: dict[str, Callable[..., list[Prog]]] = {
    "seed": seed,
    "multi": multi,
    "throughput": throughput,
    "suite": suite,
}
