"""benchmarks/plot_seqlen.py: the TFLOP/s-against-length plot from a bench_attention.py sweep."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import plot_seqlen  # noqa: E402


def _rows():
    return [
        {"shape": "seq_8192", "method": "sdpa_default", "tflops": 600.0},
        {"shape": "seq_1024", "method": "sdpa_default", "tflops": 300.0},
        {"shape": "seq_1024", "method": "sdpa_flash", "error": "RuntimeError: no kernel"},
        {"shape": "wan13b_480p", "method": "sdpa_default", "tflops": 560.0},  # not a sweep shape
        {"shape": "seq_8192", "method": "fsattn[default]", "tflops": 490.0},
    ]


def test_series_keeps_sweep_rows_with_a_figure_sorted_by_length():
    assert plot_seqlen.series(_rows()) == {"sdpa_default": [(1024, 300.0), (8192, 600.0)],
                                           "fsattn[default]": [(8192, 490.0)]}


def test_command_line_writes_a_png_and_refuses_results_without_sweep_rows(tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "sweep.json"
    results.write_text(json.dumps({"environment": {"gpu": "test"}, "rows": _rows()}))
    png = tmp_path / "plot.png"
    script = os.path.join(ROOT, "benchmarks", "plot_seqlen.py")
    subprocess.run([sys.executable, script, str(results), str(png)], check=True, capture_output=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results.write_text(json.dumps({"rows": _rows()[3:4]}))
    done = subprocess.run([sys.executable, script, str(results), str(png)], capture_output=True, text=True)
    assert done.returncode != 0 and "no rows of the sweep shapes" in done.stderr
