"""Refit (engine side): the published version's arena into a running engine's arena.

The copy is a FlashClone of the trainer's seed record (``clone(into=...)``): chunk-pipelined,
the transport chosen by the transports registry (posix_fd on one host), engines refitting the
same version together forming a chain or a star. Nothing moves before the record is checked:
its version, image key and rank must be the engine's.

``atomic=True`` (default): the copy lands in a staging arena (fresh segments, one image of
extra memory, held only during the update), its chunk checksums are verified against the
trainer's, and only then are its segments mapped under the live arena's addresses
(:func:`flashboot.arena.remap.replace_backing`), so views and CUDA-graph pointers stay valid
and any failure leaves the old weights whole. ``atomic=False`` copies into the live arena: no
extra memory, but a failure mid-copy leaves a mix of old and new weights (the checksums are
still verified before the version is declared live). Such a failure, once the clone had issued
a write into the arena (one before it, e.g. a source refused, leaves the old version claimed),
marks the weights torn:
``loaded.version`` is None and ``loaded.refit_torn`` says which versions the bytes mix and why,
until a refit to a version newer than the last whole one succeeds. An arena the holder keeps
(handed over, or opened from it: an atomic refit cannot remap it) is the holder's memory: an
in-place refit records there what it makes of it, torn before its first write, then the version
(:mod:`flashboot.flashclone.holder_refit`), so that a restart does not take its bytes for the
image's.

The engine keeps the trainer's arena mapped between refits (``LoadedImage.refit_sources``): a
trainer publishes every version from one arena, so the next refit copies at once instead of
importing and mapping every segment again (about as long as the copy itself on one H200). The
mapping keeps that memory alive after the trainer releases it, until the engine refits from
another arena, a refit fails, the engine sleeps (whose point is to free the GPU's memory), or it
is closed.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ArenaError, ChecksumMismatchError, FlashBootError, OutOfMemoryError
from ..flashclone.rendezvous import DEFAULT_TIMEOUT_S
from .publish import DEFAULT_NAME, check_version, version_namespace


class RefitError(FlashBootError):
    """A refit refused or failed; says why, and whether the old weights are whole."""


@dataclass
class RefitReport:
    """One refit: ``copy_ms`` (the clone's transfer), ``verify_ms``, ``remap_ms`` (atomic only:
    the swap, from the device wait to the new segments mapped), ``total_ms``, ``nbytes``;
    ``transport``, ``schedule``, ``position`` as the clone reports them. ``breakdown``: where
    ``total_ms`` went, in ms (see :func:`refit`)."""

    version: int
    previous_version: int | None
    """None: the weights were torn (a mix of versions) before this refit."""
    atomic: bool
    nbytes: int
    wait_ms: float = 0.0
    copy_ms: float = 0.0
    verify_ms: float = 0.0
    remap_ms: float = 0.0
    total_ms: float = 0.0
    transport: str = ""
    schedule: str = ""
    position: int = 0
    details: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)

    @property
    def copy_gbps(self) -> float:
        return self.nbytes / self.copy_ms / 1e6 if self.copy_ms > 0 else 0.0

    def summary(self) -> str:
        mode = f"atomic, remap {self.remap_ms:.2f} ms" if self.atomic else "in place"
        before = "torn weights" if self.previous_version is None else f"v{self.previous_version}"
        return (f"refit {before} -> v{self.version} ({mode}): {self.nbytes:,} bytes copied in "
                f"{self.copy_ms:.2f} ms ({self.copy_gbps:.1f} GB/s, {self.transport}, {self.schedule} #{self.position}), "
                f"verified in {self.verify_ms:.2f} ms, total {self.total_ms:.2f} ms")


def check_refit_values(where: str, **values: Any) -> None:
    """RefitError naming the option and its value for an ``atomic`` that is not a bool (None would
    mean in place, "false" atomic), a ``timeout_s`` that is not a finite number of seconds in (0,
    :data:`~flashboot.units.MAX_TIMEOUT_S`], ``clones``/``chunk_bytes`` that are not a positive int (or None), a
    ``schedule`` not ``chain`` or ``star``, a ``transport``/``name`` that is not a string, and a ``token_file``
    not a path."""
    import os

    from ..units import check_timeout

    def bad(name: str, want: str) -> RefitError:
        return RefitError(f"{where}: refit option {name} must be {want}, got {values[name]!r}; nothing was copied")

    for name, value in values.items():
        if name == "atomic" and not isinstance(value, bool):
            raise bad(name, "true or false")
        if name == "timeout_s":
            check_timeout(value, f"{where}: refit option timeout_s", RefitError)
        if name in ("clones", "chunk_bytes") and value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise bad(name, "a positive integer or None")
        if name in ("schedule", "transport", "name") and (not isinstance(value, str) or not value):
            raise bad(name, "a non-empty string")
        if name == "schedule" and value not in ("chain", "star"):  # a ring loads shards of a host image
            raise bad(name, "'chain' or 'star'")
        if name == "token_file" and value is not None and not isinstance(value, (str, os.PathLike)):
            raise bad(name, "a path or None")


def _check_record(rec, loaded, version: int, where: str):
    """The published manifest after checking version, key and rank against the engine's."""
    from ..flashclone.manifest import Manifest

    body = rec.body
    meta = loaded.metadata
    rank = meta.parallel.rank
    if body.get("refit_version") != version:
        raise RefitError(f"{where}: the record is for version {body.get('refit_version')!r}, not {version}; nothing "
                         "was copied, the old weights are serving")
    if body.get("refit_rank") != rank:
        raise RefitError(f"{where}: version {version} was published for rank {body.get('refit_rank')!r}; this engine "
                         f"serves rank {rank}; nothing was copied, the old weights are serving")
    manifest = Manifest.from_dict(body["manifest"])
    if manifest.key_digest != meta.key.digest:
        theirs = (manifest.key or {}).get("model_id", "?")
        raise RefitError(f"{where}: version {version} was published for image key {str(manifest.key_digest)[:19]} "
                         f"({theirs}); this engine serves {meta.key.digest[:19]} ({meta.key.model_id}); nothing was "
                         "copied, the old weights are serving")
    if (manifest.nbytes, manifest.arena_nbytes) != (meta.image_nbytes, loaded.arena.nbytes):
        raise RefitError(f"{where}: version {version} is {manifest.nbytes:,} bytes in a {manifest.arena_nbytes:,}-byte "
                         f"arena; this engine's image is {meta.image_nbytes:,} in {loaded.arena.nbytes:,}; nothing "
                         "was copied")
    return manifest


