"""A small explicit time-stepping simulation whose first step is mostly kernel compilation.

2D wave equation with absorbing layers, a tracer carried by an advection-diffusion
equation, sources and diagnostics: 12 kernels in 4 programs, built with
``asyncclcache.Program`` inside ``asyncclcache.step()``.

``python examples/simulation.py`` runs the simulation three times, each in a fresh
process with an empty pocl kernel cache (a new node): with pyopencl as installed (no
asyncclcache), then twice with asyncclcache. It compares their first steps: the cold
run compiles as pyopencl does, the warm run loads what the cold run's background work
wrote. Each cached run ends with the exit summary line (``ASYNCCLCACHE_STATS=1``).

The cache directory is the demo's own, ``.demo-cache/`` in the checkout, emptied at each
start (so every demo shows a cold run; ``asyncclcache list --dir .demo-cache`` shows what
it stored), unless ``--dir`` or ``ASYNCCLCACHE_DIR`` names one, which is used as it is.
The runs' pocl kernel caches are temporary folders, removed at the end (also on Ctrl-C).

Options: ``--steps N``, ``--size N``, ``--short`` (for tests), ``--dir DIR``, ``--once``
(one run in this process), ``--no-cache``. Honours ``PYOPENCL_CTX``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

STENCILS = r"""
#define IDX(i, j) ((j) * nx + (i))
__kernel void laplacian(const int nx, const int ny, const float inv_h2,
                        __global const float *u, __global float *lap)
{
    int i = get_global_id(0), j = get_global_id(1);
    if (i >= nx || j >= ny) return;
    if (i == 0 || j == 0 || i == nx - 1 || j == ny - 1) { lap[IDX(i, j)] = 0.0f; return; }
    /* fourth-order interior where possible, second-order next to the boundary */
    float c = u[IDX(i, j)];
    float l;
    if (i > 1 && j > 1 && i < nx - 2 && j < ny - 2) {
        l = (-u[IDX(i-2, j)] + 16.0f*u[IDX(i-1, j)] - 30.0f*c + 16.0f*u[IDX(i+1, j)] - u[IDX(i+2, j)]
             -u[IDX(i, j-2)] + 16.0f*u[IDX(i, j-1)] - 30.0f*c + 16.0f*u[IDX(i, j+1)] - u[IDX(i, j+2)])
            / 12.0f;
    } else {
        l = u[IDX(i-1, j)] + u[IDX(i+1, j)] + u[IDX(i, j-1)] + u[IDX(i, j+1)] - 4.0f * c;
    }
    lap[IDX(i, j)] = l * inv_h2;
}

__kernel void wave_update(const int nx, const int ny, const float c2dt2,
                          __global const float *u_prev, __global const float *u,
                          __global const float *lap, __global const float *damping,
                          __global float *u_next)
{
    int i = get_global_id(0), j = get_global_id(1);
    if (i >= nx || j >= ny) return;
    int k = IDX(i, j);
    float d = damping[k];
    u_next[k] = ((2.0f - d * d) * u[k] - (1.0f - d) * u_prev[k] + c2dt2 * lap[k]) / (1.0f + d);
}

__kernel void advect_upwind(const int nx, const int ny, const float dt_h,
                            __global const float *vx, __global const float *vy,
                            __global const float *q, __global float *q_new)
{
    int i = get_global_id(0), j = get_global_id(1);
    if (i >= nx || j >= ny) return;
    int k = IDX(i, j);
    int im = max(i - 1, 0), ip = min(i + 1, nx - 1), jm = max(j - 1, 0), jp = min(j + 1, ny - 1);
    float u = vx[k], v = vy[k];
    float dqx = u > 0.0f ? q[k] - q[IDX(im, j)] : q[IDX(ip, j)] - q[k];
    float dqy = v > 0.0f ? q[k] - q[IDX(i, jm)] : q[IDX(i, jp)] - q[k];
    q_new[k] = q[k] - dt_h * (u * dqx + v * dqy);
}

__kernel void diffuse(const int nx, const int ny, const float nu_dt_h2,
                      __global const float *q, __global float *q_new)
{
    int i = get_global_id(0), j = get_global_id(1);
    if (i >= nx || j >= ny) return;
    int im = max(i - 1, 0), ip = min(i + 1, nx - 1), jm = max(j - 1, 0), jp = min(j + 1, ny - 1);
    float c = q[IDX(i, j)];
    q_new[IDX(i, j)] = c + nu_dt_h2 * (q[IDX(im, j)] + q[IDX(ip, j)] + q[IDX(i, jm)] + q[IDX(i, jp)] - 4.0f * c);
}

