"""Experiment: the warp-specialised kernel at head dim 64 with two consumer warpgroups against three
(under any Triton release: under 3.8 and later three is the build whose GEMMs ptxas serialises)
(the CogVideoX-like shape and Wan2.1-1.3B's queries at head dim 64), `fsattn()` beside SDPA, one
process, interleaved rounds; outputs compared bit for bit.

    python3 benchmarks/experiments/consumers_probe.py --out $OUT/consumers.json
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from fsattn_diffusers import fsattn, ops, plan
from fsattn_diffusers.kernels import configs
from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as ws


def use(consumers):
    # The plan and the launcher read the count separately: both must see the same one.
    ws.gluon_ws_consumers = configs.gluon_ws_consumers = lambda *args, **kwargs: consumers
    ws.gluon_ws_forward.cache_clear()
    plan._plan.cache_clear()
    ops._prepared_calls.clear()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for name, (bsz, heads, seq) in {"cogvideox_d64": (2, 48, 17776), "wan13b_d64": (1, 24, 32760)}.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, seq, heads, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        flops = 4.0 * bsz * heads * seq * seq * 64
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        row = {"shape": name, "sdpa_ms": triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(qh, kh, vh), warmup=5, rep=500, return_mode="median")}
        outs, times = {}, {3: [], 2: []}
        for _ in range(3):
            for consumers in (3, 2):
                use(consumers)
                outs[consumers] = fsattn(q, k, v)
                times[consumers].append(triton.testing.do_bench(lambda: fsattn(q, k, v), warmup=5, rep=500,
                                                                return_mode="median"))
        for consumers in (3, 2):
            ms = sorted(times[consumers])[1]
            row[f"ms_{consumers}"] = times[consumers]
            row[f"tflops_{consumers}"] = flops / ms / 1e9
        row["bit_equal"] = bool(torch.equal(outs[3], outs[2]))
        print(row, flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
