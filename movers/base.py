"""The mover base class: ``copy`` validates once, each backend implements only ``_copy``."""

from __future__ import annotations

from typing import Any, ClassVar

from flashboot.errors import CapabilityError, MoverError
from flashboot.memory import Span, check_backed, count_of, path_between, span_of, stream_device, writable

from .batch import ChunkBatch


def availability_of(cls: type["Mover"]) -> tuple[bool, str]:
    """``cls.availability()``, an exception from it or an answer other than ``(bool, str)`` read
    as ``(False, why)``: a researcher's mover whose availability() imported a missing library had
    made list_movers(), best_mover() and ``bench movers`` raise that ImportError for every mover."""
    try:
        answer = cls.availability()
    except Exception as exc:  # noqa: BLE001 - named in the reason, which every listing shows
        return False, f"{cls.__name__}.availability() raised {type(exc).__name__}: {exc}"
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool)):
        return False, f"{cls.__name__}.availability() returned {answer!r}, not (ok: bool, why: str)"
    return answer[0], str(answer[1])


class Mover:
    """Copies a byte range from ``src`` to ``dst``.

    Subclasses set ``name`` and ``paths`` (a subset of :data:`flashboot.memory.PATHS`), may
    override :meth:`availability`, and implement :meth:`_copy`.
    """

    name: ClassVar[str] = ""
    paths: ClassVar[frozenset[str]] = frozenset()
    alignment: ClassVar[int] = 1
    """Pointers and sizes must be multiples of this (1 for byte-exact backends)."""
    overlap: ClassVar[bool] = True
    """Whether a copy between overlapping ranges is exact; False: :meth:`copy` refuses one (a
    kernel's programs read and write tiles in any order: a forward overlap copied wrong bytes;
    cuMemcpyAsync's memory areas "may not overlap")."""
    batched: ClassVar[str] = "one call per chunk"
    """How :meth:`copy_batch` copies a list of chunks (reports print it)."""

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """``(True, "")`` when the mover can run on this machine, else ``(False, why)``."""
        return True, ""

    def __init__(self) -> None:
        ok, why = availability_of(type(self))
        if not ok:
            raise CapabilityError(f"mover {self.name!r} cannot run here: {why}")

    def copy(self, dst: Any, src: Any, nbytes: int | None = None, *, stream: Any) -> None:
        """Copy ``nbytes`` (default: all of ``src``) from ``src`` to ``dst``, asynchronously on ``stream``.

        ``dst`` and ``src`` are spans, arenas, tensors or arrays. Raises MoverError for a path
        this mover does not support, a size that does not fit, or misaligned pointers.
        """
        dst_span, src_span = span_of(writable(dst, self.name)), span_of(src)
        check_backed(dst_span, self.name, "destination")
        check_backed(src_span, self.name, "source")
        # a size from numpy (np.int64(4096)) had been refused as "not an int"
        nbytes = src_span.nbytes if nbytes is None else count_of(nbytes)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise MoverError(f"{self.name}: nbytes must be a positive int, got {nbytes!r}")
        if nbytes > src_span.nbytes or nbytes > dst_span.nbytes:
            role, span = ("source", src_span) if nbytes > src_span.nbytes else ("destination", dst_span)
            raise MoverError(f"{self.name}: copy of {nbytes:,} bytes overruns the {span.nbytes:,}-byte {role}")
        path = path_between(src_span.device, dst_span.device)
        if path not in self.paths:
            self._check_path(path, src_span.device, dst_span.device)
        self._check_stream(path, src_span.device, dst_span.device, stream)
        if not self.overlap and src_span.device == dst_span.device and dst_span.ptr < src_span.ptr + nbytes \
                and src_span.ptr < dst_span.ptr + nbytes:
            raise MoverError(f"{self.name}: the destination {dst_span.ptr:#x} and the source {src_span.ptr:#x} overlap "
                             f"({nbytes:,} bytes on {dst_span.device}), which it does not copy exactly: copy through a "
                             "separate buffer")
        a = self.alignment
        if a > 1 and (src_span.ptr % a or dst_span.ptr % a or nbytes % a):
            raise MoverError(
                f"{self.name}: needs {a}-byte aligned pointers and size; got src {src_span.ptr:#x}, "
                f"dst {dst_span.ptr:#x}, nbytes {nbytes:,}"
            )
        # Both bounds are checked above; the spans go on whole (no sub-span per call) with the count.
        self._copy(dst_span, src_span, nbytes, path, stream)

    def _check_stream(self, path: str, src: Any, dst: Any, stream: Any) -> None:
        runs_on = src if path == "d2h" else dst
        on = stream_device(stream)
        if runs_on.is_cuda and on is not None and on != runs_on.index:
            raise MoverError(
                f"{self.name}: a {path} copy runs on {runs_on} but the stream belongs to cuda:{on}; "
                f"pass a stream of {runs_on}"
            )

    def _check_path(self, path: str, src: Any, dst: Any) -> None:
        if path not in self.paths:
            from .registry import movers_for

            raise MoverError(
                f"mover {self.name!r} cannot copy {path} ({src} -> {dst}); "
                f"it supports {', '.join(sorted(self.paths))}; movers for {path}: {', '.join(movers_for(path)) or 'none'}"
            )

    def batch(self, dst: Any, src: Any, chunks: Any) -> ChunkBatch:
        """Validate ``chunks``, a list of ``(dst_offset, src_offset, nbytes)`` into ``dst`` from
        ``src``, once: the returned :class:`ChunkBatch` copies them all (``run``) or one by one
        (``copy_chunk``) with no further checks. Raises MoverError naming the first bad entry."""
        return ChunkBatch(self, span_of(writable(dst, self.name)), span_of(src), chunks)

    def copy_batch(self, dst: Any, src: Any, chunks: Any, *, stream: Any) -> None:
        """``self.batch(dst, src, chunks).run(stream=stream)``: every chunk, one call or launch."""
        self.batch(dst, src, chunks).run(stream=stream)

    def _copy(self, dst: Span, src: Span, nbytes: int, path: str, stream: Any) -> None:
        """Copy the first ``nbytes`` of ``src`` to the start of ``dst`` (validated: both hold them)."""
        raise NotImplementedError

    def _prepare_batch(self, batch: ChunkBatch) -> Any:
        """What a backend builds once per batch (a descriptor table, pointer lists); None here."""
        return None

    def _copy_batch(self, batch: ChunkBatch, stream: Any) -> None:
        """Every entry of a validated batch; this default issues one copy per entry."""
        for i in range(len(batch)):
            batch.copy_chunk(i, stream=stream)


__all__ = ["Mover", "availability_of"]
