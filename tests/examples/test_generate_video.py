"""examples/generate_video.py end to end on the built-in `tiny` pipeline (CPU)."""

import argparse
import json
import os
import subprocess
import sys
import types

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "examples")
# CPU-quick, on the CPU even where a GPU is present: 9 frames (3 latent frames) of 64x96.
SMALL = ["--device", "cpu", "--height", "64", "--width", "96", "--num-frames", "9"]


def test_sdpa_run_writes_the_video_and_a_summary(generate_video, read_video, tmp_path):
    out, summary_path = tmp_path / "v.mp4", tmp_path / "summary.json"
    summary = generate_video.main([*SMALL, "--steps", "2", "--attention", "sdpa", "--output", str(out),
                                   "--summary-json", str(summary_path)])
    frames = read_video(str(out))
    assert len(frames) == 9 and frames[0].shape == (64, 96, 3)
    saved = json.loads(summary_path.read_text())
    assert saved["output"] == str(out) and saved["frames_written"] == 9
    assert saved["random_weights"] is True and "noise-like" in saved["note"]
    assert len(saved["step_seconds"]) == 2 and all(t > 0 for t in saved["step_seconds"])
    assert saved["total_seconds"] >= saved["denoise_seconds"] > 0
    assert saved["attention"].startswith("sdpa") and saved["fsattn_stats"]["calls"] == {}
    assert saved["peak_gpu_bytes"] is None and saved["device"] == "cpu" and saved["dtype"] == "float32"
    assert summary["step_seconds"] == saved["step_seconds"]


def test_command_line_fsattn_run_counts_fsattn_calls_and_prints_the_summary(read_video, tmp_path):
    out, summary_path = tmp_path / "fs.mp4", tmp_path / "fs.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "generate_video.py"), *SMALL, "--steps", "2",
         "--attention", "fsattn", "--output", str(out), "--summary-json", str(summary_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("time per step", "time in total", "attention", "speculative-max fallbacks", "peak GPU memory",
                 "RANDOM WEIGHTS"):
        assert line in proc.stdout
    assert str(out) in proc.stdout
    assert len(read_video(str(out))) == 9
    saved = json.loads(summary_path.read_text())
    assert saved["attention"].startswith("fsattn")
    stats = saved["fsattn_stats"]
    # 2 steps x 2 passes (classifier-free guidance) x 2 blocks x (self + cross) = 16 calls.
    assert sum(stats["calls"].values()) == 16 and stats["q_tiles"] > 0
    assert 0 <= stats["fallback_q_tiles"] <= stats["q_tiles"]


def test_no_decode_times_the_denoising_loop_only(generate_video, tmp_path):
    summary = generate_video.main([*SMALL, "--steps", "3", "--attention", "sdpa", "--no-decode",
                                   "--output", str(tmp_path / "none.mp4")])
    assert summary["output"] is None and summary["frames_written"] is None
    assert not (tmp_path / "none.mp4").exists()
    assert len(summary["step_seconds"]) == 3


def test_fsattn_config_json_reaches_the_run(generate_video):
    config = generate_video.parse_fsattn_config('{"pv_format": "16bit", "max_threshold": 2.0}')
    assert config.pv_format == "16bit" and config.max_threshold == 2.0
    assert generate_video.short_label("fsattn", config) == "fsattn[pv_format='16bit', max_threshold=2.0]"
    assert generate_video.short_label("fsattn", None) == "fsattn"


@pytest.mark.parametrize("text,match", [("{not json", "neither a JSON object"), ("[1, 2]", "JSON object"),
                                        ('{"no_such_field": 1}', "no_such_field")])
def test_bad_fsattn_config_is_refused_naming_the_option(generate_video, text, match):
    with pytest.raises(SystemExit, match=match) as info:
        generate_video.parse_fsattn_config(text)
    assert "--fsattn-config" in str(info.value)


def test_an_unloadable_model_names_the_option_and_the_builtins(generate_video, tmp_path):
    with pytest.raises(SystemExit) as info:
        generate_video.main(["--model", str(tmp_path), "--attention", "sdpa"])  # a folder with no pipeline
    message = str(info.value)
    assert f"--model={str(tmp_path)!r}" in message and "tiny" in message and "from_pretrained failed" in message


def test_bad_numbers_are_refused_by_the_parser(generate_video, capsys):
    with pytest.raises(SystemExit):
        generate_video.main(["--steps", "0"])
    assert "expected an integer >= 1, got '0'" in capsys.readouterr().err


def test_hunyuanvideo_builtin_without_vae_stops_at_latents(generate_video, tmp_path):
    summary = generate_video.main(["--model", "tiny-hunyuanvideo", "--device", "cpu", "--height", "64",
                                   "--width", "64", "--num-frames", "5", "--steps", "2", "--attention", "sdpa",
                                   "--output", str(tmp_path / "h.mp4")])
    assert summary["family"] == "hunyuanvideo" and summary["output"] is None
    assert len(summary["step_seconds"]) == 2 and not (tmp_path / "h.mp4").exists()


# ----------------------------------------------------------------------------- context parallelism


def test_parallel_degrees_of_one_outside_torchrun_mean_a_plain_run(generate_video):
    assert generate_video.check_parallel_args(1, 1, "fsattn", environ={}) is None


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2)])
def test_parallel_degrees_without_torchrun_are_refused_with_the_command_to_use(generate_video, ulysses, ring):
    with pytest.raises(SystemExit) as info:
        generate_video.check_parallel_args(ulysses, ring, "fsattn", environ={})
    message = str(info.value)
    assert "not launched by torchrun" in message and "torchrun --nproc-per-node 2" in message
    assert f"--ulysses-degree={ulysses} x --ring-degree={ring} = 2" in message


