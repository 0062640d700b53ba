"""Flag-driven chain copy: one persistent kernel per clone, no host work per chunk (the paper's design).

A clone's kernel copies ``src`` (its predecessor's arena) into ``dst`` chunk by chunk. Chunk ``c``
may be read once the predecessor's ready flag ``ready[c]`` has reached the run's ``epoch``
(cyclic compare, as ``cuStreamWaitValue32`` GEQ); when every tile of the chunk is written the
kernel raises its own ``done[c] = epoch``, which is the next clone's ready flag. Flags are int32
words in GPU memory (host memory under the interpreter); loads and stores of flags are atomics
with acquire/release semantics at system scope, so a predecessor on another GPU works too.

It never spins forever. A wait ends at the run's deadline -- measured with ``%globaltimer`` on
a GPU, counted in polls under the interpreter -- or when the host raises the abort word; the
kernel then records the lowest chunk it could not copy and stops, and :meth:`FlagChainCopy.wait`
raises :class:`~flashboot.errors.WaitTimeoutError` naming that chunk and its bytes. The host
also bounds its own wait for the kernel (a watchdog that raises the abort word).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import triton
import triton.language as tl

from flashboot.errors import MoverError, WaitTimeoutError
from flashboot.memory import Span, check_backed, count_of, span_of, stream_handle, writable
from flashboot.units import check_timeout

from .knobs import check_launch_knobs
from .launch import LaunchConfig, launch
from .views import interpreting, require_kernel_memory, sm_count, span_tensor

NO_FAILURE = 0x7FFFFFFF
"""The error word before any wait failed (kernels ``atomic_min`` the failed chunk into it)."""

FLAG_TUNING: dict[str, Any] = {
    "block_bytes": 32768,  # bytes per tile (4096 int64)
    "num_warps": 4,
    "programs_per_sm": 1,  # one resident program per SM: two clones' kernels share a GPU
}

INTERPRETER_POLLS = 64
"""Under the interpreter a wait gives up after this many polls (no clock there)."""


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _backoff():
    """Sleep the polling thread ~0.5 us: spinning programs leave memory bandwidth to the copies."""
    return tl.inline_asm_elementwise("nanosleep.u32 500;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def flag_chain_copy_kernel(
    dst_ptr,
    src_ptr,
    ready_ptr,
    done_ptr,
    count_ptr,
    error_ptr,
    abort_ptr,
    n_elems: tl.int64,
    chunk_elems: tl.int64,
    tiles_per_chunk: tl.int64,
    n_tiles: tl.int64,
    epoch,
    max_wait: tl.int64,
    BLOCK: tl.constexpr,  # int64 elements per tile
    TIMER: tl.constexpr,  # True: max_wait is nanoseconds of %globaltimer; False: a number of polls
):
    """Tiles in increasing order per program; each waits for its chunk's ready flag, copies, and
    the chunk's last tile raises ``done``. A failed wait records its chunk and ends the program."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    failed = tl.zeros([], tl.int32)
    for tile in range(pid, n_tiles, nprog):
        chunk = tile // tiles_per_chunk
        first = chunk * chunk_elems + (tile - chunk * tiles_per_chunk) * BLOCK
        chunk_end = tl.minimum(chunk * chunk_elems + chunk_elems, n_elems)
        if (failed == 0) and (first < chunk_end):
            flag = tl.atomic_add(ready_ptr + chunk, 0, sem="acquire", scope="sys")
            ready = (flag - epoch) >= 0  # cyclic >= on int32, as cuStreamWaitValue32 GEQ
            waited = tl.zeros([], tl.int64)
            if TIMER:
                start = _now_ns()
            while (not ready) and (waited < max_wait):
                flag = tl.atomic_add(ready_ptr + chunk, 0, sem="acquire", scope="sys")
                ready = (flag - epoch) >= 0
                if TIMER:
                    _backoff()
                    waited = _now_ns() - start
                else:
                    waited += 1
                stop = (tl.atomic_add(abort_ptr, 0, sem="relaxed", scope="sys") != 0) | (
                    tl.atomic_add(error_ptr, 0, sem="relaxed") != 0x7FFFFFFF)
                if stop and not ready:
                    waited = max_wait
            if ready:
                if first + BLOCK <= chunk_end:  # a whole tile: unmasked, so the accesses vectorise
                    tl.store(dst_ptr + first + offs, tl.load(src_ptr + first + offs, cache_modifier=".cg"))
                else:
                    mask = first + offs < chunk_end
                    x = tl.load(src_ptr + first + offs, mask=mask, cache_modifier=".cg")
                    tl.store(dst_ptr + first + offs, x, mask=mask)
                tl.debug_barrier()  # every thread's stores precede the release below
                chunk_len = chunk_end - chunk * chunk_elems
                chunk_tiles = (chunk_len + BLOCK - 1) // BLOCK
                if tl.atomic_add(count_ptr + chunk, 1, sem="acq_rel", scope="gpu") == chunk_tiles - 1:
                    tl.atomic_xchg(done_ptr + chunk, epoch, sem="release", scope="sys")
            else:
                tl.atomic_min(error_ptr, chunk.to(tl.int32))
                failed = tl.full([], 1, tl.int32)


