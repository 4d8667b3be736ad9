import sys
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
sys.path.insert(0, "/project/tests")
from _pocl import pocl_context
ctx = pocl_context()
q = cl.CommandQueue(ctx)
prg = cl.Program(ctx, "__kernel void twice(__global float *a) { a[get_global_id(0)] *= 2.0f; }").build()
a = cla.arange(q, 16, dtype=np.float32)
prg.twice(q, a.shape, None, a.data)
assert np.allclose((a + 1).get(), 2 * np.arange(16) + 1)
