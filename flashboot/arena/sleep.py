"""The Arena's sleep and wake: its physical segments apart from its reserved address range.

A mixin of :class:`flashboot.arena.Arena` (its state is the Arena's: ``_segments``, ``_backing``,
``_attach``, ``_exports``, ``_asleep``, ``_shares``): :meth:`~SleepWake.sleep` releases the
segments and keeps the range, :meth:`~SleepWake.wake` maps new ones (or another arena's) at the
same addresses, :meth:`~SleepWake.share` marks an arena another process maps for its lifetime.
"""

from __future__ import annotations

import errno
import time
from collections import Counter
from typing import Callable, Sequence

from .. import _cuda
from ..errors import ArenaError, CudaError, OutOfMemoryError
from ..memory import Span
from . import backing_host as host
from .undo import _Undo


def _reusable_bytes(sizes: Sequence[int], donor_sizes: Sequence[int]) -> int:
    """Bytes of an arena of segment ``sizes`` that segments of ``donor_sizes`` can back (size for size)."""
    return sum((Counter(sizes) & Counter(donor_sizes)).elements())


def _release_handed(handles: list | None) -> None:
    """``cuMemRelease`` the ``(handle, nbytes)`` a donor handed over that no segment took; all run,
    the first error is raised."""
    first: BaseException | None = None
    drv = _cuda.driver() if handles else None
    while handles:
        handle, nbytes = handles.pop()
        try:
            _cuda.check(drv.cuMemRelease(handle), f"cuMemRelease(a handed-over segment of {nbytes:,} bytes)")
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first


