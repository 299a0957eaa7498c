"""Quality metrics: per-frame PSNR / SSIM / LPIPS of videos, and the error of an attention output.

Videos
------
A video is a NumPy array or a torch tensor of frames, channels last: ``(F, H, W, C)`` (what
diffusers returns with ``output_type="np"``) or ``(F, H, W)`` for one channel. ``uint8`` frames
have a data range of 255; floating frames are taken to lie in ``[0, 1]`` (range 1.0). Pass
``data_range`` to say otherwise. PSNR and SSIM are computed here in NumPy, frame by frame, with
scikit-image's definitions and defaults (``skimage.metrics.peak_signal_noise_ratio`` and
``structural_similarity``: a 7x7 uniform window, K1 = 0.01, K2 = 0.03, sample covariance,
channels averaged), in float64, so that they need nothing beyond NumPy; the tests check them
against scikit-image (which computes float32 frames in float32: ~1e-7 apart there). LPIPS is
the ``lpips`` package's, used only where it and its network weights are already on disk.

Attention outputs
-----------------
:func:`attention_error` compares an output with a reference (usually the float64
``fsattn_diffusers.reference.attention_reference``) in float64: cosine similarity of the
flattened tensors, relative L1 ``sum|o - r| / sum|r|``, RMSE, and the worst cosine over rows
(a row is one query's output vector for one head: the last dim).
"""

from __future__ import annotations

import math
import os

import numpy as np

# The LPIPS backbones' ImageNet weights, as torchvision names them in the torch hub cache.
_LPIPS_BACKBONE_FILES = {
    "alex": "alexnet-owt-7be5be79.pth",
    "vgg": "vgg16-397923af.pth",
    "squeeze": "squeezenet1_1-b8a52dc0.pth",
}


def _to_numpy(video, name: str) -> np.ndarray:
    try:
        import torch

        if isinstance(video, torch.Tensor):
            video = video.detach().cpu()
            if video.dtype == torch.bfloat16 or video.dtype == torch.float16:
                video = video.float()
            return video.numpy()
    except ImportError:  # metrics work without torch
        pass
    if not isinstance(video, np.ndarray):
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(video).__name__}")
    return video


def as_frames(video, name: str = "video") -> np.ndarray:
    """``video`` as a NumPy array ``(F, H, W, C)``; ``(F, H, W)`` gains a channel axis."""
    frames = _to_numpy(video, name)
    if frames.ndim == 3:
        frames = frames[..., None]
    if frames.ndim != 4:
        raise ValueError(f"{name} must have shape (F, H, W, C) or (F, H, W), got {frames.shape}")
    if not (frames.dtype == np.uint8 or np.issubdtype(frames.dtype, np.floating)):
        raise TypeError(f"{name} has dtype {frames.dtype}; expected uint8 (0..255) or floating (0..1)")
    return frames


