"""fold_params with rotate=/smooth= on the 0.54 B decoder: time, peak memory growth, outputs;
and fold_stablehlo(params=, smooth=) on its jax.export module.

``python -m benchmarks.quant_size MODE`` (MODE: fold_params, rotate, smooth, smooth+search
(``alpha="search:w4a8"``), rotate+smooth,
stablehlo, stablehlo+smooth; scan, scan+smooth, scan+rotate: the same decoder as one scan over stacked
layers, ``examples.scanned_decoder_apply``; stablehlo+scan, stablehlo+scan+equalize,
stablehlo+scan+smooth: that scan's module, folded, then equalized or smoothed per layer of its
loop; one process each, so that the peak is the mode's own). Random weights made in code.
"""
import resource, time, sys
import jax, jax.numpy as jnp, numpy as np
import hlofold
from hlofold import examples
import threading
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
def now():       # the resident set now (the peak above says nothing once stacking made a copy)
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS")) / 2**20
class Sampled(threading.Thread):      # the largest resident set while the call runs
    def __init__(self):
        super().__init__(daemon=True); self.top, self.stop = now(), threading.Event()
    def run(self):
        while not self.stop.wait(0.02): self.top = max(self.top, now())
p = examples.init_decoder(8, d=2048, ffn=5632, vocab=32000)
n = sum(a.size for a in jax.tree.leaves(p)); gib = sum(a.nbytes for a in jax.tree.leaves(p)) / 2**30
t = jnp.asarray(np.random.default_rng(0).integers(0, 32000, (1, 16)))
calib = [jnp.asarray(np.random.default_rng(k).integers(0, 32000, (1, 16))) for k in (1, 2)]
f = examples.decoder_apply
mode = sys.argv[1]
if "scan" in mode:                     # one scan over the stacked layers
    p, f = examples.stack_decoder(p), examples.scanned_decoder_apply
if mode.startswith("stablehlo"):       # the module takes the weights as arguments
    leaves, tree = jax.tree.flatten(p)
    g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1]))
    exp = jax.export.export(g)(*leaves, t)
    params = {i: np.asarray(a) for i, a in enumerate(leaves)}
    ref = g(*leaves, t)
else:
    ref = f(p, t)
base = rss()
print(f"{n/1e9:.3f} B params, {gib:.2f} GiB; peak RSS before {base:.2f} GiB", flush=True)
modes = {"fold_params": {}, "rotate": {"rotate": True}, "smooth": {"smooth": calib},
         "smooth+search": {"smooth": calib, "alpha": "search:w4a8"},
         "rotate+smooth": {"rotate": True, "smooth": calib}, "stablehlo": {},
         "stablehlo+smooth": {"smooth": calib}, "scan": {}, "scan+smooth": {"smooth": calib}, "scan+rotate": {"rotate": True},
         "stablehlo+scan": {}, "stablehlo+scan+equalize": {"equalize": True},
         "stablehlo+scan+smooth": {"smooth": calib}}
start = now(); sampler = Sampled(); sampler.start()
t0 = time.perf_counter()
if mode.startswith("stablehlo"):
    got, rep, prep = hlofold.fold_stablehlo(exp, params=params, **modes[mode])
    dt = time.perf_counter() - t0
    y, pairs, rot = got.call(t, *prep), len(rep.equalized + rep.smoothed), None
else:
    out = hlofold.fold_params(f, p, t, **modes[mode])
    dt = time.perf_counter() - t0
    y, pairs, rot = (f(out.params, t), len(out.equalized + out.smoothed),
                     out.rotation and out.rotation.reason)
sampler.stop.set(); sampler.join()
rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
print(f"{mode}: {dt:.1f} s, peak RSS {rss():.2f} GiB (+{rss()-base:.2f}; sampled: "
      f"{start:.2f} -> {sampler.top:.2f}, +{sampler.top-start:.2f}), rel {rel:.2e}, "
      f"pairs {pairs}, rotation {rot}", flush=True)
