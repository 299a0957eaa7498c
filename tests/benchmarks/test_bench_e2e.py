"""benchmarks/bench_e2e.py on the tiny built-ins (CPU: fsattn's emulation), and its pieces.

The script lives in benchmarks/ (not a package): it is imported by path, so that the tests call the
very functions the command line runs. CPU times are meaningless (and the test machine is shared),
so nothing here asserts a speed; only the bookkeeping around the times, the quality figures, the
row order, the compile counters and the argument errors. Compiled rows use Dynamo's eager backend
(the tracing, guards and graph counts are the same as inductor's; inductor itself only in the slow
cache test).
"""

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from unittest import mock

import pytest
import torch

from fp8_on_cpu import lift_fp8_hardware_checks

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks", "bench_e2e.py")
# CPU-quick, on the CPU even where a GPU is present: 9 frames (3 latent frames) of 64x96, 72 tokens.
SMALL = ["--model", "tiny", "--device", "cpu", "--height", "64", "--width", "96", "--frames", "9",
         "--compile-backend", "eager"]
# The tiny Wan: 2 blocks, each with self- and cross-attention; classifier-free guidance: 2 forwards a step.
TINY_ATTENTION_MODULES = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny model gains nothing from more, and on a shared machine spinning
    OpenMP threads can make each step many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.abspath(BENCH))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _strict_json(path):
    def refuse(token):
        raise ValueError(f"non-standard JSON literal {token}")
    with open(path) as f:
        return json.load(f, parse_constant=refuse)


