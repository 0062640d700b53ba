"""What a load asks for, checked before any byte moves: the options that exclude each other, a
``staged=`` handle of the right rank, the job's tp/ep/key, and whether it verifies by default."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import FlashBootError, LayoutError
from ..memory import Device
from ..units import check_timeout


def image_path(image_dir) -> str:
    """``image_dir`` (a str, a path-like or bytes, as ``os`` functions take it) as a str;
    FlashBootError naming the type for anything else (None, an int: had been a bare TypeError
    from deep inside the metadata read)."""
    try:
        path = os.fsdecode(os.fspath(image_dir))
    except TypeError:
        raise FlashBootError(f"the image directory must be a path (str, os.PathLike or bytes), got "
                             f"{type(image_dir).__name__} {image_dir!r}") from None
    if not path:  # os.path reads '' as the current directory: an unset variable had loaded whatever image was there
        raise FlashBootError(f"the image directory is an empty path ({image_dir!r}); name the image's directory")
    if not os.path.isabs(path):
        # anchored to the directory it was named in (joined, not normalised: 'link/../x' stays the
        # OS's to resolve): a loaded image keeps it, and its wake from disk or the daemon after the
        # engine changed directory had looked for another image ('/tmp/image: no such image directory')
        try:
            path = os.path.join(os.getcwd(), path)
        except OSError:  # the working directory is gone: the path is read as given, and fails by name
            pass
    return path


def job_dir_of(image_dir: str, rank: int) -> str:
    """``image_dir``, or the job directory above it where it is that job's directory of rank
    ``rank``. The staged copies, the preloader and its daemon are keyed by the job's path: a load
    given the rank's directory had streamed from disk beside the staged copy ("no preloader runs
    for .../rank-0"), and with ``served=True`` or ``stream=False`` waited out its whole timeout
    for a ``.ready`` written under another key. Another rank's directory is left as it is (the
    metadata's rank check refuses it)."""
    from flashboot.layouts.image import JOB_FILE, METADATA_FILE, read_job

    real = os.path.realpath(image_dir)
    parent = os.path.dirname(real)
    if not (os.path.isfile(os.path.join(real, METADATA_FILE)) and os.path.isfile(os.path.join(parent, JOB_FILE))):
        return image_dir
    return parent if read_job(parent).ranks.get(rank) == os.path.basename(real) else image_dir


def count_of(value, name: str, minimum: int, error: type = FlashBootError, *, optional: bool = True) -> int | None:
    """``value`` as an int >= ``minimum`` (None stays None where ``optional``); a count numpy computed
    (``np.int64``) is the int it holds. ``error`` (naming ``name`` and the value) for a bool, a
    float, a str or anything smaller: ``tp="2"`` had been refused as "packed for tp=2, requested
    tp=2", ``tp=True`` taken for 1, and a rank from ``np.arange`` refused as no int."""
    import numbers

    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        what = ("None or " if optional else "") + ("a non-negative int" if minimum == 0 else f"an int >= {minimum}")
        raise error(f"{name} must be {what}, got {value!r}")
    return int(value)


def flag_of(value, name: str, *, optional: bool = True) -> bool | None:
    """``value`` as True or False (None stays None where ``optional``); a numpy bool is the bool it
    holds. FlashBootError naming ``name`` and the value for anything else: ``stream=0`` or
    ``stream=np.False_`` (never stream) had streamed all the same, read as None (decide), and
    ``served="no"`` or ``verify="false"`` turned the option on."""
    import numpy as np

    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise FlashBootError(f"{name} must be {'None, ' if optional else ''}True or False, got {type(value).__name__} "
                         f"{value!r}")


def check_expected_key(expected_key) -> None:
    """FlashBootError unless ``expected_key`` is None, an :class:`~flashboot.layouts.format.ImageKey`
    or a mapping of its fields (a string had failed with a bare ValueError, after a served load's
    copy); LayoutError for a field no key has (it had used up a prepared handle, its copy discarded)."""
    from flashboot.layouts.format import ImageKey

    if expected_key is not None and not isinstance(expected_key, (ImageKey, Mapping)):
        raise FlashBootError(f"expected_key must be None, an ImageKey or a mapping of its fields, got "
                             f"{type(expected_key).__name__} {expected_key!r}")
    if isinstance(expected_key, Mapping):  # a misspelt field: refused before a prepared handle is used up
        unknown = set(expected_key) - set(ImageKey.FIELDS) - {"digest"}
        if unknown:
            raise LayoutError(f"expected key names unknown fields {sorted(unknown)}; known: "
                              f"{', '.join(ImageKey.FIELDS)}")


