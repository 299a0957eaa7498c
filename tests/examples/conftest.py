"""Fixtures for the example scripts' tests: the scripts as modules, and the small video they make.

The scripts live in examples/ (not a package); they are imported by path so that the tests call
the very functions the command line runs.
"""

import importlib
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples")


def _load(name):
    """Import examples/<name>.py under its own name (ab_compare.py imports generate_video so too)."""
    path = os.path.abspath(EXAMPLES)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


@pytest.fixture(scope="session")
def generate_video():
    return _load("generate_video")


@pytest.fixture(scope="session")
def ab_compare():
    return _load("ab_compare")


def _read_video(path):
    # As examples/generate_video.py writes: through imageio-ffmpeg, or OpenCV where it is missing
    # (GPU images that carry OpenCV but not ffmpeg).
    import importlib.util

    if importlib.util.find_spec("imageio_ffmpeg") is not None:
        import imageio.v2 as imageio

        with imageio.get_reader(path, "ffmpeg") as reader:
            return [frame for frame in reader]
    import cv2

    capture = cv2.VideoCapture(path)
    if not capture.isOpened():
        raise OSError(f"OpenCV cannot open {path!r} (and imageio-ffmpeg is not installed)")
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(frame[..., ::-1].copy())  # OpenCV gives BGR
    capture.release()
    return frames


@pytest.fixture(scope="session")
def read_video():
    """The frames of an mp4 read back, as a list of (H, W, 3) uint8 RGB arrays."""
    return _read_video
