"""Devices, byte spans and copy paths: the vocabulary shared by arenas, movers and schedulers.

A :class:`Span` is a raw byte range (pointer, length, device). Movers copy between spans; an
arena hands out spans of itself; :func:`span_of` turns tensors and arrays into spans without
copying.
"""

from __future__ import annotations

import operator
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ArenaError, CapabilityError, FlashBootError, MoverError

PATHS = ("h2d", "d2h", "d2d", "p2p", "host")
"""Copy paths a mover may support: host->GPU, GPU->host, same GPU, GPU->other GPU, host->host."""


@dataclass(frozen=True)
class Device:
    """Where memory lives: ``Device("cuda", 0)`` or ``Device("cpu")``."""

    kind: Literal["cuda", "cpu"]
    index: int = 0

    @classmethod
    def parse(cls, spec: Any = None) -> "Device":
        """Accept an int, a bare index (``"0"``), ``"cuda:N"``, ``"cuda"``, ``"cpu"``, a torch.device
        or a Device.

        ``None`` means ``cuda:0`` where CUDA exists, else the host backend (``cpu``).
        Raises CapabilityError for a CUDA device that does not exist.
        """
        from ._cuda import cuda_available, device_count

        if isinstance(spec, Device):
            dev = spec
        elif spec is None:
            dev = cls("cuda", 0) if cuda_available() else cls("cpu")
        elif isinstance(spec, int) and not isinstance(spec, bool):
            dev = cls("cuda", spec)
        else:
            text = str(spec).strip().lower()
            m = re.fullmatch(r"(?:(cuda|cpu)(?::(\d+))?|(\d+))", text)  # the command line gives "0" as text
            if not m:
                raise FlashBootError(f"cannot parse device {spec!r}: use an index (0), 'cuda:N' or 'cpu'")
            dev = cls("cuda", int(m.group(3))) if m.group(3) else cls(m.group(1), int(m.group(2) or 0))
        if dev.kind == "cpu":
            return cls("cpu", 0)
        if dev.index < 0:
            raise CapabilityError(f"device index {dev.index} is negative")
        if not cuda_available():
            raise CapabilityError(f"{dev} was asked for but this machine has no CUDA device; use 'cpu'")
        count = device_count()
        if dev.index >= count:
            raise CapabilityError(f"{dev} does not exist: this machine has {count} CUDA device(s)")
        return dev

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else "cpu"


CPU = Device("cpu")


@dataclass(frozen=True)
class Span:
    """A byte range at ``ptr`` of ``nbytes`` on ``device``. ``pinned`` marks page-locked host memory.

    ``owner`` keeps whatever backs the range alive for as long as the span exists.
    """

    ptr: int
    nbytes: int
    device: Device
    pinned: bool = False
    owner: Any = None

    def sub(self, offset: int, nbytes: int | None = None) -> "Span":
        """The sub-range ``[offset, offset + nbytes)``; bounds checked, integers only (a float
        offset made a span whose pointer no copy could take)."""
        try:
            offset = operator.index(offset)
            nbytes = self.nbytes - offset if nbytes is None else operator.index(nbytes)
        except TypeError:
            raise ArenaError(f"a span's offset and size must be integers, got offset {offset!r} and nbytes "
                             f"{nbytes!r}") from None
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ArenaError(
                f"range [{offset:,}, {offset + nbytes:,}) is outside the {self.nbytes:,}-byte span on {self.device}"
            )
        return Span(self.ptr + offset, nbytes, self.device, self.pinned, self.owner)


def check_backed(span: Span, who: str, role: str) -> None:
    """ArenaError (``"{who}: the {role}: ..."``) when nothing backs a span's memory now: its owner
    was closed since (an arena's range given back: a copy through the span would fault or write
    over whatever the process put there), or is an arena asleep (its range reserved, unmapped: a
    copy segfaulted). A wake's own fills copy into the segments it has mapped so far
    (``Arena.backs``). On every copy's path: the message is built only for a refusal."""
    owner = span.owner
    if getattr(owner, "closed", False) is True:
        raise ArenaError(f"{who}: the {role}: the span at {span.ptr:#x} ({span.nbytes:,} bytes on {span.device}) "
                         f"belongs to {owner!r}, which is closed")
    backs = getattr(owner, "backs", None)
    if backs is not None and not backs(span.ptr, span.nbytes):
        raise ArenaError(f"{who}: the {role}: the span at {span.ptr:#x} ({span.nbytes:,} bytes on {span.device}) "
                         f"belongs to {owner!r}, which is asleep (nothing backs it): wake() it first")