@pytest.fixture(scope="module")
def cli_report(tmp_path_factory):
    """One run of the command line as a user types it: four rows given out of order, two steps, JSON out."""
    out = tmp_path_factory.mktemp("e2e") / "e2e.json"
    proc = subprocess.run([sys.executable, BENCH, *SMALL, "--rows", "fsattn,default+compile,fsattn+fuse+compile,default",
                           "--steps", "2", "--profile", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _strict_json(out)
    return report, {r["row"]: r for r in report["rows"]}, proc.stdout


def test_json_records_versions_config_and_the_rows_in_run_order(cli_report):
    report, rows, stdout = cli_report
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["diffusers"] and env["triton"] and env["torchao"]
    assert env["gpu"] is None and env["device"] == "cpu"
    cfg = report["config"]
    assert (cfg["model"], cfg["height"], cfg["width"], cfg["frames"], cfg["steps"]) == ("tiny", 64, 96, 9, 2)
    assert cfg["latent_shape"] == [1, 16, 3, 8, 12] and cfg["video_tokens"] == 3 * 4 * 6 and cfg["decode"]
    # The reference first, then the others as given (no FP8 row to move last).
    assert cfg["rows"] == [r["row"] for r in report["rows"]] == ["default", "fsattn", "default+compile",
                                                                  "fsattn+fuse+compile"]
    assert report["forwards_per_step"] == 2 and report["build_seconds"] > 0
    for text in ("== bench_e2e: tiny 64x96", "first call s", "NOTE: CPU run", "RANDOM weights"):
        assert text in stdout, text


def test_every_row_times_its_first_call_forwards_and_steps(cli_report):
    _, rows, _ = cli_report
    for row in rows.values():
        forwards, steps = row["forward_seconds"], row["step_seconds"]
        assert len(forwards) == 2 * 2 and len(steps) == 2 and all(t > 0 for t in forwards + steps)
        assert row["forward_seconds_median"] == pytest.approx(statistics.median(forwards), rel=1e-12)
        assert row["step_seconds_median"] == pytest.approx(statistics.median(steps), rel=1e-12)
        assert row["compile_seconds_estimate"] == pytest.approx(row["first_call_seconds"] - row["forward_seconds_median"])
        assert row["peak_memory_bytes"] is None  # not a CUDA run
        assert row["speedup_per_step"] == pytest.approx(
            rows["default"]["step_seconds_median"] / row["step_seconds_median"], rel=1e-12)
        assert row["reference_row"] == "default"


def test_fsattn_rows_run_every_call_on_fsattn_and_compiled_rows_make_one_graph(cli_report):
    _, rows, _ = cli_report
    calls = 2 * 2 * TINY_ATTENTION_MODULES  # steps x (cond, uncond) x modules
    for name, row in rows.items():
        stats = row["fsattn_stats"]
        assert stats["calls"] == ({"emulation": calls} if name.startswith("fsattn") else {})
        assert stats["sdpa_fallbacks"] == {}
        compiled = name.endswith("compile")
        assert row["dynamo"]["stats.unique_graphs"] == (1 if compiled else 0)  # both blocks share it
        assert row["dynamo"]["graph_breaks"] == 0
    assert rows["fsattn"]["recipe"] is None and rows["default"]["recipe"] is None
    no_fp8 = {"fp8_linear_layers": 0, "fp8_linear_layers_quantized_here": 0, "fused_feed_forwards": 0}
    assert rows["default+compile"]["recipe"] == {"fused_modules": 0, "compiled_modules": 2, **no_fp8}
    assert rows["fsattn+fuse+compile"]["recipe"] == {"fused_modules": 4, "compiled_modules": 2, **no_fp8}


def test_quality_is_measured_against_the_default_row(cli_report):
    report, rows, _ = cli_report
    ref = rows["default"]["quality"]
    assert ref["output_cosine"] == pytest.approx(1.0) and ref["latents_rel_l1"] == 0.0
    assert ref["psnr_db"] == ["inf"] * 9 and ref["ssim"] == pytest.approx([1.0] * 9)
    # The eager backend runs the traced ops as they are: the compiled default is the default.
    assert rows["default+compile"]["quality"]["latents_cosine"] > 0.999999
    for name in ("fsattn", "fsattn+fuse+compile"):
        q = rows[name]["quality"]
        assert 0.999 < q["output_cosine"] < 1.0 and 0.999 < q["latents_cosine"] < 1.0  # 8-bit attention, a little
        assert 0 < q["latents_rel_l1"] < 0.02
        psnr = [float(p) for p in q["psnr_db"]]
        assert len(psnr) == 9 and all(30 < p < math.inf for p in psnr)
        assert len(q["ssim"]) == 9 and q["ssim_summary"]["min"] > 0.99
    assert report["warnings"] == []


def test_attention_share_is_profiled_per_row(cli_report):
    _, rows, _ = cli_report
    # The eager default's SDPA, and fsattn's custom op inside the compiled graph, seen by kind.
    for name, op in (("default", "aten::scaled_dot_product_attention"), ("fsattn+fuse+compile", "fsattn::attention")):
        attention = rows[name]["attention"]
        assert set(attention["by_kind"]) == {"self", "cross"}
        for kind in attention["by_kind"].values():
            assert kind["calls_per_step"] == 2 and kind["ops"] == [op]  # one forward: 2 blocks
        assert 0 < attention["attention_share"] < 1


# ----------------------------------------------------------------------------- FP8 rows

def test_fp8_rows_run_last_on_shared_quantized_weights(bench, monkeypatch, tmp_path):
    # torchao's float8 GEMMs on the CPU through torch's emulated _scaled_mm.
    lift_fp8_hardware_checks(monkeypatch, runs_gemms=True)
    report = bench.main([*SMALL, "--dtype", "bf16", "--rows", "fsattn+fuse+fp8c+compile,recipe,fsattn+fp8+compile,default",
                         "--steps", "1", "--no-decode", "--out", str(tmp_path / "fp8.json")])
    rows = {r["row"]: r for r in report["rows"]}
    assert [r["row"] for r in report["rows"]] == ["default", "recipe", "fsattn+fp8+compile", "fsattn+fuse+fp8c+compile"]
    # 14 block linears (of the cross-attention only the query projection) and the 2 fused
    # self-attention QKV projections; the second FP8 row finds the 14 (unfused again) quantized, and
    # runs them; the fp8c row quantizes the cross-attention's other 6 and its 2 fused K/V projections
    # (the QKV fused again from FP8 projections is FP8 already).
    # The recipe fuses both blocks' feed-forwards; rows without "ffn" run torchao's own path.
    assert rows["recipe"]["recipe"] == {"fused_modules": 4, "fp8_linear_layers": 16,
                                        "fp8_linear_layers_quantized_here": 16, "fused_feed_forwards": 2,
                                        "compiled_modules": 2}
    assert rows["fsattn+fp8+compile"]["recipe"]["fused_feed_forwards"] == 0
    assert rows["fsattn+fp8+compile"]["recipe"]["fp8_linear_layers_quantized_here"] == 0
    assert rows["fsattn+fp8+compile"]["recipe"]["fp8_linear_layers"] == 14
    assert rows["fsattn+fuse+fp8c+compile"]["recipe"]["fp8_linear_layers_quantized_here"] == 6 + 2
    assert rows["fsattn+fuse+fp8c+compile"]["recipe"]["fp8_linear_layers"] == 14 + 6 + 2 + 2
    for name in ("recipe", "fsattn+fp8+compile", "fsattn+fuse+fp8c+compile"):
        assert rows[name]["dynamo"]["graph_breaks"] == 0 and rows[name]["dynamo"]["stats.unique_graphs"] == 1
        assert 0.99 < rows[name]["quality"]["output_cosine"] < 1.0
    assert _strict_json(tmp_path / "fp8.json")["rows"][1]["row"] == "recipe"


def test_fp8_rows_asked_for_are_refused_where_fp8_cannot_run(bench, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, "--rows", "default,recipe"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "rows ['recipe'] need FP8 linear layers, which cannot run here: the transformer runs on cpu" in err
    from fsattn_diffusers import recipe

    monkeypatch.setattr(recipe, "fp8_unavailable_reason", lambda device: None)  # as on an FP8-capable GPU
    with pytest.raises(SystemExit):
        bench.main([*SMALL, "--rows", "recipe", "--dtype", "fp16"])
    assert "rows ['recipe'] need FP8 linear layers, which cannot run here: torchao's per-row float8 takes " \
           "bfloat16 weights: use --dtype bf16" in capsys.readouterr().err


# ----------------------------------------------------------------------------- other models and modes

def test_hunyuanvideo_runs_one_forward_per_step_without_a_vae(bench):
    report = bench.main(["--model", "tiny-hunyuanvideo", "--device", "cpu", "--height", "64", "--width", "64",
                         "--frames", "5", "--rows", "default,fsattn", "--steps", "2"])
    assert report["forwards_per_step"] == 1 and not report["config"]["decode"]
    assert report["config"]["video_tokens"] == 2 * 4 * 4
    fs = report["rows"][1]
    assert len(fs["forward_seconds"]) == 2 and "psnr_db" not in fs["quality"]
    assert 0.999 < fs["quality"]["latents_cosine"] < 1.0
    assert fs["fsattn_stats"]["calls"]["emulation"] > 0


def test_cogvideox_runs_guidance_as_one_batched_forward_per_step(bench):
    report = bench.main(["--model", "tiny-cogvideox", "--device", "cpu", "--rows", "default,fsattn", "--steps", "2"])
    assert report["forwards_per_step"] == 1 and not report["config"]["decode"]
    assert report["config"]["video_tokens"] == 3 * 8 * 8
    fs = report["rows"][1]
    assert len(fs["forward_seconds"]) == 2 and "psnr_db" not in fs["quality"]
    assert 0.999 < fs["quality"]["latents_cosine"] < 1.0
    assert fs["fsattn_stats"]["calls"]["emulation"] == 2 * 2  # two blocks, two steps


@pytest.mark.parametrize("guidance", [6.0, 1.0])
def test_cogvideox_loop_steps_as_the_pipeline_does(bench, guidance):
    # float32 on the CPU: the loop's latents after three steps are the pipeline's, bit for bit
    # (prompt order under guidance, timesteps, the scheduler's step, the dtype between steps).
    from fsattn_diffusers import builtin_models

    parser = bench.build_parser()
    settings, _, device, dtype = bench.resolve_settings(parser, parser.parse_args(
        ["--model", "tiny-cogvideox", "--device", "cpu", "--steps", "3", "--guidance-scale", str(guidance)]))
    pipe = builtin_models.build_pipeline("tiny-cogvideox", device, dtype, seed=settings.seed)
    loop = bench.Loop(settings, pipe.transformer, device, dtype)
    scheduler, latents, times = loop.scheduler(), loop.noise.clone(), []
    with torch.no_grad():
        for index in range(settings.steps):
            latents = loop.step(pipe.transformer, scheduler, latents, index, times)
        # The loop's draws, in its order: the noise, then the prompt's and the negative prompt's embeddings.
        generator = torch.Generator("cpu").manual_seed(settings.seed)
        torch.randn(settings.latent_shape, generator=generator)
        prompt = builtin_models.random_prompt_inputs("tiny-cogvideox", 1, "cpu", dtype, generator)
        if guidance <= 1.0:
            del prompt["negative_prompt_embeds"]
        reference = pipe(**prompt, height=settings.height, width=settings.width, num_frames=settings.frames,
                         num_inference_steps=settings.steps, guidance_scale=guidance, latents=loop.noise.clone(),
                         output_type="latent").frames
    assert len(times) == settings.steps and torch.equal(latents, reference)


def test_first_call_only_times_the_first_call_and_nothing_else(bench, tmp_path):
    # --cache-dir sets two variables for the rest of the process: restored after this test, so later
    # tests (and the processes they spawn) do not inherit a temporary folder
    with mock.patch.dict(os.environ):
        report = bench.main([*SMALL, "--rows", "default,fsattn+compile", "--first-call-only", "--cache-dir",
                             str(tmp_path / "cache")])
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    for row in report["rows"]:
        assert row["first_call_seconds"] > 0 and "forward_seconds" not in row and "step_seconds" not in row
        assert set(row["quality"]) == {"output_cosine"}
    assert report["rows"][1]["dynamo"]["stats.unique_graphs"] == 1


def test_a_budget_skips_the_rows_that_would_not_fit(bench, tmp_path):
    out = tmp_path / "b.json"
    report = bench.main([*SMALL, "--rows", "default,fsattn", "--steps", "1", "--no-decode", "--budget-s", "1e-3",
                         "--out", str(out)])
    first, second = report["rows"]
    assert first["row"] == "default" and "first_call_seconds" in first  # the first row always runs
    assert second["row"] == "fsattn" and "would pass --budget-s" in second["skipped"]
    assert _strict_json(out)["rows"][1]["skipped"] == second["skipped"]


def test_a_fuse_row_that_fused_less_than_an_earlier_one_is_flagged(bench, monkeypatch):
    # CogVideoX after an FP8 row: diffusers' generic fusion cannot copy FP8 weights, so a later
    # row asking for fused QKV runs unfused. Stand-in: the real rows, the second one's count lowered.
    real = bench.run_row

    def run_row(row, *args):
        result = real(row, *args)
        if row.name == "default+fuse":
            result["recipe"]["fused_modules"] = 0
        return result

    rows = ["--rows", "default,fsattn+fuse,default+fuse", "--steps", "1", "--no-decode"]
    report = bench.main([*SMALL, *rows])
    assert [r["recipe"]["fused_modules"] for r in report["rows"][1:]] == [4, 4] and report["warnings"] == []
    monkeypatch.setattr(bench, "run_row", run_row)
    report = bench.main([*SMALL, *rows])
    (warning,) = report["warnings"]
    assert warning.startswith("row default+fuse: 0 attention modules fused against 4 in an earlier row")


def test_row_estimate_adds_the_worst_compile_to_compiled_rows(bench):
    parser = bench.build_parser()
    settings, _, _, _ = bench.resolve_settings(parser, parser.parse_args([*SMALL, "--steps", "3"]))
    done = [{"first_call_seconds": 12.0, "forward_seconds_median": 10.0, "setup_seconds": 1.0,
             "row_parts": {"compile": False}},
            {"first_call_seconds": 70.0, "forward_seconds_median": 8.0, "setup_seconds": 2.0,
             "row_parts": {"compile": True}}]
    assert bench.estimate_row_seconds(bench.parse_row("fsattn"), [], settings, 2) is None
    # slowest forward 10 s; 3 steps x 2 forwards; the compiled row's first call was 62 s more than its forward
    assert bench.estimate_row_seconds(bench.parse_row("fsattn"), done, settings, 2) == 10 + 60 + 2
    assert bench.estimate_row_seconds(bench.parse_row("recipe"), done, settings, 2) == 10 + 62 + 60 + 2


@pytest.mark.slow
def test_a_second_process_reuses_the_first_ones_compiled_artefacts(tmp_path):
    # Inductor (the real backend) on the CPU, twice with one --cache-dir: the second process's
    # graphs come from the FX-graph and AOTAutograd caches.
    cache, results = tmp_path / "cache", []
    for run in ("cold", "warm"):
        out = tmp_path / f"{run}.json"
        args = [a for a in SMALL if a not in ("--compile-backend", "eager")]
        proc = subprocess.run([sys.executable, BENCH, *args, "--rows", "fsattn+compile", "--first-call-only",
                               "--cache-dir", str(cache), "--out", str(out)], capture_output=True, text=True,
                              timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(_strict_json(out)["rows"][0]["dynamo"])
    cold, warm = results
    assert cold["inductor.fxgraph_cache_miss"] >= 1 and cold["inductor.fxgraph_cache_hit"] == 0
    assert warm["inductor.fxgraph_cache_hit"] >= 1 and warm["inductor.fxgraph_cache_miss"] == 0
    assert warm["aot_autograd.autograd_cache_hit"] >= 1


# ----------------------------------------------------------------------------- rows and arguments

@pytest.mark.parametrize("text, parts", [
    ("default", (False, False, False, False, False, False, False)),
    ("default+fuse+fp8+ffn+rope+compile", (False, True, True, False, True, True, True)),
    ("recipe", (True, True, True, False, True, True, True)),
    ("fsattn+fuse+fp8+compile", (True, True, True, False, False, False, True)),
    ("fsattn+compile+fp8", (True, False, True, False, False, False, True)),
    ("fsattn+fuse+fp8c+compile", (True, True, True, True, False, False, True)),
    ("fsattn+rope", (True, False, False, False, False, True, False)),
])
def test_rows_parse_into_attention_and_parts(bench, text, parts):
    row = bench.parse_row(text)
    assert row.name == text and (row.fsattn, row.fuse, row.fp8, row.fp8_conditioning, row.ffn, row.rope,
                                 row.compile) == parts


def test_default_rows_put_the_reference_first_and_fp8_last_or_leave_fp8_out(bench, capsys):
    rows = [r.name for r in bench._rows(",".join(bench.DEFAULT_ROWS))]
    assert rows == ["default", "default+compile", "fsattn", "fsattn+compile", "default+fuse+fp8+ffn+rope+compile",
                    "recipe"]
    parser = bench.build_parser()
    settings, _, _, _ = bench.resolve_settings(parser, parser.parse_args(SMALL))  # on the CPU: no FP8
    assert settings.rows == ["default", "default+compile", "fsattn", "fsattn+compile"]
    assert "default rows ['default+fuse+fp8+ffn+rope+compile', 'recipe'] are left out: the transformer runs on cpu" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("args, message", [
    (["--frames", "8"], "--frames=8: expected 4k+1"),
    (["--height", "60"], "--height=60: expected a multiple of 16"),
    (["--rows", "sdpa"], "row 'sdpa': expected 'default' or 'fsattn'"),
    (["--rows", "fsattn+fast"], "row 'fsattn+fast'"),
    (["--rows", "fsattn,fsattn"], "expected a comma-separated list of distinct rows"),
    (["--rows", "recipe,fsattn+fuse+fp8+ffn+rope+compile"], "distinct rows"),
    (["--rows", "fsattn+ffn+compile"], "ffn only with one of them"),
    (["--model", "wan2.2"], "invalid choice: 'wan2.2'"),
    (["--steps", "0"], "expected an integer >= 1, got '0'"),
    (["--fsattn-config", '{"no_such_field": 1}'], "--fsattn-config="),
    (["--budget-s", "0"], "--budget-s=0.0: expected a positive number"),
    (["--model", "tiny-hunyuanvideo", "--height", "64", "--width", "64", "--frames", "5", "--decode"],
     "tiny-hunyuanvideo is built without a VAE"),
    (["--device", "tpu"], "--device='tpu'"),
    (["--rows", "fsattn+fp8+fp8c"], "fp8 or fp8c, not both"),
    (["--inductor-options", "[1]"], "--inductor-options='[1]': expected a JSON object"),
    (["--inductor-options", "{}", "--compile-mode", "max-autotune"], "one of mode and options, not both"),
])
def test_bad_arguments_name_the_argument_and_what_is_accepted(bench, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
def test_cuda_without_a_gpu_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main([*SMALL, "--device", "cuda"])
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_loops_mirror_the_pipelines_inputs_and_repeat_with_the_seed(bench):
    parser = bench.build_parser()
    settings, _, device, dtype = bench.resolve_settings(parser, parser.parse_args(SMALL))

    class Wan:
        class config:
            text_dim = 32

    a, b = bench.Loop(settings, Wan, device, dtype), bench.Loop(settings, Wan, device, dtype)
    assert a.noise.shape == (1, 16, 3, 8, 12) and a.noise.dtype == torch.float32 and torch.equal(a.noise, b.noise)
    cond, uncond = (c["encoder_hidden_states"] for c in a.conditions)
    assert cond.shape == uncond.shape == (1, 512, 32) and not torch.equal(cond, uncond)
    scheduler = a.scheduler()
    assert len(scheduler.timesteps) == settings.steps and scheduler.config.flow_shift == 3.0
    big, _, _, _ = bench.resolve_settings(parser, parser.parse_args(["--model", "wan2.1-t2v-14b", "--device", "cpu"]))
    assert (big.height, big.width, big.frames, big.video_tokens) == (720, 1280, 81, 75600)
    assert big.latent_shape == (1, 16, 21, 90, 160) and not big.decode
    hy, _, _, _ = bench.resolve_settings(parser, parser.parse_args(["--model", "hunyuanvideo", "--device", "cpu"]))
    assert (hy.height, hy.width, hy.frames, hy.video_tokens) == (720, 1280, 129, 118800)
    assert hy.latent_shape == (1, 16, 33, 90, 160)
    hy_loop = bench.Loop(hy, None, device, dtype)
    (condition,) = hy_loop.conditions  # embedded guidance: one forward per step
    assert condition["encoder_hidden_states"].shape == (1, 256, 4096)
    assert condition["encoder_attention_mask"].sum() == 32 and condition["guidance"].item() == 6000.0
    cog, _, _, _ = bench.resolve_settings(parser, parser.parse_args(["--model", "cogvideox-5b", "--device", "cpu"]))
    # 49 frames at 480x720: 13 latent frames of 30x45 patches (the joint attention adds 226 text tokens).
    assert (cog.height, cog.width, cog.frames, cog.video_tokens) == (480, 720, 49, 17550)
    assert cog.latent_shape == (1, 13, 16, 60, 90)


@pytest.mark.parametrize("name, attention", [
    ("fsattn::attention", True),
    ("aten::scaled_dot_product_attention", True),
    ("aten::_scaled_dot_product_cudnn_attention", True),
    ("aten::_scaled_dot_product_flash_attention", True),
    ("aten::_efficient_attention_forward", True),
    ("aten::linear", False),
    ("aten::_softmax", False),
    ("fsattn::quantize", False),
])
def test_attention_ops_are_recognised_by_name(bench, name, attention):
    assert bool(bench.ATTENTION_OP.match(name)) is attention


@pytest.mark.parametrize("kernel, attention", [
    ("_fsattn_fwd_kernel", True),
    ("_quantize_kv_kernel", True),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", True),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", True),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", True),
    ("triton_poi_fused_add_mul_native_layer_norm_0", False),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", False),
])
def test_attention_kernels_are_recognised_by_name(bench, kernel, attention):
    assert bool(bench.ATTENTION_KERNEL.search(kernel)) is attention


def test_gpu_attention_share_counts_nested_kernels_once_and_skips_annotations(bench):
    # The CUDA branch of attention_share on a hand-built profile (no GPU here): an SDPA call whose
    # cuDNN kernel is launched by a nested op, a GEMM, and a GPU user annotation spanning both.
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def cpu_op(name, start, end, shapes=None, parent=None):
        ev = FunctionEvent(id=start, name=name, thread=1, start_us=start, end_us=end, input_shapes=shapes,
                           use_device="cuda")
        if parent is not None:
            ev.set_cpu_parent(parent)
            parent.append_cpu_child(ev)
        return ev

    def gpu(name, start, end, annotation=False):
        return FunctionEvent(id=start, name=name, thread=7, start_us=start, end_us=end, use_device="cuda",
                             device_type=DeviceType.CUDA, is_user_annotation=annotation)

    qkv = [[1, 2, 72, 64]] * 3
    sdpa = cpu_op("aten::scaled_dot_product_attention", 0, 50, qkv)
    cudnn = cpu_op("aten::_scaled_dot_product_cudnn_attention", 5, 45, qkv, parent=sdpa)
    cudnn.append_kernel("cudnn_generated_fort_native_sdpa_sm90_kernel", 0, 300)
    linear = cpu_op("aten::linear", 60, 80, [[1, 72, 128], [128, 128]])
    linear.append_kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 700)
    events = [sdpa, cudnn, linear, gpu("cudnn_generated_fort_native_sdpa_sm90_kernel", 100, 400),
              gpu("sm90_xmma_gemm_bf16bf16_bf16f32", 400, 1100), gpu("## Call CompiledFxGraph ##", 100, 1100, True)]

    class Profile:
        def events(self):
            return events

    share = bench.attention_share(Profile(), torch.device("cuda"), wall_seconds=0.002, steps=1)
    assert share["attention_seconds_per_step"] == pytest.approx(300e-6)
    assert share["device_seconds_per_step"] == pytest.approx(1000e-6)
    assert share["attention_share"] == pytest.approx(0.3)
    assert share["op_device_time_crosscheck"]["attention_share"] == pytest.approx(0.3)
    assert share["by_kind"] == {"self": {"seconds_per_step": pytest.approx(300e-6), "calls_per_step": 1.0,
                                         "ops": ["aten::scaled_dot_product_attention"]}}
    assert [(k["name"], k["launches_per_step"], k["seconds_per_step"]) for k in share["top_kernels"]] == [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 1.0, pytest.approx(700e-6)),
        ("cudnn_generated_fort_native_sdpa_sm90_kernel", 1.0, pytest.approx(300e-6))]


def test_report_prints_the_lowest_frame_and_the_top_kernels(bench, capsys):
    row = {"row": "recipe", "first_call_seconds": 20.0, "forward_seconds_median": 0.37, "step_seconds_median": 0.74,
           "speedup_per_step": 1.7, "peak_memory_bytes": None,
           "quality": {"output_cosine": 0.9998, "latents_cosine": 0.999, "psnr_db_summary": {"mean": 35.64, "min": 34.19}},
           "attention": {"top_kernels": [{"name": "_fsattn_fwd_gluon_ws_kernel", "launches_per_step": 30.0,
                                          "seconds_per_step": 0.2252}]}}
    report = {"config": {"model": "m", "height": 1, "width": 1, "frames": 1, "video_tokens": 1, "steps": 1},
              "environment": {"gpu": "G", "device": "cuda"}, "rows": [row], "warnings": [], "note": None,
              "timing_note": None}
    bench.print_report(report)
    out = capsys.readouterr().out
    assert "35.6 / 34.2" in out
    assert "recipe: most device time per step: 225.2 ms _fsattn_fwd_gluon_ws_kernel (x30)" in out


def test_json_drops_tensors_and_non_finite_literals(bench):
    row = {"row": "x", "_latents": torch.zeros(2), "psnr": [math.inf, 1.0], "cos": math.nan}
    assert json.loads(json.dumps(bench.json_safe(row), allow_nan=False)) == {"row": "x", "psnr": ["inf", 1.0],
                                                                             "cos": "nan"}