@functools.cache
def _flag_config(block: int, timer: bool, num_warps: int) -> LaunchConfig:
    # num_stages=1: the loop waits on flags; there is nothing to prefetch across its iterations
    return LaunchConfig((("BLOCK", block), ("TIMER", timer)), ("int64", "int64") + ("int32",) * 5 + (None,) * 6,
                        num_warps, 1)


def _flag_knobs(tuning: dict[str, Any]) -> dict[str, Any]:
    """:data:`FLAG_TUNING` with ``tuning``'s overrides, checked (a misspelt knob was ignored, and a
    block that is not a power of two failed inside Triton)."""
    unknown = sorted(set(tuning) - set(FLAG_TUNING))
    if unknown:
        raise MoverError(f"flag chain copy: unknown tuning knob(s) {unknown}; known: {sorted(FLAG_TUNING)}")
    knobs = {**FLAG_TUNING, **tuning}
    bb = knobs["block_bytes"]
    if not isinstance(bb, int) or isinstance(bb, bool) or bb < 16 or bb & (bb - 1):
        raise MoverError(f"flag chain copy: block_bytes must be a power of two >= 16, got {bb!r}")
    check_launch_knobs({**knobs, "num_stages": 1})  # num_stages is fixed at 1 (the loop waits on flags)
    return knobs


