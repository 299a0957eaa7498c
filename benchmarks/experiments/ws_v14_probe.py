"""Probe: late saturation check (after the turn handoff) vs the check inside the turn; same process, SDPA beside."""
import json, os, sys, time
sys.path.insert(0, "benchmarks")
import torch, triton.testing
from bench_attention import make_inputs, sdpa_fn, accuracy, environment
from shapes import SHAPES
from fsattn_diffusers import FSAttnConfig, fsattn
from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as ws

out = os.environ.get("OUT", "/tmp")
names = sys.argv[1].split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
rows = []
env = environment()
print(json.dumps(env), flush=True)
for name in names:
    shape = SHAPES[name]
    q, k, v, mask = make_inputs(shape, 0)
    base = triton.testing.do_bench(sdpa_fn(q, k, v, mask, "default"), warmup=25, rep=300, return_mode="median")
    rows.append(dict(shape=name, method="sdpa", ms=base, tflops=shape.flops / base / 1e9)); print(rows[-1], flush=True)
    variants = [("A_early_global", (False, False), {}), ("B_early_smem", (False, True), {}), ("C_late_smem", (True, True), {})]
    if shape.head_dim == 64:
        variants = [("triton", None, {})] + [(l, f, {"kernel": "gluon_ws"}) for l, f, _ in variants]
    outs = {}
    for r in range(rounds):
        for label, late, fields in variants:
            if late is not None:
                ws.LATE_CHECK, ws.KS_SMEM = late
            cfg = FSAttnConfig(**fields)
            fn = lambda: fsattn(q, k, v, attn_mask=mask, config=cfg)
            acc = accuracy(fn, q, k, v, mask, 0) if r == 0 else None
            if r == 0 and late is not None:
                o = fn().float()
                ref = outs.setdefault("first", o)
                acc["max_abs_vs_first_ws"] = (o - ref).abs().max().item()
                acc["mean_abs_vs_first_ws"] = (o - ref).abs().mean().item()
                del o
            ms = triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")
            rows.append(dict(shape=name, method=label, round=r, ms=ms, tflops=shape.flops / ms / 1e9,
                             speedup=base / ms, accuracy=acc))
            print(rows[-1], flush=True)
            json.dump({"environment": env, "rows": rows}, open(f"{out}/probe.json", "w"), indent=1)
    del q, k, v, mask
    torch.cuda.empty_cache()
