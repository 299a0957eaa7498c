"""Counters users read to see what fsattn did: calls, speculation fallbacks, SDPA fallbacks."""

from __future__ import annotations

import threading
from collections import Counter

import torch

_lock = threading.Lock()
_calls = Counter()  # "kernel", "emulation"
_q_tiles = Counter()  # query tiles processed, by path
_sdpa_fallbacks = Counter()  # reason -> calls
# The kernels count speculative-max fallbacks on the device (an atomic add only when one
# happens); reading them needs a sync, so it happens only when stats() is called.
_device_counters: dict[torch.device, torch.Tensor] = {}
_emulated_fallbacks = Counter()


def fallback_counter(device: torch.device) -> torch.Tensor:
    """The int32 device counter that kernels on `device` add their fallback Q tiles to."""
    with _lock:
        counter = _device_counters.get(device)
        if counter is None:
            # Made outside inference mode: a tensor born inside it could not be zeroed by a later
            # reset_stats() outside it ("Inplace update to inference tensor").
            with torch.inference_mode(False):
                counter = torch.zeros(1, dtype=torch.int32, device=device)
            _device_counters[device] = counter
        return counter


def record_call(path: str, q_tiles: int) -> None:
    with _lock:
        _calls[path] += 1
        _q_tiles[path] += q_tiles


def record_emulated_fallbacks(n: int) -> None:
    if n:
        with _lock:
            _emulated_fallbacks["emulation"] += int(n)


def record_sdpa_fallback(reason: str) -> None:
    with _lock:
        _sdpa_fallbacks[reason] += 1


def stats() -> dict:
    """Counts since import or the last :func:`reset_stats`.

    Returns
    -------
    dict
        ``calls``: fsattn calls by path (``"kernel"`` on GPU, ``"emulation"`` on CPU);
        ``q_tiles``: query tiles processed; ``fallback_q_tiles``: query tiles whose speculative
        (frozen) row max failed and that were recomputed with the exact online softmax;
        ``sdpa_fallbacks``: calls sent to SDPA instead, by reason.
    """
    with _lock:
        device_fallbacks = sum(int(c.item()) for c in _device_counters.values())
        return {
            "calls": dict(_calls),
            "q_tiles": sum(_q_tiles.values()),
            "fallback_q_tiles": device_fallbacks + sum(_emulated_fallbacks.values()),
            "sdpa_fallbacks": dict(_sdpa_fallbacks),
        }


def reset_stats() -> None:
    """Zero every counter."""
    with _lock:
        _calls.clear()
        _q_tiles.clear()
        _sdpa_fallbacks.clear()
        _emulated_fallbacks.clear()
        for counter in _device_counters.values():
            counter.zero_()
