"""The endpoints a clone reads from: the seed, earlier clones, a retry source, the host image."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from ..errors import FlashBootError, RendezvousError, WaitTimeoutError
from ..memory import CPU, Device, Span
from ..schedulers import HOST
from .executor import Endpoint
from .manifest import Manifest
from .rendezvous import Rendezvous, StoreLostError
from .common import _FALLBACK_INDEX, _SEED_INDEX, _alive, _descriptor_from, _gkey, _same_host
from .session import _Session
from .transports.posix_fd import _open_arena


MAX_DONE_SCAN = 64
"""How many of the newest finished-clone records a re-attaching clone looks through."""


class _HostImage:
    """An image's bytes mapped on the host: the preloader's staged copy in /dev/shm when there is
    one (same pages, no copy), else the image file. On CUDA, ``pin`` = (offset, nbytes) is
    page-locked so the copy engine can read it (only a ring member's shard, not the whole image)."""

    def __init__(self, source: Any, device: Device, *, rank: int = 0, pin: tuple[int, int] | None = None):
        import mmap

        self.metadata = None
        self._mm = None
        self._pinned = None
        path = Path(source)
        fd = None
        if path.is_dir():
            from flashboot.layouts import read_image

            image = read_image(path, rank)
            self.metadata = image.metadata
            file_path, self.nbytes = image.path, image.nbytes
        elif path.is_file():
            file_path, self.nbytes = path, path.stat().st_size
        else:
            raise FlashBootError(f"host image {str(path)!r} is neither an image directory nor a file")
        if self.nbytes <= 0:
            raise FlashBootError(f"host image {str(file_path)!r} is empty")
        if self.metadata is not None:
            staged = _open_staged(path, rank, image)
            if staged is not None:
                file_path, fd = staged
        self.path = str(file_path)
        if fd is None and os.access(file_path, os.W_OK):
            fd = os.open(file_path, os.O_RDWR)
        if fd is not None:
            try:  # shared: the page-cache (or /dev/shm) pages themselves, so pinning copies nothing; never written
                self._mm = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        else:
            with open(file_path, "rb") as f:
                # private copy-on-write, so its address can be taken (pinning it copies the pages)
                self._mm = mmap.mmap(f.fileno(), self.nbytes, access=mmap.ACCESS_COPY)
        import ctypes

        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        if pin is not None and device.is_cuda and pin[1] > 0:
            from ..pinning import register_host

            page = mmap.PAGESIZE
            lo = pin[0] // page * page
            hi = min(self.nbytes, -(-(pin[0] + pin[1]) // page) * page)
            try:
                self._pinned = register_host(self.ptr + lo, hi - lo, device, path=self.path, offset=lo)
            except BaseException:
                self.close()
                raise

    def span(self) -> Span:
        return Span(self.ptr, self.nbytes, CPU, pinned=self._pinned is not None, owner=self)

    @property
    def pin_ms(self) -> float:
        return self._pinned.pin_ms if self._pinned is not None else 0.0

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned.unregister()
            self._pinned = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def _open_staged(image_dir: Path, rank: int, image) -> tuple[Path, int] | None:
    """The preloader's staged copy of ``image``'s rank, opened read-write from its checked folder
    (:func:`flashboot.flashload.shm.open_staged`), or None where there is none of this pre-pack.
    By path, a folder swapped in after a check, or a copy staged from an earlier pre-pack of the
    same directory (any size as large), had been read as the image."""
    from ..flashload.shm import open_staged, staged_paths

    try:
        paths = staged_paths(image_dir, rank)
        info, fd = open_staged(paths, os.O_RDWR)
    except (FileNotFoundError, FlashBootError):
        return None
    if info.metadata_sha256 != image.metadata_sha256 or info.nbytes != image.nbytes or os.fstat(fd).st_size < image.nbytes:
        os.close(fd)
        return None
    return paths.image, fd


class _Sources:
    """Opens and remembers the endpoints a clone reads from: the seed, earlier clones, a retry
    source, the host image."""

    def __init__(self, session: _Session, dev: Device, generation: str, schedule: str, manifest: Manifest,
                 seed_desc, seed_pid: int, transport: str, timeout_s: float, rank: int = 0, held: dict | None = None,
                 chunk_bytes: int | None = None):
        self.session, self.dev, self.gen, self.schedule = session, dev, generation, schedule
        self.chunk_bytes = chunk_bytes
        """The plan's chunk: a clone that copies by other chunks raises flags we cannot read (None: unchecked)."""
        self.held = held
        """The caller's seed mappings kept between clones (``clone(held_sources=...)``), or None."""
        self.rank = rank
        self.manifest, self.seed_desc, self.seed_pid = manifest, seed_desc, seed_pid
        self.transport, self.timeout_s = transport, timeout_s
        self.endpoints: dict[int, Endpoint] = {}
        self.pids: dict[int, int | None] = {}
        """Source process ids, kept after a source is dropped (to tell a dead one from a slow one)."""
        self.host_image: _HostImage | None = None
        self.detail: dict[str, float] = {}
        """Where opening sources took its time (ms, summed over sources): see CloneReport.exchange_detail."""

    @property
    def rdv(self) -> Rendezvous:
        return self.session.rdv

    def _pid_if_local(self, desc, pid: int) -> int | None:
        return pid if _same_host(desc) else None

    def open(self, participant: int) -> Endpoint:
        """Map ``participant``'s arena (and flags) on our device; ArenaError/RendezvousError if gone."""
        if participant in self.endpoints:
            return self.endpoints[participant]
        if participant == _SEED_INDEX:
            if self.held is not None:
                arena = self._held_seed()
            else:
                arena = _open_arena(self.seed_desc, self.dev, self.transport, self.detail)
                self.session.opened[participant] = [arena]
            ep = Endpoint(participant, "seed", arena, None, self._pid_if_local(self.seed_desc, self.seed_pid))
        else:
            tr = time.perf_counter()
            rec = self._member_record(participant)
            self.detail["member_record_ms"] = self.detail.get("member_record_ms", 0.0) + (time.perf_counter() - tr) * 1e3
            if rec.body.get("manifest_digest") != self.manifest.digest:
                raise RendezvousError(f"clone #{participant} holds another image (manifest {rec.body.get('manifest_digest')}, "
                                      f"the seed's is {self.manifest.digest}); refusing to read from it")
            if self.chunk_bytes is not None and rec.body.get("chunk_bytes") != self.chunk_bytes:
                raise RendezvousError(f"clone #{participant} copies by {rec.body.get('chunk_bytes')!r}-byte chunks, "
                                      f"our plan by {self.chunk_bytes:,}; its flags do not match our steps, "
                                      "refusing to read from it")
            arena_desc = _descriptor_from(rec.sealed["arena"])
            flags_desc = _descriptor_from(rec.sealed["flags"])
            opened = []
            self.session.opened[participant] = opened
            arena = _open_arena(arena_desc, self.dev, self.transport, self.detail)
            opened.append(arena)
            flags = _open_arena(flags_desc, self.dev, self.transport, self.detail, prefix="flags_")
            opened.append(flags)
            ep = Endpoint(participant, f"clone #{participant}", arena, flags,
                          self._pid_if_local(arena_desc, int(rec.body["pid"])))
        self.endpoints[participant] = ep
        self.pids[participant] = ep.pid
        return ep

    def _member_record(self, participant: int):
        key = lambda *parts: _gkey(self.gen, self.schedule, *parts)  # noqa: E731
        return await_member(self.rdv, key("member", participant), key("joined", participant),
                            key("status", participant), f"clone #{participant}", self.timeout_s)

    def _held_seed(self):
        """The seed's arena from the caller's held mappings, mapped (and held) if it is not there;
        a held mapping of another arena is closed first (its exporter publishes from a new one)."""
        d = self.seed_desc
        key = (d.hostname, d.pid, d.arena_id, str(self.dev), self.transport)
        arena = self.held.get(key)
        if arena is None or arena.closed:
            release_held_sources(self.held)
            arena = _open_arena(d, self.dev, self.transport, self.detail)
            self.held[key] = arena
        return arena

    def left(self, participant: int) -> bool:
        """Whether clone ``participant`` of this schedule finished and exited (withdrew as a source)."""
        return participant not in (_SEED_INDEX, HOST) and self.rdv.has(
            _gkey(self.gen, self.schedule, "status", participant, "left"))

    def drop(self, participant: int) -> None:
        self.endpoints.pop(participant, None)
        self.session.close_opened(participant)

    def full_copy(self, dead: set[int]) -> tuple[int, str] | None:
        """Another live process that holds every byte (a finished clone), opened as a retry source."""
        # the counter is the store's, which anyone reaching it can bump (to 10**7, say): only the
        # newest MAX_DONE_SCAN records are looked at, within our timeout, and a planted or
        # malformed one is passed over
        n = self.rdv.add(_gkey(self.gen, "done", "count"), 0)
        deadline = time.monotonic() + self.timeout_s
        for k in range(n, max(0, n - MAX_DONE_SCAN), -1):
            if time.monotonic() > deadline:
                break
            try:
                rec = self.rdv.try_read(_gkey(self.gen, "done", k))
            except StoreLostError:
                raise
            except RendezvousError:
                continue
            if rec is None or rec.body.get("manifest_digest") != self.manifest.digest:
                continue
            try:
                pid, where = int(rec.body["pid"]), (str(rec.body["schedule"]), int(rec.body["position"]))
            except (KeyError, TypeError, ValueError):
                continue
            if pid == os.getpid() or where in dead or rec.sealed is None or "arena" not in rec.sealed:
                continue
            if self.rdv.has(_gkey(self.gen, where[0], "status", where[1], "left")):
                continue
            index = _FALLBACK_INDEX + k
            try:
                desc = _descriptor_from(rec.sealed["arena"])
                arena = _open_arena(desc, self.dev, self.transport)
            except FlashBootError:
                dead.add(where)
                continue
            self.session.opened[index] = [arena]
            who = f"{rec.body['schedule']} clone #{rec.body['position']} (pid {rec.body['pid']})"
            self.endpoints[index] = Endpoint(index, who, arena, None, self._pid_if_local(desc, int(rec.body["pid"])))
            return index, who
        return None

    def image(self, source: Any) -> tuple[int, str]:
        if self.host_image is None:
            img = _HostImage(source, self.dev, rank=self.rank, pin=(0, self.manifest.nbytes))
            self.session.extra.append(img)
            if img.metadata is not None:
                self.manifest.require(img.metadata, f"host image {img.path}")
            elif img.nbytes < self.manifest.nbytes:
                raise RendezvousError(f"host image {img.path} holds {img.nbytes:,} bytes; the seed's image is "
                                      f"{self.manifest.nbytes:,}")
            self.host_image = img
        return HOST, f"the host image {self.host_image.path}"


MEMBER_POLL_S = 0.05
"""The longest sleep between two looks for an upstream clone's member record."""


def await_member(rdv: Rendezvous, member_key: str, joined_key: str, status_key: str, who: str,
                 timeout_s: float):
    """The member record of upstream clone ``who``, polled for (a signal stops the wait; short
    store.wait slices logged two c10d warnings each). A clone publishes it only after opening its
    own sources, which may take it its whole timeout when its own source died; it announces
    itself at ``joined_key`` first. So RendezvousError ("taking it as gone") comes when:

    * its status says failed, or it left;
    * its joined record names a pid on this host that is dead;
    * after ``timeout_s`` it has not even joined (killed right after taking its position): it is
      then marked as left, so later clones skip it at once instead of each waiting in turn;
    * after twice ``timeout_s`` a clone that joined and lives still has no record: we read past
      it, but it is not marked as left (it is alive, and a source for others).
    """
    deadline = time.monotonic() + timeout_s
    extended = False
    joined = None
    delay = 0.001
    while True:
        rec = rdv.try_read(member_key)
        if rec is not None:
            return rec
        why, mark = _member_gone(rdv, status_key), False
        if why is None and joined is None:
            try:
                joined = rdv.try_read(joined_key)
            except StoreLostError:
                raise
            except RendezvousError:
                joined = None  # planted: as good as not joined
        if why is None and joined is not None:
            pid, host = joined.body.get("pid"), joined.body.get("host")
            if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
                why, mark = f"exited (pid {pid}) before publishing its descriptors", True
        if why is None and time.monotonic() >= deadline:
            if joined is None:
                why, mark = f"did not even join within {timeout_s:g} s (killed after taking its position?)", True
            elif not extended:  # alive and, most likely, still waiting for its own upstream
                deadline, extended = deadline + timeout_s, True
            else:
                why = (f"joined (pid {joined.body.get('pid')} on {joined.body.get('host')}) but published no "
                       f"descriptors within {2 * timeout_s:g} s; reading past it (not marked as gone)")
        if why is not None:
            rec = rdv.try_read(member_key)  # it may have published as we looked
            if rec is not None:
                return rec
            if mark:
                try:
                    rdv.publish(status_key + "/left", {"pid": None, "marked_by": os.getpid(), "why": why})
                except FlashBootError:
                    pass  # a store that fails here fails the next call too, which names it
            raise RendezvousError(f"{who} {why}; taking it as gone")
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, MEMBER_POLL_S)


def _member_gone(rdv: Rendezvous, status_key: str) -> str | None:
    """Why a clone counts as ended ('failed: ...' or 'left'), or None: a ``done`` status does not
    end it (its member record is there, or about to be)."""
    if rdv.has(status_key + "/left"):
        return "left"
    try:
        status = rdv.try_read(status_key)
    except StoreLostError:
        raise
    except RendezvousError:
        return None
    if status is not None and status.body.get("state") == "failed":
        return f"failed ({str(status.body.get('error', '?'))[:200]})"
    return None


def release_held_sources(held: dict) -> None:
    """Close every mapping in ``held`` (see ``clone(held_sources=...)``) and empty it."""
    arenas = list(held.values())
    held.clear()
    for arena in arenas:
        if not arena.closed:
            arena.close()
