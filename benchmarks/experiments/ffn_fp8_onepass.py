"""Experiment (NOTES v16, Next): the recipe with each GELU feed-forward's down projection fed by
the one-pass GELU + per-row FP8 scaling of `gelu_fp8_probe.py`, end to end, in one process.

Row A is `apply_recipe` as committed; row B is the same recipe with every diffusers
``FeedForward`` whose activation is ``GELU(approximate="tanh")`` and whose down projection is
in torchao's float8 running ``fsattn_exp::gelu_fp8_linear`` (the one-pass kernel, then
``torch._scaled_mm`` on the down projection's FP8 weight and per-row scales, as torchao calls it).
Both compiled regionally (``fullgraph=True``).

    python benchmarks/experiments/ffn_fp8_onepass.py --model wan2.1-t2v-1.3b --out onepass_13b.json
    TRITON_INTERPRET=1 FSATTN_CPU_PATH=interpreter python benchmarks/experiments/ffn_fp8_onepass.py --check  # CPU
"""
import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, os.pardir))
import bench_e2e  # noqa: E402
import fsattn_diffusers  # noqa: E402
from fsattn_diffusers import metrics  # noqa: E402
from gelu_fp8_probe import gelu_fp8_rows  # noqa: E402


@torch.library.custom_op("fsattn_exp::gelu_fp8_linear", mutates_args=())
def gelu_fp8_linear(h: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    rows = h.reshape(-1, h.shape[-1]).contiguous()
    q, scale = gelu_fp8_rows(rows)
    out = torch._scaled_mm(q, w_q.t(), scale_a=scale, scale_b=w_scale.t(), bias=bias, out_dtype=torch.bfloat16,
                           use_fast_accum=True)
    return out.reshape(*h.shape[:-1], w_q.shape[0])


@gelu_fp8_linear.register_fake
def _(h, w_q, w_scale, bias):
    return h.new_empty((*h.shape[:-1], w_q.shape[0]), dtype=torch.bfloat16)


def patch_ffns(model) -> int:
    """Route every tanh-GELU FeedForward with an FP8 (per-row) down projection through the op."""
    patched = 0
    for _, ff in model.named_modules():
        net = getattr(ff, "net", None)
        if not (isinstance(net, torch.nn.ModuleList) and len(net) == 3):
            continue
        act, _, down = net
        if type(act).__name__ != "GELU" or getattr(act, "approximate", None) != "tanh":
            continue
        if not type(down.weight).__module__.startswith("torchao.") or down.weight.scale.shape[-1] != 1:
            continue
        ff.register_buffer("_exp_w_q", down.weight.qdata, persistent=False)
        ff.register_buffer("_exp_w_scale", down.weight.scale, persistent=False)

        def forward(hidden_states, *args, _ff=ff, **kwargs):
            h = _ff.net[0].proj(hidden_states)
            return torch.ops.fsattn_exp.gelu_fp8_linear(h, _ff._exp_w_q, _ff._exp_w_scale, _ff.net[2].bias)

        ff.forward = forward
        patched += 1
    return patched


def timed(loop, transformer, device, n):
    scheduler = loop.scheduler()
    t = scheduler.timesteps[0]
    with torch.no_grad():
        bench_e2e._sync(device)
        start = time.perf_counter()
        out = loop.forward(transformer, loop.noise, t, 0)
        bench_e2e._sync(device)
        first = time.perf_counter() - start
        times = []
        for _ in range(n):
            with bench_e2e.Timer(device) as timer:
                loop.forward(transformer, loop.noise, t, 0)
            times.append(timer)
    return out.float().cpu(), first, [x.seconds for x in times]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="wan2.1-t2v-1.3b")
    parser.add_argument("--forwards", type=int, default=5)
    parser.add_argument("--check", action="store_true",
                        help="CPU, tiny model: torchao's float8 on torch's emulated _scaled_mm, eager backend")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.check:
        import torchao.float8.inference as inference

        inference.is_MI300 = lambda: True
        from fsattn_diffusers import recipe

        recipe.fp8_unavailable_reason = lambda device: None
    bench_args = ["--model", "tiny" if args.check else args.model, "--no-decode"]
    bench_args += ["--dtype", "bf16", "--height", "64", "--width", "64", "--frames", "5"] if args.check else []
    parser_e2e = bench_e2e.build_parser()
    settings, _, device, dtype = bench_e2e.resolve_settings(parser_e2e, parser_e2e.parse_args(bench_args))
    transformer, _ = bench_e2e.build(settings, device, dtype)
    loop = bench_e2e.Loop(settings, transformer, device, dtype)
    backend = {"backend": os.environ.get("CHECK_BACKEND", "eager")} if args.check else {}
    result = {"model": settings.model, "torch": torch.__version__}
    if device.type == "cuda":
        import triton

        result.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    fsattn_diffusers.apply_recipe(transformer, compile_options=backend or None)
    out_a, first_a, times_a = timed(loop, transformer, device, args.forwards)
    result["recipe"] = {"first_call_s": first_a, "forward_s": times_a, "median_s": statistics.median(times_a)}
    fsattn_diffusers.remove_recipe(transformer)  # the FP8 weights stay
    torch._dynamo.reset()
    fsattn_diffusers.apply_recipe(transformer, compile=False)
    result["patched_ffns"] = patch_ffns(transformer)
    for block in transformer.blocks:
        block.compile(fullgraph=True, **backend)
    out_b, first_b, times_b = timed(loop, transformer, device, args.forwards)
    result["recipe_onepass_ffn"] = {"first_call_s": first_b, "forward_s": times_b,
                                    "median_s": statistics.median(times_b)}
    result["output_cosine_b_vs_a"] = metrics.cosine_similarity(out_b, out_a)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
