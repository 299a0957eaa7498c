import sys, torch
sys.path.insert(0, "benchmarks/experiments")
import prepass_probe2 as P
from fsattn_diffusers import fsattn
P.setv(sys.argv[1])
B, S, H, D, pad = P.SHAPES["wan13b"]
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    fsattn(q, k, v)
torch.cuda.synchronize()