class SleepWake:
    """Sleep, wake and sharing of an :class:`~flashboot.arena.Arena` (mixed into it)."""

    @property
    def asleep(self) -> bool:
        """True between :meth:`sleep` and :meth:`wake`: the addresses are reserved, nothing backs them."""
        return self._asleep

    def backs(self, ptr: int, nbytes: int) -> bool:
        """Whether memory backs ``[ptr, ptr + nbytes)`` now: all of the range while awake, none
        while asleep, except during :meth:`wake` the segments it has mapped so far (its ``fill``
        copies into each as it comes; the arena is asleep until the last is mapped)."""
        if not self._asleep:
            return True
        return self._ptr <= ptr and ptr + nbytes <= self._ptr + self._waking_bytes

    def share(self, who: str) -> None:
        """Record that another process keeps this arena mapped for as long as it lives (a holder,
        a seed's clones): :meth:`sleep` is refused by name until :meth:`unshare` (``who``)."""
        self._check_open()
        self._shares.add(str(who))

    def unshare(self, who: str) -> None:
        """Forget :meth:`share` (``who``), once that process has let go of its mapping."""
        self._shares.discard(str(who))

    @_cuda.keeps_context
    def sleep(self, *, synchronize: bool = True, timings: dict | None = None,
              drain: Callable[[int, Span], Callable[[], None] | None] | None = None) -> None:
        """Release the physical memory and keep the address range: every view, and every pointer a
        CUDA graph captured, keeps its address; reading one before :meth:`wake` is a fault.

        CUDA: waits for the device's work, then ``cuMemRelease`` per segment and one
        ``cuMemUnmap`` over the whole range, which frees them (the ``cuMemAddressReserve``
        stays). Host: each segment's mapping becomes the inaccessible reservation again and its
        memfd is closed. The contents are gone; :meth:`wake` maps new, uninitialised segments
        (:func:`flashboot.flashload.lifecycle.sleep` keeps the bytes).

        ``drain(offset, span)``, when given, is called for every segment in order before any is
        released (``span``: the segment, at byte ``offset`` of the arena): it issues the copy of
        the segment's bytes out and returns a callable that waits for that copy (or None once it
        is done). Each segment is then released as soon as its copy has ended, while the later
        copies run: the driver's work on freed memory (on an H200 it holds the copy engine for
        ~25 ms after 14 GB are freed) overlaps the copy instead of slowing the next H2D. A drain
        that raises leaves the arena awake, nothing released. A wait that raises: the other
        copies are waited for, every segment is released (the arena is asleep) and ArenaError
        names the segment whose bytes were not copied out. The exports are revoked once every copy
        is issued, before the first release.

        Exports: an arena :meth:`share` d with another process (a holder: :func:`hand_over
        <flashboot.flashclone.holder.hand_over>` marks it) is refused with ArenaError naming who
        maps it, since its memory would silently stop being this arena's. Otherwise the export is
        revoked: the exported fds are closed and :meth:`export` after :meth:`wake` hands out the
        new segments; a process that opened the old descriptor and still maps it keeps the old
        memory (its copy, never freed memory). Sleeping an asleep arena is a no-op; an opened
        (imported) arena is refused. ``synchronize=False``: the caller has already waited for
        every use of this memory (so a copy into another arena on the device may go on meanwhile).
        ``timings`` (optional dict) gains ``sync_ms``, ``drain_ms`` (with ``drain``: from the
        first copy issued to the last segment released behind its copy), ``revoke_ms`` (the
        exported fds closed), ``release_ms`` (the segments) and ``steps_ms`` (the release's ms
        per driver or system call, e.g. ``cuMemUnmap``).
        """
        self._check_sleepable()
        self._make_all()  # an arena made with segments_now releases every segment
        with self._map_lock:
            self._check_open()  # again under the lock: a close() may have run since
            if self._asleep:
                return
            self._check_unshared("sleep")
            t0 = time.perf_counter()
            if self._device.is_cuda:
                _cuda.use_device(self._home_device.index)
                if synchronize:
                    _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize(before sleep)")
            t_synced = time.perf_counter()
            waits = [] if drain is None else [drain(i * self._segment_bytes, self._segment_span(i))
                                              for i in range(self.segments)]
            t_issued = time.perf_counter()
            self._revoke_exports()  # before any release: an exported fd would keep a segment's memory
            t_revoked = time.perf_counter()
            segments, steps = self._segments, {}
            self._segments, self._asleep = None, True
            try:
                if waits:
                    self._release_drained(segments, waits)
            finally:
                t_drained = time.perf_counter()
                try:
                    self._backing.release()
                finally:
                    steps.update(segments.steps_ms)
                    if timings is not None:
                        timings.update(sync_ms=(t_synced - t0) * 1e3, revoke_ms=(t_revoked - t_issued) * 1e3,
                                       release_ms=(time.perf_counter() - t_drained) * 1e3, steps_ms=steps)
                        if drain is not None:
                            timings["drain_ms"] = (t_issued - t_synced + t_drained - t_revoked) * 1e3

    def check_can_sleep(self) -> None:
        """ArenaError naming why :meth:`sleep` would be refused (closed, opened from another
        process's export, or mapped by another process, see :meth:`share`), before anything moves."""
        self._check_sleepable()
        self._check_unshared("sleep")

    def _check_sleepable(self) -> None:
        self._check_open()
        if self._imported:
            raise ArenaError(f"arena {self._arena_id} is opened from pid {self._descriptor.pid}'s export; only its "
                             "owner can put it to sleep or hand its segments over")

    def _check_unshared(self, what: str) -> None:
        if self._shares:
            raise ArenaError(f"arena {self._arena_id} cannot {what}: {len(self._shares)} other process(es) map it "
                             f"({'; '.join(sorted(self._shares))}); release it there, then unshare()")

    def _segment_span(self, i: int) -> Span:
        offset = i * self._segment_bytes
        return Span(self._ptr + offset, self._segment_sizes[i], self._device, False, self)

    def _release_drained(self, segments, waits: list) -> None:
        """Release each segment once its drained copy ended; see :meth:`sleep` for a failed one."""
        for i, wait in enumerate(waits):
            try:
                if wait is not None:
                    wait()
            except BaseException as exc:
                for later in waits[i + 1:]:  # no copy may read a segment once it is freed
                    try:
                        if later is not None:
                            later()
                    except BaseException as again:
                        exc.add_note(f"waiting for a later segment's copy failed too: {again!r}")
                start = i * self._segment_bytes
                raise ArenaError(f"putting arena {self._arena_id} to sleep: the copy out of segment {i} (bytes "
                                 f"{start:,}..{start + self._segment_sizes[i]:,}) failed: {type(exc).__name__}: "
                                 f"{exc}; the arena is asleep and its bytes from segment {i} on were not all copied "
                                 "out") from exc
            segments.release_segment(i)

    def _hand_over(self, timings: dict) -> list:
        """Give this arena's segments to another one (:meth:`wake`'s ``donor``): unmap them, keep
        them allocated, and go to sleep; returns ``(handle, nbytes)`` per segment."""
        with self._map_lock:
            self._check_handable()
            t0 = time.perf_counter()
            _cuda.use_device(self._home_device.index)
            segments = self._segments
            self._segments, self._asleep = None, True
            try:
                self._revoke_exports()
                handed = segments.detach()
            finally:
                self._backing.release()  # the detached segments' step: nothing left to release
            timings["donor_ms"] = (time.perf_counter() - t0) * 1e3
            return handed

    def _check_handable(self) -> None:
        """ArenaError unless this arena can hand its segments to another: an awake owner, unshared."""
        self._check_sleepable()
        self._check_awake("handing its segments over")
        self._make_all()  # an arena made with segments_now hands over every segment
        self._check_unshared("hand its segments over")

    def _check_donor(self, donor: "SleepWake") -> None:
        if not isinstance(donor, SleepWake) or donor is self:
            raise ArenaError(f"wake(donor=...) needs another Arena, got {donor!r}")
        donor._check_handable()
        if not (self._device.is_cuda and donor.device.is_cuda):
            raise ArenaError(f"arena {self._arena_id} cannot take the segments of arena {donor.arena_id}: only CUDA "
                             "arenas hand segments over (a host arena's memfds are named after their arena, and "
                             "importers check the name)")
        if (donor.home_device, donor.segment_bytes) != (self._home_device, self._segment_bytes):
            raise ArenaError(f"arena {self._arena_id} ({self._segment_bytes:,}-byte segments on {self._home_device}) "
                             f"cannot take the segments of arena {donor.arena_id} ({donor.segment_bytes:,}-byte "
                             f"segments on {donor.home_device})")

    @_cuda.keeps_context
    def wake(self, fill: Callable[[int, Span], None] | None = None, *, settle: Callable[[], None] | None = None,
             timings: dict | None = None, donor: "SleepWake | None" = None) -> None:
        """Back the reserved range with new segments at the same addresses (contents undefined).

        ``fill(offset, span)``, when given, is called for each new segment in order as soon as it
        is mapped and accessible (``span``: the segment, starting at byte ``offset`` of the arena),
        so the caller can issue the copy of its bytes while the next segments are created; the
        copy engine then starts on the first segment instead of after the last. ``settle()``
        waits until every copy ``fill`` issued has ended: a failed wake calls it before it
        releases the new segments, so no copy writes freed memory. ``timings`` (optional dict)
        gains ``create_ms``, ``map_ms``, ``access_ms``, ``fill_ms`` (time spent in ``fill``),
        summed over the segments, ``reused`` and ``donor_ms`` (with ``donor``), and ``wake_ms``
        (all of it).

        ``donor``: another awake CUDA arena of this process on the same device with the same
        segment size, whose segments this one takes instead of new ones (a model swap): the donor
        is unmapped and asleep (its exports revoked, as :meth:`sleep`), its segments are mapped
        here without being freed or created, and those of a size this arena has no use for are
        released. No memory changes hands through the driver, so none of its work on freed memory
        slows the copy that follows (benchmarks/RESULTS.md, "Issue 17 again"). ArenaError before
        anything moves for a host, imported, shared or asleep donor, or another device or segment
        size. The donor's memory is this arena's from then on, also when the wake fails (then both
        are asleep).

        One transaction: the new segments' steps go onto their own undo list, which is released
        if any step (or ``fill``) fails (the arena stays asleep and can be woken later) and
        committed to the arena only when all succeeded. Raises OutOfMemoryError with the bytes
        needed and free when the device (host: MemAvailable + SwapFree) has no room, before or
        during the allocation. Waking an awake arena is a no-op (``fill`` is not called).
        """
        self._check_open()
        with self._map_lock:
            self._check_open()  # again under the lock: mapping into a range close() gave back is fatal
            if not self._asleep:
                return
            t0 = time.perf_counter()
            where = f"waking arena {self._arena_id} ({self._nbytes:,} bytes in {self.segments} segment(s) on {self._device})"
            if donor is not None:
                self._check_donor(donor)
            need = self._nbytes - (_reusable_bytes(self._segment_sizes, donor._segment_sizes) if donor else 0)
            free = self._free_bytes()
            if need > free:
                raise OutOfMemoryError(where, need, free)
            fresh = _Undo(where, before_release=(lambda i=self._home_device.index: _cuda.use_device(i))
                          if self._device.is_cuda else None)
            ready = None
            if fill is not None:
                def ready(i: int) -> None:
                    offset = i * self._segment_bytes
                    self._waking_bytes = offset + self._segment_sizes[i]  # segments map in order
                    fill(offset, self._segment_span(i))

            stats: dict = {}
            reuse = donor._hand_over(stats) if donor is not None else None
            try:
                if self._device.is_cuda:
                    _cuda.use_device(self._home_device.index)
                made = self._attach(fresh, ready, stats, reuse)
            except BaseException as exc:
                self._waking_bytes = 0
                try:
                    if settle is not None:
                        settle()  # the copies already issued end before their memory is released
                except BaseException as again:
                    exc.add_note(f"waiting for the copies issued into the new segments failed too: {again!r}")
                finally:
                    try:
                        fresh.release()
                    finally:
                        _release_handed(reuse)
                if isinstance(exc, CudaError) and exc.name == "CUDA_ERROR_OUT_OF_MEMORY" or \
                        isinstance(exc, OSError) and exc.errno in (errno.ENOMEM, errno.ENOSPC):
                    raise OutOfMemoryError(f"{where}: {exc}", need, self._free_bytes()) from exc
                if isinstance(exc, OSError):
                    raise ArenaError(f"{where} failed: {exc}") from exc
                raise
            fresh.commit_into(self._backing)
            self._segments = made
            if not self._device.is_cuda:
                self._descriptor = self._host_descriptor(made.fds)
            self._asleep, self._waking_bytes = False, 0
            _release_handed(reuse)  # the donor's segments this arena had no place for
            if timings is not None:
                stats["fill_ms"] = stats.pop("ready_ms", 0.0)
                timings.update(stats, wake_ms=(time.perf_counter() - t0) * 1e3)

    def _free_bytes(self) -> int:
        if not self._device.is_cuda:
            return host._host_mem_available()
        _cuda.use_device(self._home_device.index)  # cuMemGetInfo answers for the current context's device
        free, _total = _cuda.check(_cuda.driver().cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    def _check_awake(self, what: str) -> None:
        if self._asleep:
            raise ArenaError(f"arena {self._arena_id} is asleep (its addresses are reserved, nothing backs them): "
                             f"wake() it before {what}")
