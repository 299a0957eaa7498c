"""Test-session setup shared by every test folder.

Without a CUDA GPU, Triton kernels run in Triton's interpreter: the variable must be set before
anything imports Triton, which is why it lives here and not in the kernel tests.
"""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU with FP8 tensor cores (sm_89+); CPU only here"))