__kernel void apply_boundary(const int nx, const int ny, __global float *u)
{
    int i = get_global_id(0);
    if (i < nx) { u[IDX(i, 0)] = 0.0f; u[IDX(i, ny - 1)] = 0.0f; }
    if (i < ny) { u[IDX(0, i)] = 0.0f; u[IDX(nx - 1, i)] = 0.0f; }
}
"""

SOURCES = r"""
#define IDX(i, j) ((j) * nx + (i))
__kernel void gaussian_source(const int nx, const int ny, const float t, const float x0,
                              const float y0, const float width, const float amplitude,
                              const float freq, __global float *u)
{
    int i = get_global_id(0), j = get_global_id(1);
    if (i >= nx || j >= ny) return;
    float x = (float) i / nx - x0, y = (float) j / ny - y0;
    float envelope = exp(-(x * x + y * y) / (width * width));
    float arg = M_PI_F * freq * (t - 1.0f / freq);
    float ricker = (1.0f - 2.0f * arg * arg) * exp(-arg * arg);
    u[IDX(i, j)] += amplitude * envelope * ricker;
}

__kernel void damping_layer(const int nx, const int ny, const int width, const float strength,
                            __global float *damping)
{
    int i = get_global_id(0), j = get_global_id(1);
    if (i >= nx || j >= ny) return;
    int d = min(min(i, j), min(nx - 1 - i, ny - 1 - j));
    float s = d < width ? (float)(width - d) / width : 0.0f;
    damping[IDX(i, j)] = strength * s * s;
}

__kernel void velocity_field(const int nx, const int ny, const float speed,
                             __global float *vx, __global float *vy)
{
    int i = get_global_id(0), j = get_global_id(1);
    if (i >= nx || j >= ny) return;
    float x = (float) i / nx - 0.5f, y = (float) j / ny - 0.5f;
    float r2 = x * x + y * y;
    float swirl = speed * exp(-8.0f * r2);
    vx[IDX(i, j)] = -swirl * y + 0.1f * speed;
    vy[IDX(i, j)] = swirl * x;
}
"""

DIAGNOSTICS = r"""
__kernel void energy_partial(const int n, __global const float *u, __global const float *u_prev,
                             __local float *scratch, __global float *partial)
{
    int gid = get_global_id(0), lid = get_local_id(0);
    float acc = 0.0f;
    for (int k = gid; k < n; k += get_global_size(0)) {
        float du = u[k] - u_prev[k];
        acc += du * du + u[k] * u[k];
    }
    scratch[lid] = acc;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (lid < s) scratch[lid] += scratch[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) partial[get_group_id(0)] = scratch[0];
}

__kernel void max_abs_partial(const int n, __global const float *q, __local float *scratch,
                              __global float *partial)
{
    int gid = get_global_id(0), lid = get_local_id(0);
    float m = 0.0f;
    for (int k = gid; k < n; k += get_global_size(0)) m = fmax(m, fabs(q[k]));
    scratch[lid] = m;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (lid < s) scratch[lid] = fmax(scratch[lid], scratch[lid + s]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) partial[get_group_id(0)] = scratch[0];
}
"""

TRACER = r"""
__kernel void tracer_source(const int nx, const int ny, const float rate,
                            __global const float *u, __global float *q)
{
    int i = get_global_id(0), j = get_global_id(1);
    if (i >= nx || j >= ny) return;
    int k = j * nx + i;
    q[k] = clamp(q[k] + rate * fabs(u[k]), 0.0f, 10.0f);
}

