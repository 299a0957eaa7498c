"""benchmarks/bench_e2e.py on the tiny Wan transformer (CPU: fsattn's emulation), and its pieces.

The script lives in benchmarks/ (not a package): it is imported by path, so that the tests call the
very functions the command line runs. CPU times are meaningless (and the test machine is shared),
so nothing here asserts a speed; only the bookkeeping around the times, the fidelity, the restore
check and the argument errors.
"""

import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks", "bench_e2e.py")
# CPU-quick, on the CPU even where a GPU is present: 9 frames (3 latent frames) of 64x96, 72 tokens.
SMALL = ["--model", "tiny", "--device", "cpu", "--height", "64", "--width", "96", "--frames", "9"]
# The tiny transformer: 2 blocks, each with self- and cross-attention.
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
    """One run of the command line as a user types it: both sides, restore forward check, JSON out."""
    out = tmp_path_factory.mktemp("e2e") / "e2e.json"
    proc = subprocess.run([sys.executable, BENCH, *SMALL, "--steps", "3", "--warmup-steps", "1", "--profile-steps", "1",
                           "--check-restore-forward", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _strict_json(out), proc.stdout


def test_json_records_versions_config_and_every_time(cli_report):
    report, stdout = cli_report
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["diffusers"] and env["triton"]
    assert env["gpu"] is None and env["device"] == "cpu" and env["world_size"] == 1
    cfg = report["config"]
    assert (cfg["model"], cfg["height"], cfg["width"], cfg["frames"]) == ("tiny", 64, 96, 9)
    assert cfg["latent_shape"] == [1, 16, 3, 8, 12] and cfg["video_tokens"] == 3 * 4 * 6
    assert cfg["schedule_steps"] == 1 + 3 + 1 and cfg["flow_shift"] == 3.0 and cfg["guidance_scale"] == 5.0
    assert report["order"] == ["baseline", "fsattn"] and list(report["sides"]) == ["baseline", "fsattn"]
    for side in report["sides"].values():
        steps = side["step_seconds"]
        assert len(steps) == 3 and all(s > 0 for s in steps) and len(side["warmup_step_seconds"]) == 1
        assert side["step_seconds_median"] == pytest.approx(statistics.median(steps), rel=1e-12)
        assert side["step_seconds_mean"] == pytest.approx(statistics.fmean(steps), rel=1e-12)
        assert side["compile_seconds_estimate"] is None  # not compiled
    for text in ("== bench_e2e: tiny 64x96", "speed-up per step (median)", "NOTE: CPU run", "RANDOM weights"):
        assert text in stdout, text


def test_speedup_is_the_ratio_of_the_median_step_times(cli_report):
    report, _ = cli_report
    base, fs = report["sides"]["baseline"], report["sides"]["fsattn"]
    assert report["speedup"] == pytest.approx(base["step_seconds_median"] / fs["step_seconds_median"], rel=1e-12)
    assert report["attention_speedup"] == pytest.approx(
        base["attention"]["attention_seconds_per_step"] / fs["attention"]["attention_seconds_per_step"], rel=1e-12)


def test_cpu_run_has_no_peak_memory_and_no_speed_target(cli_report):
    report, _ = cli_report
    assert all(side["peak_memory_bytes"] is None for side in report["sides"].values())
    assert report["peak_memory_ratio"] is None
    assert report["targets"]["speedup"] is None and report["targets"]["speedup_met"] is None
    assert report["targets"]["peak_memory_met"] is None
    assert "say nothing about GPU speed" in report["timing_note"]


def test_fsattn_side_ran_fsattn_on_every_attention_call_and_stays_close(cli_report):
    report, _ = cli_report
    calls = 3 * 2 * TINY_ATTENTION_MODULES  # timed steps x (cond, uncond) x attention modules
    assert report["sides"]["fsattn"]["fsattn_stats"]["calls"] == {"emulation": calls}
    assert report["sides"]["fsattn"]["fsattn_stats"]["sdpa_fallbacks"] == {}
    assert report["sides"]["baseline"]["fsattn_stats"]["calls"] == {}
    fid = report["fidelity"]
    assert 0 < fid["rel_l1"] < 0.02  # 8-bit attention changes the latents, a little
    assert fid["cosine"] > 0.999 and 40 < fid["psnr_db"] < math.inf
    assert report["warnings"] == []


def test_removing_fsattn_restores_the_processors_and_the_output_bit_for_bit(cli_report):
    report, _ = cli_report
    assert report["restore_check"] == {"processors_restored": True, "backends_reset": True,
                                       "forward_max_abs_difference": 0.0, "forward_identical": True}


def test_attention_share_counts_each_call_once_by_kind(cli_report):
    report, _ = cli_report
    ops = {"baseline": "aten::scaled_dot_product_attention", "fsattn": "fsattn::attention"}
    for name, side in report["sides"].items():
        attention = side["attention"]
        assert attention["profiled_steps"] == 1
        assert set(attention["by_kind"]) == {"self", "cross"}
        for row in attention["by_kind"].values():
            assert row["calls_per_step"] == 2 * TINY_ATTENTION_MODULES // 2  # 2 forwards x 2 blocks
            assert row["ops"] == [ops[name]]
        total = sum(row["seconds_per_step"] for row in attention["by_kind"].values())
        assert attention["attention_seconds_per_step"] == pytest.approx(total, rel=1e-9)
        assert 0 < attention["attention_share"] < 1


def test_side_order_does_not_change_what_is_compared(bench, cli_report, tmp_path):
    # Same weights, noise and prompts on both sides whatever runs first: the same fidelity. The same
    # 5-step schedule as the command-line run, split differently into warm-up and timed steps.
    report = bench.main([*SMALL, "--steps", "1", "--warmup-steps", "3", "--profile-steps", "1",
                         "--sides", "fsattn,baseline", "--out", str(tmp_path / "r.json")])
    assert report["order"] == ["fsattn", "baseline"] and list(report["sides"]) == ["fsattn", "baseline"]
    assert report["fidelity"] == pytest.approx(cli_report[0]["fidelity"], rel=1e-6)
    assert report["restore_check"]["processors_restored"]


def test_backend_route_gives_the_same_latents_and_resets_the_backend(bench, cli_report):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    report = bench.main([*SMALL, "--steps", "3", "--warmup-steps", "1", "--profile-steps", "1",
                         "--fsattn-via", "backend"])
    assert report["config"]["fsattn_via"] == "backend"
    assert report["sides"]["fsattn"]["label"] == "fsattn via set_attention_backend('fsattn')"
    assert report["sides"]["fsattn"]["fsattn_stats"]["calls"] == {"emulation": 3 * 2 * TINY_ATTENTION_MODULES}
    assert report["fidelity"] == pytest.approx(cli_report[0]["fidelity"], rel=1e-6)
    assert report["restore_check"] == {"processors_restored": True, "backends_reset": True}
    assert _AttentionBackendRegistry.get_active_backend()[0].value == "native"


def test_compile_recompiles_once_for_fsattn_and_keeps_the_output(bench, cli_report):
    torch._dynamo.reset()
    try:
        report = bench.main([*SMALL, "--steps", "1", "--warmup-steps", "1", "--profile-steps", "0", "--compile",
                             "--compile-backend", "eager"])
    finally:
        torch._dynamo.reset()
    for side in report["sides"].values():
        assert side["graphs_compiled_in_warmup"] == 1  # the baseline's graph; then fsattn's, after apply_fsattn
        assert side["compile_seconds_estimate"] is not None and side["attention"] is None
    assert report["sides"]["fsattn"]["fsattn_stats"]["calls"] == {"emulation": 2 * TINY_ATTENTION_MODULES}
    assert report["fidelity"]["cosine"] > 0.999 and report["fidelity"]["rel_l1"] > 0
    assert report["restore_check"]["processors_restored"]


def test_one_side_alone_reports_no_comparison(bench):
    report = bench.main([*SMALL, "--steps", "1", "--warmup-steps", "0", "--profile-steps", "0", "--sides", "baseline"])
    assert list(report["sides"]) == ["baseline"]
    assert report["speedup"] is None and report["fidelity"] is None and report["restore_check"] is None
    assert report["sides"]["baseline"]["attention"] is None


@pytest.mark.parametrize("args, message", [
    (["--frames", "8"], "--frames=8: expected 4k+1"),
    (["--height", "60"], "--height=60: expected a multiple of 16"),
    (["--sides", "baseline,baseline"], "non-repeating list of baseline, fsattn"),
    (["--sides", "sdpa"], "non-repeating list of baseline, fsattn"),
    (["--model", "wan2.2"], "invalid choice: 'wan2.2'"),
    (["--steps", "0"], "expected an integer >= 1, got '0'"),
    (["--compile", "--warmup-steps", "0"], "--warmup-steps=0 with --compile: expected at least 1"),
    (["--schedule-steps", "2"], "--schedule-steps=2 is shorter than the 5 steps run"),
    (["--ulysses-degree", "2"], "context parallelism needs CUDA GPUs"),
    (["--fsattn-config", '{"no_such_field": 1}'], "--fsattn-config="),
    (["--device", "tpu"], "--device='tpu'"),
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


@pytest.mark.parametrize("model, height, width, speedup, memory, met", [
    ("wan2.1-t2v-1.3b", 480, 832, 1.31, 1.05, (1.3, True, True)),
    ("wan2.1-t2v-1.3b", 480, 832, 1.29, 1.11, (1.3, False, False)),
    ("wan2.1-t2v-14b", 720, 1280, 1.39, 1.0, (1.4, False, True)),
    ("wan2.1-t2v-14b", 480, 832, 2.0, 1.0, (None, None, True)),  # no target at other sizes
])
def test_targets_apply_at_their_model_and_size(bench, model, height, width, speedup, memory, met):
    parser = bench.build_parser()
    settings, _, _ = bench.resolve_settings(parser, parser.parse_args(SMALL))
    settings = dataclasses.replace(settings, model=model, height=height, width=width)
    targets = bench.evaluate_targets(settings, torch.device("cuda"), speedup, memory)
    assert (targets["speedup"], targets["speedup_met"], targets["peak_memory_met"]) == met
    assert bench.evaluate_targets(settings, torch.device("cpu"), speedup, None)["speedup"] is None


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


def test_fidelity_of_identical_latents_is_infinite_psnr_and_json_safe(bench):
    latents = torch.randn(1, 16, 3, 8, 12)
    fid = bench.fidelity(latents.clone(), latents)
    assert fid["psnr_db"] == math.inf and fid["cosine"] == pytest.approx(1.0) and fid["rel_l1"] == 0.0
    assert json.loads(json.dumps(bench.json_safe(fid), allow_nan=False))["psnr_db"] == "inf"
    shifted = bench.fidelity(latents + 0.01, latents)
    expected = 20 * math.log10(float(latents.max() - latents.min()) / 0.01)
    assert shifted["psnr_db"] == pytest.approx(expected, rel=1e-4)


def test_inputs_mirror_wan_pipeline_shapes_and_repeat_with_the_seed(bench):
    parser = bench.build_parser()
    settings, device, dtype = bench.resolve_settings(parser, parser.parse_args(SMALL))
    a = bench.make_inputs(settings, 32, device, dtype)
    b = bench.make_inputs(settings, 32, device, dtype)
    assert a.latents.shape == (1, 16, 3, 8, 12) and a.latents.dtype == torch.float32
    assert a.prompt_embeds.shape == a.negative_prompt_embeds.shape == (1, 512, 32)
    assert torch.equal(a.latents, b.latents) and not torch.equal(a.prompt_embeds, a.negative_prompt_embeds)
    scheduler = bench.make_scheduler(settings, device)
    assert len(scheduler.timesteps) == settings.schedule_steps and scheduler.config.flow_shift == 3.0
    big, _, _ = bench.resolve_settings(parser, parser.parse_args(["--model", "wan2.1-t2v-14b", "--device", "cpu"]))
    assert (big.height, big.width, big.frames, big.flow_shift) == (720, 1280, 81, 5.0)
    assert big.latent_shape == (1, 16, 21, 90, 160) and big.video_tokens == 75600


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
