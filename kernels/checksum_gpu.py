"""The 64-bit content checksum on the GPU: Triton kernels over a span (see
:mod:`flashboot.kernels.checksum`, which dispatches here for CUDA memory).

The word kernel (every aligned span) launches from a cubin compiled ahead of time
(:mod:`flashboot.kernels.cubin`), so a fresh process checksums without importing Triton: the
cubin is built by ``flashboot warm``, by :func:`prepare_checksum_kernels` (a seed's start, a
clone's early call) or, loudly, by the first call that finds none. Triton's own launch
(:mod:`flashboot.kernels.checksum_triton`) stays the reference, and the path for unaligned spans,
chunk sizes that are not whole 16-word groups, and the interpreter.
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from flashboot.errors import FlashBootError, KernelCacheError

from . import cubin
from .checksum_spec import LENGTH_MUL, M64, word_term
from .knobs import check_launch_knobs
from .launch_ctypes import compute_capability


# ------------------------------------------------------------------------------------------ GPU
CHECKSUM_TUNING: dict[str, Any] = {
    "block_words": 1024,  # 32-bit words per program per loop step (a power of two): 8 per thread
    "num_warps": 4,
    "programs_per_sm": 6,  # persistent grid = #SMs x this, one wave (~70 registers a thread, sm_90, ptxas 13):
    # copy + checksum of 1 GiB on the H200 ran 0.87x a plain copy at 4, 0.99x at 6, 0.63x at 2 (RESULTS.md)
    "num_stages": 3,  # Triton's default software pipelining of the loop's loads
}
"""Defaults of the GPU checksum's knobs; :func:`checksum` and :func:`chunk_checksums` take overrides."""

LAUNCHED_ON: set[int] = set()
"""Devices this process has launched the word checksum kernel on (a verify's kernel): a first
launch through Triton costs ~1 s (its import, launcher and cache), from a cached cubin a few ms,
later ones ~1 ms (see :func:`~flashboot.kernels.checksum.gpu_checksum_loaded`)."""


_KERNEL_SOURCE = Path(__file__).with_name("checksum_triton.py")
WORDS_ALIGNED_ARGS = ("words_ptr", "sums_ptr", "copy_ptr", "chunk_words")
"""The word kernel's arguments its cubin assumes divisible by 16 (16-byte aligned pointers; whole
16-word groups per chunk, so full tiles load as 16-byte vectors); the others stay runtime values,
so one cubin fits every size. Spans that break this launch through Triton."""
_launchers: dict[tuple, cubin.CubinLauncher | None] = {}
_launchers_lock = threading.Lock()


def words_kernel_key(arch: int, knobs: dict[str, Any], copy: bool) -> cubin.KernelKey:
    """The cache key of the word kernel's cubin for ``arch`` and the launch knobs ``knobs``."""
    build = {"BLOCK": knobs["block_words"], "COPY": copy, "num_warps": knobs["num_warps"],
             "num_stages": knobs["num_stages"], "divisible_by_16": list(WORDS_ALIGNED_ARGS)}
    variant = f"b{build['BLOCK']}-{'copy' if copy else 'read'}-w{build['num_warps']}-s{build['num_stages']}"
    return cubin.KernelKey("checksum_words_kernel", cubin.source_sha256(_KERNEL_SOURCE), arch,
                           cubin.triton_version() or "none", variant, build)


def _build_words_cubin(key: cubin.KernelKey) -> cubin.CachedKernel:
    from .checksum_triton import compile_words_kernel

    b = key.build
    compiled = compile_words_kernel(key.arch, block=b["BLOCK"], copy=b["COPY"], num_warps=b["num_warps"],
                                    num_stages=b["num_stages"], divisible_by_16=tuple(b["divisible_by_16"]))
    return cubin.save(key, compiled)


