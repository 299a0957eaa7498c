#!/usr/bin/env python
"""A/B: one pipeline, prompt and seed run twice (baseline, then candidate), and the videos compared.

    python examples/ab_compare.py                                  # tiny: SDPA vs fsattn, on the CPU
    python examples/ab_compare.py --candidate-config '{"pv_format": "16bit"}' --attention-report
    python examples/ab_compare.py --model wan2.1-t2v-1.3b --steps 10   # on a GPU: the speed-up
    python examples/ab_compare.py --model wan2.1-t2v-1.3b --steps 10 --recipe   # diffusers' default vs the recipe

Each side is ``sdpa`` or ``fsattn`` with its own FSAttnConfig (JSON), so two fsattn
configurations can be compared too. The recipe's parts (``fsattn_diffusers.apply_recipe``):
``--compile`` compiles both sides; ``--fuse-qkv``, ``--fp8-linear`` (and ``--fp8-conditioning``)
go to the candidate only (FP8 replaces the weights, so the candidate runs second); ``--recipe``
makes the candidate fsattn with every part, against the baseline as diffusers runs it. Written
to ``--output-dir``:

* ``side_by_side.mp4``: baseline | candidate | |candidate - baseline| x ``--diff-gain``;
* ``metrics.png``: per-frame PSNR, SSIM (and LPIPS where its weights are on disk), where
  matplotlib is installed (otherwise one line says so, and everything else is written);
* ``report.json``: settings, timings, speed-up, per-frame metrics, latent error, and with
  ``--attention-report`` the per-layer error of fsattn (and of SDPA, as a yardstick) against the
  float64 reference, on q, k, v captured from chosen layers and steps of the baseline trajectory.

PSNR and SSIM are fsattn_diffusers.metrics' own (NumPy), so ``pip install -e .`` is enough. What
the comparison needs after both runs (a video writer, FP8 support) is checked before the first.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # generate_video.py, beside this file

import generate_video as gv  # noqa: E402

import fsattn_diffusers  # noqa: E402
from fsattn_diffusers import builtin_models, metrics  # noqa: E402
from fsattn_diffusers.reference import attention_reference  # noqa: E402


CPU_TIMING_NOTE = ("CPU run: fsattn runs a PyTorch emulation of the GPU kernel's numerics here, so these times "
                   "and speed-ups say nothing about GPU speed; the quality figures do stand for the GPU kernel.")


# ----------------------------------------------------------------------------- video comparison

def compare_videos(baseline: np.ndarray, candidate: np.ndarray, lpips_net: str = "alex", device="cpu") -> dict:
    """Per-frame PSNR, SSIM and (where available offline) LPIPS of two uint8 ``(F, H, W, 3)`` videos."""
    psnr = metrics.psnr_per_frame(baseline, candidate)
    ssim = metrics.ssim_per_frame(baseline, candidate)
    lpips_values, lpips_message = metrics.lpips_per_frame(baseline, candidate, net=lpips_net, device=device)
    out = {
        "frames": int(baseline.shape[0]),
        "psnr_db": psnr.tolist(), "psnr_db_summary": metrics.summarize(psnr),
        "ssim": ssim.tolist(), "ssim_summary": metrics.summarize(ssim),
        "lpips": None if lpips_values is None else lpips_values.tolist(),
        "lpips_summary": None if lpips_values is None else metrics.summarize(lpips_values),
        "lpips_message": lpips_message,
    }
    return out


def side_by_side(baseline: np.ndarray, candidate: np.ndarray, gain: float) -> np.ndarray:
    """Frames ``baseline | candidate | |candidate - baseline| * gain`` (uint8, 3x as wide)."""
    diff = np.abs(candidate.astype(np.int16) - baseline.astype(np.int16)).astype(np.float32) * gain
    diff = np.clip(diff, 0, 255).astype(np.uint8)
    return np.concatenate([baseline, candidate, diff], axis=2)


def plot_unavailable() -> str | None:
    """Why metrics.png cannot be drawn (one line, with the install command), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed, so metrics.png is not written (pip install matplotlib); the rest is"
    return None