def writable(dst: Any, who: str) -> Any:
    """``dst``, or MoverError for a read-only numpy array (``np.frombuffer`` of bytes, a memory
    map opened "r"): its span is a bare pointer, and a copy through it wrote into the immutable
    bytes or faulted on the read-only map. Every copy into a caller's destination checks it."""
    np = sys.modules.get("numpy")  # no numpy imported: no numpy array (this module imports none)
    if np is not None and isinstance(dst, np.ndarray) and not dst.flags.writeable:
        raise MoverError(f"{who}: the destination ({dst.nbytes:,} bytes at {dst.ctypes.data:#x}) is a read-only "
                         "numpy array; copy into a writeable one")
    return dst


def count_of(value: Any) -> Any:
    """``value`` as the plain int it holds where numpy computed it (``np.int64(4096)``: a sweep over
    ``2 ** np.arange``), else unchanged for the caller to judge; a bool stays a bool (True is no
    byte count)."""
    if type(value) is int or isinstance(value, bool) or not hasattr(type(value), "__index__") \
            or type(value).__module__ != "numpy" or getattr(value, "dtype", None) == bool:
        return value
    try:
        return operator.index(value)
    except TypeError:  # an array of more than one value, or of floats: no count, for the caller to refuse
        return value


_CUDA_DEVICES: dict[int, Device] = {}


def cuda_device(index: int) -> Device:
    """``Device("cuda", index)``, one object per index (the movers' per-call path builds none)."""
    dev = _CUDA_DEVICES.get(index)
    if dev is None:
        dev = _CUDA_DEVICES.setdefault(index, Device("cuda", index))
    return dev


def span_of(obj: Any) -> Span:
    """A span over a Span, an arena, a contiguous torch tensor, a numpy or a CuPy array (no copy)."""
    if isinstance(obj, Span):
        return obj
    mod = type(obj).__module__
    if mod == "torch" or mod.startswith("torch."):  # tensors first: a mover's per-call path
        if not obj.is_contiguous():
            raise FlashBootError(f"tensor of shape {tuple(obj.shape)} is not contiguous; movers copy byte ranges")
        if obj.is_conj() or obj.is_neg():  # a lazy conj()/neg view: its bytes are not its values
            raise FlashBootError(f"tensor of shape {tuple(obj.shape)} is a lazy {'conjugate' if obj.is_conj() else 'negative'}"
                                 " view (its bytes are not its values); resolve_conj()/resolve_neg() it first")
        nbytes = obj.nbytes
        if obj.is_cuda:  # plain attributes: ``obj.device`` builds a torch.device every time
            return Span(obj.data_ptr(), nbytes, cuda_device(obj.get_device()), owner=obj)
        dev = obj.device
        if dev.type == "cpu":
            return Span(obj.data_ptr(), nbytes, CPU, pinned=bool(obj.is_pinned()) if nbytes else False, owner=obj)
        raise FlashBootError(f"tensors on {dev} are not supported")
    if hasattr(obj, "span") and callable(obj.span):  # Arena
        return obj.span()
    mod = mod.split(".")[0]
    if mod == "numpy":
        if not obj.flags["C_CONTIGUOUS"]:
            raise FlashBootError("numpy array is not C-contiguous")
        if obj.dtype.hasobject:  # its bytes are pointers into this process's heap
            raise FlashBootError(f"numpy array of dtype {obj.dtype} holds Python objects, not bytes to copy")
        return Span(obj.ctypes.data, obj.nbytes, CPU, owner=obj)
    if mod == "cupy":
        if not obj.flags.c_contiguous:
            raise FlashBootError("CuPy array is not C-contiguous")
        return Span(obj.data.ptr, obj.nbytes, cuda_device(obj.device.id), owner=obj)
    raise FlashBootError(f"cannot take a byte span of {type(obj).__name__}")


def path_between(src: Device, dst: Device) -> str:
    """The copy path from ``src`` to ``dst``: one of :data:`PATHS`."""
    if src.kind == "cpu" and dst.kind == "cpu":
        return "host"
    if src.kind == "cpu":
        return "h2d"
    if dst.kind == "cpu":
        return "d2h"
    return "d2d" if src.index == dst.index else "p2p"


def stream_handle(stream: Any) -> int:
    """The raw ``cudaStream_t`` of an int, a torch or CuPy stream, or None (the legacy default stream)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if handle is None:
        handle = getattr(stream, "ptr", None)  # cupy.cuda.Stream
    if handle is not None:
        return int(handle)
    raise FlashBootError(f"cannot use {type(stream).__name__} as a CUDA stream")


def stream_device(stream: Any) -> int | None:
    """The CUDA device index a torch or CuPy stream belongs to; None for raw handles and None."""
    index = getattr(stream, "device_index", None)  # torch.cuda.Stream: a plain int (``.device`` builds an object)
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    dev = getattr(stream, "device", None)  # torch streams of other kinds
    if dev is not None and getattr(dev, "type", None) == "cuda":
        return dev.index or 0
    dev_id = getattr(stream, "device_id", None)  # cupy.cuda.Stream
    return int(dev_id) if isinstance(dev_id, int) and dev_id >= 0 else None


# ------------------------------------------------------------------ the process's own limits
def address_space_limit() -> tuple[int, int] | None:
    """``(limit, mapped now)`` in bytes where this process's address space is limited
    (RLIMIT_AS, ``ulimit -v``: set by some batch schedulers and containers), else None."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        used = 0
    return limit, used


