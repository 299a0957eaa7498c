"""The recipe across resolutions: what ``dynamic`` costs in compiles and in speed.

For each ``dynamic`` setting of :func:`fsattn_diffusers.apply_recipe` (None, False, True), one
transformer forward after another at each of several video sizes, in the order given: the
first call at each size (compiling, where it does), the median forward after it, and the graphs
Dynamo made at that size; diffusers' eager default at each size in the same process gives the
speed-ups. The settings run one after another in one process, so only the first meets cold
compile caches (inductor's and Triton's): later settings' first calls are what a second process
with warm caches would see. With ``dynamic=False`` every size is a graph, and more than Dynamo's
``recompile_limit`` (8) sizes stop the run (``fullgraph=True`` raises).

    python benchmarks/bench_resolutions.py --model wan2.1-t2v-1.3b --sizes 480x832x81 480x832x49 720x1280x21

On a CPU (``--model tiny``, ``--compile-backend eager``) it runs the same sequence for tests.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e  # noqa: E402  (environment(), json_safe(), the Timer, _sync, TEXT_TOKENS)

import fsattn_diffusers  # noqa: E402
from fsattn_diffusers import builtin_models  # noqa: E402
from fsattn_diffusers.recipe import fp8_unavailable_reason  # noqa: E402

DYNAMIC = {"none": None, "false": False, "true": True}


def parse_size(text: str) -> tuple[int, int, int]:
    try:
        height, width, frames = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected HEIGHTxWIDTHxFRAMES, e.g. 480x832x81") from None
    if height % 16 or width % 16 or height <= 0 or width <= 0 or frames < 1 or (frames - 1) % 4:
        raise argparse.ArgumentTypeError(f"size {text!r}: height and width must be positive multiples of 16 and "
                                         "frames of the form 4k+1")
    return height, width, frames


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    wan = [name for name, m in builtin_models.BUILTIN_MODELS.items() if m.family == "wan"]
    parser.add_argument("--model", choices=wan, default="wan2.1-t2v-1.3b")
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=None,
                        help="HEIGHTxWIDTHxFRAMES, in the order run (default: three sizes of the model's)")
    parser.add_argument("--dynamic", nargs="+", choices=sorted(DYNAMIC), default=["none", "false", "true"])
    parser.add_argument("--forwards", type=bench_e2e._positive_int, default=3, help="timed forwards per size")
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                        help="FP8 linear layers (default: on a GPU with FP8, off elsewhere)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (tests use eager)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser


def default_sizes(model: builtin_models.BuiltinModel) -> list[tuple[int, int, int]]:
    h, w, f = model.height, model.width, model.num_frames
    return [(h, w, f), (h, w, (f - 1) // 8 * 4 + 1), (h * 3 // 2 // 16 * 16, w * 3 // 2 // 16 * 16, (f - 1) // 16 * 4 + 1)]


def inputs(transformer, size, device, dtype, generator) -> dict:
    height, width, frames = size
    cfg = transformer.config
    latents = torch.randn(1, cfg.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8, generator=generator)
    text = torch.randn(1, bench_e2e.TEXT_TOKENS, cfg.text_dim, generator=generator)
    return dict(hidden_states=latents.to(device, dtype), encoder_hidden_states=text.to(device, dtype),
                timestep=torch.tensor([500], device=device), return_dict=False)


def run_sizes(transformer, sizes, inputs_per_size, forwards, device) -> list[dict]:
    from torch._dynamo.utils import counters

    rows = []
    for size, kwargs in zip(sizes, inputs_per_size):
        graphs = counters["stats"]["unique_graphs"]
        bench_e2e._sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = transformer(**kwargs)[0]
        bench_e2e._sync(device)
        first = time.perf_counter() - start
        times = []
        for _ in range(forwards):
            with bench_e2e.Timer(device) as timer, torch.no_grad():
                transformer(**kwargs)
            times.append(timer)
        rows.append({"size": "x".join(map(str, size)), "first_call_seconds": first,
                     "forward_seconds_median": statistics.median(t.seconds for t in times),
                     "new_graphs": counters["stats"]["unique_graphs"] - graphs, "_out": out.float().cpu()})
    return rows


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = builtin_models.get_builtin(args.model)
    sizes = args.sizes or default_sizes(model)
    fp8 = args.fp8 if args.fp8 is not None else (
        device.type == "cuda" and fp8_unavailable_reason(device) is None)
    transformer = builtin_models.build_transformer(args.model, device, dtype, seed=0)
    generator = torch.Generator().manual_seed(0)
    per_size = [inputs(transformer, size, device, dtype, generator) for size in sizes]

    report = {"benchmark": "bench_resolutions", "environment": bench_e2e.environment(device),
              "command": "python3 benchmarks/bench_resolutions.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": args.model, "fp8": fp8, "compile_backend": args.compile_backend,
              "note": "settings in order, one process: only the first meets cold compile caches", "settings": []}
    default = run_sizes(transformer, sizes, per_size, args.forwards, device)
    report["settings"].append({"dynamic": "default (eager, no recipe)", "sizes": default})
    for name in args.dynamic:
        torch._dynamo.reset()
        fsattn_diffusers.apply_recipe(transformer, fp8_linear=fp8, keep_original_weights=fp8,
                                      dynamic=DYNAMIC[name], compile_options={"backend": args.compile_backend})
        rows = run_sizes(transformer, sizes, per_size, args.forwards, device)
        fsattn_diffusers.remove_recipe(transformer)
        for row, base in zip(rows, default):
            row["speedup"] = base["forward_seconds_median"] / row["forward_seconds_median"]
            row["output_cosine"] = torch.nn.functional.cosine_similarity(
                row["_out"].double().flatten(), base["_out"].double().flatten(), dim=0).item()
        report["settings"].append({"dynamic": name, "sizes": rows,
                                   "graphs": sum(r["new_graphs"] for r in rows)})
    for setting in report["settings"]:
        for row in setting["sizes"]:
            row.pop("_out")
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(bench_e2e.json_safe(report), indent=1))
    return report


def print_report(report: dict) -> None:
    print(f"== bench_resolutions: {report['model']}, FP8 {'on' if report['fp8'] else 'off'}, "
          f"backend {report['compile_backend']} ==")
    print(f"{'dynamic':<28}{'size':<14}{'first call s':>13}{'forward s':>11}{'speed-up':>10}{'new graphs':>11}")
    for setting in report["settings"]:
        for row in setting["sizes"]:
            speedup = f"{row['speedup']:.3f}" if "speedup" in row else "1.000"
            print(f"{setting['dynamic']:<28}{row['size']:<14}{row['first_call_seconds']:>13.1f}"
                  f"{row['forward_seconds_median']:>11.4f}{speedup:>10}{row['new_graphs']:>11}")


if __name__ == "__main__":
    main()