def torn_note(torn: dict) -> str:
    """What ``loaded.refit_torn`` says, for an error."""
    mix = " and ".join(map(str, torn["versions"]))
    return (f"an in-place refit to version {torn['versions'][-1]} failed ({torn['error']}): the arena holds a mix "
            f"of versions {mix}, and version {torn['last_whole']} is the last whole one")


def _torn(live: int | None, torn: dict | None, version: int, error: str) -> dict:
    """What ``loaded.refit_torn`` says once an in-place copy of ``version`` over ``live`` (None:
    over the ``torn`` mix) has written and failed."""
    if live is None:  # torn already: the same last whole version, one more in the mix
        versions = [*torn["versions"], version] if version not in torn["versions"] else torn["versions"]
        return {"last_whole": torn["last_whole"], "versions": versions, "error": error}
    return {"last_whole": live, "versions": [live, version], "error": error}


def _mark_torn(loaded, live: int | None, version: int, exc: BaseException) -> None:
    """An in-place copy failed: the bytes may be any mix of what was there and ``version``'s, so
    the weights claim no version (they had kept claiming the old one) until a refit succeeds."""
    error = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    loaded.refit_torn = _torn(live, loaded.refit_torn, version, error)
    loaded.version = None


def _record_held(held: list, state: dict | None, timeout_s: float) -> list[str]:
    """Record ``state`` (see :mod:`flashboot.flashclone.holder_refit`) for every place the arena is
    held; the problems, one per place that could not be written."""
    from ..flashclone.holder_refit import write_refit

    problems = []
    for place in held:
        try:
            write_refit(place, state, timeout_s)
        except FlashBootError as exc:
            problems.append(f"{place.describe()}: {exc}")
    return problems


