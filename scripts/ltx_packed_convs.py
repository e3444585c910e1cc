"""Each conv of one served LTX-Video 0.9.1 decode timed twice on its own input: the plain weight
(``model.conv3d``, oneDNN reorders it per call) and the packed path of ``ltx/fast.py``.

    PYTHONPATH=. python scripts/ltx_packed_convs.py FRAMES SIZE   (e.g. 3 256; docs/bench/ltx.md)

Prints per (in, out, kernel, input T/H/W) the summed best-of-2 milliseconds of both.
"""

import collections
import sys
import time

import torch

from app.decoders.ltx import fast
from app.decoders.ltx import model as M
from app.runtime import modes
from bench import ltx as b

torch.set_num_threads(2)
frames, size = int(sys.argv[1]), int(sys.argv[2])
ours = b.build_ours()
z = b.latent(frames, size)
m = modes.build(ours, torch.device("cpu"), modes.Mode(torch.float32))
agg = collections.defaultdict(lambda: [0.0, 0.0, 0, 0.0])
orig = fast.PackedCausalConv3d._run


def t(fn, n=2):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def run(self, x):
    if x.shape[2] >= self.kt:
        c = self.conv
        key = (c.in_channels, c.out_channels, self.kt, tuple(x.shape[2:]), x.is_contiguous())
        a = agg[key]
        a[0] += t(lambda: M.conv3d(x, c))
        a[1] += t(lambda: orig(self, x))
        a[2] += 1
    return orig(self, x)


fast.PackedCausalConv3d._run = run
with torch.inference_mode():
    m.decode(z, timestep=b.TIMESTEP, seed=b.SEED)
tp = tk = 0
for k, (p, q, n, _) in sorted(agg.items()):
    tp += p
    tk += q
    print(k, n, f"plain {p * 1e3:.0f} ms packed {q * 1e3:.0f} ms")
print(f"total plain {tp:.2f} s packed {tk:.2f} s")
