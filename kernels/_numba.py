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
import threading
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


_MiB = 1 << 20
_STACK_GUARD_BYTES = 64 << 10
"""Beside each thread's stack: its guard page and thread-local storage, rounded up."""
_ROOM_KEPT_BYTES = 16 * _MiB
"""Address space left for the loop's own allocations after its threads' stacks."""
_threads_given = threading.local()


def _thread_stack_bytes() -> int:
    """The stack GNU OpenMP maps for each thread: ``OMP_STACKSIZE`` (a size, in KiB unless it ends
    in B, K, M or G), else the stack limit (``ulimit -s``), else 8 MiB (glibc's default is smaller)."""
    env = os.environ.get("OMP_STACKSIZE", "").strip().upper()
    if env:
        unit = {"B": 1, "K": 1 << 10, "M": _MiB, "G": 1 << 30}.get(env[-1])
        try:
            return int(env[:-1] if unit else env) * (unit or 1 << 10)
        except ValueError:
            pass  # libgomp ignores a malformed value too
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return 8 * _MiB if soft == resource.RLIM_INFINITY else soft


def _mapped_bytes() -> int:
    """This process's address space in use (what ``ulimit -v`` counts)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def parallel_call(loop, *args):
    """``loop(*args)`` for a numba ``parallel=True`` loop; under a finite ``ulimit -v`` on only as
    many threads as the limit leaves room for their stacks.

    GNU OpenMP starts a loop's threads at the first loop of each calling thread and ends the whole
    process when a thread's stack cannot be mapped ("libgomp: Thread creation failed"): under
    ``ulimit -v 440000`` with 16 threads a host verify ended the engine, no exception raised. The
    threads this caller already has are paid for; numba's thread count is per calling thread."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        _fit_threads(loop, args, soft)
    return loop(*args)


def _fit_threads(loop, args, limit: int) -> None:
    import numba  # imported already by the loop's module

    want = numba.get_num_threads()  # NUMBA_NUM_THREADS, or what this thread set; starts the pool's layer
    given = getattr(_threads_given, "n", 0)
    if want <= given:
        return
    loop.compile(tuple(numba.typeof(a) for a in args))  # compiling (or loading the cache) maps memory too
    room = limit - _mapped_bytes() - _ROOM_KEPT_BYTES
    n = min(want, max(given, 1 + max(0, room) // (_thread_stack_bytes() + _STACK_GUARD_BYTES)))
    if n < want:
        warnings.warn(f"a parallel host loop runs on {n} of {want} threads: the address-space limit (`ulimit -v`) "
                      f"of {limit:,} bytes leaves room for no more threads' stacks", RuntimeWarning, stacklevel=4)
        numba.set_num_threads(n)
    _threads_given.n = n


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
