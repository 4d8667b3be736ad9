"""NVIDIA's compute cache as OpenCL uses it (issue 19): where it lives, what switches it off,
what one build adds (names, depth, modes), whether a hit writes or touches anything, and
whether the files appear at the build or at the first launch. Prints one line per case.
Run on a machine with NVIDIA's OpenCL (benchmarks/device/setup.sh first)."""
import os, subprocess, sys, tempfile, time, json

CHILD = r'''
import os, sys, time, json, glob
import pyopencl as cl
tag = sys.argv[1]
plat = [p for p in cl.get_platforms() if "NVIDIA" in p.name][0]
dev = plat.get_devices()[0]; ctx = cl.Context([dev]); q = cl.CommandQueue(ctx)
src = "__kernel void k(__global float *a) { a[get_global_id(0)] = %s; }" % tag
t = time.perf_counter(); prg = cl.Program(ctx, src).build(); tb = time.perf_counter() - t
root = os.environ.get("PROBE_ROOT")
def listing():
    out = {}
    if root and os.path.isdir(root):
        for dp, dn, fn in os.walk(root):
            for f in fn:
                p = os.path.join(dp, f); st = os.lstat(p)
                out[os.path.relpath(p, root)] = [st.st_size, oct(st.st_mode & 0o777), st.st_mtime_ns, st.st_atime_ns, st.st_ino, st.st_nlink]
    return out
after_build = listing()
a = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4 * 64)
t = time.perf_counter(); prg.k(q, (64,), None, a); q.finish(); tl = time.perf_counter() - t
after_launch = listing()
print(json.dumps({"build": round(tb, 4), "launch": round(tl, 4), "after_build": after_build, "after_launch": after_launch}))
'''

def run(env_over, tag="1.0f", root=None, unset=()):
    env = dict(os.environ)
    for k in unset:
        env.pop(k, None)
    env.update(env_over)
    if root:
        env["PROBE_ROOT"] = root
    p = subprocess.run([sys.executable, "-c", CHILD, tag], env=env, capture_output=True, text=True, timeout=120)
    if p.returncode:
        return {"error": p.stderr[-500:]}
    return json.loads(p.stdout.strip().splitlines()[-1])

def files(d):
    return sorted((os.path.relpath(os.path.join(dp, f), d)) for dp, _, fn in os.walk(d) for f in fn) if os.path.isdir(d) else []

T = tempfile.mkdtemp()
umask = os.umask(0o022); os.umask(umask)
print("umask", oct(umask), "uid", os.getuid(), "HOME", os.environ.get("HOME"))
# 1. one build into an empty cache: names, depth, modes; build vs launch
A = f"{T}/A"
r = run({"CUDA_CACHE_PATH": A}, root=A)
print("1 cold", r.get("build"), r.get("launch"))
print("1 after build", json.dumps(r.get("after_build")))
print("1 added by launch", sorted(set(r.get("after_launch", {})) - set(r.get("after_build", {}))))
# 2. the same again: does a hit write or touch anything?
before = r["after_launch"]
r2 = run({"CUDA_CACHE_PATH": A}, root=A)
print("2 warm", r2.get("build"), r2.get("launch"))
for k, v in r2["after_launch"].items():
    if before.get(k) != v:
        print("2 changed", k, before.get(k), "->", v)
print("2 new", sorted(set(r2["after_launch"]) - set(before)))
# 3. another program: which files are shared?
r3 = run({"CUDA_CACHE_PATH": A}, tag="2.0f", root=A)
print("3 other program new", sorted(set(r3["after_launch"]) - set(r2["after_launch"])))
for k, v in r3["after_launch"].items():
    if r2["after_launch"].get(k) not in (None, v):
        print("3 changed", k, r2["after_launch"].get(k), "->", v)
# 4. switches and defaults
for val in ["1", "0", "true", "yes", "", "2"]:
    d = f"{T}/D{val or 'empty'}"
    r = run({"CUDA_CACHE_PATH": d, "CUDA_CACHE_DISABLE": val}, tag="3.0f")
    print(f"4 CUDA_CACHE_DISABLE={val!r}: files {len(files(d))} build {r.get('build')} {r.get('error','')[:200]}")
