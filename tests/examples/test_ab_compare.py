"""examples/ab_compare.py end to end on the built-in `tiny` pipeline (CPU), and its pieces."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "examples")
# CPU-quick, on the CPU even where a GPU is present: 9 frames (3 latent frames) of 64x96.
SMALL = ["--device", "cpu", "--height", "64", "--width", "96", "--num-frames", "9"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _strict_json(path):
    """The report, refusing NaN/Infinity literals (other tools cannot read them)."""
    def refuse(token):
        raise ValueError(f"non-standard JSON literal {token}")
    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def test_identical_configurations_give_infinite_psnr_and_ssim_one(ab_compare, read_video, tmp_path):
    report = ab_compare.main([*SMALL, "--steps", "2", "--baseline", "sdpa", "--candidate", "sdpa",
                              "--output-dir", str(tmp_path)])
    saved = _strict_json(tmp_path / "report.json")
    video = saved["video"]
    assert video["frames"] == 9 and video["psnr_db"] == ["inf"] * 9
    assert video["ssim"] == pytest.approx([1.0] * 9, abs=1e-12)
    assert saved["latent_error"]["rel_l1"] == 0.0
    assert report["video"]["psnr_db_summary"]["min"] == math.inf
    frames = read_video(str(tmp_path / "side_by_side.mp4"))
    assert len(frames) == 9 and frames[0].shape == (64, 3 * 96, 3)  # baseline | candidate | difference
    assert frames[0][:, 2 * 96:].max() <= 8  # the difference panel is black, but for H.264's rounding


def test_command_line_sdpa_vs_fsattn_reports_metrics_timings_and_attention_error(read_video, tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "ab_compare.py"), *SMALL, "--steps", "2", "--output-dir",
         str(tmp_path), "--attention-report", "--report-steps", "first,last"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in ("A/B comparison: tiny", "speed-up", "PSNR dB mean/min", "SSIM mean/min", "LPIPS",
                 "NOTE: built-in model 'tiny' has RANDOM weights", "attention blocks.0.attn1 step 0"):
        assert text in proc.stdout, text
    report = _strict_json(tmp_path / "report.json")
    assert report["baseline"]["label"] == "sdpa" and report["candidate"]["label"] == "fsattn"
    assert sum(report["candidate"]["fsattn_stats"]["calls"].values()) == 16  # 2 steps x 2 passes x 4 layers
    assert report["baseline"]["fsattn_stats"]["calls"] == {}
    # Each speed-up is the baseline's time over the candidate's, as both sides report them.
    base, cand = report["baseline"], report["candidate"]
    for key, seconds in (("per_step", "step_seconds_steady_mean"), ("denoise", "denoise_seconds"),
                         ("total", "total_seconds")):
        assert base[seconds] > 0 and cand[seconds] > 0
        assert report["speedup"][key] == pytest.approx(base[seconds] / cand[seconds], rel=1e-9)
    assert f"speed-up {report['speedup']['per_step']:.2f}x" in proc.stdout
    video = report["video"]
    psnr = np.array(video["psnr_db"], dtype=float)
    assert len(psnr) == 9 and np.isfinite(psnr).all()  # 8-bit attention does change the output ...
    assert psnr.min() > 15  # ... but not into a different video
    assert 0.3 < min(video["ssim"]) < 1.0
    if video["lpips"] is None:
        assert video["lpips_message"].startswith("LPIPS skipped:")
    rows = report["attention_report"]
    # Default layers: first and last of each kind (blocks.#.attn1, blocks.#.attn2); steps 0 and 1.
    assert sorted({(r["layer"], r["step"]) for r in rows}) == sorted(
        (layer, step) for layer in ("blocks.0.attn1", "blocks.1.attn1", "blocks.0.attn2", "blocks.1.attn2")
        for step in (0, 1))
    for row in rows:
        assert 0.99 < row["fsattn"]["cosine"] < 1.0 and 0 < row["fsattn"]["rel_l1"] < 0.1
        assert row["sdpa"]["cosine"] > 0.999999  # float32 SDPA is the yardstick: far closer
    self_attn = next(r for r in rows if r["layer"] == "blocks.0.attn1")
    assert self_attn["shape_q"] == self_attn["shape_k"] == [1, 3 * 4 * 6, 2, 64]  # 3 latent frames of 4x6 patches
    cross = next(r for r in rows if r["layer"] == "blocks.0.attn2")
    assert cross["shape_k"][1] == 512  # Wan's 512 text tokens
    assert len(read_video(str(tmp_path / "side_by_side.mp4"))) == 9
    assert (tmp_path / "metrics.png").read_bytes()[:8] == PNG_MAGIC


def test_hunyuanvideo_attention_report_sees_the_key_padding_mask(ab_compare, tmp_path):
    report = ab_compare.main(["--model", "tiny-hunyuanvideo", "--device", "cpu", "--height", "64", "--width", "64",
                              "--num-frames", "5", "--steps", "2", "--output-dir", str(tmp_path), "--attention-report",
                              "--report-steps", "last"])
    assert report["video"] is None and report["latent_error"]["cosine"] > 0.999
    assert "emulation" in report["timing_note"]
    tokens = 2 * 4 * 4 + 256  # 2 latent frames of 4x4 patches, then the 256 text tokens
    rows = report["attention_report"]
    assert {r["layer"] for r in rows} == {"transformer_blocks.0.attn", "single_transformer_blocks.0.attn"}
    for row in rows:
        assert row["step"] == 1 and row["mask"] == [1, 1, 1, tokens] and row["shape_k"][1] == tokens
        assert 0.99 < row["fsattn"]["cosine"] < 1.0
    # The token refiner's processor calls SDPA itself, past the hook: reported as missed, not dropped.
    assert report["attention_report_missed_layers"] == ["context_embedder.token_refiner.refiner_blocks.0.attn"]


def test_a_known_perturbation_gives_the_expected_psnr(ab_compare):
    rng = np.random.default_rng(0)
    base = rng.integers(20, 200, size=(4, 16, 24, 3), dtype=np.uint8)
    cand = base + np.uint8(4)
    result = ab_compare.compare_videos(base, cand)
    assert result["psnr_db"] == pytest.approx([20 * math.log10(255 / 4)] * 4, abs=1e-9)
    assert all(0 < s < 1 for s in result["ssim"])
    panel = ab_compare.side_by_side(base, cand, gain=10.0)
    assert panel.shape == (4, 16, 72, 3)
    assert (panel[..., 48:, :] == 40).all()  # |difference| 4, amplified 10x
    assert (ab_compare.side_by_side(base, base + np.uint8(30), gain=10.0)[..., 48:, :] == 255).all()  # clipped


def test_metrics_plot_is_written_even_with_infinite_psnr(ab_compare, tmp_path):
    comparison = {"psnr_db": [math.inf, 42.0, 38.5], "ssim": [1.0, 0.99, 0.98], "lpips": None}
    path = ab_compare.plot_metrics(comparison, str(tmp_path / "m.png"), "test")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 500 and height > 300  # two panels


def test_default_report_layers_take_first_and_last_of_each_kind(ab_compare):
    wan = [f"blocks.{i}.attn{j}" for i in range(30) for j in (1, 2)]
    assert ab_compare.default_report_layers(wan) == ["blocks.0.attn1", "blocks.29.attn1", "blocks.0.attn2",
                                                     "blocks.29.attn2"]
    hunyuan = ["context_embedder.token_refiner.refiner_blocks.0.attn", "transformer_blocks.0.attn",
               "transformer_blocks.1.attn", "single_transformer_blocks.0.attn"]
    assert ab_compare.default_report_layers(hunyuan) == hunyuan


def test_report_steps_resolve_names_and_refuse_bad_ones(ab_compare):
    assert ab_compare.resolve_report_steps("first,middle,last", 10) == [0, 5, 9]
    assert ab_compare.resolve_report_steps("3,first,3", 10) == [0, 3]
    with pytest.raises(SystemExit, match="step 10 is outside 0..9"):
        ab_compare.resolve_report_steps("10", 10)
    with pytest.raises(SystemExit, match="'soon' is not first, middle, last"):
        ab_compare.resolve_report_steps("soon", 10)


# ----------------------------------------------------------------------------- the recipe, and a bare install

def test_bare_install_compares_without_scikit_image_or_matplotlib(ab_compare, monkeypatch, tmp_path, capsys):
    # `pip install -e .` brings neither: PSNR/SSIM are fsattn_diffusers.metrics' own, and the plot is
    # skipped with one line saying how to get it. The candidate runs two parts of the recipe.
    for name in ("skimage", "skimage.metrics", "matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)
    report = ab_compare.main([*SMALL, "--steps", "2", "--fuse-qkv", "--compile", "--compile-backend", "eager",
                              "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "matplotlib is not installed, so metrics.png is not written (pip install matplotlib)" in err
    assert not (tmp_path / "metrics.png").exists() and "plot" not in report["outputs"]
    saved = _strict_json(tmp_path / "report.json")
    assert saved["plot_note"].startswith("matplotlib is not installed")
    assert len(saved["video"]["ssim"]) == 9 and 0.9 < min(saved["video"]["ssim"]) < 1.0
    assert (tmp_path / "side_by_side.mp4").exists()
    assert saved["baseline"]["label"] == "sdpa+compile" and saved["candidate"]["label"] == "fsattn+fused-qkv+compile"
    assert saved["candidate"]["recipe"] == {"transformer": {"fused_modules": 4, "fp8_linear_layers": 0,
                                                            "fused_feed_forwards": 0, "compiled_modules": 2,
                                                            "dynamic": None}}
    assert saved["baseline"]["recipe"]["transformer"]["fused_modules"] == 0  # --compile alone on the baseline
    assert sum(saved["candidate"]["fsattn_stats"]["calls"].values()) == 16  # compiled, still every call on fsattn
    assert saved["latent_error"]["cosine"] > 0.999


@pytest.mark.parametrize("args, match", [
    (["--recipe"], r"--fp8-linear \(also part of --recipe\): the transformer runs on cpu"),
    (["--fp8-linear"], r"--fp8-linear \(also part of --recipe\): the transformer runs on cpu"),
    (["--recipe", "--candidate", "sdpa"], "cannot be combined with --candidate sdpa"),
    (["--fsattn-config", "{}"], "takes --baseline-config / --candidate-config, not --fsattn-config"),
])
def test_what_cannot_run_is_refused_before_any_model_is_loaded(ab_compare, monkeypatch, args, match):
    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(ab_compare.gv, "load_model", load_model)
    with pytest.raises(SystemExit, match=match):
        ab_compare.main([*SMALL, *args])


def test_help_lists_the_two_configs_not_generate_videos_one(ab_compare, capsys):
    with pytest.raises(SystemExit):
        ab_compare.main(["--help"])
    shown = capsys.readouterr().out
    assert "--baseline-config" in shown and "--candidate-config" in shown and "--fsattn-config" not in shown


def test_a_missing_video_writer_is_refused_before_any_model_is_loaded(ab_compare, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    monkeypatch.setitem(sys.modules, "cv2", None)
    monkeypatch.setattr(ab_compare.gv, "load_model", lambda *a, **k: pytest.fail("loaded before the refusal"))
    with pytest.raises(SystemExit, match=r"needs imageio-ffmpeg \(pip install imageio-ffmpeg\) or OpenCV.*--no-decode"):
        ab_compare.main([*SMALL])
