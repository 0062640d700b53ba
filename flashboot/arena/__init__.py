"""The arena: one contiguous, shareable address range per device; every weight is a zero-copy view into it.

Two backends behind one API, both built from **segments**: physical allocations of
``segment_bytes`` (default :data:`SEGMENT_BYTES`, 256 MiB) mapped back to back into one reserved
virtual range, so the weights still sit at offsets of one byte range and move as one.

* **CUDA** (``device=int | "cuda:N"``): ``cuMemCreate`` per segment, one ``cuMemAddressReserve``,
  ``cuMemMap`` per segment, one ``cuMemSetAccess``. The capacity is rounded up to the allocation
  granularity (2 MiB on an H200). Each segment is exportable as a POSIX fd, plus a fabric handle
  where a one-time preflight says fabric is permitted (it is not on machines without an IMEX
  channel: ``CUDA_ERROR_NOT_PERMITTED``).
* **host** (``device="cpu"``, the default without CUDA): one ``memfd`` (anonymous shared memory)
  per segment, mapped with ``MAP_FIXED`` into one reserved range, exportable in the same way. Its
  granularity is fixed at 2 MiB, the CUDA granularity of our GPUs, so an arena asked for the same
  bytes has the same capacity and segments on both backends (a layout planned on a CPU machine
  fits the GPU arena). The pages are sparse until touched.

Why segments: granting a GPU access to a peer's allocation costs ~9.5 ms the first time when the
allocation is 512 MiB or larger, whatever its size, and ~1 ms below that (measured on H200;
:data:`SEGMENT_BYTES`). With 256 MiB segments an importer maps the first segment in ~1 ms and the
rest on first use, each just ahead of its copy, so mapping overlaps the transfer.

An exporter hands out :meth:`Arena.export` (a small picklable :class:`ArenaDescriptor`); another
process on the host calls :meth:`Arena.open`, which takes the segments' fds with ``pidfd_getfd``
(only pid and fd numbers cross the rendezvous) or uses fds received over a Unix socket, then
imports and maps them, possibly on a different GPU than the exporter's (a peer mapping over NVLink).

Setup is transactional: each step pushes its release onto an undo list; a failure halfway runs
the list in reverse, and :meth:`Arena.close` runs it too. Views do not keep the memory mapped
after ``close()``: using a view of a closed arena is a use-after-free, as with any device pointer.
Dropping the last reference to an arena (and its views) without ``close()`` releases it with a
ResourceWarning.
"""

from .backing_cuda import (HandleSupport, _cu_device, _device_attribute, _resolve_access, _set_access,
                           can_access_peer, fabric_preflight, preflight_handle)
from .backing_host import _memfd_name
from .descriptor import ArenaDescriptor
from .range import Arena
from .segments import HANDLE_FABRIC_POSIX_FD, HANDLE_MEMFD, HANDLE_POSIX_FD, HOST_GRANULARITY, SEGMENT_BYTES, parse_dtype
from .undo import _Undo
from .warm import release_warm_imports, warm_import

__all__ = ["Arena", "ArenaDescriptor", "HandleSupport", "fabric_preflight", "preflight_handle", "can_access_peer",
           "parse_dtype", "HOST_GRANULARITY", "SEGMENT_BYTES", "release_warm_imports", "warm_import"]