class FlagChainCopy:
    """One clone's flag-driven copy of ``src`` into ``dst`` in ``chunk_bytes`` chunks.

    ``ready``: the predecessor's flags (one int32 per chunk; a seed's are all raised up front),
    ``done``: this clone's, the next clone's ``ready``. Pointers and ``chunk_bytes`` must be
    16-byte aligned and the size a multiple of 8 (MoverError otherwise). :meth:`launch` starts
    the kernel; :meth:`wait` waits for it and raises WaitTimeoutError naming the first chunk
    whose flag did not come in time.
    """

    def __init__(self, dst: Any, src: Any, chunk_bytes: int, *, ready: Any, done: Any, **tuning: Any):
        import torch

        d, s = span_of(writable(dst, "flag chain copy")), span_of(src)
        nbytes = s.nbytes
        self.knobs = _flag_knobs(tuning)
        chunk_bytes = count_of(chunk_bytes)  # np.int64(8192) had been refused as no multiple of 16
        n_chunks = -(-nbytes // chunk_bytes) if isinstance(chunk_bytes, int) and chunk_bytes > 0 else 0
        if n_chunks == 0 or chunk_bytes % 16 or nbytes % 8 or d.ptr % 16 or s.ptr % 16 or d.nbytes < nbytes:
            raise MoverError(f"flag chain copy: needs 16-byte aligned pointers (src {s.ptr:#x}, dst {d.ptr:#x}), "
                             f"chunk_bytes a positive multiple of 16 (got {chunk_bytes!r}), a size that is a multiple "
                             f"of 8 (got {nbytes:,}) and a destination that holds it ({d.nbytes:,} bytes)")
        r, f = span_of(ready), span_of(writable(done, "flag chain copy"))
        for role, flags in (("ready", r), ("done", f)):
            if flags.nbytes < 4 * n_chunks or flags.ptr % 4:
                raise MoverError(f"flag chain copy: the {role} flags hold {flags.nbytes // 4} int32 words at "
                                 f"{flags.ptr:#x}; {n_chunks} chunks need {n_chunks} aligned words")
        # the programs copy tiles in any order: a destination over the source read tiles already
        # overwritten, and one over a flag word raised or read that flag with copied bytes
        # (done over ready only raises a flag already at the epoch: allowed)
        out, ins = ("destination", d, nbytes), ("done flags", f, 4 * n_chunks)
        for (w_role, w, w_n), (o_role, o, o_n) in ((out, ("source", s, nbytes)), (out, ("ready flags", r, 4 * n_chunks)),
                                                   (out, ins), (ins, ("source", s, nbytes))):
            if w.device == o.device and w.ptr < o.ptr + o_n and o.ptr < w.ptr + w_n:
                raise MoverError(f"flag chain copy: the {w_role} ({w_n:,} bytes at {w.ptr:#x}) overlaps the "
                                 f"{o_role} ({o_n:,} bytes at {o.ptr:#x}) on {w.device}; give each its own memory")
        if d.device != s.device and not (d.device.is_cuda and s.device.is_cuda):
            raise MoverError(f"flag chain copy: runs between GPU memory; got {s.device} -> {d.device}")
        require_kernel_memory(d)
        if d.device.is_cuda:  # the kernel runs on dst's GPU and reads the predecessor's bytes and flags
            from flashboot.movers.triton_sm import ensure_peer_access

            for remote in (s, r):
                if remote.device != d.device:
                    ensure_peer_access(d.device.index, remote)
        self.dst, self.src, self.ready, self.done = d.sub(0, nbytes), s, r, f
        self.nbytes, self.chunk_bytes, self.n_chunks = nbytes, chunk_bytes, n_chunks
        block = max(1, self.knobs["block_bytes"] // 8)
        self.block = block
        self.tiles_per_chunk = -(-(chunk_bytes // 8) // block)
        self.n_tiles = self.tiles_per_chunk * n_chunks
        dev = d.device
        on = f"cuda:{dev.index}" if dev.is_cuda else "cpu"
        # counters per chunk, then the error word, then the abort word
        self.state = torch.zeros(n_chunks + 2, dtype=torch.int32, device=on)
        self.grid = (max(1, min(sm_count(dev.index if dev.is_cuda else 0) * self.knobs["programs_per_sm"],
                                self.n_tiles)),)
        self.timer = dev.is_cuda and not interpreting()
        self.config = _flag_config(block, self.timer, self.knobs["num_warps"])
        self._timeout_s = 0.0
        self._event = None
        self._handle = 0

    def launch(self, epoch: int, *, stream: Any, timeout_s: float) -> None:
        """Start the copy for ``epoch`` on ``stream``; each chunk's wait gives up after ``timeout_s``."""
        import torch

        # NaN passed "<= 0" and raised a raw ValueError making the kernel's wait; 1e12 s overflowed its int64
        timeout_s = check_timeout(timeout_s, "flag chain copy: timeout_s", MoverError)
        if not isinstance(epoch, (int, np.integer)) or isinstance(epoch, (bool, np.bool_)):  # 1.5 raised a raw TypeError
            raise MoverError(f"flag chain copy: epoch must be an int, got {epoch!r}")
        epoch = int(np.int32(np.uint32(int(epoch) & 0xFFFFFFFF)))  # the flags are int32 words
        for span, role in ((self.dst, "destination"), (self.src, "source"), (self.ready, "ready flags"),
                           (self.done, "done flags")):  # kept since __init__: an arena closed or asleep since segfaulted
            check_backed(span, "flag chain copy", role)
        handle = stream_handle(stream)
        self._timeout_s, self._handle = timeout_s, handle
        max_wait = int(timeout_s * 1e9) if self.timer else INTERPRETER_POLLS
        n = self.n_chunks
        state = self.state
        if self.dst.device.is_cuda:
            with torch.cuda.device(self.dst.device.index):
                s = torch.cuda.ExternalStream(handle) if handle else torch.cuda.default_stream()
                with torch.cuda.stream(s):
                    state[:n].zero_()
                    state[n].fill_(NO_FAILURE)
                    state[n + 1].zero_()
                state.record_stream(s)  # the copier may be dropped while its kernel still runs
        else:
            state[:n] = 0
            state[n] = NO_FAILURE
            state[n + 1] = 0
        base = state.data_ptr()
        args = (self.dst.ptr, self.src.ptr, self.ready.ptr, self.done.ptr, base, base + 4 * n, base + 4 * (n + 1),
                self.nbytes // 8, self.chunk_bytes // 8, self.tiles_per_chunk, self.n_tiles, epoch, max_wait)

        def views():
            return (span_tensor(self.dst, 8), span_tensor(self.src, 8), span_tensor(self.ready, 4, 0, 4 * n),
                    span_tensor(self.done, 4, 0, 4 * n), state[:n], state[n:n + 1], state[n + 1:], *args[7:])

        launch(flag_chain_copy_kernel, self.config, self.grid, args, device=self.dst.device.index, stream=handle,
               views=views)
        if self.dst.device.is_cuda:
            import cupy

            with cupy.cuda.Device(self.dst.device.index):
                self._event = cupy.cuda.Event()
                # recorded on the raw handle: CuPy 14 deprecates wrapping one in ExternalStream
                cupy.cuda.runtime.eventRecord(self._event.ptr, handle)

    def abort(self) -> None:
        """Raise the abort word: waiting programs give up at their next poll."""
        n = self.n_chunks
        if self.dst.device.is_cuda:
            from flashboot import _cuda

            drv = _cuda.driver()
            import cupy

            with cupy.cuda.Device(self.dst.device.index):
                side = cupy.cuda.Stream(non_blocking=True)
                _cuda.check(drv.cuStreamWriteValue32(drv.CUstream(side.ptr), drv.CUdeviceptr(self.state.data_ptr() + 4 * (n + 1)),
                                                     1, 0), "cuStreamWriteValue32(abort)")
                side.synchronize()
        else:
            self.state[n + 1] = 1

    def wait(self, *, watchdog_s: float | None = None) -> None:
        """Wait for the kernel (at most ``watchdog_s``, default the wait timeout plus 10 s, then
        abort it); WaitTimeoutError names the lowest chunk it could not copy."""
        if self._timeout_s == 0.0:  # the error word is 0 until a launch: "chunk 0 did not come within 0 s"
            raise MoverError("flag chain copy: wait() before launch(): nothing runs to wait for")
        if watchdog_s is not None:  # NaN: no deadline was ever passed, the wait spun forever
            watchdog_s = check_timeout(watchdog_s, "flag chain copy: watchdog_s", MoverError)
        if self._event is not None:
            limit = watchdog_s if watchdog_s is not None else self._timeout_s + 10.0
            if not self._event_within(limit):
                self.abort()  # waiting programs see it at their next poll
                if not self._event_within(10.0):
                    raise WaitTimeoutError(f"flag chain copy: the kernel ran past the {limit:g} s watchdog and did not "
                                           "stop within 10 s of the abort word")
        failed = int(self.state[self.n_chunks].item())
        if failed != NO_FAILURE:
            lo = failed * self.chunk_bytes
            hi = min(lo + self.chunk_bytes, self.nbytes)
            raise WaitTimeoutError(f"flag chain copy: chunk {failed} (bytes {lo:,}..{hi:,}) of {self.n_chunks}: its "
                                   f"ready flag did not reach the epoch within {self._timeout_s:g} s (predecessor "
                                   "stalled or gone); the chunks before it that were copied raised their flags")

    def _event_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self._event.done:
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        return True

    def copy(self, epoch: int, *, stream: Any, timeout_s: float) -> None:
        """:meth:`launch` then :meth:`wait`."""
        self.launch(epoch, stream=stream, timeout_s=timeout_s)
        self.wait()


__all__ = ["FlagChainCopy", "flag_chain_copy_kernel", "FLAG_TUNING", "NO_FAILURE"]