H = f"{T}/home"; os.makedirs(H)
r = run({"HOME": H}, tag="4.0f", unset=("CUDA_CACHE_PATH", "XDG_CACHE_HOME"))
print("5 HOME set, no CUDA_CACHE_PATH:", files(H)[:5], r.get("error", "")[:200])
r = run({"HOME": H, "XDG_CACHE_HOME": f"{T}/xdg"}, tag="4.5f", unset=("CUDA_CACHE_PATH",))
print("5b XDG_CACHE_HOME set:", files(f"{T}/xdg")[:5], len(files(H)))
r = run({}, tag="5.0f", unset=("HOME", "CUDA_CACHE_PATH"))
import pwd
pw = pwd.getpwuid(os.getuid()).pw_dir
print("6 HOME unset: pw_dir", pw, "has .nv:", os.path.isdir(os.path.join(pw, ".nv")), r.get("error", "")[:200])
r = run({"HOME": ""}, tag="6.0f", unset=("CUDA_CACHE_PATH",))
print("6b HOME='' ok" if "error" not in r else "6b HOME='' err " + r["error"][:200])
r = run({"CUDA_CACHE_PATH": ""}, tag="6.5f")
print("6c CUDA_CACHE_PATH='':", "ok" if "error" not in r else r["error"][:200], "cwd files", len(files(".nv")) if os.path.isdir(".nv") else 0)
# 7. relative CUDA_CACHE_PATH
os.makedirs(f"{T}/cwd", exist_ok=True)
env = dict(os.environ, CUDA_CACHE_PATH="rel/cc")
subprocess.run([sys.executable, "-c", CHILD, "7.0f"], env=env, cwd=f"{T}/cwd", capture_output=True, timeout=120)
print("7 relative path: files under cwd/rel/cc:", len(files(f"{T}/cwd/rel/cc")))
# 8. CUDA_CACHE_MAXSIZE small: eviction?
d = f"{T}/M"
for i in range(6):
    run({"CUDA_CACHE_PATH": d, "CUDA_CACHE_MAXSIZE": "100000"}, tag=f"{10 + i}.0f")
print("8 MAXSIZE=100000 after 6 programs:", len(files(d)), sum(os.path.getsize(os.path.join(d, f)) for f in files(d)))
# 9. a damaged file: flip bytes in every non-index file, then build: error or rebuild?
B = f"{T}/B"; run({"CUDA_CACHE_PATH": B}, tag="20.0f")
for f in files(B):
    if "index" in f: continue
    p = os.path.join(B, f); data = bytearray(open(p, "rb").read())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)): data[i] ^= 0xFF
    open(p, "wb").write(bytes(data))
r = run({"CUDA_CACHE_PATH": B}, tag="20.0f", root=B)
print("9 damaged:", r.get("build"), r.get("error", "")[:300], "files", len(files(B)))
# 11. the header question, fresh processes, one cache: a quoted include from the cwd (no -I),
# and one through -I; the header changes between runs
HC = r'''
import os, sys, numpy as np, pyopencl as cl
plat = [p for p in cl.get_platforms() if "NVIDIA" in p.name][0]
dev = plat.get_devices()[0]; ctx = cl.Context([dev]); q = cl.CommandQueue(ctx)
opts = sys.argv[1:]
prg = cl.Program(ctx, '#include "h.h"\n__kernel void k(__global int *o) { o[get_global_id(0)] = VAL; }').build(options=opts)
o = np.zeros(4, np.int32); b = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, o.nbytes)
prg.k(q, (4,), None, b); cl.enqueue_copy(q, o, b); q.finish(); print(int(o[0]))
'''
for label, sub, opts in (("cwd", ".", []), ("-I", "inc", ["-I", f"{T}/hq/inc"])):
    os.makedirs(f"{T}/hq/inc", exist_ok=True)
    got = []
    for val in (1, 2, 7):
        open(f"{T}/hq/{sub}/h.h", "w").write(f"#define VAL {val}\n")
        p = subprocess.run([sys.executable, "-c", HC, *opts], cwd=f"{T}/hq", capture_output=True, text=True,
                           env=dict(os.environ, CUDA_CACHE_PATH=f"{T}/hq/cc-{label}"), timeout=120)
        got.append(p.stdout.strip() or p.stderr[-200:])
    print(f"11 header via {label}: wrote 1,2,7 got {got}")
# 10. a mode 0644 vs 0600 file / other owner: skip. Header question lives in nvheader.py.
print("done", T)