__kernel void axpby(const int n, const float a, __global const float *x, const float b,
                    __global float *y)
{
    int k = get_global_id(0);
    if (k < n) y[k] = a * x[k] + b * y[k];
}
"""

PROGRAMS = {"stencils": STENCILS, "sources": SOURCES, "diagnostics": DIAGNOSTICS, "tracer": TRACER}
GROUP = 64  # work-group size of the reductions


class Simulation:
    """Owns the buffers and kernels; ``step()`` advances one time step."""

    def __init__(self, ctx, queue, size: int, build) -> None:
        import pyopencl as cl

        self.cl, self.ctx, self.q = cl, ctx, queue
        self.nx = self.ny = size
        n = size * size
        self.n = n
        mf = cl.mem_flags
        zeros = np.zeros(n, np.float32)

        def buf():
            return cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=zeros)

        self.u_prev, self.u, self.u_next, self.lap = buf(), buf(), buf(), buf()
        self.damping, self.vx, self.vy, self.tracer, self.tracer_tmp = buf(), buf(), buf(), buf(), buf()
        self.ngroups = 32
        self.partial = cl.Buffer(ctx, mf.READ_WRITE, 4 * self.ngroups)
        self.prg = {name: build(src) for name, src in PROGRAMS.items()}
        self.k = {k.function_name: k for p in self.prg.values() for k in p.all_kernels()}
        self.t = 0.0
        self.h = 1.0 / size
        self.dt = 0.4 * self.h
        self.initialized = False

    def _init(self) -> None:
        g2 = (self.nx, self.ny)
        i32, f32 = np.int32, np.float32
        self.k["damping_layer"](self.q, g2, None, i32(self.nx), i32(self.ny), i32(self.nx // 10), f32(0.2), self.damping)
        self.k["velocity_field"](self.q, g2, None, i32(self.nx), i32(self.ny), f32(1.0), self.vx, self.vy)
        self.initialized = True

    def step(self) -> float:
        """One time step; returns the wave energy (checksum of the run)."""
        cl, k, q = self.cl, self.k, self.q
        if not self.initialized:
            self._init()
        g2 = (self.nx, self.ny)
        i32, f32 = np.int32, np.float32
        nx, ny = i32(self.nx), i32(self.ny)
        k["gaussian_source"](q, g2, None, nx, ny, f32(self.t), f32(0.3), f32(0.4), f32(0.05), f32(1.0), f32(4.0), self.u)
        k["laplacian"](q, g2, None, nx, ny, f32(1.0 / self.h**2), self.u, self.lap)
        k["wave_update"](q, g2, None, nx, ny, f32(self.dt**2), self.u_prev, self.u, self.lap, self.damping, self.u_next)
        k["apply_boundary"](q, (max(self.nx, self.ny),), None, nx, ny, self.u_next)
        k["advect_upwind"](q, g2, None, nx, ny, f32(self.dt / self.h), self.vx, self.vy, self.tracer, self.tracer_tmp)
        k["diffuse"](q, g2, None, nx, ny, f32(0.1), self.tracer_tmp, self.tracer)
        k["tracer_source"](q, g2, None, nx, ny, f32(0.01), self.u_next, self.tracer)
        k["axpby"](q, (self.n,), None, i32(self.n), f32(1e-3), self.u_next, f32(1.0), self.tracer)
        self.u_prev, self.u, self.u_next = self.u, self.u_next, self.u_prev
        self.t += self.dt
        scratch = cl.LocalMemory(4 * GROUP)
        gsize = (GROUP * self.ngroups,)
        k["energy_partial"](q, gsize, (GROUP,), i32(self.n), self.u, self.u_prev, scratch, self.partial)
        e = np.empty(self.ngroups, np.float32)
        cl.enqueue_copy(q, e, self.partial)
        k["max_abs_partial"](q, gsize, (GROUP,), i32(self.n), self.tracer, scratch, self.partial)
        m = np.empty(self.ngroups, np.float32)
        cl.enqueue_copy(q, m, self.partial)
        q.finish()
        return float(e.sum()) + float(m.max())


def run_once(steps: int, size: int, use_cache: bool = True) -> dict:
    """One run in this process: build, step, flush. Prints a line per step.

    ``use_cache=False`` builds with pyopencl as installed, without asyncclcache.
    """
    import pyopencl as cl

    ctx = cl.create_some_context(interactive=False)
    queue = cl.CommandQueue(ctx)
    if use_cache:
        import asyncclcache as acc

        cache = acc.default_cache()
        step_block = cache.step

        def build(src):
            return acc.Program(ctx, src, cache=cache).build()
    else:
        cache = None
        step_block = contextlib.nullcontext

        def build(src):
            return cl.Program(ctx, src).build()

    t_start = time.perf_counter()
    first_step = None
    checksum = 0.0
    sim = None
    for n in range(steps):
        t0 = time.perf_counter()
        if n == 0:
            # The first step builds everything; the cache snapshots at the block's exit,
            # after the kernels ran, so the entries pack the variants they compiled.
            with step_block() as step:
                sim = Simulation(ctx, queue, size, build)
                checksum = sim.step()
            first_step = time.perf_counter() - t0
            note = f"built {step.built} programs: {step.hits} hits, {step.misses} misses" if step else ""
        else:
            checksum = sim.step()
            note = ""
        print(f"  step {n + 1:3d}/{steps}: {time.perf_counter() - t0:7.3f} s  energy {checksum:12.6e}  {note}",
              flush=True)
    total = time.perf_counter() - t_start
    result = {"first_step": first_step, "total": total, "checksum": checksum, "device": ctx.devices[0].name}
    if cache is not None:
        flushed = cache.flush(timeout=120)
        stats = cache.stats()
        result.update(flushed=flushed, hits=stats.hits, misses=stats.misses, writes=stats.writes,
                      bytes_written=stats.bytes_written, directory=cache.directory)
    return result


RUNS = {
    "pyopencl": "pyopencl as installed, no asyncclcache",
    "cold": "asyncclcache, empty cache",
    "warm": "asyncclcache, the cold run's entries",
}


#: The demo's own cache directory, in the checkout (.gitignore): emptied at each start.
DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".demo-cache")


def _command(*args: str) -> str:
    """``python -m asyncclcache ARGS`` as the user can type it here: this interpreter by its
    path unless ``python`` on the PATH is this one (an activated venv)."""
    python = "python"
    found = shutil.which("python")
    if found is None or os.path.realpath(found) != os.path.realpath(sys.executable):
        python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd() + os.sep) else sys.executable
    return shlex.join([python, "-m", "asyncclcache", *args])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=512, help="grid points per side")
    parser.add_argument("--short", action="store_true", help="3 steps on a 128x128 grid")
    parser.add_argument("--dir", help="cache directory, used as it is (default: $ASYNCCLCACHE_DIR, "
                        "else the demo's own .demo-cache, emptied first)")
    parser.add_argument("--once", action="store_true", help="one run, in this process")
    parser.add_argument("--json", action="store_true", help="(with --once) print the result as JSON")
    parser.add_argument("--no-cache", action="store_true", help="(with --once) pyopencl as installed")
    args = parser.parse_args(argv)
    if args.short:
        args.steps, args.size = 3, 128

    if args.once:
        result = run_once(args.steps, args.size, use_cache=not args.no_cache)
        if args.json:
            print(json.dumps(result))
        return 0

    directory = args.dir or os.environ.get("ASYNCCLCACHE_DIR")
    if not directory:
        directory = DEMO_DIR
        shutil.rmtree(DEMO_DIR, ignore_errors=True)  # ours alone: every demo starts cold
    with tempfile.TemporaryDirectory(prefix="acc-demo-") as pocl_caches:  # removed on any exit
        return _demo(args, directory, pocl_caches)


def _demo(args: argparse.Namespace, directory: str, pocl_caches: str) -> int:
    results = {}
    summaries = {}
    for label, what in RUNS.items():
        print(f"{label} run: {what} (a fresh process with an empty pocl kernel cache: a new node)", flush=True)
        os.mkdir(os.path.join(pocl_caches, label))
        env = dict(os.environ, POCL_CACHE_DIR=os.path.join(pocl_caches, label), ASYNCCLCACHE_DIR=directory,
                   ASYNCCLCACHE_STATS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--once", "--json",
               "--steps", str(args.steps), "--size", str(args.size)]
        if label == "pyopencl":
            cmd.append("--no-cache")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        lines = proc.stdout.splitlines()
        for line in lines[:-1]:
            print(line)
        # The exit summary (ASYNCCLCACHE_STATS=1) is the child's last stderr line; the rest passes through.
        err = proc.stderr.splitlines()
        summaries[label] = next((ln for ln in reversed(err) if ln.startswith("asyncclcache")), None)
        for line in err:
            if line != summaries[label]:
                print(line, file=sys.stderr)
        if summaries[label]:
            print(f"  {summaries[label]}")
        if proc.returncode != 0 or not lines:
            print(f"{label} run failed (exit status {proc.returncode})", file=sys.stderr)
            return 1
        results[label] = json.loads(lines[-1])

    plain, cold, warm = results["pyopencl"], results["cold"], results["warm"]
    print()
    print(f"asyncclcache demo on {cold['device']}, cache {cold['directory']}")
    print(f"  {'':22s} {'pyopencl':>12s} {'cold run':>12s} {'warm run':>12s}")
    print(f"  {'first step (s)':22s} {plain['first_step']:12.3f} {cold['first_step']:12.3f} "
          f"{warm['first_step']:12.3f}")
    print(f"  {'all steps (s)':22s} {plain['total']:12.3f} {cold['total']:12.3f} {warm['total']:12.3f}")
    for key in ("hits", "misses", "writes", "bytes_written"):
        print(f"  {key:22s} {'-':>12s} {cold[key]:12d} {warm[key]:12d}")
    same = all(abs(r["checksum"] - plain["checksum"]) <= 1e-6 * max(1.0, abs(plain["checksum"]))
               for r in (cold, warm))
    print(f"  {'same result':22s} {'yes' if same else 'NO'}")
    if cold["misses"] == 0:
        print("  (the cache directory given already held these programs: both runs hit it;"
              " without --dir and ASYNCCLCACHE_DIR the demo starts on an empty cache of its own)")
    else:
        print(f"  first step with the cache: cold {cold['first_step'] / plain['first_step']:.2f}x "
              f"pyopencl's time, warm {plain['first_step'] / max(warm['first_step'], 1e-9):.1f}x faster")
    shown = os.path.relpath(directory) if directory.startswith(os.getcwd() + os.sep) else directory
    print(f"  what it stored: {_command('list', '--dir', shown)}")
    print(f"  the same without changing any code: {_command('run', 'your_driver.py')}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
