"""Where the host time of one fsattn call goes at a small shape (the fixed cost of the length
sweep): cProfile over repeated calls, GPU synchronised before and after.

    python benchmarks/experiments/host_profile.py [--tokens 1024] [--calls 50] [--top 30]
"""

import argparse
import cProfile
import pstats
import time

import torch

from fsattn_diffusers import fsattn


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    q, k, v = (torch.randn(1, args.tokens, args.heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):  # compile and warm up
        fsattn(q, k, v)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        fsattn(q, k, v)
    host = (time.perf_counter() - start) / args.calls
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) / args.calls
    print(f"{args.tokens} tokens x {args.heads} heads: host {host * 1e3:.3f} ms per call, "
          f"host + GPU {total * 1e3:.3f} ms per call")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        fsattn(q, k, v)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
