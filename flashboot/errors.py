"""The one error hierarchy of FlashBoot. Every failure the package raises derives from
:class:`FlashBootError` and carries the numbers that explain it (bytes, offsets, paths)."""

from __future__ import annotations


class FlashBootError(Exception):
    """Base class of every error FlashBoot raises."""


_CONTROL_ESCAPES = {c: repr(chr(c))[1:-1] for c in [*range(32), *range(127, 160)] if c != 9}


def one_line(message: str) -> str:
    """``message`` as one line of a log or terminal: control characters written as escapes (``\\n``,
    ``\\x1b``). A path named in an error may hold a newline or an escape sequence: printed raw, it
    broke the error into lines that read as records of their own, or restyled the terminal."""
    return message.translate(_CONTROL_ESCAPES)


def restated(exc: BaseException, message: str) -> FlashBootError:
    """``message`` (which says where ``exc`` happened) as an error of ``exc``'s own class, its
    attributes kept, when that is a FlashBootError, so a caller's ``except MoverError`` (or
    ``ArenaError``, ``WaitTimeoutError``...) still catches it once a caller added its context; a
    plain FlashBootError otherwise. Raise it ``from exc``."""
    if not isinstance(exc, FlashBootError):
        return FlashBootError(message)
    cls = type(exc)
    new = cls.__new__(cls, message)  # not cls(...): CudaError and others take structured arguments
    new.__dict__.update(exc.__dict__)
    new.args = (message,)
    return new


class CudaError(FlashBootError):
    """A CUDA driver or runtime call failed. Names the call and the CUDA error."""

    def __init__(self, call: str, code: int, name: str, description: str = ""):
        self.call, self.code, self.name = call, code, name
        detail = f": {description}" if description else ""
        super().__init__(f"{call} failed with {name} ({code}){detail}")


class CapabilityError(FlashBootError):
    """The machine lacks something the request needs (no CUDA, no TMA, no peer access...)."""


class ArenaError(FlashBootError):
    """Bad arena request: size, bounds, alignment, closed arena, stale descriptor."""


class OutOfMemoryError(ArenaError):
    """Refused before allocating: says how many bytes were asked for and how many are free."""

    def __init__(self, what: str, nbytes_needed: int, nbytes_free: int):
        self.nbytes_needed, self.nbytes_free = nbytes_needed, nbytes_free
        super().__init__(
            f"{what}: needs {nbytes_needed:,} bytes but only {nbytes_free:,} are free "
            f"(short by {nbytes_needed - nbytes_free:,})"
        )


class KernelCacheError(FlashBootError):
    """A kernel compiled ahead of time is unreadable: a cubin whose size or hash is not the one
    its cache entry records, or an entry that cannot be parsed. Names the path and the numbers."""


class MoverError(FlashBootError):
    """A mover was asked for something it cannot do."""


class UnknownNameError(FlashBootError, KeyError):
    """A registry lookup failed; lists the names that are known."""

    def __init__(self, kind: str, name: str, known):
        self.kind, self.name, self.known = kind, name, sorted(known)
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class LayoutError(FlashBootError):
    """A pre-packed image or its metadata is malformed or does not match the request."""


class ChecksumMismatchError(LayoutError):
    """Bytes differ from the recorded checksum; names the chunk and its byte range."""

    def __init__(self, where: str, chunk: int, offset: int, nbytes: int, expected: int, found: int):
        self.chunk, self.offset, self.nbytes = chunk, offset, nbytes
        self.expected, self.found = expected, found
        super().__init__(
            f"{where}: chunk {chunk} (bytes {offset:,}..{offset + nbytes:,}) has checksum "
            f"{found:#018x}, expected {expected:#018x}"
        )


class ImageReadError(FlashBootError):
    """Reading an image file failed (an I/O error, not a malformed image); names the file, the
    byte offset and the operating system's error."""

    def __init__(self, path: str, offset: int, nbytes: int, error: str):
        self.path, self.offset, self.nbytes, self.error = str(path), offset, nbytes, error
        super().__init__(f"{path}: reading {nbytes:,} bytes at byte {offset:,} failed: {error}")


class WaitTimeoutError(FlashBootError, TimeoutError):
    """A wait ran past its timeout; names what was awaited and for how long."""


class RendezvousError(FlashBootError):
    """Out-of-band exchange refused or failed (wrong token, mismatched manifest, dead peer)."""


class StoreLostError(RendezvousError):
    """The connection to the rendezvous store broke (the process hosting it exited, the connection
    was reset): names the store and what was being done. Later calls on the same connection fail
    at once with this error, as do the calls after a bounded call went unanswered (that one
    raises WaitTimeoutError)."""