def plot_metrics(comparison: dict, path: str, title: str) -> str:
    """The per-frame metrics as a PNG (one panel per metric; infinite PSNR drawn at the top, marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("PSNR (dB)", comparison["psnr_db"]), ("SSIM", comparison["ssim"])]
    if comparison["lpips"] is not None:
        panels.append(("LPIPS (lower is closer)", comparison["lpips"]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (label, values) in zip(axes[:, 0], panels):
        arr = np.asarray(values, dtype=np.float64)
        frames = np.arange(len(arr))
        finite = np.isfinite(arr)
        if finite.any():
            ax.plot(frames[finite], arr[finite], marker="o", markersize=3)
        if not finite.all():
            top = (arr[finite].max() + 5) if finite.any() else 100.0
            ax.scatter(frames[~finite], np.full((~finite).sum(), top), marker="^", color="tab:green",
                       label="identical frame (inf)")
            ax.legend(loc="lower right")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("frame")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- attention capture

def attention_modules(transformer) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules of a diffusers transformer (those with an attention processor)."""
    return [(n, m) for n, m in transformer.named_modules() if hasattr(m, "processor") and hasattr(m, "set_processor")]


def default_report_layers(names: list[str]) -> list[str]:
    """The first and the last module of each kind (``blocks.#.attn1``, ``blocks.#.attn2``, ...)."""
    kinds: dict[str, list[str]] = {}
    for name in names:
        kinds.setdefault(re.sub(r"\.\d+\.", ".#.", name), []).append(name)
    chosen = []
    for members in kinds.values():
        chosen += [members[0]] + ([members[-1]] if len(members) > 1 else [])
    return chosen


def resolve_report_steps(text: str, steps: int) -> list[int]:
    """``first,middle,last`` or step indices (0-based) to a sorted list of indices."""
    named = {"first": 0, "middle": steps // 2, "last": steps - 1}
    out = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        index = named.get(part)
        if index is None:
            try:
                index = int(part)
            except ValueError:
                raise SystemExit(f"--report-steps: {part!r} is not first, middle, last or a step index") from None
        if not 0 <= index < steps:
            raise SystemExit(f"--report-steps: step {index} is outside 0..{steps - 1}")
        out.add(index)
    return sorted(out)


def capture_attention_inputs(loaded: gv.LoadedModel, settings: gv.GenerationSettings, layers: list[str],
                             steps: list[int]) -> tuple[list[dict], list[str]]:
    """Run the pipeline on SDPA and keep q, k, v (and mask, scale) of ``layers`` at ``steps``.

    The attention call is hooked where the processors make it (``dispatch_attention_fn`` in the
    processor's module); only the conditional pass of each step is kept. The loop stops after the
    last requested step. Returns the captures and the layers that never reached the hook.
    """
    gv.clear_attention(loaded)
    pipe = loaded.pipe
    modules = dict(attention_modules(pipe.transformer))
    unknown = [n for n in layers if n not in modules]
    if unknown:
        raise SystemExit(f"--report-layers: {unknown} are not attention modules; some are {list(modules)[:6]}")
    state = {"layer": None, "step": 0, "forward": 0}
    captures: list[dict] = []
    patched, handles = {}, []

    for name in layers:
        module = modules[name]
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: state.__setitem__("layer", name)))
        handles.append(module.register_forward_hook(lambda m, a, o: state.__setitem__("layer", None)))
        mod = sys.modules[type(module.processor).__module__]
        if hasattr(mod, "dispatch_attention_fn") and mod not in patched:
            patched[mod] = mod.dispatch_attention_fn

    def make_wrapper(original):
        def wrapper(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *args, **kwargs):
            if state["layer"] is not None and state["step"] in steps and state["forward"] == 0:
                captures.append({"layer": state["layer"], "step": state["step"], "q": query.detach().clone(),
                                 "k": key.detach().clone(), "v": value.detach().clone(),
                                 "mask": None if attn_mask is None else attn_mask.detach().clone(), "scale": scale})
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, *args, **kwargs)
        return wrapper

    def count_forward(module, args):
        state["forward"] += 1

    def on_step_end(pipeline, step, timestep, callback_kwargs):
        state["step"], state["forward"] = step + 1, -1
        if step >= max(steps):
            pipeline._interrupt = True  # the pipelines skip the remaining steps
        return callback_kwargs

    for mod, original in patched.items():
        mod.dispatch_attention_fn = make_wrapper(original)
    state["forward"] = -1
    handles.append(pipe.transformer.register_forward_pre_hook(count_forward))
    try:
        kwargs = gv.call_kwargs(loaded, settings, settings.steps, decode=False)
        pipe.set_progress_bar_config(desc="capturing q, k, v (sdpa)", leave=False)
        with torch.no_grad():
            pipe(**kwargs, callback_on_step_end=on_step_end)
    finally:
        for mod, original in patched.items():
            mod.dispatch_attention_fn = original
        for h in handles:
            h.remove()
        pipe._interrupt = False
    seen = {c["layer"] for c in captures}
    return captures, [n for n in layers if n not in seen]


