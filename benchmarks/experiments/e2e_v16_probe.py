"""v16 device probe (run from the repository root): `quality` = FP8 layer-subset sensitivity on Wan2.1-1.3B (eager, default attention); `v1,v2,...` = apply_recipe with the named torch.compile options, timed and profiled per kernel. MODEL=tiny runs it on a CPU (no FP8). The last call picked its options with: min over variants with first_call_s < 60 of median."""
import json, os, re, sys, time, statistics, gc
sys.path.insert(0, "benchmarks")
import torch
import bench_e2e as be
import fsattn_diffusers
from fsattn_diffusers import metrics, recipe

OUT = os.environ["OUT"]
PART = sys.argv[1]
res = {}
def save():
    json.dump(be.json_safe(res), open(f"{OUT}/probe1_{PART.replace(',', '_')}.json", "w"), indent=1)

parser = be.build_parser()
args = parser.parse_args(["--model", os.environ.get("MODEL", "wan2.1-t2v-1.3b"), "--steps", "2"] + (["--no-decode"] if PART != "quality" else []))
settings, rows, device, dtype = be.resolve_settings(parser, args)
t0 = time.perf_counter()
transformer, pipe = be.build(settings, device, dtype)
loop = be.Loop(settings, transformer, device, dtype)

def run_loop():
    sched = loop.scheduler()
    lat = loop.noise.clone(); ft = []
    with torch.no_grad():
        for i in range(settings.steps):
            lat = loop.step(transformer, sched, lat, i, ft)
    return lat

def fwd_times(n=5):
    sched = loop.scheduler(); ts = []
    with torch.no_grad():
        for _ in range(n):
            with be.Timer(device) as t:
                loop.forward(transformer, loop.noise, sched.timesteps[0], 0)
            ts.append(t)
    return [t.seconds for t in ts]

def breakdown():
    sched = loop.scheduler()
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        with be.Timer(device) as t:
            loop.forward(transformer, loop.noise, sched.timesteps[0], 0)
    by = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU or getattr(ev, "is_user_annotation", False):
            continue
        if "annotation" in str(getattr(ev, "activity_type", "") or ""):
            continue
        d = by.setdefault(ev.name, [0, 0.0]); d[0] += 1; d[1] += ev.time_range.elapsed_us()
    total = sum(v[1] for v in by.values())
    cls = {}
    for name, (n, us) in by.items():
        if be.ATTENTION_KERNEL.search(name): k = "attention"
        elif re.search(r"gemm|cutlass|xmma|scaled_mm|triton_tem|nvjet|sm90", name, re.I): k = "gemm"
        elif name.startswith("triton_"): k = "inductor_" + name.split("_")[1]
        else: k = "other"
        cls[k] = cls.get(k, 0) + us
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:40]
    return {"wall_s": t.seconds, "device_us": total, "by_class_us": cls,
            "top": [[name[:160], n, round(us, 1)] for name, (n, us) in top]}

if PART == "quality":
    with torch.no_grad():
        ref_lat = run_loop(); ref_frames = be.decode(pipe, ref_lat)
    names = recipe.fp8_linear_names(transformer)["model"]
    if device.type != "cuda": names = names[:0]
    mods = dict(transformer.named_modules())
    flops = {n: mods[n].in_features * mods[n].out_features for n in names}  # per token (x2 for FLOPs), cross k/v on 512 tokens ignored
    res["n_layers"] = len(names)
    variants = {
        "all": lambda n: True,
        "no_ffn_down": lambda n: not n.endswith("ffn.net.2"),
        "no_ffn_up": lambda n: not n.endswith("ffn.net.0.proj"),
        "no_attn2": lambda n: ".attn2." not in n,
        "no_attn1": lambda n: ".attn1." not in n,
        "no_to_out": lambda n: "to_out" not in n,
        "no_attn2_qo": lambda n: not (".attn2.to_q" in n or ".attn2.to_out" in n),
        "no_blocks_0_29": lambda n: int(n.split(".")[1]) not in (0, 29),
        "no_blocks_0_1_2": lambda n: int(n.split(".")[1]) not in (0, 1, 2),
        "no_blocks_27_28_29": lambda n: int(n.split(".")[1]) not in (27, 28, 29),
        "no_block_0": lambda n: int(n.split(".")[1]) != 0,
    }
    from torchao.quantization import quantize_
    cfg = recipe._fp8_config()
    tot = sum(flops.values())
    for vname, keep in variants.items():
        chosen = [n for n in names if keep(n)]
        ids = {id(mods[n]) for n in chosen}
        orig = {n: mods[n].weight for n in chosen}
        quantize_(transformer, cfg, filter_fn=lambda m, fqn: id(m) in ids)
        with torch.no_grad():
            lat = run_loop(); frames = be.decode(pipe, lat)
        psnr = metrics.psnr_per_frame(ref_frames, frames)
        err = metrics.attention_error(lat.float().cpu(), ref_lat.float().cpu())
        res[vname] = {"layers": len(chosen), "bf16_flop_share": 1 - sum(flops[n] for n in chosen) / max(tot, 1),
                      "latents_cos": err["cosine"], "psnr": metrics.summarize(psnr)}
        print(vname, res[vname], flush=True)
        for n, w in orig.items():
            mods[n].weight = w; mods[n].__dict__.pop("extra_repr", None)
        save()
else:
    variants = {"default": {"options": {}}, "cdt": {"options": {"coordinate_descent_tuning": True}},
                "mk1": {"options": {"triton.multi_kernel": 1}}, "mk2": {"options": {"triton.multi_kernel": 2}},
                "mk1_cdt": {"options": {"triton.multi_kernel": 1, "coordinate_descent_tuning": True}},
                "mk2_cdt": {"options": {"triton.multi_kernel": 2, "coordinate_descent_tuning": True}}}
    order = PART.split(",")
    with torch.no_grad():
        for v in order:
            torch._dynamo.reset(); gc.collect()
            opts = dict(variants[v])
            fsattn_diffusers.apply_recipe(transformer, compile_options=opts or None, fp8_linear=device.type == "cuda")
            s = time.perf_counter(); sched = loop.scheduler()
            out = loop.forward(transformer, loop.noise, sched.timesteps[0], 0); be._sync(device)
            first = time.perf_counter() - s
            ts = fwd_times(6)
            r = {"options": opts.get("options"), "first_call_s": first, "forward_s": ts, "median": statistics.median(ts), "breakdown": breakdown(),
                 "_out": out.float().cpu()}
            res[v] = r
            if v != order[0]:
                r["cos_vs_first"] = metrics.cosine_similarity(out.float().cpu(), res[order[0]]["_out"])
            print(v, first, statistics.median(ts), r["breakdown"]["by_class_us"], flush=True)
            fsattn_diffusers.remove_recipe(transformer)
            save()
        save()
print("total", time.perf_counter() - t0)