def to_uint8(video) -> np.ndarray:
    """Frames as ``uint8`` ``(F, H, W, C)``: floats in ``[0, 1]`` are scaled, rounded and clipped."""
    frames = as_frames(video)
    if frames.dtype == np.uint8:
        return frames
    return np.clip(np.rint(frames.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)


def _pair(reference, test, data_range):
    ref = as_frames(reference, "reference")
    tst = as_frames(test, "test")
    if ref.shape != tst.shape:
        raise ValueError(f"reference and test differ in shape: {ref.shape} vs {tst.shape}")
    if ref.dtype != tst.dtype:
        raise TypeError(f"reference and test differ in dtype: {ref.dtype} vs {tst.dtype}; convert both "
                        "with to_uint8() or to float first")
    if data_range is None:
        data_range = 255.0 if ref.dtype == np.uint8 else 1.0
    if not (isinstance(data_range, (int, float)) and data_range > 0):
        raise ValueError(f"data_range must be a positive number, got {data_range!r}")
    return ref, tst, float(data_range)


def psnr_per_frame(reference, test, data_range=None) -> np.ndarray:
    """PSNR (dB) of each frame, float64 ``(F,)``; identical frames give ``inf``.

    ``10 * log10(data_range**2 / MSE)`` with the MSE over all pixels and channels of a frame, in
    float64: a constant offset of ``d`` on 8-bit frames gives ``20 * log10(255 / d)``.
    """
    ref, tst, data_range = _pair(reference, test, data_range)
    out = np.empty(ref.shape[0], dtype=np.float64)
    for i in range(ref.shape[0]):
        mse = float(np.mean((ref[i].astype(np.float64) - tst[i].astype(np.float64)) ** 2))
        out[i] = math.inf if mse == 0 else 10.0 * math.log10(data_range**2 / mse)
    return out


def _ssim_window(height: int, width: int) -> int:
    """scikit-image's 7x7 window, shrunk (odd, >= 3) for frames smaller than that."""
    side = min(7, height, width)
    if side < 3:
        raise ValueError(f"SSIM needs frames of at least 3x3 pixels, got {height}x{width}")
    return side if side % 2 == 1 else side - 1


def _box_mean(image: np.ndarray, win: int) -> np.ndarray:
    """Mean over every ``win x win`` window lying wholly inside `image` (H, W, C), float64.

    Running sums along one axis at a time: each sum spans at most one row or column, which keeps
    float64 rounding far below what SSIM can show.
    """
    for axis in (0, 1):
        csum = np.cumsum(image, axis=axis, dtype=np.float64)
        zero = np.zeros_like(np.take(csum, [0], axis=axis))
        csum = np.concatenate([zero, csum], axis=axis)
        n = csum.shape[axis]
        image = np.take(csum, np.arange(win, n), axis=axis) - np.take(csum, np.arange(0, n - win), axis=axis)
    return image / (win * win)


def _ssim_frame(ref: np.ndarray, tst: np.ndarray, data_range: float, win: int) -> float:
    """Mean SSIM of one ``(H, W, C)`` frame, channels averaged (scikit-image's definition).

    scikit-image filters the whole frame and then drops ``(win - 1) // 2`` pixels at each border,
    which leaves exactly the windows wholly inside the frame: the only ones computed here.
    """
    x, y = ref.astype(np.float64), tst.astype(np.float64)
    n = win * win
    cov_norm = n / (n - 1.0)  # sample covariance, as use_sample_covariance=True
    ux, uy = _box_mean(x, win), _box_mean(y, win)
    vx = cov_norm * (_box_mean(x * x, win) - ux * ux)
    vy = cov_norm * (_box_mean(y * y, win) - uy * uy)
    vxy = cov_norm * (_box_mean(x * y, win) - ux * uy)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    ssim_map = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux * ux + uy * uy + c1) * (vx + vy + c2))
    return float(ssim_map.mean(axis=(0, 1)).mean())


def ssim_per_frame(reference, test, data_range=None) -> np.ndarray:
    """SSIM of each frame, float64 ``(F,)``: a 7x7 uniform window (smaller for frames under 7
    pixels), K1 = 0.01, K2 = 0.03, sample covariance, channels averaged, as scikit-image's
    ``structural_similarity`` computes by default."""
    ref, tst, data_range = _pair(reference, test, data_range)
    win = _ssim_window(ref.shape[1], ref.shape[2])
    return np.array([_ssim_frame(ref[i], tst[i], data_range, win) for i in range(ref.shape[0])], dtype=np.float64)


def lpips_status(net: str = "alex") -> tuple[bool, str]:
    """Whether LPIPS can run offline, and if not, why (a sentence for the user).

    LPIPS needs the ``lpips`` package (which ships its own linear heads), torchvision, and the
    backbone's ImageNet weights already in the torch hub cache: nothing is downloaded here.
    """
    if net not in _LPIPS_BACKBONE_FILES:
        raise ValueError(f"net={net!r}; expected one of {sorted(_LPIPS_BACKBONE_FILES)}")
    try:
        import lpips  # noqa: F401
    except ImportError:
        return False, ("the 'lpips' package is not installed (pip install lpips; it also needs torchvision and "
                       f"the {net} backbone weights in the torch hub cache)")
    except Exception as exc:  # e.g. a torchvision that does not match torch
        return False, f"the 'lpips' package failed to import: {type(exc).__name__}: {exc}"
    import torch

    weights = os.path.join(torch.hub.get_dir(), "checkpoints", _LPIPS_BACKBONE_FILES[net])
    if not os.path.exists(weights):
        return False, (f"the {net} backbone weights are not cached at {weights} (no download is attempted; "
                       "copy them there from a machine with network access)")
    return True, "available"


