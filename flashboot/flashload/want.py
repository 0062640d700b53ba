"""What a load asks for, checked before any byte moves: the options that exclude each other, a
``staged=`` handle of the right rank, the job's tp/ep/key, and whether it verifies by default."""

from __future__ import annotations

import os

from ..errors import FlashBootError, LayoutError
from ..memory import Device


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
    from flashboot.kernels.checksum import gpu_checksum_loaded

    if by_daemon or gpu_checksum_loaded(dev.index):
        return True, ""
    return False, ("off by default for a load in this process: the checksum kernel's first call in a process "
                   "costs ~1 s, more than the load (a served load is verified by the daemon); verify=True checks")


def check_job_request(mf, *, tp, ep, expected_key) -> None:
    """LayoutError where the job file (``prepack.json``) says the image is not what the caller
    expects: the checks of :func:`flashboot.layouts.image.check_request` that need no tensor table."""
    from flashboot.layouts.image import JOB_FILE, check_key

    key, where = mf.job.key, str(mf.job.path / JOB_FILE)
    if tp is not None and tp != key.tp_size:
        raise LayoutError(f"{where}: packed for tp={key.tp_size}, requested tp={tp}")
    if ep is not None and ep != key.ep_size:
        raise LayoutError(f"{where}: packed for ep={key.ep_size}, requested ep={ep}")
    check_key(key, where, expected_key)


__all__ = ["VERIFY_BY_DEFAULT_ON_HOST", "check_job_request", "check_staged", "verify_default"]