@pytest.mark.parametrize("ulysses, ring, world", [(2, 1, 4), (2, 2, 2), (1, 1, 2)])
def test_parallel_degrees_must_multiply_to_the_world_size(generate_video, ulysses, ring, world):
    with pytest.raises(SystemExit, match=f"= {ulysses * ring}, but it runs {world} processes"):
        generate_video.check_parallel_args(ulysses, ring, "fsattn", environ={"WORLD_SIZE": str(world)})


def test_parallel_launch_reads_torchrun_ranks(generate_video):
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
    parallel = generate_video.check_parallel_args(2, 2, "fsattn", environ=env)
    assert (parallel.rank, parallel.local_rank, parallel.world_size) == (3, 1, 4)
    assert (parallel.ulysses_degree, parallel.ring_degree) == (2, 2) and not parallel.is_main
    assert generate_video.check_parallel_args(2, 1, "sdpa", environ={"WORLD_SIZE": "2"}).is_main


def test_ring_with_sdpa_is_refused_naming_the_alternatives(generate_video):
    with pytest.raises(SystemExit, match="native attention cannot run ring attention.*--attention fsattn"):
        generate_video.check_parallel_args(1, 2, "sdpa", environ={"WORLD_SIZE": "2"})


@pytest.mark.parametrize("flag", [["--ulysses-degree", "0"], ["--ring-degree", "-1"]])
def test_parallel_degrees_below_one_are_refused_by_the_parser(generate_video, flag, capsys):
    with pytest.raises(SystemExit):
        generate_video.main([*SMALL, *flag])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_summary_prints_every_rank_time(generate_video, capsys):
    summary = {
        "model": "tiny", "random_weights": False, "num_frames": 9, "height": 64, "width": 96, "steps": 2,
        "guidance_scale": 5.0, "seed": 0, "device": "cuda:0", "gpu": None, "dtype": "bfloat16", "attention": "fsattn",
        "step_seconds": [1.0, 1.0], "step_seconds_mean": 1.0, "step_seconds_median": 1.0,
        "step_seconds_steady_mean": 1.0, "total_seconds": 2.5, "prepare_seconds": 0.2, "denoise_seconds": 2.0,
        "decode_seconds": 0.3, "fsattn_stats": {}, "peak_gpu_bytes": None, "output": None, "note": None,
        "parallel": {"world_size": 2, "ulysses_degree": 2, "ring_degree": 1, "rank_total_seconds": [2.5, 2.75],
                     "rank_denoise_seconds": [2.0, 2.25]},
    }
    generate_video.print_summary(summary)
    out = capsys.readouterr().out
    assert "2 GPUs: ulysses 2 x ring 1" in out
    assert "rank 0 2.50 s, rank 1 2.75 s; slowest 2.75 s" in out


# ----------------------------------------------------------------------------- the recipe's parts


def test_recipe_parts_run_and_are_reported(generate_video, tmp_path):
    summary = generate_video.main([*SMALL, "--steps", "2", "--fuse-qkv", "--compile", "--compile-backend", "eager",
                                   "--dynamic", "false", "--no-decode"])
    assert summary["recipe"] == {"transformer": {"fused_modules": 4, "fp8_linear_layers": 0,
                                                 "fused_feed_forwards": 0, "compiled_modules": 2, "dynamic": False}}
    assert sum(summary["fsattn_stats"]["calls"].values()) == 16  # compiled and fused, every call still on fsattn
    plain = generate_video.main([*SMALL, "--steps", "2", "--no-decode"])
    assert plain["recipe"] is None