def check_same_root(shm_dir, theirs, maker: str, takes: str) -> None:
    """FlashBootError where a load's ``shm_dir`` names another staging root than ``theirs``, the one
    ``flashboot.<maker>`` used (``takes``: what the load takes from it). The roots are compared, not
    their spellings: 'shm/' or an absolute path had been refused for 'shm'."""
    from .shm import shm_root

    if shm_dir is not None and os.path.realpath(shm_root(shm_dir)) != os.path.realpath(shm_root(theirs)):
        raise FlashBootError(f"shm_dir={os.fspath(shm_dir)!r} differs from the staging root flashboot.{maker} used "
                             f"({shm_root(theirs)}), {takes}; pass it to {maker}")


def check_staged(staged, image_dir, rank: int) -> None:
    """FlashBootError unless ``staged`` is None or a :func:`flashboot.stage` handle of this rank and image."""
    from .stage import StagedImage

    if staged is not None:
        if not isinstance(staged, StagedImage):
            raise FlashBootError(f"staged must come from flashboot.stage(), got {type(staged).__name__}")
        if staged.rank != rank or os.path.realpath(staged.image_dir) != os.path.realpath(image_dir):
            raise FlashBootError(f"staged image is rank {staged.rank} of {staged.image_dir}; load asked for rank "
                                 f"{rank} of {image_dir}")


VERIFY_BY_DEFAULT_ON_HOST = False
"""The host backend's checksum (numba) runs at about half the host copy's rate (1.2 vs 2.5-3 GB/s
on 2 cores), so checking costs ~2x the load there: opt in with ``verify=True``. On CUDA the kernel
runs ~2.7 TB/s against a ~54 GB/s H2D (2 % of the load), but its first call in a process costs
~1 s (Triton's import, launcher, cache; 0.95-1.3 s on the H200 machine): so a served load is
verified by default by the daemon, which warmed its kernel once, and an in-process load only
where this process has run the kernel already."""


def verify_default(dev: Device, *, by_daemon: bool) -> tuple[bool, str]:
    """Whether a load verifies when the caller did not say; when not, why (the report's
    ``verify_skipped``). ``by_daemon``: the served-load daemon computes the digests."""
    if not dev.is_cuda:
        return VERIFY_BY_DEFAULT_ON_HOST, ("off by default on the host backend, where it costs ~2x the copy; "
                                           "verify=True checks")
    if by_daemon:
        return True, ""
    from flashboot.kernels.checksum import gpu_checksum_loaded  # (its import costs ~0.7 ms: not before a served copy)

    if gpu_checksum_loaded(dev.index):
        return True, ""
    return False, ("off by default for a load in this process: the checksum kernel's first call in a process "
                   "costs ~1 s, more than the load (a served load is verified by the daemon); verify=True checks")


def check_job_request(job, *, tp, ep, expected_key) -> None:
    """LayoutError where the job file (``prepack.json``, ``job``: its
    :class:`~flashboot.layouts.image.JobInfo`) says the image is not what the caller expects: the
    checks of :func:`flashboot.layouts.image.check_request` that need no tensor table."""
    from flashboot.layouts.image import JOB_FILE, check_key

    key, where = job.key, str(job.path / JOB_FILE)
    if tp is not None and tp != key.tp_size:
        raise LayoutError(f"{where}: packed for tp={key.tp_size}, requested tp={tp}")
    if ep is not None and ep != key.ep_size:
        raise LayoutError(f"{where}: packed for ep={key.ep_size}, requested ep={ep}")
    check_key(key, where, expected_key)


@dataclass
class LoadRequest:
    """One call of :func:`flashboot.load` (no ``holder=``), its options checked once by
    :func:`load_request`: what every source's plain load reads. ``verify`` is None only for a
    prepared load (the handle chose when it knew its source); ``why_not_verified`` is the report's
    ``verify_skipped`` otherwise. ``stream_config`` is set once the choice of source needs it."""

    image_dir: Any
    rank: int
    device: Device
    t_start: float
    timeout_s: float
    verify: bool | None
    why_not_verified: str
    shm_dir: Any
    chunk_bytes: int
    tp: int | None
    ep: int | None
    expected_key: Any
    served: bool
    staged: Any
    stream: bool | None
    stream_buffer_bytes: Any
    prepared: Any
    stream_config: Any = None


