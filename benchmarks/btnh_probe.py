"""The Mosaic forward on [B, S, H, D] (JAX's layout) read in place, beside the
[B, H, S, D] call: bits (out transposed back) and time, one process on the GPU.

  python -m benchmarks.btnh_probe --out_dir=$OUT/btnh
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxattn.backends.mosaic import forward as mosaic_fwd

flags.DEFINE_string("out_dir", "/tmp/btnh", "Where results.json goes.")
flags.DEFINE_list("points", ["2,4096,32,8,128,1", "16,1024,32,8,128,1", "2,4096,32,8,128,0",
                             "8,1,32,8,128,1"], "B,S,Hq,Hkv,D,causal (S=1: decode "
                  "against 8192 keys).")
flags.DEFINE_integer("iters", 20, "Timed calls per point (rotating inputs).")
FLAGS = flags.FLAGS


def _time(f, inputs, iters):
    for x in inputs:
        jax.block_until_ready(f(*x))
    t0 = time.perf_counter()
    for i in range(iters):
        r = f(*inputs[i % len(inputs)])
    jax.block_until_ready(r)
    return (time.perf_counter() - t0) / iters * 1e3


def main(_):
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    rows = []
    for spec in FLAGS.points:
        b, s, hq, hkv, d, causal = map(int, spec.split(","))
        skv = 8192 if s == 1 else s
        keys = jax.random.split(jax.random.key(0), 9)
        sets = [tuple(jax.random.normal(keys[3 * i + j], shp, jnp.bfloat16)
                      for j, shp in enumerate([(b, s, hq, d), (b, skv, hkv, d),
                                               (b, skv, hkv, d)])) for i in range(3)]
        t = lambda x: jnp.swapaxes(x, 1, 2)
        f_btnh = jax.jit(lambda q, k, v, c=bool(causal): mosaic_fwd.forward(
            q, k, v, causal=c, btnh=True)[0])
        f_bhsd = jax.jit(lambda q, k, v, c=bool(causal): mosaic_fwd.forward(
            q, k, v, causal=c)[0])
        sets_bhsd = [tuple(t(x) for x in st) for st in sets]
        a = np.asarray(t(f_btnh(*sets[0]))).view(np.uint16)
        bb = np.asarray(f_bhsd(*sets_bhsd[0])).view(np.uint16)
        hlo = f_btnh.lower(*sets[0]).compile().as_text()
        row = dict(point=spec, bits_equal=bool((a == bb).all()),
                   differ=int((a != bb).sum()),
                   transposes_in_hlo=hlo.count(" transpose("),
                   ms_btnh=_time(f_btnh, sets, FLAGS.iters),
                   ms_bhsd=_time(f_bhsd, sets_bhsd, FLAGS.iters))
        print(row, flush=True)
        rows.append(row)
    with open(os.path.join(FLAGS.out_dir, "results.json"), "w") as fh:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), fh,
                  indent=1)


if __name__ == "__main__":
    app.run(main)
