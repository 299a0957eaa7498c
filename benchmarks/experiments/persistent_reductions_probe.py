"""Experiment (NOTES v17, Next): inductor's row reductions made persistent in the recipe's blocks.

At Wan2.1-14B the recipe's forward spends ~0.3 s in inductor's looped reductions ("triton_red_*":
RMSNorm + RoPE of Q and K, LayerNorm + modulation + FP8 scaling), ~1 TB/s: inductor makes a
reduction persistent (the row in registers, one read) only up to 1,024 elements (choices.py,
ReductionHint.INNER), and these rows are 1,536 (1.3B) or 5,120 (14B) wide. This probe compiles
the same recipe twice in one process, the second time through a backend that raises that limit
(a scoped InductorChoices, no FX-graph cache so nothing comes from the first compile), and
reports each row's forward time, the reduction kernels of a profiled forward, and the output
cosine between them.

    python benchmarks/experiments/persistent_reductions_probe.py --model wan2.1-t2v-14b --threshold 8192 --out p.json
    python benchmarks/experiments/persistent_reductions_probe.py --model tiny --cpu-check   # plumbing only
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
from fsattn_diffusers import metrics  # noqa: E402


def persistent_backend(threshold: int):
    """torch.compile backend: inductor, with INNER reductions up to `threshold` elements persistent."""
    from torch._inductor import config as inductor_config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class PersistentChoices(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction):
            if (inductor_config.triton.persistent_reductions and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, threshold)):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    def backend(gm, example_inputs):
        with V.set_choices_handler(PersistentChoices()), inductor_config.patch(fx_graph_cache=False):
            return compile_fx(gm, example_inputs)

    return backend


def timed_row(loop, transformer, device, forwards):
    scheduler = loop.scheduler()
    t = scheduler.timesteps[0]
    with torch.no_grad():
        out = loop.forward(transformer, loop.noise, t, 0)  # compiles
        times = []
        for _ in range(forwards):
            with bench_e2e.Timer(device) as timer:
                loop.forward(transformer, loop.noise, t, 0)
            times.append(timer.seconds)
        row = {"forward_s": times, "median_s": statistics.median(times)}
        if device.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                with bench_e2e.Timer(device) as timer:
                    loop.forward(transformer, loop.noise, t, 0)
            share = bench_e2e.attention_share(prof, device, timer.seconds, 1)
            row["device_s"] = share.get("device_seconds_per_step")
            row["kernels"] = [k for k in share.get("top_kernels", []) if k["name"].startswith("triton_")]
    return out.float().cpu(), row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="wan2.1-t2v-1.3b")
    parser.add_argument("--threshold", type=int, default=8192)
    parser.add_argument("--forwards", type=int, default=3)
    parser.add_argument("--cpu-check", action="store_true", help="tiny model on the CPU, no FP8 (plumbing only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bench_args = ["--model", args.model, "--no-decode", "--guidance-scale", "1"]
    if args.cpu_check:
        bench_args += ["--height", "64", "--width", "64", "--frames", "5"]
    parser_e2e = bench_e2e.build_parser()
    settings, _, device, dtype = bench_e2e.resolve_settings(parser_e2e, parser_e2e.parse_args(bench_args))
    transformer, _ = bench_e2e.build(settings, device, dtype)
    loop = bench_e2e.Loop(settings, transformer, device, dtype)
    parts = {"fp8_linear": False, "fuse_qkv": False} if args.cpu_check else {}
    result = {"model": settings.model, "threshold": args.threshold, "torch": torch.__version__}
    outputs = {}
    for name, backend in (("default", "inductor"), (f"persistent_{args.threshold}", persistent_backend(args.threshold))):
        torch._dynamo.reset()
        fsattn_diffusers.apply_recipe(transformer, compile_options={"backend": backend}, **parts)
        outputs[name], result[name] = timed_row(loop, transformer, device, args.forwards)
        fsattn_diffusers.remove_recipe(transformer)
        print(name, json.dumps({k: v for k, v in result[name].items() if k != "kernels"}), flush=True)
    first, second = outputs.values()
    result["output_cosine"] = metrics.cosine_similarity(second, first)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