def attention_report(captures: list[dict], config) -> list[dict]:
    """fsattn's and SDPA's error against the float64 reference for each captured call."""
    import torch.nn.functional as F

    rows = []
    for cap in captures:
        q, k, v, mask, scale = cap["q"], cap["k"], cap["v"], cap["mask"], cap["scale"]
        row = {"layer": cap["layer"], "step": cap["step"], "shape_q": list(q.shape), "shape_k": list(k.shape),
               "dtype": str(q.dtype).replace("torch.", ""), "mask": None if mask is None else list(mask.shape)}
        with torch.no_grad():
            ref, _ = attention_reference(q, k, v, mask, scale)
            try:
                out = fsattn_diffusers.fsattn(q, k, v, attn_mask=mask, scale=scale, config=config)
                row["fsattn"] = metrics.attention_error(out, ref)
            except fsattn_diffusers.UnsupportedInputError as exc:
                row["fsattn"] = {"unsupported": str(exc)}
            m = mask
            while m is not None and m.dim() < 4:
                m = m.unsqueeze(0)
            sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=m, scale=scale).transpose(1, 2)
            row["sdpa"] = metrics.attention_error(sdpa, ref)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- reporting

def _fmt(value, digits=3):
    if value is None:
        return "-"
    if isinstance(value, float) and not np.isfinite(value):
        return "inf" if value > 0 else str(value)
    return f"{value:.{digits}f}"


def print_table(report: dict) -> None:
    base, cand = report["baseline"], report["candidate"]
    speed = report["speedup"]
    rows = [
        ("", f"baseline: {base['label']}", f"candidate: {cand['label']}", ""),
        ("time per step (s)", _fmt(base["step_seconds_steady_mean"]), _fmt(cand["step_seconds_steady_mean"]),
         f"speed-up {speed['per_step']:.2f}x (steps after the first)"),
        ("denoising (s)", _fmt(base["denoise_seconds"], 2), _fmt(cand["denoise_seconds"], 2),
         f"speed-up {speed['denoise']:.2f}x"),
        ("total (s)", _fmt(base["total_seconds"], 2), _fmt(cand["total_seconds"], 2), f"speed-up {speed['total']:.2f}x"),
        ("spec.-max fallbacks", _fallbacks(base["fsattn_stats"]), _fallbacks(cand["fsattn_stats"]), ""),
        ("peak GPU memory", gv.format_gib(base["peak_gpu_bytes"]), gv.format_gib(cand["peak_gpu_bytes"]), ""),
    ]
    video = report.get("video")
    if video:
        p, s = video["psnr_db_summary"], video["ssim_summary"]
        rows.append(("PSNR dB mean/min", "", f"{_fmt(p['mean'], 2)} / {_fmt(p['min'], 2)}", f"{video['frames']} frames"))
        rows.append(("SSIM mean/min", "", f"{_fmt(s['mean'], 4)} / {_fmt(s['min'], 4)}", ""))
        lp = video["lpips_summary"]
        rows.append(("LPIPS mean/max", "", f"{_fmt(lp['mean'], 4)} / {_fmt(lp['max'], 4)}" if lp else "skipped",
                     "" if lp else video["lpips_message"]))
    lat = report["latent_error"]
    rows.append(("latents rel-L1 / cos", "", f"{lat['rel_l1']:.4g} / {lat['cosine']:.6f}", "candidate vs baseline"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"\n== A/B comparison: {report['model']} ==")
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip())
    for row in report.get("attention_report") or []:
        fs = row["fsattn"]
        fs_text = (f"cos {fs['cosine']:.6f}, rel-L1 {100 * fs['rel_l1']:.2f} %" if "cosine" in fs
                   else fs.get("unsupported", "?"))
        print(f"attention {row['layer']} step {row['step']}: fsattn {fs_text}; "
              f"sdpa cos {row['sdpa']['cosine']:.6f}, rel-L1 {100 * row['sdpa']['rel_l1']:.2f} %")
    if report["timing_note"]:
        print("NOTE: " + report["timing_note"])
    if report["note"]:
        print("NOTE: " + report["note"])
    if report.get("plot_note"):
        print("note: " + report["plot_note"])
    for key, path in report["outputs"].items():
        print(f"{key}: {path}")


