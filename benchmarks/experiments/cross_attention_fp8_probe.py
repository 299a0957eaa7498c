"""Experiment (NOTES v17, Next): which of Wan's cross-attention projections can join the recipe's FP8.

v16 (c) kept the whole cross-attention in bf16 (FP8 there cost 3.6 dB of the lowest frame with
FP8 alone); its Q and output projections are 17 % of the blocks' linear FLOPs at 14B and took
0.38 s of a 7.27 s recipe forward in v17 (e). v16 could not tell Q's share of the cost from the
output's. Per variant, one process: the recipe (fsattn, fused QKV, FP8, fused feed-forward,
compiled) with the named attn2 layers in FP8 too, its forward time and, with decoding (1.3B),
the loop's latents and per-frame PSNR against diffusers' eager default.

    python benchmarks/experiments/cross_attention_fp8_probe.py --model wan2.1-t2v-1.3b --out x13.json   # quality
    python benchmarks/experiments/cross_attention_fp8_probe.py --model wan2.1-t2v-14b --no-decode --guidance-scale 1 \\
        --variants recipe,q --out x14.json                                                          # time
    python benchmarks/experiments/cross_attention_fp8_probe.py --model tiny --cpu-check              # plumbing only
"""
import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir))
import bench_e2e  # noqa: E402
import fsattn_diffusers  # noqa: E402
from fsattn_diffusers import metrics, recipe  # noqa: E402

# attn2 layers (as the fused processor runs them: K and V as to_kv) per variant
VARIANTS = {"recipe": (), "q": ("to_q",), "o": ("to_out.0",), "qo": ("to_q", "to_out.0"), "kv": ("to_kv",),
            "all": ("to_q", "to_kv", "to_out.0")}


def run_loop(loop, transformer):
    scheduler = loop.scheduler()
    latents, times = loop.noise.clone(), []
    with torch.no_grad():
        for index in range(loop.settings.steps):
            latents = loop.step(transformer, scheduler, latents, index, times)
    return latents, [t.seconds for t in times]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="wan2.1-t2v-1.3b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--guidance-scale", default=None)
    parser.add_argument("--cpu-check", action="store_true", help="tiny model on the CPU, torchao's FP8 emulated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    backend = "inductor"
    if args.cpu_check:
        import torchao.float8.inference as inference

        inference.is_MI300 = lambda: True
        recipe.fp8_unavailable_reason = lambda device: None
        backend = "aot_eager"
    bench_args = ["--model", args.model, "--steps", "2", "--dtype", "bf16"]
    bench_args += ["--no-decode"] if args.no_decode else []
    bench_args += ["--guidance-scale", args.guidance_scale] if args.guidance_scale else []
    bench_args += ["--height", "64", "--width", "64", "--frames", "5"] if args.cpu_check else []
    parser_e2e = bench_e2e.build_parser()
    settings, _, device, dtype = bench_e2e.resolve_settings(parser_e2e, parser_e2e.parse_args(bench_args))
    transformer, pipe = bench_e2e.build(settings, device, dtype)
    loop = bench_e2e.Loop(settings, transformer, device, dtype)
    ref_latents, ref_times = run_loop(loop, transformer)
    ref_frames = bench_e2e.decode(pipe, ref_latents) if pipe is not None else None
    result = {"model": settings.model, "torch": torch.__version__, "default_forward_s": statistics.median(ref_times)}
    from torchao.quantization import quantize_

    for name in args.variants.split(","):
        torch._dynamo.reset()
        fsattn_diffusers.apply_recipe(transformer, keep_original_weights=True, compile=False)
        extra = {f"blocks.{i}.attn2.{layer}" for i in range(len(transformer.blocks)) for layer in VARIANTS[name]}
        modules = dict(transformer.named_modules())
        originals = {path: modules[path].weight for path in extra}
        quantize_(transformer, recipe._fp8_config(), filter_fn=lambda module, fqn: fqn in extra)
        for block in transformer.blocks:
            block.compile(fullgraph=True, backend=backend)
        run_loop(loop, transformer)  # compiles
        latents, times = run_loop(loop, transformer)
        row = {"fp8_layers_added": len(extra), "forward_s": statistics.median(times),
               "speedup": result["default_forward_s"] / statistics.median(times),
               "latents_cosine": metrics.cosine_similarity(latents, ref_latents)}
        if ref_frames is not None:
            row["psnr_db"] = metrics.summarize(metrics.psnr_per_frame(ref_frames, bench_e2e.decode(pipe, latents)))
        result[name] = row
        print(name, json.dumps(row), flush=True)
        for block in transformer.blocks:
            block._compiled_call_impl = None
        for path, weight in originals.items():
            modules[path].weight = weight
            modules[path].__dict__.pop("extra_repr", None)
        fsattn_diffusers.remove_recipe(transformer)  # keep_original_weights: the rest back in bf16
    if args.out:
        with open(args.out, "w") as f:
            json.dump(bench_e2e.json_safe(result), f, indent=1)


if __name__ == "__main__":
    main()