def _words_launcher(device: int, knobs: dict[str, Any], copy: bool, *, quiet: bool = False) -> cubin.CubinLauncher | None:
    """The word kernel's cubin for ``device`` and ``knobs``, loaded; built (and cached on disk)
    when there is none, loudly unless ``quiet`` (an early call that builds it on purpose).
    None when it cannot be built: the caller launches through Triton, which said why."""
    k = (device, knobs["block_words"], knobs["num_warps"], knobs["num_stages"], copy)
    if k in _launchers:
        return _launchers[k]
    with _launchers_lock:
        if k in _launchers:
            return _launchers[k]
        key = words_kernel_key(compute_capability(device), knobs, copy)
        try:
            cached, why = cubin.load(key)
        except KernelCacheError as exc:
            # a corrupt entry would fail every load forever (and `flashboot warm`, the remedy it
            # names): set it aside and rebuild, loudly, whether or not the caller asked for quiet
            warnings.warn(f"flashboot: {exc}; discarding it and rebuilding", RuntimeWarning, stacklevel=4)
            cubin.discard(key)
            cached, why, quiet = None, f"corrupt cubin at {key.path()} discarded", True
        if cached is None:
            if not quiet:
                warnings.warn(f"flashboot: {why}; compiling the checksum kernel ({key.variant}, sm_{key.arch}) now, "
                              "once (`flashboot warm` does it ahead of time)", RuntimeWarning, stacklevel=4)
            try:
                cached = _build_words_cubin(key)
            except (FlashBootError, ImportError, RuntimeError, OSError) as exc:
                warnings.warn(f"flashboot: the checksum kernel ({key.variant}, sm_{key.arch}) could not be compiled "
                              f"ahead of time ({type(exc).__name__}: {exc}); launching it through Triton",
                              RuntimeWarning, stacklevel=4)
        launcher = _launchers[k] = None if cached is None else cubin.CubinLauncher(cached)
    return launcher


def prepare_checksum_kernels(device: int, **tuning: Any) -> dict[str, float]:
    """Make the checksum's first call on CUDA device ``device`` cheap: build its cubins where the
    cache has none (Triton, once per machine and version) and load them into the device's
    context. For a process's early call (a seed's start, a clone before it knows its source).
    Returns ms per kernel variant ("read", "copy")."""
    knobs = _gpu_knobs(tuning)
    out = {}
    for copy in (False, True):
        t0 = time.perf_counter()
        launcher = _words_launcher(device, knobs, copy, quiet=True)
        if launcher is not None:
            launcher.function(device)
        out["copy" if copy else "read"] = (time.perf_counter() - t0) * 1e3
    return out


