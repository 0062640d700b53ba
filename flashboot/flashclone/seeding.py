"""The seed: publish an arena (manifest and sealed descriptor) at the rendezvous store."""

from __future__ import annotations

import numbers
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ..service_loop import Service
from ..errors import FlashBootError, RendezvousError, WaitTimeoutError
from ..memory import Device
from .manifest import Manifest
from .records import ForeignRecordError
from .rendezvous import DEFAULT_TIMEOUT_S, Rendezvous, StoreLostError
from .common import METADATA_KEY, SEED_KEY, _gkey
from .sources import _HostImage
from .transports.nccl import _broadcast, _process_group, _shutdown_pg


SEED_RECORD_FIELDS = frozenset({"generation", "pid", "host", "device", "manifest", "nccl", "nixl", "has_metadata",
                                "published_at"})
"""The fields of the seed record's body that :func:`seed` writes itself (``extra`` may not replace them)."""

CHECK_PUBLISHED_S = 1.0
"""How often a serving seed checks that the store still holds its record."""


class Seed(Service):
    """A published arena. Built by :func:`seed`; passive: clones map its memory themselves.

    ``arena``, ``manifest``, ``generation`` (a fresh id per publication), ``rendezvous``.
    :meth:`serve_forever` blocks until stopped (SIGTERM/SIGINT or ``stop``); it also answers the
    NCCL-broadcast fallback for clones that cannot map the arena. :meth:`close` withdraws the
    records and releases what the seed owns.
    """

    def __init__(self, rdv: Rendezvous, arena, manifest: Manifest, generation: str, *, metadata=None,
                 owned: list | None = None, serve_nccl: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                 records: list | None = None, host_store: bool = False):
        self.rendezvous, self.arena, self.manifest, self.generation = rdv, arena, manifest, generation
        self.host_store = host_store
        """Whether this seed may host the store (``seed(host_store=True)``), also when the one it
        joined has gone, unless ``flashboot store`` hosted that one (it is waited for to come back):
        a seed that hosted it and was replaced by another seed exits, and with it the store its
        replacement had joined."""
        self._store_server = False if rdv.is_server else self._hosted_by_store_server(rdv)
        # every store call bounded: the serve loop checks the store, and close() withdraws, on a
        # connection whose store may stop answering (SIGSTOPped, link down) without closing it
        rdv.bounded = True
        self.metadata = metadata
        self.timeout_s = timeout_s
        self._owned = owned or []
        self._records = records or []
        """``(key, body, sealed)`` published: republished when the store loses them."""
        self._stop = threading.Event()
        self._closed = False
        self._nccl_error: BaseException | None = None
        self.nccl_served = 0
        self.republished = 0
        """How many times the records were published again (a restarted store, a deleted record)."""
        self.superseded = False
        """True once another seed's record replaced ours (we then leave it alone; :meth:`serve_forever`
        stops with an error naming it)."""
        self.superseded_by: dict | None = None
        """The record body of the seed that replaced ours."""
        self._next_check = 0.0
        self._thread = None
        self._thread_stop = threading.Event()
        if serve_nccl:
            self._start_nccl()

    def _start_nccl(self) -> None:
        self._thread_stop = threading.Event()
        self._thread = threading.Thread(target=self._nccl_service, args=(self.rendezvous, self._thread_stop),
                                        name="flashboot-seed-nccl", daemon=True)
        self._thread.start()

    def serve_forever(self, stop: threading.Event | None = None, *, handle_signals: bool = True) -> None:
        """Block until ``stop``, :meth:`stop` or SIGTERM/SIGINT, checking every
        :data:`CHECK_PUBLISHED_S` that the store still holds our record (see :meth:`check_published`),
        then :meth:`close`. Raises RendezvousError naming the store when it is lost for good, or
        naming the seed that published over this one's record (:attr:`superseded`)."""
        from ..service_loop import serve_until_stopped

        try:
            serve_until_stopped(self._stop, stop, handle_signals=handle_signals, tick=self._tick)
        finally:
            self.close()

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + CHECK_PUBLISHED_S
            self.check_published()
            if self.superseded:  # it had served on, saying "seed ready", while every clone went to the other
                raise RendezvousError(f"this seed no longer serves: {self.superseded_description()}")

    def superseded_description(self) -> str:
        """Which seed replaced ours, for an error (call once :attr:`superseded`)."""
        by = self.superseded_by or {}
        if by.get("foreign"):
            return (f"the seed record in namespace {self.rendezvous.namespace!r} at {self.address} is now one this "
                    f"seed cannot verify: another job's seed (pid {by.get('pid')} on {by.get('host')}, as its "
                    f"unverified record says) published over this one's (generation {self.generation}), signed "
                    "with a different token (or by another FlashBoot version); two jobs cannot share a namespace "
                    "(this seed leaves the other's record alone): give each job its own --name")
        return (f"another seed (pid {by.get('pid')} on {by.get('host')}, generation {by.get('generation')}) "
                f"published over this one's record (generation {self.generation}) in namespace "
                f"{self.rendezvous.namespace!r} at {self.address}; one seed serves a namespace at a time "
                "(stop the other, or give each its own --name)")

    def check_published(self) -> bool:
        """Publish our records again when the store no longer holds them (it was restarted, or
        the record was deleted or overwritten with garbage); reconnect first when the connection
        broke. Leaves a newer seed's record alone (``superseded``), and one signed with another
        token (another job's seed in this namespace). Returns whether it published.
        StoreLostError naming the store when no store answers there within ``timeout_s``:
        a seed nobody can find must not run on as if it served."""
        if self.superseded or not self._records:
            return False
        if self.rendezvous.lost is None and self._record_there() in ("ours", "another"):
            return False
        if self.rendezvous.lost is not None:
            self._reconnect()
            # a store that was only silent still holds what was published meanwhile
            if self._record_there() == "another":
                return False
        for key, body, sealed in self._records:
            self.rendezvous.publish(key, body, sealed=sealed)
        self.republished += 1
        return True

    def _record_there(self) -> str | None:
        """Whose record the store holds under the seed key: ``"ours"``, ``"another"`` (then
        :attr:`superseded`), or None (none, garbage, or the store lost: ``rendezvous.lost`` says so)."""
        try:
            rec = self.rendezvous.try_read(SEED_KEY)
        except ForeignRecordError as exc:
            # another job's seed, signed with its own token (or of another version): it yields to
            # none of ours, so publishing over it again had the two seeds overwrite each other every
            # second, and half the clones of each job read the other's record
            self.superseded = True
            self.superseded_by = {"foreign": True, **{k: (exc.claimed or {}).get(k)
                                                      for k in ("pid", "host", "generation")}}
            return "another"
        except (StoreLostError, WaitTimeoutError):  # gone, or silent for timeout_s: rdv.lost says so
            return None
        except RendezvousError:  # garbage in our place: publish over it
            return None
        if rec is None:
            return None
        if rec.body.get("generation") != self.generation:
            self.superseded = True
            self.superseded_by = {k: rec.body.get(k) for k in ("pid", "host", "generation")}
            return "another"
        return "ours"

    def _reconnect(self) -> None:
        old = self.rendezvous
        try:
            new = Rendezvous.connect(old.address, old.token, namespace=old.namespace,
                                     host=old.is_server or (self.host_store and not self._store_server),
                                     timeout_s=self.timeout_s)
        except (RendezvousError, WaitTimeoutError) as exc:
            raise StoreLostError(f"the seed lost its store at {old.address} ({old.lost}) and cannot reach one "
                                 f"there again: {exc}") from None
        new.bounded = True
        self.rendezvous = new
        self._store_server = False if new.is_server else self._hosted_by_store_server(new)
        if self._thread is not None:
            # the old service, possibly mid-broadcast, ends with the old connection (its next call
            # fails at once); a new one serves on the new connection. A restarted store counts the
            # requests from 0; one that was only silent (our record still there) keeps its count:
            # counted from 0 again, every request answered already was replayed, each waiting its
            # timeout for a clone long gone, and a new clone's request timed out behind them
            same_store = self._holds_our_record(new)
            self._thread_stop.set()
            old.close()
            self._thread.join(self.timeout_s + 5)
            if self._thread.is_alive():
                raise StoreLostError(f"the seed's NCCL service on the lost store at {old.address} did not stop "
                                     f"within {self.timeout_s + 5:g} s; cannot serve the fallback again")
            if not same_store:
                self.nccl_served = 0
            self._start_nccl()
        else:
            old.close()

    @staticmethod
    def _hosted_by_store_server(rdv: Rendezvous) -> bool:
        try:
            return rdv.hosted_by_store_server()
        except (RendezvousError, WaitTimeoutError):
            return False  # the store check finds it lost and says so

    def _holds_our_record(self, rdv: Rendezvous) -> bool:
        try:
            rec = rdv.try_read(SEED_KEY)
        except (RendezvousError, WaitTimeoutError):
            return False
        return rec is not None and rec.body.get("generation") == self.generation

    @property
    def address(self) -> str:
        return self.rendezvous.address

    def _nccl_service(self, rdv: Rendezvous, stop: threading.Event) -> None:
        """Answer broadcast requests (the fallback transport), one at a time, on ``rdv`` until
        ``stop`` or the seed's stop (a reconnect stops it and starts another on the new one)."""
        dev = self.arena.device
        count_key = _gkey(self.generation, "nccl", "count")
        while not self._stop.wait(0.05) and not stop.is_set():
            try:
                n = rdv.add(count_key, 0)
                while self.nccl_served < n and not self._stop.is_set() and not stop.is_set():
                    self.nccl_served += 1
                    rid = self.nccl_served
                    try:
                        rdv.read(_gkey(self.generation, "nccl", "req", rid), what=f"broadcast request {rid}",
                                 timeout_s=self.timeout_s)  # authenticated: no token, no weights
                        pg = _process_group(rdv, _gkey(self.generation, "nccl", "pg", rid), 0, dev, self.timeout_s)
                        try:
                            _broadcast(pg, self.arena.bytes()[: self.manifest.nbytes], dev, self.timeout_s)
                        finally:
                            _shutdown_pg(pg)
                    except FlashBootError as exc:
                        self._nccl_error = exc  # one bad request must not stop the seed
            except RendezvousError as exc:
                self._nccl_error = exc
                return
            except Exception as exc:  # noqa: BLE001 - torch.distributed errors; reported by serve_forever
                self._nccl_error = exc

    def close(self) -> None:
        """Withdraw the seed's records, stop the NCCL service, release what it owns (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5)
        for key in (SEED_KEY, METADATA_KEY):
            try:
                # only our own record: a seed published since replaced it, and deleting that
                # left its clones waiting for a seed that is alive (a race of one round trip remains)
                self.rendezvous.delete_if(key, lambda rec: rec.body.get("generation") == self.generation)
            except FlashBootError:
                pass  # the store may be gone already (we might have been hosting it), or holds garbage
        for obj in reversed(self._owned):
            try:
                obj.close()
            except FlashBootError:
                pass
        self.rendezvous.close()

    def __repr__(self) -> str:
        return f"Seed({self.manifest.describe()}, on {self.arena.device}, store {self.address}, gen {self.generation})"


def _load_seed_source(source: Any, dev: Device, rank: int, timeout_s: float):
    """``(arena, metadata, owned)`` for a seed: an Arena, a LoadedImage/CloneResult, or an image
    directory (FlashLoad when the preloader has staged it, else a direct read of the image file)."""
    from ..arena import Arena

    if isinstance(source, Arena):
        return source, None, []
    if hasattr(source, "arena") and hasattr(source, "metadata"):  # LoadedImage, CloneResult
        return source.arena, source.metadata, []
    path = Path(source)
    if not path.exists():
        raise FlashBootError(f"seed source {str(path)!r} does not exist (pass an image directory or an Arena)")
    try:
        from ..flashload.shm import staged_paths

        staged = staged_paths(path, rank).ready.exists()
    except FlashBootError:
        staged = False
    if staged:
        from ..flashload.pipeline import load

        loaded = load(path, rank, dev, timeout_s=timeout_s)
        return loaded.arena, loaded.metadata, [loaded]
    img = _HostImage(path, dev, rank=rank)
    try:
        arena = Arena.create(img.nbytes, dev)
        try:
            if dev.is_cuda:
                import torch

                with torch.cuda.device(dev.index):
                    arena.bytes()[: img.nbytes].copy_(torch.frombuffer(img._mm, dtype=torch.uint8), non_blocking=False)
                    torch.cuda.synchronize(dev.index)
            else:
                import ctypes

                # a one-off load off the critical path: a plain memmove, no thread pool to spin up
                ctypes.memmove(arena.ptr, img.ptr, img.nbytes)
        except BaseException:
            arena.close()
            raise
        return arena, img.metadata, [arena]
    finally:
        img.close()


def _check_nbytes(nbytes: int | None, manifest: Manifest | None, source: Any, rank: int) -> None:
    """RendezvousError when ``nbytes`` differs from what the seed would replicate anyway: the given
    manifest's bytes, or an image's (a directory, a LoadedImage). Both are replicated whole (the
    published metadata and checksum table describe every byte), so a smaller ``nbytes`` had been
    dropped without a word and clones received the whole image; ``nbytes`` cuts a bare arena only."""
    if nbytes is None:
        return
    if manifest is not None:
        if nbytes != manifest.nbytes:
            raise RendezvousError(f"seed nbytes={nbytes:,} differs from the {manifest.nbytes:,} bytes the given "
                                  "manifest covers; the manifest says what is replicated: pass one or the other")
        return
    from ..arena import Arena

    if isinstance(source, Arena):
        return
    if hasattr(source, "arena") and hasattr(source, "metadata"):  # LoadedImage, CloneResult
        metadata, what = source.metadata, f"the {type(source).__name__}'s image"
    else:
        path = Path(source)
        if not path.is_dir():
            return  # an image file (a bare arena's bytes), or nothing: _load_seed_source says which
        from ..layouts import read_image_metadata

        metadata, what = read_image_metadata(path, rank), f"the image {str(path)!r} (rank {rank})"
    if metadata is not None and nbytes != int(metadata.image_nbytes):
        raise RendezvousError(f"seed nbytes={nbytes:,} differs from the {int(metadata.image_nbytes):,} bytes of {what}: "
                              "an image is replicated whole (its metadata and checksums describe every byte); "
                              "nbytes applies to an Arena source only: leave it out")


def seed(store: str, source: Any, device: Any = None, *, token=None, token_file=None, name: str = "default",
         rank: int = 0, nbytes: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, serve_nccl: bool = True,
         checksum_chunk_bytes: int | None = None, manifest: Manifest | None = None, nixl: bool = False,
         host_store: bool = True, extra: dict | None = None) -> Seed:
    """Publish an arena for cloning at the rendezvous store ``store`` (``HOST:PORT``).

    ``source``: an image directory (rank ``rank``; loaded with :func:`flashboot.load` when the
    preloader staged it, else read from the image file), an :class:`~flashboot.Arena` (``nbytes``:
    how much of it to replicate, default all; ``manifest``: its checksums when already known,
    else they are computed on the device), or a LoadedImage/CloneResult. An image is replicated
    whole: ``nbytes`` other than its size (or than a given manifest's) is refused. The seed hosts the
    store at ``store`` unless one already listens there (then, if this process dies, the store and
    every record in it die too), and when the store it joined goes, hosts one there itself (unless
    ``flashboot store`` hosted it: that one is waited for to come back); ``host_store=False``:
    never host, wait up to ``timeout_s`` for a store (``flashboot store HOST:PORT``, torchrun's,
    any TCPStore) and join it. The token (``token``, ``token_file`` or ``$FLASHBOOT_TOKEN``)
    signs every record. ``nixl``: also register the arena (every segment)
    with a NIXL agent and publish its metadata, sealed, so clones on other hosts can READ it
    (``transport="nixl"``; needs ``pip install flashboot[nixl]``). ``extra``: more fields for the
    seed record's body (a refit's version and rank). Returns a :class:`Seed`; call ``serve_forever()``
    or keep it open while clones run, then ``close()``.
    """
    from ..units import check_timeout
    from .records import resolve_token

    check_timeout(timeout_s, "seed timeout_s")  # before loading anything, as the token
    for arg, value in (("nbytes (how much of the arena to replicate)", nbytes),
                       ("checksum_chunk_bytes", checksum_chunk_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0):
            # int() had cut 1.5 and True to 1: the seed served one byte of the arena (or checksummed
            # it byte by byte), and said nothing
            raise RendezvousError(f"seed {arg} must be a positive int, got {value!r}")
    taken = sorted(set(extra or {}) & SEED_RECORD_FIELDS)
    if taken:  # "generation" had made the seed take its own record for another seed's, and stop
        raise RendezvousError(f"extra fields {taken} are the seed record's own; name extra fields otherwise (its own "
                              f"are {sorted(SEED_RECORD_FIELDS)})")
    dev = Device.parse(device) if device is not None else None
    tok = resolve_token(token, token_file)  # before loading anything
    if dev is None:
        from ..arena import Arena

        if isinstance(source, Arena):
            dev = source.device
        elif hasattr(source, "arena"):
            dev = source.arena.device
        else:
            dev = Device.parse(None)
    if dev.is_cuda:
        # the checksum's cubin (built here when this machine has none yet): clones in fresh
        # processes then verify without Triton, and this seed's manifest is computed with it
        from flashboot.kernels.checksum_gpu import prepare_checksum_kernels

        prepare_checksum_kernels(dev.index)
    _check_nbytes(nbytes, manifest, source, rank)  # before loading anything
    arena, metadata, owned = _load_seed_source(source, dev, rank, timeout_s)
    try:
        if manifest is not None:
            if manifest.arena_nbytes != arena.nbytes:
                raise RendezvousError(f"the given manifest is for a {manifest.arena_nbytes:,}-byte arena; this one "
                                      f"holds {arena.nbytes:,}")
        elif metadata is not None:
            manifest = Manifest.from_metadata(metadata, arena.nbytes)
        else:
            manifest = Manifest.of_arena(arena, nbytes, checksum_chunk_bytes or 64 << 20)
        descriptor = arena.export()
        sealed = {"arena": descriptor.to_dict()}
        if nixl:
            from .transports.nixl import Agent

            agent = Agent(f"flashboot-seed-{os.getpid()}-{secrets.token_hex(4)}")
            owned.append(agent)  # closed before the arena: deregistered, then unmapped
            sealed["nixl"] = agent.register(arena)
        rdv = Rendezvous.connect(store, tok, namespace=name, host=host_store, timeout_s=timeout_s)
    except BaseException:
        for obj in reversed(owned):
            obj.close()
        raise
    generation = secrets.token_hex(6)
    records = [(METADATA_KEY, {"generation": generation,
                               "metadata": metadata.to_dict() if metadata is not None else None}, None),
               (SEED_KEY, {**(extra or {}), "generation": generation, "pid": os.getpid(),
                           "host": socket.gethostname(), "device": str(arena.device), "manifest": manifest.to_dict(),
                           "nccl": serve_nccl, "nixl": nixl, "has_metadata": metadata is not None,
                           "published_at": time.time()}, sealed)]
    try:
        for key, body, sealed_part in records:
            rdv.publish(key, body, sealed=sealed_part)
    except BaseException:
        rdv.close()
        for obj in reversed(owned):
            obj.close()
        raise
    return Seed(rdv, arena, manifest, generation, metadata=metadata, owned=owned, serve_nccl=serve_nccl,
                timeout_s=timeout_s, records=records, host_store=host_store)
