"""`cached_jit`: numba's njit with an on-disk cache that always has somewhere to live.

Why one decorator for every numba function of cubic (the native kernels, the harness's synthetic
batches): a rank is a fresh process, and `cache=True` makes every process after the first load machine
code instead of compiling for seconds; where neither the package folder nor the user's cache folder is
writable (read-only site-packages, no HOME), the cache goes under the temp folder rather than nowhere.
"""

from __future__ import annotations

import os
import tempfile

import numba


def cached_jit(**kw):
    """njit(cache=True, nogil=True, **kw), cached under the temp folder where numba finds no place."""

    def deco(fn):
        try:
            return numba.njit(cache=True, nogil=True, **kw)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            old = numba.config.CACHE_DIR
            numba.config.CACHE_DIR = os.path.join(tempfile.gettempdir(), f"cubic-numba-{os.getuid()}")
            try:
                return numba.njit(cache=True, nogil=True, **kw)(fn)
            finally:
                numba.config.CACHE_DIR = old

    return deco
