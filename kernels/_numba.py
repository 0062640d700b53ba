"""numba, imported where a host loop needs it, or an error that says why it could not be.

Under a tight address-space limit (``ulimit -v``) numba's import fails in ways that point
elsewhere: ``OSError: Could not find/load shared object file 'libllvmlite.so'`` (the library is
there; its mapping was refused), ``SystemError: error return without exception set`` or a bare
``MemoryError``, and a retry in the same process may fail differently. The error names the
limit, so the fix (a larger limit) is not taken for a broken install."""

from __future__ import annotations

import resource

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