@pytest.mark.parametrize("args, match", [
    (["--recipe"], r"--fp8-linear \(also part of --recipe\): the transformer runs on cpu.*--fuse-qkv --compile"),
    (["--recipe", "--attention", "sdpa"], "--recipe runs fsattn"),
    (["--fp8-conditioning", "--compile"], "--fp8-conditioning adds the cross-attention's K/V and output projections to --fp8-linear's layers"),
])
def test_recipe_that_cannot_run_is_refused_before_loading(generate_video, monkeypatch, args, match):
    monkeypatch.setattr(generate_video, "load_model", lambda *a, **k: pytest.fail("loaded before the refusal"))
    with pytest.raises(SystemExit, match=match):
        generate_video.main([*SMALL, *args])


def test_fp8_conditioning_reaches_apply_recipe(generate_video, monkeypatch):
    seen = []
    monkeypatch.setattr(generate_video.fsattn_diffusers, "apply_recipe", lambda pipe, **kwargs: seen.append(kwargs))
    args = argparse.Namespace(recipe=True, fuse_qkv=False, fp8_linear=False, fp8_conditioning=True, compile=False,
                              dynamic="auto", compile_backend="inductor")
    parts = generate_video.recipe_parts(args)
    assert parts.label() == "+fused-qkv+fp8+fp8-conditioning+compile"
    loaded = types.SimpleNamespace(pipe=object())
    monkeypatch.setattr(generate_video, "clear_attention", lambda loaded: None)
    generate_video.set_up(loaded, "fsattn", None, {}, parts)
    assert seen[0]["fp8_linear"] is True and seen[0]["fp8_conditioning"] is True


def test_fp8_needs_bf16(generate_video, monkeypatch):
    from fsattn_diffusers import recipe

    monkeypatch.setattr(recipe, "fp8_unavailable_reason", lambda device: None)  # as on an FP8-capable GPU
    parts = generate_video.RecipeParts(fp8_linear=True)
    import torch

    with pytest.raises(SystemExit, match="--fp8-linear needs the transformer in bfloat16.*--dtype float16"):
        generate_video.check_recipe_parts(parts, torch.device("cuda"), torch.float16)
    generate_video.check_recipe_parts(parts, torch.device("cuda"), torch.bfloat16)


def _defaults_args():
    return argparse.Namespace(prompt="a prompt", negative_prompt=None, height=None, width=None, num_frames=None,
                              steps=None, guidance_scale=None, seed=0, fps=None, no_decode=True)


def test_a_cogvideox_checkpoint_gets_the_size_its_config_names(generate_video, monkeypatch):
    # CogVideoX1.5's checkpoints name other sizes than 1.0's, so the size must come from the
    # config, not a table. The tiny built-in stands in for what from_pretrained would return.
    import diffusers
    import torch
    from fsattn_diffusers import builtin_models

    pipe = builtin_models.build_pipeline("tiny-cogvideox", torch.device("cpu"), torch.float32)
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", classmethod(lambda cls, *a, **k: pipe))
    loaded = generate_video.load_model("THUDM/CogVideoX1.5-5B", torch.device("cpu"), torch.float32)
    assert loaded.family == "cogvideox" and not loaded.random_weights
    settings = generate_video.resolve_settings(_defaults_args(), loaded)
    config = loaded.pipe.transformer.config
    assert (settings.height, settings.width, settings.num_frames) == (
        config.sample_height * 8, config.sample_width * 8, config.sample_frames)  # 8: no VAE, the pipeline's factor
    assert (settings.height, settings.width) != (480, 720)


def test_an_image_to_video_pipeline_is_refused_naming_its_input(generate_video, monkeypatch):
    import diffusers
    import torch

    class CogVideoXImageToVideoPipeline:
        def __call__(self, image, prompt=None, height=None):
            raise AssertionError("called")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained",
                        classmethod(lambda cls, *a, **k: CogVideoXImageToVideoPipeline()))
    with pytest.raises(SystemExit, match=r"needs image as input; .*text prompt only"):
        generate_video.load_model("THUDM/CogVideoX-5b-I2V", torch.device("cpu"), torch.float32)
