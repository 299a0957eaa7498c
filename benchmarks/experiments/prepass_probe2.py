"""Scratch probe 2: pack-kernel variants (gather order, elementwise error sum, register caps)."""
import json, os, sys
import torch, triton
from torch.profiler import profile, ProfilerActivity
from fsattn_diffusers import fsattn
from fsattn_diffusers.kernels import quantize as Qm

OUT = os.environ.get("OUT", "/tmp")
res = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}, "rows": []}
def dump():
    json.dump(res, open(f"{OUT}/prepass_probe2.json", "w"), indent=1)

SHAPES = {"seq16k": (1, 16384, 12, 128, 0), "wan13b": (1, 32760, 12, 128, 0), "d64": (2, 17776, 48, 64, 0),
          "wan14b": (1, 75600, 40, 128, 0), "hunyuan": (1, 119056, 24, 128, 226)}
BASE = dict(LOOP_STAGES=3, Q_WARPS=8, V_GATHER=False, V_ERR_ACC=False, PACK_MAX_REGISTERS=168,
            STATS_MAX_REGISTERS=255, TARGET=3 * 132)
VARIANTS = {
    "base3": {},
    "G": dict(V_GATHER=True),
    "GE": dict(V_GATHER=True, V_ERR_ACC=True),
    "GE128": dict(V_GATHER=True, V_ERR_ACC=True, PACK_MAX_REGISTERS=128, STATS_MAX_REGISTERS=128, TARGET=4 * 132),
    "GE128s4": dict(V_GATHER=True, V_ERR_ACC=True, PACK_MAX_REGISTERS=128, STATS_MAX_REGISTERS=128, TARGET=4 * 132,
                    LOOP_STAGES=4),
    "B128": dict(PACK_MAX_REGISTERS=128, STATS_MAX_REGISTERS=128, TARGET=4 * 132),
    "GE_t6": dict(V_GATHER=True, V_ERR_ACC=True, TARGET=6 * 132),
}

def setv(name):
    for k, v in {**BASE, **VARIANTS[name]}.items():
        if k == "TARGET":
            Qm.quantize_kv.__kwdefaults__["n_programs_target"] = v
        else:
            setattr(Qm, k, v)

def kernel_times(fn, iters):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            out[e.key[:40]] = round(t / iters, 1)
    return out

if __name__ == "__main__":
    for sname in sys.argv[1:] or list(SHAPES):
        B, S, H, D, pad = SHAPES[sname]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        mask = None
        if pad:
            mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device="cuda"); mask[..., S - pad:] = False
        ref = None
        iters = 3 if S * H > 2e6 else 10
        for rnd in range(2):
            for vname in VARIANTS:
                setv(vname)
                fn = lambda: fsattn(q, k, v, attn_mask=mask)
                o = fn(); torch.cuda.synchronize()
                if ref is None:
                    ref = o
                row = {"shape": sname, "variant": vname, "round": rnd,
                       "max_abs_diff_vs_base3": (o.float() - ref.float()).abs().max().item(),
                       "rel_l1_vs_base3": ((o.float() - ref.float()).abs().sum() / ref.float().abs().sum()).item()}
                row["kernels_us"] = kernel_times(fn, iters)
                row["prepass_us"] = round(sum(t for n, t in row["kernels_us"].items() if "quantize" in n or "stats" in n), 1)
                res["rows"].append(row); dump(); print(row, flush=True)
        del q, k, v, ref, o
        torch.cuda.empty_cache()