def _gpu_knobs(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = set(overrides) - set(CHECKSUM_TUNING)
    if unknown:
        raise FlashBootError(f"unknown checksum knob(s) {sorted(unknown)}; known: {sorted(CHECKSUM_TUNING)}")
    k = {**CHECKSUM_TUNING, **overrides}
    bw = k["block_words"]
    if not isinstance(bw, int) or bw < 16 or bw & (bw - 1):
        raise FlashBootError(f"block_words must be a power of two >= 16, got {bw!r}")
    check_launch_knobs(k)
    return k


def _sum_partials(partials, n_chunks: int) -> list[int]:
    """Wrap-around uint64 sums of the ``(n_chunks, P)`` partials, fetched to the host."""
    host = partials.cpu().numpy().view(np.uint64).reshape(n_chunks, -1)
    return [int(v) for v in host.sum(axis=1, dtype=np.uint64)]


class PendingDigests:
    """Chunk digests the device is still computing: :meth:`digests` waits for them (a launch
    returns at once, so a caller or a benchmark can stop the clock, or queue more work, first)."""

    def __init__(self, span, stream: Any, sums, chunk_bytes: int, start_word: int):
        self._span, self._stream, self._sums = span, stream, sums
        self._chunk_bytes, self._start_word = chunk_bytes, start_word
        self._done: list[int] | None = None

    @classmethod
    def finished(cls, digests: list[int]) -> "PendingDigests":
        """Digests already known (a host copy computes them before it returns)."""
        done = cls(None, None, None, 0, 0)
        done._done = digests
        return done

    def digests(self) -> list[int]:
        """The digests, one per chunk (waits for the launch's stream once)."""
        if self._done is not None:
            return self._done
        from .views import launch_on, span_tensor

        span, n, chunk_bytes = self._span, self._span.nbytes, self._chunk_bytes
        r = n % 4
        with launch_on(span, self._stream):  # the read-back is ordered after the kernel on its stream
            sums = [int(v) for v in self._sums.cpu().numpy().view(np.uint64)]
            tail = span_tensor(span, 1, n - r, r).cpu().numpy() if r else None
        out = []
        for c, term in enumerate(sums):
            nb = min(chunk_bytes, n - c * chunk_bytes)
            if tail is not None and c == len(sums) - 1:
                word = int.from_bytes(tail.tobytes() + b"\0" * (4 - r), "little")
                term += word_term(word, self._start_word + (nb // 4))
            out.append((nb * LENGTH_MUL + term) & M64)
        self._done, self._sums = out, None
        return out


def _words_launch(nbytes: int, chunk_bytes: int, block: int, programs_per_sm: int,
                  device_index: int) -> tuple[tuple[int], tuple[int, int, int, int]]:
    """The word kernel's grid and sizes (``n_words, chunk_words, tiles_per_chunk, n_tiles``) for
    ``chunk_bytes`` chunks of ``nbytes``: what a launch passes, and what Triton specialises on
    (an int that is 1 or a multiple of 16 compiles another kernel), so a warm-up can match it."""
    from .views import sm_count

    n_chunks = -(-nbytes // chunk_bytes)
    n_words = nbytes // 4
    chunk_words = chunk_bytes // 4
    tiles_per_chunk = -(-chunk_words // block)
    n_tiles = (n_chunks - 1) * tiles_per_chunk + -(-(n_words - (n_chunks - 1) * chunk_words) // block)
    # One wave of a few programs per SM, each a contiguous share of all chunks' tiles: a grid of
    # (chunks x programs per chunk) left a second, nearly empty wave behind.
    n_prog = max(1, min(n_tiles, sm_count(device_index) * programs_per_sm))
    return (n_prog,), (n_words, chunk_words, tiles_per_chunk, n_tiles)


def _words_sizes_args(sizes: tuple[int, int, int, int], start_word: int) -> tuple[int, ...]:
    """The word kernel's int arguments in its parameter order."""
    n_words, chunk_words, tiles_per_chunk, n_tiles = sizes
    return n_words, chunk_words, start_word, tiles_per_chunk, n_tiles


def _start_chunk_sums(span, chunk_bytes: int, stream: Any, knobs: dict[str, Any], start_word: int = 0,
                      copy_to=None, via: str = "auto") -> PendingDigests:
    """Launch the digests of ``chunk_bytes`` chunks of a word-aligned span (``span.ptr % 4 == 0``
    and ``chunk_bytes % 4 == 0``) in one kernel on ``stream``; the last chunk's 1-3 trailing bytes
    are read back by :meth:`PendingDigests.digests`. ``copy_to``: a span the bytes are copied into
    in the same pass (same size, word-aligned). ``via``: "auto" (the cubin where the span fits
    :data:`WORDS_ALIGNED_ARGS`, else Triton), "triton" (the reference) or "cubin" (FlashBootError
    where it cannot)."""
    import torch

    from .views import launch_on, span_tensor

    n = span.nbytes
    block = knobs["block_words"]
    if start_word % block:
        raise FlashBootError(f"start_word {start_word} must be a multiple of block_words {block}")
    n_chunks = -(-n // chunk_bytes)
    grid, sizes = _words_launch(n, chunk_bytes, block, knobs["programs_per_sm"], span.device.index)
    (n_prog,), (n_words, chunk_words, tiles_per_chunk, n_tiles) = grid, sizes
    r = n % 4
    launcher = None
    if via != "triton" and span.device.is_cuda and n_words:
        dst_ptr = span.ptr if copy_to is None else copy_to.ptr
        if span.ptr % 16 == 0 and dst_ptr % 16 == 0 and chunk_words % 16 == 0:
            launcher = _words_launcher(span.device.index, knobs, copy_to is not None)
        if launcher is None and via == "cubin":
            raise FlashBootError(f"no checksum cubin for this launch (source {span.ptr:#x}, destination {dst_ptr:#x}, "
                                 f"{chunk_bytes:,}-byte chunks; it needs 16-byte aligned pointers and chunks of "
                                 "whole 64 bytes, and a cubin that could be built)")
    with launch_on(span, stream):
        sums = torch.zeros(n_chunks, dtype=torch.int64, device="cuda" if span.device.is_cuda else "cpu")
        if launcher is not None:
            launcher.launch((n_prog,), (span.ptr, sums.data_ptr(), dst_ptr, n_words, chunk_words, start_word,
                                        tiles_per_chunk, n_tiles),
                            device=span.device.index, stream=torch.cuda.current_stream().cuda_stream)
        elif n_words:
            from .checksum_triton import checksum_words_kernel

            words = span_tensor(span, 4, 0, n_words * 4)
            checksum_words_kernel[grid](
                words, sums, words if copy_to is None else span_tensor(copy_to, 4, 0, n_words * 4),
                *_words_sizes_args(sizes, start_word), BLOCK=block, COPY=copy_to is not None,
                num_warps=knobs["num_warps"], num_stages=knobs["num_stages"],
            )
        if n_words and copy_to is None and span.device.is_cuda:
            LAUNCHED_ON.add(span.device.index)
        if copy_to is not None and r:
            from .copy import copy_bytes_kernel

            copy_bytes_kernel[(1,)](span_tensor(copy_to, 1), span_tensor(span, 1), 0, n - r, r)
    return PendingDigests(span, stream, sums, chunk_bytes, start_word)


def _device_chunk_sums(span, chunk_bytes: int, stream: Any, knobs: dict[str, Any], start_word: int = 0) -> list[int]:
    """:func:`_start_chunk_sums`, waited for."""
    return _start_chunk_sums(span, chunk_bytes, stream, knobs, start_word).digests()


def _device_chunk_sums_bytes(span, chunk_bytes: int, stream: Any, knobs: dict[str, Any], start_word: int = 0) -> list[int]:
    """The byte-load slow path (any start address, any ``chunk_bytes``), all chunks in one launch."""
    import torch

    from .views import launch_on, sm_count, span_tensor

    block = knobs["block_words"]
    if start_word % block:
        raise FlashBootError(f"start_word {start_word} must be a multiple of block_words {block}")
    n = span.nbytes
    n_chunks = -(-n // chunk_bytes)
    tiles_per_chunk = -(-(-(-min(chunk_bytes, n) // 4)) // block)
    target = sm_count(span.device.index) * knobs["programs_per_sm"]
    n_prog = max(1, min(tiles_per_chunk, -(-target // n_chunks), 65535))
    with launch_on(span, stream):
        partials = torch.empty(n_chunks * n_prog, dtype=torch.int64, device="cuda" if span.device.is_cuda else "cpu")
        from .checksum_triton import checksum_bytes_kernel

        checksum_bytes_kernel[(n_chunks, n_prog)](span_tensor(span, 1), partials, n, chunk_bytes, start_word,
                                                  BLOCK=block, num_warps=knobs["num_warps"], num_stages=knobs["num_stages"])
        sums = _sum_partials(partials, n_chunks)
    return [(min(chunk_bytes, n - c * chunk_bytes) * LENGTH_MUL + sums[c]) & M64 for c in range(n_chunks)]


def device_checksum(span, *, stream: Any = None, start_word: int = 0, **tuning: Any) -> int:
    """The digest of a span with the Triton kernels (CUDA spans; host spans under the interpreter).

    ``start_word`` shifts the word indices (tests use it to reach indices past 2**32 without
    allocating 16 GB); it must be a multiple of ``block_words``.
    """
    knobs = _gpu_knobs(tuning)
    if span.nbytes == 0:
        return 0
    if span.ptr % 4:
        return _device_chunk_sums_bytes(span, span.nbytes, stream, knobs, start_word)[0]
    # One chunk spanning the range; its stride rounded to whole tiles keeps 16-byte alignment visible.
    block = knobs["block_words"]
    stride_bytes = -(-span.nbytes // (4 * block)) * 4 * block
    return _device_chunk_sums(span, stride_bytes, stream, knobs, start_word)[0]


def device_chunk_checksums(span, chunk_bytes: int, *, stream: Any = None, **tuning: Any) -> list[int]:
    """:func:`chunk_checksums` with the Triton kernels (CUDA spans; host spans under the interpreter)."""
    knobs = _gpu_knobs(tuning)
    if span.nbytes == 0:
        return []
    if span.ptr % 4 == 0 and chunk_bytes % 4 == 0:
        return _device_chunk_sums(span, chunk_bytes, stream, knobs)
    return _device_chunk_sums_bytes(span, chunk_bytes, stream, knobs)


def start_device_chunk_checksums(span, chunk_bytes: int, *, stream: Any, **tuning: Any) -> PendingDigests:
    """:func:`device_chunk_checksums` launched on ``stream`` and not waited for: the digests of a
    word-aligned span (``span.ptr`` and ``chunk_bytes`` multiples of 4), read by
    :meth:`PendingDigests.digests`. A caller checksums a piece while the next one is copied."""
    if span.ptr % 4 or chunk_bytes % 4 or span.nbytes == 0:
        raise FlashBootError(f"start_device_chunk_checksums needs a non-empty span at a 4-byte aligned address "
                             f"and chunks of a multiple of 4 bytes; got {span.nbytes:,} bytes at {span.ptr:#x} in "
                             f"chunks of {chunk_bytes:,}")
    return _start_chunk_sums(span, chunk_bytes, stream, _gpu_knobs(tuning))


def warm_chunk_checksums(device_index: int, nbytes: int, chunk_bytes: int, **tuning: Any) -> None:
    """Compile and load the kernel that :func:`chunk_checksums` of ``nbytes`` at a 16-byte aligned
    address (an arena, a piece of one) in ``chunk_bytes`` chunks on CUDA device ``device_index``
    launches, without launching it. Chunks of whole 64 bytes take the cubin (one for every size:
    built where the cache has none, and loaded); others launch through Triton, which specialises
    on the sizes (1, multiples of 16): a probe of another shape left ~290 ms of compiling to a
    served load of 40,250 tensors, so that exact launch is compiled. Touches a few bytes of
    scratch memory, not ``nbytes``."""
    import contextlib

    import torch

    from .views import interpreting

    knobs = _gpu_knobs(tuning)
    if nbytes <= 0 or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise FlashBootError(f"warm_chunk_checksums needs nbytes > 0 and chunk_bytes > 0, got {nbytes!r}, "
                             f"{chunk_bytes!r}")
    on_host = interpreting()  # the interpreter compiles nothing; its launches are what tests compare
    words = chunk_bytes % 4 == 0 and nbytes >= 4
    if words and not on_host and (chunk_bytes // 4) % 16 == 0:  # the cubin's launch: one for every size
        launcher = _words_launcher(device_index, knobs, False, quiet=True)
        if launcher is not None:
            launcher.function(device_index)
            return
    from .checksum_triton import checksum_bytes_kernel, checksum_words_kernel

    block = knobs["block_words"]
    n_chunks = -(-nbytes // chunk_bytes)
    with contextlib.nullcontext() if on_host else torch.cuda.device(device_index):
        # 16-byte aligned, as an arena: pointers specialise on it too
        scratch = torch.zeros(16, dtype=torch.int64, device="cpu" if on_host else f"cuda:{device_index}")
        if words:
            grid, sizes = _words_launch(nbytes, chunk_bytes, block, knobs["programs_per_sm"], device_index)
            compiled = checksum_words_kernel.warmup(
                scratch.view(torch.int32), scratch, scratch.view(torch.int32), *_words_sizes_args(sizes, 0),
                BLOCK=block, COPY=False, num_warps=knobs["num_warps"], num_stages=knobs["num_stages"], grid=grid)
        else:
            compiled = checksum_bytes_kernel.warmup(
                scratch.view(torch.uint8), scratch, nbytes, chunk_bytes, 0, BLOCK=block,
                num_warps=knobs["num_warps"], num_stages=knobs["num_stages"], grid=(n_chunks, 1))
    # the module load and launcher a first launch would make lazily (Triton's CompiledKernel)
    init_handles = getattr(compiled, "_init_handles", None)
    if init_handles is not None:
        init_handles()


__all__ = ["CHECKSUM_TUNING", "PendingDigests", "WORDS_ALIGNED_ARGS", "device_checksum", "device_chunk_checksums",
           "prepare_checksum_kernels", "start_device_chunk_checksums", "warm_chunk_checksums", "words_kernel_key"]
