"""The Gluon entry points whose names differ between the Triton releases the Gluon kernels support
(3.6, 3.7 and 3.9).

Gluon is Triton's experimental layer and renames its API between releases; the Gluon kernels import
the moving names from here, so that each kernel is written once. Each name is bound to the
release's own builtin, not wrapped, so a kernel compiles exactly as it would with that release's
spelling.

- ``tma_async_load(desc, coord, barrier, result)``: a TMA copy of one tile from global into shared
  memory that completes on ``barrier``. Triton 3.6 and 3.7 call it
  ``tma.async_copy_global_to_shared``; 3.9 renamed it ``tma.async_load`` and left the old name
  raising an error.

A release with neither raises ImportError here, which the op takes as "no Gluon kernels" (the
Triton kernel then runs every call).
"""

from triton.experimental.gluon.language.nvidia.hopper import tma

if hasattr(tma, "async_load"):
    tma_async_load = tma.async_load
elif hasattr(tma, "async_copy_global_to_shared"):
    tma_async_load = tma.async_copy_global_to_shared
else:
    raise ImportError("this Triton's Gluon TMA has neither async_load (3.9) nor async_copy_global_to_shared (3.6, 3.7)")

__all__ = ["tma_async_load"]