def _mark_held_torn(held: list, live: int | None, torn: dict | None, version: int, timeout_s: float,
                    where: str) -> None:
    """Before an in-place refit's first write into an arena the holder keeps: record it torn there
    (a restart then binds no mix as a whole version, even if this engine dies mid-copy). RefitError
    when that cannot be recorded; the records written are put back."""
    before = [place.state for place in held]  # None: the image's bytes
    state = {"torn": _torn(live, torn, version, f"an in-place refit to version {version} by pid {os.getpid()} began "
                                                "writing and did not finish (its engine exited mid-copy?)")}
    problems = _record_held(held, state, timeout_s)
    if problems:
        for place, was in zip(held, before):
            _record_held([place], was, timeout_s)
        raise RefitError(f"{where} (atomic=False, in place): the arena is the holder's memory, and the refit could "
                         f"not be recorded there before its first write ({'; '.join(problems)}); a restart would "
                         f"have bound its bytes as version {live if live is not None else 'torn'}; nothing was "
                         "copied, the old weights are serving")


def _held_recorded(held: list, state: dict | None, timeout_s: float, where: str) -> None:
    """Record what an in-place refit left in a held arena (after its copy); a record that cannot
    be written warns: the engine's weights are what ``loaded`` says, and a restart finds the torn
    mark written before the copy, which it does not bind as a whole version."""
    problems = _record_held(held, state, timeout_s)
    if problems:
        warnings.warn(f"flashboot: {where}: the held arena's refit record is not updated ({'; '.join(problems)}); a "
                      "restart from the holder takes its bytes as torn", RuntimeWarning, stacklevel=4)


def _check_not_superseded(rdv, name: str, version: int, where: str) -> None:
    """RefitError when the publisher of ``name`` has published a newer version than ``version``,
    which is not out: it withdrew it as it published the next, and the wait for it had run its
    whole timeout for a publish that would never come."""
    from ..errors import RendezvousError
    from ..flashclone.common import SEED_KEY
    from .publish import LATEST_KEY

    namespace, rdv.namespace = rdv.namespace, name  # the name's own keys, over the same connection
    try:
        latest = rdv.try_read(LATEST_KEY)
    except RendezvousError:  # not an authentic record: no word on it, the wait goes on
        latest = None
    finally:
        rdv.namespace = namespace
    newest = latest.body.get("version") if latest is not None else None
    if isinstance(newest, int) and not isinstance(newest, bool) and newest > version and not rdv.has(SEED_KEY):
        raise RefitError(f"{where}: version {version} is not out: its publisher has published version {newest} since "
                         f"(a Publisher withdraws its last version as it publishes the next); refit to version "
                         f"{newest}; nothing was copied, the old weights are serving")


SUPERSEDED_POLL_S = 1.0
"""How often a refit waiting for its version's publish asks whether the publisher has published a
newer one meanwhile (:func:`_check_not_superseded`)."""


def _wait_for_publish(rdv, name: str, version: int, what: str, timeout_s: float, where: str):
    """The seed record of ``version``, waited for up to ``timeout_s``; RefitError as soon as its
    publisher has published a newer version instead (a trainer whose numbers skip this one: the
    wait had run its whole timeout for a publish that would never come, then blamed the trainer)."""
    from ..errors import WaitTimeoutError
    from ..flashclone.common import SEED_KEY

    deadline = time.monotonic() + timeout_s
    while True:
        if not rdv.has(SEED_KEY):
            _check_not_superseded(rdv, name, version, where)
        left = deadline - time.monotonic()
        try:
            return rdv.read(SEED_KEY, what=what, timeout_s=max(min(left, SUPERSEDED_POLL_S), 0.001))
        except WaitTimeoutError:
            if deadline - time.monotonic() <= 0:
                raise WaitTimeoutError(f"waited {timeout_s:g} s for {what} (store keys {[SEED_KEY]} at "
                                       f"{rdv.address})") from None


