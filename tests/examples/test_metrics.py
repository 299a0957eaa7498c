"""fsattn_diffusers.metrics: against closed-form values and against scikit-image itself."""

import math
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from fsattn_diffusers import metrics


def _video(frames=3, height=24, width=20, channels=3, seed=0, low=10, high=240):
    rng = np.random.default_rng(seed)
    return rng.integers(low, high, size=(frames, height, width, channels), dtype=np.uint8)


@pytest.mark.parametrize("offset", [1, 3, 10])
def test_constant_offset_on_8bit_frames_gives_20log10_255_over_d(offset):
    ref = _video()
    test = (ref.astype(np.int16) + offset).astype(np.uint8)  # no wrap: values stay below 250
    got = metrics.psnr_per_frame(ref, test)
    assert got.shape == (3,)
    np.testing.assert_allclose(got, 20 * math.log10(255 / offset), rtol=0, atol=1e-9)


def test_per_frame_offsets_give_per_frame_psnr():
    ref = _video(frames=4, high=200)  # + 17 stays below 256
    offsets = np.array([1, 2, 5, 17])
    test = (ref.astype(np.int16) + offsets[:, None, None, None]).astype(np.uint8)
    np.testing.assert_allclose(metrics.psnr_per_frame(ref, test), 20 * np.log10(255 / offsets), atol=1e-9)


def test_float_frames_use_range_one():
    ref = np.full((2, 8, 8, 3), 0.5, dtype=np.float32)
    test = ref + np.float32(0.01)
    np.testing.assert_allclose(metrics.psnr_per_frame(ref, test), 40.0, atol=1e-4)
    # The same frames with a stated range of 2 are 20*log10(2) dB better.
    np.testing.assert_allclose(metrics.psnr_per_frame(ref, test, data_range=2.0), 40.0 + 20 * math.log10(2), atol=1e-4)


def test_identical_frames_give_infinite_psnr_and_ssim_one_without_warnings():
    ref = _video()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # skimage would warn about dividing by zero
        psnr = metrics.psnr_per_frame(ref, ref.copy())
        ssim = metrics.ssim_per_frame(ref, ref.copy())
    assert np.isinf(psnr).all() and (psnr > 0).all()
    np.testing.assert_allclose(ssim, 1.0, rtol=0, atol=1e-12)


def test_psnr_and_ssim_match_scikit_image_frame_by_frame():
    ref = _video(seed=1)
    rng = np.random.default_rng(2)
    test = np.clip(ref.astype(np.int16) + rng.integers(-20, 21, size=ref.shape), 0, 255).astype(np.uint8)
    psnr = metrics.psnr_per_frame(ref, test)
    ssim = metrics.ssim_per_frame(ref, test)
    for i in range(ref.shape[0]):
        assert psnr[i] == pytest.approx(peak_signal_noise_ratio(ref[i], test[i], data_range=255), abs=1e-12)
        assert ssim[i] == pytest.approx(
            structural_similarity(ref[i], test[i], data_range=255, channel_axis=-1), abs=1e-12)
    assert 0.0 < ssim.max() < 1.0


@pytest.mark.parametrize("channels, dtype", [(3, np.float32), (1, np.float64), (3, np.uint8)])
def test_ssim_matches_scikit_image_on_structured_frames(channels, dtype):
    # Smooth gradients plus noise (not only noise): the means, variances and covariance of the
    # windows all vary over the frame, and the frame is larger than a few windows.
    rng = np.random.default_rng(4)
    yy, xx = np.mgrid[0:40, 0:56] / 56.0
    base = (0.5 + 0.4 * np.sin(6 * xx + 3 * yy))[None, ..., None] * np.ones((2, 1, 1, channels))
    ref = np.clip(base + 0.05 * rng.standard_normal(base.shape), 0, 1)
    test = np.clip(ref + 0.08 * rng.standard_normal(ref.shape) + 0.02, 0, 1)
    if dtype == np.uint8:
        ref, test = metrics.to_uint8(ref), metrics.to_uint8(test)
    else:
        ref, test = ref.astype(dtype), test.astype(dtype)
    data_range = 255 if dtype == np.uint8 else 1.0
    got = metrics.ssim_per_frame(ref, test)
    # scikit-image computes float32 frames in float32, metrics always in float64.
    tol = 1e-6 if dtype == np.float32 else 1e-10
    for i in range(2):
        want = structural_similarity(ref[i], test[i], data_range=data_range, channel_axis=-1)
        assert got[i] == pytest.approx(want, abs=tol)
        psnr = peak_signal_noise_ratio(ref[i], test[i], data_range=data_range)
        assert metrics.psnr_per_frame(ref, test)[i] == pytest.approx(psnr, abs=tol)
    assert 0.2 < got.min() < 0.99