def _fallbacks(stats: dict) -> str:
    if not stats.get("calls"):
        return "-"
    return f"{stats['fallback_q_tiles']} of {stats['q_tiles']} q tiles"


def side_parts(args) -> dict:
    """Each side's recipe parts: --compile for both, the rest for the candidate (--recipe: all of them)."""
    everything = gv.recipe_parts(args)
    baseline = gv.RecipeParts(compile=args.compile, dynamic=everything.dynamic,
                              compile_backend=everything.compile_backend)
    return {"baseline": baseline, "candidate": everything}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gv.add_model_args(parser)
    parser.add_argument("--baseline", choices=("sdpa", "fsattn"), default="sdpa")
    parser.add_argument("--candidate", choices=("sdpa", "fsattn"), default=None,
                        help="fsattn or sdpa (default: fsattn)")
    parser.add_argument("--baseline-config", default=None, help="FSAttnConfig JSON for a fsattn baseline")
    parser.add_argument("--candidate-config", default=None, help="FSAttnConfig JSON for a fsattn candidate")
    gv.add_fsattn_args(parser, config_help=argparse.SUPPRESS)  # two configs here: --baseline/--candidate-config
    parser.add_argument("--output-dir", default=None, help="default: outputs/ab_<model>")
    parser.add_argument("--diff-gain", type=float, default=10.0, help="amplification of the difference panel")
    parser.add_argument("--lpips-net", default="alex", choices=("alex", "vgg", "squeeze"))
    parser.add_argument("--attention-report", action="store_true",
                        help="capture q, k, v of chosen layers and steps; report fsattn's error against float64")
    parser.add_argument("--report-layers", default=None,
                        help="comma-separated attention module names (default: first and last of each kind)")
    parser.add_argument("--report-steps", default="first,middle,last", help="first, middle, last or step indices")
    args = parser.parse_args(argv)
    if args.fsattn_config:
        raise SystemExit("ab_compare takes --baseline-config / --candidate-config, not --fsattn-config")
    if args.recipe and args.candidate == "sdpa":
        raise SystemExit("--recipe makes the candidate fsattn with every part; it cannot be combined with "
                         "--candidate sdpa (use --fuse-qkv --fp8-linear --compile for the parts on diffusers' "
                         "attention)")
    args.candidate = args.candidate or "fsattn"
    parts = side_parts(args)

    device, dtype = gv.resolve_device_dtype(args.device, args.dtype)
    configs = {"baseline": gv.parse_fsattn_config(args.baseline_config),
               "candidate": gv.parse_fsattn_config(args.candidate_config)}
    # Everything the comparison needs after the two runs is checked before the first.
    gv.check_recipe_parts(parts["candidate"], device, dtype)
    if not args.no_decode:
        gv.check_video_writer()
    no_plot = plot_unavailable()
    if no_plot:
        print("note: " + no_plot, file=sys.stderr)
    loaded = gv.load_model(args.model, device, dtype, cpu_offload=args.cpu_offload, seed=args.seed)
    note = builtin_models.RANDOM_WEIGHTS_NOTE.format(name=loaded.name) if loaded.random_weights else None
    if note:
        print("NOTE: " + note, file=sys.stderr)
    settings = gv.resolve_settings(args, loaded)
    out_dir = args.output_dir or os.path.join("outputs", "ab_" + os.path.basename(os.path.normpath(args.model)))
    os.makedirs(out_dir, exist_ok=True)
    warmup = gv.default_warmup(args, device)

    sides, results, captures, missed = {}, {}, None, None
    for side, backend in (("baseline", args.baseline), ("candidate", args.candidate)):
        skip = gv.skip_kwargs(args) if backend == "fsattn" else {}
        label = gv.set_up(loaded, backend, configs[side], skip, parts[side])
        result = gv.run_pipeline(loaded, settings, warmup_steps=warmup, desc=f"{side} [{backend}]")
        results[side] = result
        sides[side] = {**gv.summary_dict(loaded, settings, label, result, None),
                       "label": gv.short_label(backend, configs[side], parts[side])}
        gv.clear_attention(loaded)
        for key in ("model", "family", "random_weights", "note", "device", "dtype", "gpu", "torch", "height",
                    "width", "num_frames", "steps", "guidance_scale", "seed", "output", "frames_written"):
            sides[side].pop(key)
        if side == "baseline" and args.attention_report:
            # On the baseline's weights, before the candidate's FP8 (if any) replaces them.
            names = [n for n, _ in attention_modules(loaded.pipe.transformer)]
            layers = args.report_layers.split(",") if args.report_layers else default_report_layers(names)
            steps = resolve_report_steps(args.report_steps, settings.steps)
            captures, missed = capture_attention_inputs(loaded, settings, layers, steps)

    base, cand = results["baseline"], results["candidate"]
    report = {
        "model": loaded.name, "random_weights": loaded.random_weights, "note": note,
        "device": str(device), "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "settings": vars(settings), "baseline": sides["baseline"], "candidate": sides["candidate"],
        "speedup": {"per_step": base.steady_step_seconds / cand.steady_step_seconds,
                    "denoise": base.denoise_seconds / cand.denoise_seconds,
                    "total": base.total_seconds / cand.total_seconds},
        "latent_error": {k: v for k, v in metrics.attention_error(cand.latents, base.latents).items()
                         if k in ("cosine", "rel_l1", "rmse", "max_abs")},
        "video": None, "outputs": {},
        "timing_note": None if device.type == "cuda" else CPU_TIMING_NOTE,
    }
    if base.frames is not None:
        report["video"] = compare_videos(base.frames, cand.frames, args.lpips_net, device)
        video_path = gv.write_video(side_by_side(base.frames, cand.frames, args.diff_gain),
                                    os.path.join(out_dir, "side_by_side.mp4"), settings.fps)
        report["outputs"]["side_by_side"] = video_path
        if no_plot is None:
            title = (f"{loaded.name}: {sides['baseline']['label']} vs {sides['candidate']['label']}"
                     + (" (random weights)" if loaded.random_weights else ""))
            report["outputs"]["plot"] = plot_metrics(report["video"], os.path.join(out_dir, "metrics.png"), title)
        report["plot_note"] = no_plot
        report["side_by_side_layout"] = f"baseline | candidate | |difference| x {args.diff_gain:g}"
    else:
        print("note: no decoded frames (--no-decode or no VAE): comparing the final latents only", file=sys.stderr)

    if args.attention_report:
        config = configs["candidate"] if args.candidate == "fsattn" else configs["baseline"]
        report["attention_report"] = attention_report(captures, config)
        report["attention_report_missed_layers"] = missed  # their processors call SDPA directly

    report["outputs"]["report"] = os.path.join(out_dir, "report.json")
    gv.write_json(report, report["outputs"]["report"])
    print_table(report)
    return report


if __name__ == "__main__":
    main()
