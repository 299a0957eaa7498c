"""Experiment: do other inductor options shorten the recipe's compiled Wan block?

A Wan2.1-14B recipe forward's profile (NOTES v29) lists three inductor reductions at 1.25-1.54 ms a
block each: the LayerNorm, the modulation and torchao's per-row FP8 scaling of the input of the
fused QKV projection, of the cross-attention's query projection and of the feed-forward's up
projection. Each reads the 75,600 x 5,120 bf16 hidden (774 MB) in a loop over the row, once per
reduction and once more to write: about 2.7 GB where one pass would move 1.2 GB (~0.35 ms).
Inductor keeps a row in registers ("persistent reduction") only up to 1,024 elements, or 16,384
with ``triton.multi_kernel`` (which compiles both forms and keeps the faster at the first call).

This builds the model with ``--layers`` blocks (random weights, the real dims), applies the recipe
once per variant (inductor options, JSON) to its own copy, and in one process times the
forwards interleaved (CUDA events, medians) and lists each variant's kernels under the profiler.

    python benchmarks/experiments/inductor_options_probe.py --model wan2.1-t2v-14b --layers 2 \
        --variants '{}' '{"triton.multi_kernel": 1}' --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_e2e  # noqa: E402

import fsattn_diffusers  # noqa: E402
from fsattn_diffusers import builtin_models  # noqa: E402


def build(name: str, layers: int, device, dtype):
    from diffusers import WanTransformer3DModel

    spec = builtin_models.get_builtin(name)
    config = {**spec.transformer_config, "num_layers": layers}
    with builtin_models._seeded(device, 0):
        return builtin_models._construct(WanTransformer3DModel, config, device, dtype)


def kernels(model, call, top: int = 14) -> list[dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call(model)
        torch.cuda.synchronize()
    rows = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = rows.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time / 1e3
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": name[:110], "launches": n, "ms": round(ms, 4)} for name, (n, ms) in ranked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="wan2.1-t2v-14b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["{}", '{"triton.multi_kernel": 1}'])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    e2e_parser = bench_e2e.build_parser()
    settings = bench_e2e.resolve_settings(e2e_parser, e2e_parser.parse_args(
        ["--model", args.model, "--rows", "default", "--no-decode", "--guidance-scale", "1"]))[0]
    variants = [json.loads(v) for v in args.variants]
    models, first = [], []
    reference = build(args.model, args.layers, device, dtype)
    loop = bench_e2e.Loop(settings, reference, device, dtype)
    t = loop.scheduler().timesteps[0]

    def call(model):
        with torch.no_grad():
            return loop.forward(model, loop.noise, t, 0)

    for options in variants:
        model = build(args.model, args.layers, device, dtype)
        fsattn_diffusers.apply_recipe(model, compile_options={"options": options} if options else None)
        start = time.perf_counter()
        out = call(model)
        torch.cuda.synchronize()
        first.append(time.perf_counter() - start)
        models.append((model, out.float()))
    del reference
    times = [[] for _ in variants]
    for _ in range(args.rounds):
        for i, (model, _) in enumerate(models):
            with bench_e2e.Timer(device) as timer:
                call(model)
            times[i].append(timer.seconds * 1e3)
    base = models[0][1].flatten()
    result = {"model": args.model, "layers": args.layers, "environment": {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__}, "variants": []}
    for i, options in enumerate(variants):
        out = models[i][1].flatten()
        result["variants"].append({
            "options": options, "first_call_s": round(first[i], 2),
            "forward_ms": sorted(times[i])[len(times[i]) // 2], "forward_ms_all": [round(x, 3) for x in times[i]],
            "output_cos_vs_first": float(torch.nn.functional.cosine_similarity(out, base, dim=0)),
            "kernels": kernels(models[i][0], call)})
        v = result["variants"][-1]
        print(f"{json.dumps(options):40s} first {v['first_call_s']:6.1f} s  forward {v['forward_ms']:8.3f} ms  "
              f"cos {v['output_cos_vs_first']:.6f}")
        for k in v["kernels"]:
            print(f"    {k['ms']:9.3f} ms  x{k['launches']:<3d} {k['name']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