def load_request(image_dir, rank, device, *, t_start: float, timeout_s: float, served: bool, staged, prepared,
                 verify: bool | None, shm_dir, chunk_bytes: int, tp, ep, expected_key, stream: bool | None,
                 stream_buffer_bytes, prepared_class: type) -> LoadRequest:
    """The options of :func:`flashboot.load` checked (:func:`check_options`), the device parsed
    and the default of ``verify`` chosen (see :func:`verify_default`)."""
    dev = Device.parse(device)
    why_not = ""
    if verify is not None:
        verify, why_not = bool(verify), "verify=False"
    elif prepared is None:  # a prepared handle chose when it knew its source: the load takes its choice
        verify, why_not = verify_default(dev, by_daemon=served)
    rank = count_of(rank, "rank", 0, LayoutError, optional=False)
    image_dir = job_dir_of(image_dir, rank)  # as prepare() takes it: its handle's check compares them
    rank, tp, ep = check_options(image_dir, rank, timeout_s=timeout_s, served=served, staged=staged,
                                 prepared=prepared, shm_dir=shm_dir, chunk_bytes=chunk_bytes, tp=tp, ep=ep,
                                 expected_key=expected_key, stream=stream, stream_buffer_bytes=stream_buffer_bytes,
                                 prepared_class=prepared_class)
    return LoadRequest(image_dir, rank, dev, t_start, timeout_s, verify, why_not, shm_dir, chunk_bytes, tp, ep,
                       expected_key, bool(served), staged, stream, stream_buffer_bytes, prepared)


def check_options(image_dir, rank, *, timeout_s: float, served: bool, staged, prepared, shm_dir, chunk_bytes: int,
                  tp, ep, expected_key, stream: bool | None, stream_buffer_bytes, prepared_class: type
                  ) -> tuple[int, int | None, int | None]:
    """(rank, tp, ep) as ints, once every option of :func:`flashboot.load` is checked: LayoutError
    for a bad rank, FlashBootError naming the options that exclude each other, a bad ``staged=``
    or a ``prepared=`` that is no ``prepared_class``. Nothing is read or allocated: a restart
    from a holder (``holder=``) checks them too, before it maps a held arena (it had restarted
    with a stream size of 0, a NaN timeout or ``served=True, stream=True`` taken unchecked). The
    stream size itself is the caller's to check (``StreamConfig.of``: this layer is below the stream)."""
    rank = count_of(rank, "rank", 0, LayoutError, optional=False)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise FlashBootError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    check_timeout(timeout_s, "load timeout_s")
    tp, ep = count_of(tp, "tp", 1), count_of(ep, "ep", 1)
    check_expected_key(expected_key)
    if served and staged is not None:
        raise FlashBootError("served=True and staged= exclude each other: the daemon holds the pinned image")
    if stream and (served or staged is not None):
        raise FlashBootError("stream=True excludes served=True and staged=: a streamed load reads the image from disk")
    check_staged(staged, image_dir, rank)
    if stream_buffer_bytes is not None and (served or staged is not None or stream is False):
        # a load that never streams has no ring: the size had been taken and ignored (as the CLI refuses it)
        never = "served=True" if served else "staged=" if staged is not None else "stream=False"
        raise FlashBootError(f"stream_buffer_bytes sizes a streamed load's ring; a {never} load never streams")
    if staged is not None:
        check_same_root(shm_dir, staged.shm_dir, "stage()", "whose staged copy the load takes")
    if prepared is not None:
        if not isinstance(prepared, prepared_class):
            raise FlashBootError(f"prepared must come from flashboot.prepare(), got {type(prepared).__name__}")
        if served or staged is not None or stream is not None:  # stream=False too: the handle may stream
            raise FlashBootError("prepared= excludes served=, staged= and stream=: the handle already chose its mode "
                                 f"({prepared.requested_mode})")
    return rank, tp, ep


@dataclass(frozen=True)
class Want:
    """What the choice of a source looks at (:mod:`flashboot.flashload.choose`): the image and
    rank, where the preloader stages (``shm_dir``), the caller's ``stream=`` (True, False or
    None: decide), the validated :class:`~flashboot.flashload.shm.RankSource` and the preloader's
    status (None where the caller did not ask for it: a plain load takes the daemon only when
    ``served=True`` says so)."""

    image_dir: str
    rank: int
    source: Any
    shm_dir: Any = None
    stream: bool | None = None
    daemon: Any = None


__all__ = ["VERIFY_BY_DEFAULT_ON_HOST", "LoadRequest", "Want", "check_expected_key", "check_job_request",
           "check_options", "check_same_root", "check_staged", "count_of", "flag_of", "image_path", "job_dir_of",
           "load_request", "verify_default"]
