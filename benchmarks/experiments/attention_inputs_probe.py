"""Experiment: is fsattn slower on a model's own self-attention inputs than on randn ones?

A 14B recipe forward's profile (NOTES v17 (e)) put the warp-specialised kernel at 135 ms a call,
against ~128 ms for the same shape in bench_attention.py (randn inputs). The speculative max makes
the kernel's work data-dependent (a tile whose scores rise more than 2.8 log2 units above the
running max takes a correction), so this probe captures the Q, K, V of chosen blocks' self-attention
from one eager forward of a built-in model (diffusers' default attention, bench_e2e.py's first-step
inputs), then in the same process:

* times ``fsattn()`` on them and on randn tensors of the same shape (interleaved rounds), and SDPA;
* simulates the speculative max's votes in float32 (per 64-row warpgroup, 128-key tiles, natural key
  order): how many (row block, key tile) pairs a correction would take, at the kernel's threshold
  and a few others;
* reads the GPU's SM clock and power around each timing (nvidia-smi), so that a difference by clock
  shows as one.

    python benchmarks/experiments/attention_inputs_probe.py capture --model wan2.1-t2v-1.3b --blocks 0 15 29 \
        --dir /tmp/caps13 --out capture.json
    python benchmarks/experiments/attention_inputs_probe.py time --dir /tmp/caps13 --offset 5 --out time5.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_e2e  # noqa: E402

from fsattn_diffusers import builtin_models, fsattn  # noqa: E402

LOG2E = 1.0 / math.log(2.0)


def smi() -> dict:
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        clock, power, temp = (float(x) for x in text.strip().splitlines()[0].split(","))
        return {"sm_mhz": clock, "watts": power, "celsius": temp}
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)}


def timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def capture(transformer, loop, blocks: set[int], min_keys: int = 4096):
    """Q, K, V (B, H, S, D) of the self-attention calls of `blocks`, in call order."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    calls, captured = [0], {}

    def spy(query, key, value, *args, **kwargs):
        if key.shape[-2] > min_keys:  # self-attention (cross-attention has 512 text keys)
            if calls[0] in blocks:
                captured[calls[0]] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
            calls[0] += 1
        return original(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        scheduler = loop.scheduler()
        with torch.no_grad():
            start = time.perf_counter()
            loop.forward(transformer, loop.noise, scheduler.timesteps[0], 0)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
    finally:
        F.scaled_dot_product_attention = original
    return captured, calls[0], seconds


def speculative_votes(q, k, heads, row_blocks: int, thresholds, scale):
    """Fraction of (64-row block, 128-key tile) pairs after the first that a correction takes, per
    threshold (log2 units above the running max; a (threshold, headroom) pair raises a corrected
    tile's new max by headroom, which votes as the threshold + headroom would), for `row_blocks` blocks spread over the rows of
    each head in `heads`. The running max moves only at a corrected tile (the kernel takes no row max
    otherwise), and then for each row of the block to the larger of itself and that tile's max
    (_corrected_if_saturated)."""
    b, h, s, d = q.shape
    n_tiles = math.ceil(k.shape[2] / 128)
    starts = torch.linspace(0, s // 64 - 1, row_blocks).long() * 64
    out = {str(t): [] for t in thresholds}
    score_std = []
    for head in heads:
        rows = torch.cat([torch.arange(int(r), int(r) + 64) for r in starts]).to(q.device)
        qh = q[0, head, rows].float()
        kh = k[0, head].float()
        kh = kh - kh.mean(0, keepdim=True)  # the pre-pass's smoothing: a constant shift per row
        scores = (qh @ kh.T) * (scale * LOG2E)  # (rows, keys), log2 units
        score_std.append(float(scores.std(dim=1).mean()))
        pad = n_tiles * 128 - scores.shape[1]
        if pad:
            scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
        tile_max = scores.view(len(rows), n_tiles, 128).amax(-1).view(row_blocks, 64, n_tiles)
        del scores
        for t in thresholds:
            threshold, headroom = t if isinstance(t, tuple) else (t, 0.0)
            m = tile_max[:, :, 0] + headroom
            corrected = 0
            for j in range(1, n_tiles):
                tj = tile_max[:, :, j]
                vote = (tj > m + threshold).any(dim=1)  # (row_blocks,)
                corrected += int(vote.sum())
                m = torch.where(vote[:, None], torch.maximum(m, tj + headroom), m)
            out[str(t)].append(corrected / (row_blocks * (n_tiles - 1)))
    return {"corrected_fraction": out, "score_std_log2": score_std}


def capture_main(args):
    parser = bench_e2e.build_parser()
    settings, _, device, dtype = bench_e2e.resolve_settings(parser, parser.parse_args(
        ["--model", args.model, "--rows", "default", "--steps", "1"]))
    transformer = builtin_models.build_transformer(args.model, device, dtype, seed=settings.seed)
    loop = bench_e2e.Loop(settings, transformer, device, dtype)
    captured, n_self, forward_s = capture(transformer, loop, set(args.blocks), args.min_keys)
    del transformer
    report = {"model": args.model, "self_attention_calls": n_self, "default_forward_s": forward_s, "blocks": {}}
    thresholds = [1.807, 2.807, 3.807, 4.807]  # offsets 7, 6 (the kernel's), 5, 4
    gen = torch.Generator(device).manual_seed(0)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    for block, (q, k, v) in sorted(captured.items()):
        scale = q.shape[-1] ** -0.5
        row = {"shape": list(q.shape), "q_std": float(q.float().std()), "k_std": float(k.float().std()),
               "v_std": float(v.float().std())}
        row.update(speculative_votes(q, k, args.heads, args.row_blocks, thresholds, scale))
        rq, rk = (torch.empty_like(t).normal_(generator=gen) for t in (q, k))
        row["randn"] = speculative_votes(rq, rk, args.heads[:1], args.row_blocks, thresholds, scale)
        del rq, rk
        torch.save({"q": q, "k": k, "v": v}, Path(args.dir) / f"block{block}.pt")
        report["blocks"][str(block)] = row
        print(block, json.dumps({kk: row[kk] for kk in ("q_std", "k_std", "corrected_fraction", "score_std_log2")}),
              flush=True)
        print("  randn", json.dumps(row["randn"]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


def time_main(args):
    import triton
    from triton.experimental.gluon import language as gl

    from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as ws

    if args.offset is not None:  # before the kernel's first compile: Triton reads the global then
        ws.SPEC_OFFSET = gl.constexpr(float(args.offset))
    device = torch.device("cuda")
    report = {"offset": float(ws.SPEC_OFFSET.value), "torch": torch.__version__, "triton": triton.__version__,
              "gpu": torch.cuda.get_device_name(), "blocks": {}}
    gen = torch.Generator(device).manual_seed(0)
    for path in sorted(Path(args.dir).glob("block*.pt")):
        t = torch.load(path, map_location=device)
        q, k, v = t["q"], t["k"], t["v"]
        # randn with the model tensors' strides (views of the projections' (B, S, H, D) output).
        rq, rk, rv = (torch.empty_like(x).normal_(generator=gen) for x in (q, k, v))
        row = {}
        for a, b_, c in ((q, k, v), (rq, rk, rv)):
            for _ in range(2):
                fsattn(a, b_, c, layout="HND")
        times = {"model": [], "randn": []}
        clocks = []
        for _ in range(args.rounds):
            clocks.append(smi())
            times["model"] += timed(lambda: fsattn(q, k, v, layout="HND"), 1)
            times["randn"] += timed(lambda: fsattn(rq, rk, rv, layout="HND"), 1)
        clocks.append(smi())
        if args.sdpa:
            times["sdpa_model"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 3)
        # Accuracy on a few heads against float32 attention (the memory-efficient SDPA kernel).
        heads = slice(0, 4)
        for name, (a, b_, c) in (("model", (q, k, v)), ("randn", (rq, rk, rv))):
            a, b_, c = (x[:, heads].contiguous() for x in (a, b_, c))
            out = fsattn(a, b_, c, layout="HND").float()
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                ref = torch.nn.functional.scaled_dot_product_attention(a.float(), b_.float(), c.float())
            row[f"{name}_cos"] = float(torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0))
            row[f"{name}_rel_l1"] = float((out - ref).abs().sum() / ref.abs().sum())
        row["ms"] = {key: sorted(val) for key, val in times.items()}
        row["median_ms"] = {key: sorted(val)[len(val) // 2] for key, val in times.items()}
        row["clocks"] = clocks
        report["blocks"][path.stem] = row
        print(path.stem, "offset", report["offset"], json.dumps({kk: row[kk] for kk in row if kk not in
                                                                 ("ms", "clocks")}), flush=True)
        del t, q, k, v, rq, rk, rv
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=1))


def main(argv=None):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("capture", help="one eager forward; save the chosen blocks' Q, K, V; simulate the votes")
    c.add_argument("--model", default="wan2.1-t2v-1.3b")
    c.add_argument("--blocks", type=int, nargs="+", default=[0])
    c.add_argument("--heads", type=int, nargs="+", default=[0, 1, 2, 3])
    c.add_argument("--row-blocks", type=int, default=16)
    c.add_argument("--min-keys", type=int, default=4096, help="calls with more keys are self-attention")
    t = sub.add_parser("time", help="fsattn on the saved inputs and on randn ones, interleaved")
    t.add_argument("--offset", type=float, default=None, help="the speculative offset (default: the kernel's)")
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--sdpa", action="store_true")
    for q in (c, t):
        q.add_argument("--dir", required=True)
        q.add_argument("--out", required=True)
    args = p.parse_args(argv)
    (capture_main if args.mode == "capture" else time_main)(args)


if __name__ == "__main__":
    main()