def _repacked_note(store: str, token, token_file, name: str, version: int, timeout_s: float) -> str:
    """Why a copy of ``version`` failed its checksums where its publisher has moved on since: it
    withdrew ``version`` and packs the next one into the one arena the copy read (a Publisher
    publishes every version from one arena). '' where it has not (its latest record names an
    older version, or none: it closed), or the store cannot tell."""
    from ..flashclone.common import SEED_KEY
    from ..flashclone.rendezvous import Rendezvous
    from .publish import LATEST_KEY

    try:
        with Rendezvous.connect(store, token, token_file=token_file, namespace=version_namespace(name, version),
                                timeout_s=timeout_s) as rdv:
            if rdv.has(SEED_KEY):
                return ""
            rdv.namespace = name
            latest = rdv.try_read(LATEST_KEY)
    except FlashBootError:
        return ""
    newest = latest.body.get("version") if latest is not None else None
    if not isinstance(newest, int) or isinstance(newest, bool) or newest < version:
        return ""  # no open publisher of this name says so (one that closed takes its record out)
    newer = f"version {newest}" if newest > version else "the next version"  # the record follows the seed's
    return (f"its publisher withdrew version {version} during the copy and packs {newer} into the arena it read (a "
            f"Publisher publishes every version from one arena: publish the next once the engines have taken the "
            f"last); refit to {newer}")


def refit(loaded, store: str, version: int, *, atomic: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
          name: str = DEFAULT_NAME, schedule: str = "chain", clones: int | None = None, mover: Any = None,
          chunk_bytes: int | None = None, transport: str = "auto", token=None, token_file=None,
          check_record: Callable[[dict], None] | None = None) -> RefitReport:
    """Bring ``loaded`` (a :class:`~flashboot.flashload.report.LoadedImage`) to the weights published
    as ``version`` at ``store`` (see :func:`flashboot.weight_update.publish`). See the module doc for
    ``atomic``; ``schedule``/``clones``/``mover``/``chunk_bytes``/``transport`` as for
    :func:`flashboot.clone`. Call it between forward passes: an atomic refit waits for the
    device's work before it remaps. ``check_record``: called with the trainer's record (its
    ``extra`` fields included) after the version, key and rank checks, before a byte moves; it
    raises to refuse (the engine integrations check the engine key there).

    Raises RefitError (an option of the wrong type or range: :func:`check_refit_values`; a version
    not newer than the live one, or not out while its publisher has published a newer one since;
    a record for another image key or rank, an engine asleep: wake() it first; another refit of
    the engine still running after ``timeout_s``: one runs at a time),
    WaitTimeoutError naming the step it waited on (the trainer's publish, a source),
    OutOfMemoryError with the numbers when there is no room for the staging copy
    (``atomic=False`` needs none), ChecksumMismatchError when the bytes copied are not those
    published (a RefitError naming the newer version where its publisher has withdrawn this one
    and packs the next into the arena the copy read). All of them leave the old weights whole and serving, except a failure
    during an ``atomic=False`` copy.

    The report's ``breakdown`` splits ``total_ms``: ``record_ms`` (connect, read and check the
    trainer's record), ``staging_create_ms``, ``clone_ms`` (the clone call: its
    ``clone_connect_ms``, ``clone_exchange_ms`` (map the trainer's arena), ``clone_alloc_ms``,
    ``copy_ms`` (host wall time; ``copy_gpu_ms`` on the device, ``map_during_copy_ms`` of the
    source's segments overlapped with it), ``verify_ms``, ``clone_other_ms``), then
    ``remap_prepare_ms`` (segment references and revoked exports, the weights still mapped),
    ``remap_ms`` (with ``remap_sync_ms``, ``remap_unmap_ms``, ``remap_map_ms``), and
    ``remap_release_old_ms`` after the swap, ``clone_close_ms`` and ``staging_close_ms``.
    """
    t0 = time.perf_counter()
    check_version(version, "refit", RefitError)  # a FlashBootError had escaped `except RefitError`
    check_refit_values("refit", atomic=atomic, timeout_s=timeout_s, schedule=schedule, clones=clones,
                       chunk_bytes=chunk_bytes, transport=transport, name=name, token_file=token_file)
    # one refit of an engine at a time: two at once both passed the version check against the
    # same live version, and the one that finished last went live, older or not
    lock = _refit_lock(loaded)
    if not lock.acquire(timeout=timeout_s):
        raise RefitError(f"refit of {loaded.metadata.key.model_id} rank {loaded.metadata.parallel.rank} to version "
                         f"{version}: another refit of this engine was still running after {timeout_s} s; nothing "
                         "was copied")
    try:
        return _refit(loaded, store, version, t0, atomic=atomic, timeout_s=timeout_s, name=name, schedule=schedule,
                      clones=clones, mover=mover, chunk_bytes=chunk_bytes, transport=transport, token=token,
                      token_file=token_file, check_record=check_record)
    finally:
        lock.release()


