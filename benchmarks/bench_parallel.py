#!/usr/bin/env python
"""Transformer forward time under diffusers' context parallelism: fsattn vs diffusers' default attention.

One measurement per launch, on one GPU or under torchrun (one GPU per rank):

    python benchmarks/bench_parallel.py --attention native --out one_gpu_native.json
    python benchmarks/bench_parallel.py --attention fsattn --out one_gpu_fsattn.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_parallel.py --attention fsattn --ulysses 2 --out u2.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_parallel.py --attention fsattn --ring 2 --out r2.json

The transformer is a built-in architecture (fsattn_diffusers.builtin_models; default the real
Wan2.1-T2V-14B config) with random weights in bf16; the inputs are one video's latents (default
720x1280, 81 frames: 21 x 90 x 160 latents, 75,600 tokens) and 512 text tokens, as one classifier-
free-guidance branch sees them. ``--warmup`` untimed forwards (kernel compilation), then
``--repeats`` timed ones, each synchronised on every rank; rank 0 writes every rank's times, the
GPU, driver and library versions to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="wan2.1-t2v-14b", help="a built-in Wan architecture")
    parser.add_argument("--attention", choices=("fsattn", "native"), default="fsattn",
                        help="fsattn's diffusers backend, or diffusers' default (native: SDPA)")
    parser.add_argument("--ulysses", type=int, default=1, help="Ulysses degree")
    parser.add_argument("--ring", type=int, default=1, help="ring degree")
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--num-frames", type=int, default=81)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True, help="JSON results (written by rank 0)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.ulysses * args.ring != world_size:
        raise SystemExit(f"--ulysses {args.ulysses} x --ring {args.ring} must equal the number of processes "
                         f"({world_size}); launch with torchrun --nproc-per-node {args.ulysses * args.ring}")
    if args.ring > 1 and args.attention == "native":
        raise SystemExit("diffusers' native attention cannot run ring attention (its op returns no log-sum-exp)")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    parallel = world_size > 1
    if parallel:
        dist.init_process_group("nccl", device_id=device)

    import diffusers
    import triton

    import fsattn_diffusers
    from fsattn_diffusers import builtin_models, register_fsattn_backend

    spec = builtin_models.get_builtin(args.model)
    cfg = spec.transformer_config
    # Wan's VAE: 4x in time (first frame alone), 8x in space; the transformer patches 2x2.
    latent = ((args.num_frames - 1) // 4 + 1, args.height // 8, args.width // 8)
    tokens = latent[0] * (latent[1] // cfg["patch_size"][1]) * (latent[2] // cfg["patch_size"][2])
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, cfg["in_channels"], *latent, generator=g).to(device, torch.bfloat16),
        timestep=torch.tensor([700], device=device),
        encoder_hidden_states=torch.randn(1, args.text_tokens, cfg["text_dim"], generator=g).to(device, torch.bfloat16),
    )
    start = time.perf_counter()
    model = builtin_models.build_transformer(args.model, device, torch.bfloat16, seed=0)
    build_seconds = time.perf_counter() - start
    if args.attention == "fsattn":
        register_fsattn_backend()
    model.set_attention_backend(args.attention)
    if parallel:
        from diffusers import ContextParallelConfig

        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=args.ulysses, ring_degree=args.ring))

    def forward() -> float:
        if parallel:
            dist.barrier()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(**inputs, return_dict=False)
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    warmup = [forward() for _ in range(args.warmup)]
    fsattn_diffusers.reset_stats()
    torch.cuda.reset_peak_memory_stats(device)
    times = [forward() for _ in range(args.repeats)]
    mine = {"rank": rank, "forward_seconds": times, "warmup_seconds": warmup, "build_seconds": build_seconds,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device), "fsattn_stats": fsattn_diffusers.stats()}
    ranks = [mine]
    if parallel:
        ranks = [None] * world_size
        dist.all_gather_object(ranks, mine)
    if rank == 0:
        # A forward ends when the slowest rank ends: the per-forward wall time is the max over ranks.
        wall = [max(r["forward_seconds"][i] for r in ranks) for i in range(args.repeats)]
        props = torch.cuda.get_device_properties(device)
        result = {
            "model": args.model, "random_weights": True, "dtype": "bfloat16", "attention": args.attention,
            "ulysses_degree": args.ulysses, "ring_degree": args.ring, "world_size": world_size,
            "height": args.height, "width": args.width, "num_frames": args.num_frames, "latent": list(latent),
            "video_tokens": tokens, "text_tokens": args.text_tokens,
            "forward_seconds": wall, "forward_seconds_mean": statistics.fmean(wall), "ranks": ranks,
            "gpu": props.name, "gpu_count": world_size, "driver": _driver_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "diffusers": diffusers.__version__,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"{args.model} {args.height}x{args.width}x{args.num_frames} ({tokens} tokens), {args.attention}, "
              f"ulysses {args.ulysses} x ring {args.ring} on {world_size} x {props.name}: forward "
              f"{statistics.fmean(wall):.3f} s (runs {', '.join(f'{t:.3f}' for t in wall)}; warm-up "
              f"{max(warmup, default=0.0):.1f} s) -> {args.out}")
    if parallel:
        dist.destroy_process_group()


def _driver_version() -> str | None:
    try:
        import subprocess

        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    main()
