"""Child of mesarules.sh: build a tiny program on rusticl (argument: a constant, or inc for #include "h.h"; more
arguments: build options), create its kernel, launch it; print the value and the files each step added to
$MESA_SHADER_CACHE_DIR/mesa_shader_cache."""
import os, sys, json, numpy as np, pyopencl as cl
plat = [p for p in cl.get_platforms() if p.name == "rusticl"][0]
dev = plat.get_devices()[0]; ctx = cl.Context([dev]); q = cl.CommandQueue(ctx)
opts = sys.argv[2:]
src = '#include "h.h"\n__kernel void k(__global int *o) { o[get_global_id(0)] = VAL; }' if sys.argv[1] == "inc" else "__kernel void k(__global int *o) { o[get_global_id(0)] = %s; }" % sys.argv[1]
root = os.environ["MESA_SHADER_CACHE_DIR"] + "/mesa_shader_cache"
def ls():
    out = {}
    for dp, _, fn in os.walk(root):
        for f in fn:
            p = os.path.join(dp, f); st = os.lstat(p); out[os.path.relpath(p, root)] = (st.st_size, oct(st.st_mode & 0o777), st.st_mtime_ns, st.st_atime_ns)
    return out
a = ls()
prg = cl._cl._Program(ctx, src); prg.build(" ".join(opts).encode())
b = ls()
o = np.zeros(4, np.int32); buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, o.nbytes)
k = cl.Kernel(prg, "k"); c = ls()
k.set_args(buf); cl.enqueue_nd_range_kernel(q, k, (4,), None); cl.enqueue_copy(q, o, buf); q.finish()
d = ls()
print("val", int(o[0]), "build+", sorted(set(b) - set(a)), "kernel+", sorted(set(c) - set(b)), "launch+", sorted(set(d) - set(c)),
      "changed", sorted(k for k in a if a[k] != d.get(k)), "modes", sorted({v[1] for v in d.values()}))