def test_psnr_and_ssim_need_no_scikit_image(monkeypatch):
    # `pip install -e .` installs no scikit-image; the examples' A/B comparison must still score videos.
    for name in ("skimage", "skimage.metrics"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import skimage...` raise ImportError
    ref = _video(seed=5)
    test = (ref.astype(np.int16) + 2).astype(np.uint8)
    np.testing.assert_allclose(metrics.psnr_per_frame(ref, test), 20 * math.log10(255 / 2), atol=1e-9)
    # A constant offset leaves variances and covariance alone; only the luminance term drops below 1.
    ssim = metrics.ssim_per_frame(ref, test)
    assert ((0.99 < ssim) & (ssim < 1.0)).all()


def test_ssim_of_small_frames_shrinks_the_window_to_fit():
    ref = _video(height=5, width=6, seed=3)
    test = np.clip(ref.astype(np.int16) + 7, 0, 255).astype(np.uint8)
    got = metrics.ssim_per_frame(ref, test)
    want = [structural_similarity(ref[i], test[i], data_range=255, channel_axis=-1, win_size=5) for i in range(3)]
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_torch_tensors_and_single_channel_frames_are_accepted():
    ref = _video(channels=1)[..., 0]  # (F, H, W)
    test = (ref.astype(np.int16) + 5).astype(np.uint8)
    got = metrics.psnr_per_frame(torch.from_numpy(ref), torch.from_numpy(test))
    np.testing.assert_allclose(got, 20 * math.log10(255 / 5), atol=1e-9)


@pytest.mark.parametrize(
    "ref,test,error,match",
    [
        (np.zeros((2, 8, 8, 3), np.uint8), np.zeros((2, 8, 9, 3), np.uint8), ValueError, "differ in shape"),
        (np.zeros((2, 8, 8, 3), np.uint8), np.zeros((2, 8, 8, 3), np.float32), TypeError, "differ in dtype"),
        (np.zeros((8, 8), np.uint8), np.zeros((8, 8), np.uint8), ValueError, r"\(F, H, W, C\)"),
        (np.zeros((1, 8, 8, 3), np.int32), np.zeros((1, 8, 8, 3), np.int32), TypeError, "expected uint8"),
        ([1, 2], [1, 2], TypeError, "numpy array or a torch tensor"),
    ],
)
def test_bad_videos_raise_errors_that_name_the_problem(ref, test, error, match):
    with pytest.raises(error, match=match):
        metrics.psnr_per_frame(ref, test)


def test_ssim_refuses_frames_smaller_than_3_pixels():
    with pytest.raises(ValueError, match="at least 3x3"):
        metrics.ssim_per_frame(np.zeros((1, 2, 8, 3), np.uint8), np.zeros((1, 2, 8, 3), np.uint8))


def test_to_uint8_scales_rounds_and_clips():
    frames = np.array([[[[0.0, 0.4 / 255, 1.6 / 255], [1.0, 1.2, -0.3]]]], dtype=np.float32)
    np.testing.assert_array_equal(metrics.to_uint8(frames), [[[[0, 0, 2], [255, 255, 0]]]])
    as_uint8 = np.arange(6, dtype=np.uint8).reshape(1, 1, 2, 3)
    assert metrics.to_uint8(as_uint8) is as_uint8


# ------------------------------------------------------------------ attention error metrics

def test_attention_error_of_an_exact_copy_is_perfect():
    ref = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    err = metrics.attention_error(ref.clone(), ref)
    assert err == {"cosine": pytest.approx(1.0, abs=1e-15), "rel_l1": 0.0, "rmse": 0.0,
                   "worst_row_cosine": pytest.approx(1.0, abs=1e-15), "max_abs": 0.0}


def test_attention_error_of_a_scaled_copy_has_known_values():
    ref = torch.randn(1, 7, 2, 16, dtype=torch.float64)
    err = metrics.attention_error(2 * ref, ref)
    assert err["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert err["worst_row_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert err["rel_l1"] == pytest.approx(1.0, abs=1e-12)  # sum|2r - r| / sum|r|
    assert err["rmse"] == pytest.approx(float(ref.pow(2).mean().sqrt()), rel=1e-12)
    assert err["max_abs"] == pytest.approx(float(ref.abs().max()), rel=1e-12)


def test_worst_row_cosine_finds_the_one_bad_row():
    ref = np.tile(np.array([1.0, 0.0, 0.0, 0.0]), (10, 1))  # 10 rows along the last dim
    out = ref.copy()
    out[6] = [0.0, 1.0, 0.0, 0.0]  # orthogonal: cosine 0 in that row
    assert metrics.worst_row_cosine(out, ref) == pytest.approx(0.0, abs=1e-15)
    assert metrics.cosine_similarity(out, ref) == pytest.approx(0.9, abs=1e-12)  # 9 / (sqrt(10) * sqrt(10))
    assert metrics.relative_l1(out, ref) == pytest.approx(0.2, abs=1e-12)  # |1| + |1| over 10
    assert metrics.rmse(out, ref) == pytest.approx(math.sqrt(2 / 40), abs=1e-12)


def test_zero_rows_count_as_equal_when_both_are_zero():
    ref = np.zeros((3, 4))
    ref[0] = 1.0
    out = ref.copy()
    assert metrics.worst_row_cosine(out, ref) == 1.0
    out[1, 2] = 1e-3  # a nonzero row where the reference has zeros: cosine 0
    assert metrics.worst_row_cosine(out, ref) == 0.0
    assert metrics.relative_l1(np.ones(3), np.zeros(3)) == math.inf
    assert metrics.relative_l1(np.zeros(3), np.zeros(3)) == 0.0


def test_attention_error_takes_bf16_tensors_and_checks_shapes():
    ref = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    err = metrics.attention_error(ref.to(torch.bfloat16), ref)
    assert 0.999 < err["cosine"] < 1.0 and 0 < err["rel_l1"] < 0.01  # bf16 rounding: about 2**-9
    with pytest.raises(ValueError, match="differ in shape"):
        metrics.attention_error(ref[:, :3], ref)


def test_fsattn_error_against_the_float64_reference_is_small_but_not_zero():
    from fsattn_diffusers import fsattn
    from fsattn_diffusers.reference import attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 700, 2, 64, generator=g) for _ in range(3))
    err = metrics.attention_error(fsattn(q, k, v), attention_reference(q, k, v)[0])
    # 8-bit attention (docs/design.md §2): cosine about 0.9994, relative L1 a few percent.
    assert 0.995 < err["cosine"] < 0.99999
    assert 1e-3 < err["rel_l1"] < 0.08
    assert err["worst_row_cosine"] <= err["cosine"]


# ------------------------------------------------------------------ LPIPS availability

def test_lpips_is_skipped_with_a_reason_when_the_package_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "lpips", None)  # makes `import lpips` raise ImportError
    ok, why = metrics.lpips_status()
    assert not ok and "not installed" in why
    values, message = metrics.lpips_per_frame(_video(), _video())
    assert values is None and message.startswith("LPIPS skipped:") and "not installed" in message


def test_lpips_is_skipped_when_backbone_weights_are_not_cached(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lpips", types.ModuleType("lpips"))
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    ok, why = metrics.lpips_status("alex")
    assert not ok and "alexnet-owt-7be5be79.pth" in why and str(tmp_path) in why
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "alexnet-owt-7be5be79.pth").write_bytes(b"")
    assert metrics.lpips_status("alex") == (True, "available")
    with pytest.raises(ValueError, match="net='resnet'"):
        metrics.lpips_status("resnet")


def test_summarize_keeps_infinite_psnr():
    assert metrics.summarize([math.inf, 30.0]) == {"mean": math.inf, "min": 30.0, "max": math.inf}
