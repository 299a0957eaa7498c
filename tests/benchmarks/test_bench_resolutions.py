"""benchmarks/bench_resolutions.py on the tiny Wan (CPU: fsattn's emulation, Dynamo's eager backend).

Nothing here asserts a speed; only the compiles each ``dynamic`` setting makes as the size
changes, the quality against the eager default, and the argument errors.
"""

import argparse
import importlib.util
import json
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks",
                     "bench_resolutions.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_resolutions", os.path.abspath(BENCH))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_each_dynamic_setting_compiles_as_documented_when_the_size_changes(bench, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "r.json"
        bench.main(["--model", "tiny", "--device", "cpu", "--compile-backend", "eager", "--forwards", "1",
                    "--sizes", "64x96x9", "64x96x5", "96x128x5", "--dynamic", "none", "false", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    settings = {s["dynamic"]: s for s in report["settings"]}
    assert [r["size"] for r in settings["none"]["sizes"]] == ["64x96x9", "64x96x5", "96x128x5"]
    # None: static at the first size, dynamic at the second, which then serves the third.
    assert [r["new_graphs"] for r in settings["none"]["sizes"]] == [1, 1, 0]
    assert [r["new_graphs"] for r in settings["false"]["sizes"]] == [1, 1, 1]  # one graph per size
    assert all(r["new_graphs"] == 0 for r in settings["default (eager, no recipe)"]["sizes"])
    for name in ("none", "false"):  # fsattn's emulation against the model's own attention
        assert all(0.999 < r["output_cosine"] < 1.0 for r in settings[name]["sizes"])


@pytest.mark.parametrize("text", ["480x832", "480x830x81", "480x832x80", "ax832x81", "0x832x81"])
def test_sizes_that_are_not_video_sizes_are_refused(bench, text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"size {text!r}"):
        bench.parse_size(text)


def test_a_size_is_height_width_frames(bench):
    assert bench.parse_size("480x832x81") == (480, 832, 81)
