"""numba, imported where a host loop needs it, or an error that says why it could not be.

Under a tight address-space limit (``ulimit -v``) numba's import fails in ways that point
elsewhere: ``OSError: Could not find/load shared object file 'libllvmlite.so'`` (the library is
there; its mapping was refused), ``SystemError: error return without exception set`` or a bare
``MemoryError``, and a retry in the same process may fail differently. The error names the
limit, so the fix (a larger limit) is not taken for a broken install."""

from __future__ import annotations

import os
import resource
import tempfile
import warnings

from flashboot.errors import FlashBootError
from flashboot.units import limit_text


def numba_or_error(what: str):
    """The ``numba`` module, or FlashBootError naming ``what`` needed it, the cause and the limit."""
    try:
        import numba
    except Exception as exc:  # noqa: BLE001 - any failure of the import is named the same way
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        limit = limit_text(soft) + ("" if soft == resource.RLIM_INFINITY else " bytes")
        raise FlashBootError(f"{what} needs numba, whose import failed in this process ({type(exc).__name__}: "
                             f"{str(exc)[:300]}); its address-space limit (`ulimit -v`) is {limit}: numba and "
                             "LLVM map a few hundred MB") from exc
    return numba


def cached_njit(**options):
    """``numba.njit(cache=True, **options)`` that also works where numba finds no cache directory.

    numba caches beside the source (``__pycache__``) or under ``~/.cache``; in a container with a
    read-only file system and no ``HOME`` neither is writable, and ``cache=True`` raised "no
    locator available" at import, so every verify failed. There the cache goes to a folder of this
    user under the temporary directory (``$TMPDIR``), and where even that is refused the loop is
    compiled in each process (a warning says so: ~0.6 s at its first call)."""
    numba = numba_or_error("a host loop")

    def decorate(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError as exc:
            if "no locator available" not in str(exc):
                raise
        if not numba.config.CACHE_DIR:
            numba.config.CACHE_DIR = os.path.join(tempfile.gettempdir(), f"flashboot-numba-cache-{os.getuid()}")
            try:
                return numba.njit(cache=True, **options)(fn)
            except RuntimeError as exc:
                if "no locator available" not in str(exc):
                    raise
        warnings.warn(f"numba has no writable cache directory (beside {fn.__code__.co_filename}, ~/.cache, "
                      f"NUMBA_CACHE_DIR={numba.config.CACHE_DIR!r}): {fn.__name__} is compiled in every process",
                      RuntimeWarning, stacklevel=2)
        return numba.njit(**options)(fn)

    return decorate