def lpips_per_frame(reference, test, net: str = "alex", device="cpu"):
    """LPIPS of each frame, float64 ``(F,)``, or ``None`` when it cannot run offline.

    Returns ``(values or None, message)``; the message says why LPIPS was skipped.
    """
    ok, why = lpips_status(net)
    if not ok:
        return None, f"LPIPS skipped: {why}"
    import lpips
    import torch

    ref, tst, data_range = _pair(reference, test, None)
    if ref.shape[-1] != 3:
        return None, f"LPIPS skipped: it needs RGB frames, got {ref.shape[-1]} channel(s)"
    model = lpips.LPIPS(net=net, verbose=False).to(device).eval()

    def prep(frames):  # (F, H, W, 3) -> (F, 3, H, W) in [-1, 1]
        x = torch.from_numpy(frames.astype(np.float32) / data_range).permute(0, 3, 1, 2)
        return (x * 2 - 1).to(device)

    out = np.empty(ref.shape[0], dtype=np.float64)
    with torch.no_grad():
        for i in range(ref.shape[0]):
            out[i] = float(model(prep(ref[i:i + 1]), prep(tst[i:i + 1])).item())
    return out, "available"


def _as_float64_pair(output, reference):
    out = _to_numpy(output, "output").astype(np.float64, copy=False)
    ref = _to_numpy(reference, "reference").astype(np.float64, copy=False)
    if out.shape != ref.shape:
        raise ValueError(f"output and reference differ in shape: {out.shape} vs {ref.shape}")
    if out.size == 0:
        raise ValueError("output and reference are empty")
    return out, ref


def _cos(a: np.ndarray, b: np.ndarray, axis=None):
    """Cosine similarity; a pair of zero vectors counts as equal (1), one zero vector as 0."""
    dot = np.sum(a * b, axis=axis)
    na = np.sqrt(np.sum(a * a, axis=axis))
    nb = np.sqrt(np.sum(b * b, axis=axis))
    denom = na * nb
    both_zero = (na == 0) & (nb == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(denom > 0, dot / np.where(denom > 0, denom, 1.0), 0.0)
    return np.where(both_zero, 1.0, cos)


def cosine_similarity(output, reference) -> float:
    """Cosine similarity of the two tensors flattened."""
    out, ref = _as_float64_pair(output, reference)
    return float(_cos(out.ravel(), ref.ravel()))


def relative_l1(output, reference) -> float:
    """``sum|output - reference| / sum|reference|`` (``inf`` if the reference is all zeros and they differ)."""
    out, ref = _as_float64_pair(output, reference)
    num = float(np.abs(out - ref).sum())
    den = float(np.abs(ref).sum())
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def rmse(output, reference) -> float:
    """Root-mean-square error."""
    out, ref = _as_float64_pair(output, reference)
    return float(np.sqrt(np.mean((out - ref) ** 2)))


def worst_row_cosine(output, reference) -> float:
    """The smallest cosine similarity over rows (vectors along the last dim)."""
    out, ref = _as_float64_pair(output, reference)
    rows = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    return float(_cos(rows[0], rows[1], axis=1).min())


def attention_error(output, reference) -> dict:
    """Every attention-error metric at once.

    Parameters
    ----------
    output : Tensor or ndarray
        The attention output to judge, e.g. ``fsattn(q, k, v)`` as ``(B, S, H, D)``.
    reference : Tensor or ndarray
        Same shape; e.g. ``attention_reference(q, k, v)[0]`` (float64).

    Returns
    -------
    dict
        ``cosine``, ``rel_l1``, ``rmse``, ``worst_row_cosine`` (rows along the last dim),
        ``max_abs`` (largest absolute difference), all floats computed in float64.
    """
    out, ref = _as_float64_pair(output, reference)
    return {
        "cosine": cosine_similarity(out, ref),
        "rel_l1": relative_l1(out, ref),
        "rmse": rmse(out, ref),
        "worst_row_cosine": worst_row_cosine(out, ref),
        "max_abs": float(np.abs(out - ref).max()),
    }


def summarize(values) -> dict:
    """Mean / min / max of per-frame values (``inf`` kept: identical frames have infinite PSNR)."""
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max())}