_NO_LIMIT = 1 << 60
"""A cgroup v1 ``memory.limit_in_bytes`` at or above this is no limit (the kernel writes ~2**63)."""


def cgroup_memory_room(*, root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> tuple[int, str] | None:
    """``(bytes, where)``: what this process's memory cgroup, and each one above it, may still be
    charged before its limit (the page cache counted as reclaimable, shared memory as not), the
    tightest of them and its limit file; None where no limit applies or none can be read.

    A container's ``/dev/shm`` is tmpfs charged to its memory cgroup: a stage past the limit was
    OOM-killed halfway, where a free-space check of the tmpfs (the host's half of RAM) passed.
    cgroup v2 (``0::PATH``: ``memory.max``, ``memory.current``, ``memory.stat`` file and shmem)
    and v1 (the ``memory`` controller: ``memory.limit_in_bytes``, ``memory.usage_in_bytes``,
    ``memory.stat`` cache and shmem)."""
    import os

    def number(path: str) -> int | None:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None  # "max": no limit at this level

    def stat(path: str, *keys: str) -> list[int]:
        try:
            with open(path) as f:
                fields = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
        except OSError:
            return [0 for _ in keys]
        return [int(fields.get(k, 0)) for k in keys]

    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    tightest: tuple[int, str] | None = None
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # v2: its root, or beside v1 controllers at unified/
            base = root if os.path.exists(os.path.join(root, "cgroup.controllers")) else os.path.join(root, "unified")
            files = ("memory.max", "memory.current", ("file", "shmem"))
        elif "memory" in controllers.split(","):
            base = os.path.join(root, "memory")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("cache", "shmem"))
        else:
            continue
        level = path.rstrip("/")
        while True:  # the cgroup, then each one above it, to the hierarchy's root
            d = os.path.join(base, level.lstrip("/"))
            limit = number(os.path.join(d, files[0]))
            if limit is not None and limit < _NO_LIMIT:
                used = number(os.path.join(d, files[1])) or 0
                cache, shmem = stat(os.path.join(d, "memory.stat"), *files[2])
                room = max(0, limit - used + max(0, cache - shmem))
                if tightest is None or room < tightest[0]:
                    tightest = (room, f"{os.path.join(d, files[0])} = {limit:,}, {used:,} charged")
            if not level:
                break
            level = level.rpartition("/")[0]
    return tightest


def map_refused(what: str, nbytes: int, exc: OSError) -> FlashBootError:
    """The error for a mapping of ``nbytes`` (``what``) the kernel refused with ``exc``: under an
    address-space limit too small for it, an OutOfMemoryError with the limit and the bytes left
    under it (a bare ``[Errno 12] Cannot allocate memory`` named neither); otherwise a
    FlashBootError naming the bytes and the system's error."""
    import errno

    from .errors import OutOfMemoryError

    limited = address_space_limit() if exc.errno == errno.ENOMEM else None
    if limited is not None and nbytes > limited[0] - limited[1]:
        limit, used = limited
        return OutOfMemoryError(f"{what}: this process may map at most {limit:,} bytes (`ulimit -v`) and maps "
                                f"{used:,} already", nbytes, max(0, limit - used))
    code = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    return FlashBootError(f"{what}: mapping {nbytes:,} bytes failed: {code} ({exc.strerror or exc})")


def thread_refused(what: str, exc: RuntimeError) -> FlashBootError:
    """The error for a thread whose start was refused (``exc``, Python's "can't start new thread"):
    the process may start no more (``ulimit -u``, a container's pids limit) or has no room for
    its stack (``ulimit -v``), with the limits this process has."""
    import resource

    from .units import limit_text

    nproc, vm = resource.getrlimit(resource.RLIMIT_NPROC)[0], resource.getrlimit(resource.RLIMIT_AS)[0]
    return FlashBootError(f"{what}: a thread could not be started ({exc}): this process may start no more "
                          f"(`ulimit -u`: {limit_text(nproc)} processes and threads of its user; or a container's "
                          f"pids limit) or map no more stacks (`ulimit -v`: {limit_text(vm)} bytes)")