_LOCKS_GUARD = threading.Lock()


def _refit_lock(loaded) -> threading.Lock:
    """The lock that serializes the refits of ``loaded`` (made on its first refit)."""
    with _LOCKS_GUARD:
        lock = getattr(loaded, "_refit_lock", None)
        if lock is None:
            lock = loaded._refit_lock = threading.Lock()
    return lock


def _refit(loaded, store: str, version: int, t0: float, *, atomic, timeout_s, name, schedule, clones, mover,
           chunk_bytes, transport, token, token_file, check_record) -> RefitReport:
    from ..arena.remap import check_replaceable, replace_backing, staging_for
    from ..flashclone.cloning import clone
    from ..flashclone.holder_refit import links as holder_links
    from ..flashclone.holder_refit import remember as remember_refit
    from ..flashclone.sources import release_held_sources
    from ..flashclone.rendezvous import Rendezvous
    from ..flashload.lifecycle import held_still

    arena, meta = loaded.arena, loaded.metadata
    live = loaded.version
    torn = loaded.refit_torn if live is None else None
    rank = meta.parallel.rank
    where = f"refit of {meta.key.model_id} rank {rank} on {arena.device} to version {version}"
    if arena.closed:
        raise RefitError(f"{where}: its arena is closed (the weights were released); nothing was copied")
    if arena.asleep:
        raise RefitError(f"{where}: the engine is asleep (its weights are released); wake() it, then refit")
    if torn is not None:
        if version <= torn["last_whole"]:
            raise RefitError(f"{where}: version {version} is not newer than version {torn['last_whole']}, the last "
                             f"whole one ({torn_note(torn)}); refit to a newer version; refused")
    elif version <= live:
        raise RefitError(f"{where}: version {version} is not newer than the live version {live}; refused")
    if atomic:
        try:
            check_replaceable(arena)
        except ArenaError as exc:
            raise RefitError(f"{where}: an atomic refit cannot remap this arena ({exc}); nothing was copied, the old "
                             "weights are serving") from None
    namespace = version_namespace(name, version)
    rdv = Rendezvous.connect(store, token, token_file=token_file, namespace=namespace, host=False, timeout_s=timeout_s)
    try:
        rec = _wait_for_publish(rdv, name, version, f"the trainer's publish of version {version} ({meta.key.model_id} "
                                f"rank {rank}, namespace {namespace!r})", timeout_s, where)
    finally:
        rdv.close()
    manifest = _check_record(rec, loaded, version, where)
    if check_record is not None:
        check_record(rec.body)
    # the copy and the remap under the image's lifecycle lock: a close() or sleep() from another
    # thread had released the arena under the copy into it (a segfault on the host backend)
    with held_still(loaded) as closed:
        if closed:
            raise RefitError(f"{where}: the engine's weights were closed while it waited for the publish; nothing "
                             "was copied")
        if arena.asleep:
            raise RefitError(f"{where}: the engine was put to sleep while it waited for the publish; wake() it, then "
                             "refit; nothing was copied")
        t1 = time.perf_counter()
        report = RefitReport(version, live, atomic, manifest.nbytes, wait_ms=(t1 - t0) * 1e3)
        steps = report.breakdown
        steps["record_ms"] = report.wait_ms
        if atomic:
            try:
                target = staging_for(arena)
            except OutOfMemoryError as exc:
                raise OutOfMemoryError(f"{where}: an atomic refit stages one image beside the live one (the old "
                                       "weights are serving; refit(..., atomic=False) copies in place with no extra "
                                       "memory)",
                                       exc.nbytes_needed, exc.nbytes_free) from None
        else:
            target = arena
        steps["staging_create_ms"] = (time.perf_counter() - t1) * 1e3
        # in place into the holder's memory (handed over, or opened from it): a restart binds what
        # this writes, so the held record says so before the first write (see holder_refit)
        held = [] if atomic else holder_links(arena)
        held_before = [place.state for place in held]
        if held:
            _mark_held_torn(held, live, torn, version, timeout_s, where)
        written = False  # in place, the live bytes are whole until the clone issues a write into them
        went_live = False  # the version's bytes, verified, under the views (copied in place, or swapped in)

        def now_live() -> None:
            loaded.version = version
            loaded.refit_torn = None
            made = {"version": version, "manifest": manifest.to_dict()}
            remember_refit(arena, made)  # for a hand-over after this refit
            _held_recorded(held, made, timeout_s, where)

        try:
            tc = time.perf_counter()
            try:
                result = clone(store, arena.device, schedule, verify=True, timeout_s=timeout_s, mover=mover,
                               chunk_bytes=chunk_bytes, token=token, token_file=token_file, name=namespace,
                               clones=clones, expect=manifest, transport=transport, into=target,
                               held_sources=loaded.refit_sources)
            except BaseException as exc:
                release_held_sources(loaded.refit_sources)  # a trainer that failed us is not mapped again
                # not said: raised before the clone connected (ours: nothing was written), or an
                # interrupt, which may have come as the clone returned, every byte in place
                written = getattr(exc, "into_written", not isinstance(exc, FlashBootError))
                if isinstance(exc, ChecksumMismatchError):  # the publisher's next version, or corruption?
                    why = _repacked_note(store, token, token_file, name, version, timeout_s)
                    if why:  # in place, the error below says where and what the arena holds
                        raise RefitError(f"{where}: {exc}: {why}; the old weights are serving" if atomic else
                                         f"{exc}: {why}") from exc
                raise
            written = True
            went_live = not atomic  # the clone returns verified
            steps["clone_ms"] = (time.perf_counter() - tc) * 1e3
            try:
                rep = result.report
                report.copy_ms, report.verify_ms = rep.transfer_ms, rep.verify_ms
                report.transport, report.schedule, report.position = rep.transport, rep.schedule, rep.position
                report.details = {"clone_total_ms": rep.total_ms, "exchange_ms": rep.exchange_ms,
                                  "chunk_bytes": rep.chunk_bytes, "mover": rep.mover, "source": rep.source}
                gpu_s = max((lane["seconds"] for lane in rep.lanes), default=0.0)
                steps.update(clone_connect_ms=rep.connect_ms, clone_exchange_ms=rep.exchange_ms,
                             clone_alloc_ms=rep.alloc_ms, copy_ms=rep.transfer_ms, copy_gpu_ms=gpu_s * 1e3,
                             map_during_copy_ms=rep.map_during_copy_ms, verify_ms=rep.verify_ms,
                             clone_other_ms=steps["clone_ms"] - rep.connect_ms - rep.exchange_ms - rep.alloc_ms
                             - rep.transfer_ms - rep.verify_ms)
                if atomic:
                    remap: dict = {}
                    report.remap_ms = replace_backing(arena, target, remap)
                    went_live = True
                    steps.update({f"remap_{k}": v for k, v in remap.items()}, remap_ms=report.remap_ms)
            finally:
                tr = time.perf_counter()
                result.close()
                steps["clone_close_ms"] = (time.perf_counter() - tr) * 1e3
        except BaseException as exc:
            if went_live:  # releasing the clone failed (an interrupt) with the new version serving: say so
                now_live()  # (the old version had been claimed over the new bytes; in place, a torn mix)
                raise
            if atomic or not written:  # not a byte of the live arena changed: the old weights are serving
                for place, was in zip(held, held_before):  # what the records said before the torn mark
                    _held_recorded([place], was, timeout_s, where)
                raise
            before = live if live is not None else torn["last_whole"]
            _mark_torn(loaded, live, version, exc)
            remember_refit(arena, {"torn": loaded.refit_torn})  # for a hand-over after this refit
            _held_recorded(held, {"torn": loaded.refit_torn}, timeout_s, where)
            if not isinstance(exc, FlashBootError):  # an interrupt: the weights are marked torn all the same
                raise
            raise RefitError(f"{where} (atomic=False, in place): {exc}; the arena may hold a mix of versions {before} "
                             f"and {version}, so the weights claim no version (loaded.version is None) until a refit "
                             f"to a version newer than {loaded.refit_torn['last_whole']} succeeds: refit again or "
                             "reload") from exc
        finally:
            if atomic and not target.closed:
                ts = time.perf_counter()
                target.close()
                steps["staging_close_ms"] = (time.perf_counter() - ts) * 1e3
        now_live()
    report.total_ms = (time.perf_counter() - t0) * 1e3
    return report


__all__ = ["RefitError", "RefitReport", "check_refit_values", "refit", "torn_note"]
