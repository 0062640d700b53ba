"""``flashboot bench movers``: every mover on every path it supports, against a bare torch ``copy_``.

Paths: h2d from pinned host memory, d2h to pinned host memory, d2d on one GPU, p2p between two
GPUs (arenas mapped for both), and host->host on the host backend. For each size the median of
the repeats (CUDA events) gives GB/s, compared with a bare ``copy_`` of the same bytes in the
same run. Every mover's copy is verified by checksum against the source.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from flashboot.units import parse_bytes

DEFAULT_SIZES = ("1MB", "16MB", "256MB", "1GB", "4GB")
PATHS = ("h2d", "d2h", "d2d", "p2p", "host")


@dataclass
class MoverRow:
    mover: str
    path: str
    nbytes: int
    median_ms: float
    gbps: float
    baseline_gbps: float
    ratio: float
    verified: bool
    first_ms: float = 0.0
    """The first call of a freshly made mover at this size, to its completion, before any warm-up:
    at a path's first size, the process's first call of that mover (a kernel's JIT or cache load)."""


@dataclass
class _Endpoints:
    src: object  # a torch uint8 tensor covering the largest size
    dst: object
    device: int  # where CUDA events are recorded
    keep: tuple = ()


def check_sizes(sizes, what: str) -> list[int]:
    """``sizes`` (an iterable of byte counts: ints >= 1) as a non-empty list of ints, or
    FlashBootError naming ``what`` and the first bad one: through the Python API a chunk of 0 had
    ended in range()'s ValueError, a float or NaN in its TypeError, a negative one in the batch's
    'non-empty list' refusal, no size at all in max()'s ValueError or, for the chunked host run,
    in a report with no rows."""
    import numbers

    from flashboot.errors import FlashBootError

    try:
        sizes = list(sizes)
    except TypeError:
        raise FlashBootError(f"{what} must be a list of byte counts, got {sizes!r}") from None
    if not sizes:
        raise FlashBootError(f"{what}: give at least one size in bytes")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise FlashBootError(f"{what}: {size!r} is not a whole number of bytes >= 1"
                                 + (f" (in {sizes!r})" if len(sizes) > 1 else ""))
    return [int(size) for size in sizes]


def _randomize(t) -> None:
    """Random bytes in all of the uint8 tensor ``t``: whole 8-byte words, then the tail byte by byte
    (a size not a multiple of 8 had raised torch's view error, a traceback for ``--sizes 1``)."""
    import torch

    whole = t.numel() // 8 * 8
    t[:whole].view(torch.int64).random_()
    t[whole:].random_(0, 256)


def _endpoints(path: str, nbytes: int) -> _Endpoints:
    import torch

    from flashboot.arena import Arena

    if path == "host":
        a, b = Arena.create(nbytes, device="cpu"), Arena.create(nbytes, device="cpu")
        src, dst = a.bytes()[:nbytes], b.bytes()[:nbytes]
        _randomize(src)
        return _Endpoints(src, dst, -1, (a, b))
    gpu = Arena.create(nbytes, device=0, access="all" if path == "p2p" else None)
    g = gpu.bytes()[:nbytes]
    _randomize(g)
    if path in ("h2d", "d2h"):
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if path == "h2d":
            pinned.copy_(g)
            return _Endpoints(pinned, g, 0, (gpu,))
        return _Endpoints(g, pinned, 0, (gpu,))
    other = Arena.create(nbytes, device=1 if path == "p2p" else 0, access="all" if path == "p2p" else None)
    return _Endpoints(g, other.bytes()[:nbytes], 1 if path == "p2p" else 0, (gpu, other))


def _checksum(t) -> int:
    from flashboot.kernels.checksum import checksum

    return checksum(t)


def _first_call_ms(mover, dst, src, nbytes: int, device: int) -> float:
    """One call of ``mover`` to its completion, timed on the host clock: a warm-up had hidden what
    a user's first call pays (a Triton kernel compiled or loaded from its cache)."""
    import torch

    t0 = time.perf_counter()
    if device < 0:
        mover.copy(dst, src, nbytes, stream=None)
    else:
        mover.copy(dst, src, nbytes, stream=torch.cuda.current_stream(device))
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _inner(nbytes: int) -> int:
    """Copies per timed sample: enough that small copies are not dominated by event resolution."""
    return max(1, min(20, (256 << 20) // nbytes))


def run(paths: list[str], sizes: list[int], movers: list[str] | None = None, repeats: int = 7) -> list[MoverRow]:
    """Measure every available mover on ``paths`` at ``sizes``; returns one row per (mover, path, size)."""
    import torch

    from flashboot.errors import UnknownNameError, restated
    from flashboot.movers import create_mover, list_movers
    from flashboot.benchmarks.timing import check_count, time_cuda, time_host

    check_count(repeats, "repeats")
    sizes = check_sizes(sizes, "bench movers sizes")
    for path in paths:  # a typo had measured nothing and exited 0
        if path not in PATHS:
            raise UnknownNameError("path", path, PATHS)
    every = list_movers()
    for name in movers or ():
        if name not in {m.name for m in every}:
            raise UnknownNameError("mover", name, [m.name for m in every])
    infos = [m for m in every if m.available and (movers is None or m.name in movers)]
    rows: list[MoverRow] = []
    for path in paths:
        chosen = [m for m in infos if path in m.paths]
        if not chosen:
            continue
        ends = _endpoints(path, max(sizes))
        try:
            for nbytes in sizes:
                src, dst = ends.src[:nbytes], ends.dst[:nbytes]
                expected = _checksum(src)
                if ends.device < 0:
                    base = time_host(lambda: dst.copy_(src), repeats=repeats)
                else:
                    def bare(stream):
                        with torch.cuda.stream(stream):
                            dst.copy_(src, non_blocking=True)
                    base = time_cuda(bare, device=ends.device, repeats=repeats, inner=_inner(nbytes))
                for info in chosen:
                    dst.fill_(0xAB)  # poison: a mover that writes nothing cannot pass the checksum
                    try:
                        mover = create_mover(info.name)
                        first_ms = _first_call_ms(mover, dst, src, nbytes, ends.device)
                        first_ok = _checksum(dst) == expected  # checked apart: the timed calls overwrite it
                        dst.fill_(0xAB)
                        if ends.device < 0:
                            t = time_host(lambda: mover.copy(dst, src, nbytes, stream=None), repeats=repeats)
                        else:
                            t = time_cuda(lambda s: mover.copy(dst, src, nbytes, stream=s), device=ends.device,
                                          repeats=repeats, inner=_inner(nbytes))
                    except Exception as exc:  # a mover's own error ("boom") had not said which mover, path or size
                        raise restated(exc, f"bench movers: mover {info.name!r} failed on {path} at {nbytes:,} bytes: "
                                            f"{type(exc).__name__}: {exc}") from exc
                    ok = first_ok and _checksum(dst) == expected
                    rows.append(MoverRow(info.name, path, nbytes, t.median_ms, t.gbps(nbytes), base.gbps(nbytes),
                                         t.gbps(nbytes) / base.gbps(nbytes), ok, first_ms))
        finally:  # a failing mover's traceback (a notebook keeps it) had held both arenas mapped
            for a in ends.keep:
                a.close()
            del ends
    return rows


def default_paths() -> list[str]:
    from flashboot._cuda import device_count

    n = device_count()
    if n == 0:
        return ["host"]
    return ["h2d", "d2h", "d2d"] + (["p2p"] if n > 1 else [])


def register_bench(sub) -> None:
    p = sub.add_parser("movers", help="every mover on every path it supports vs a bare torch copy_")
    p.add_argument("--paths", nargs="*", help="h2d d2h d2d p2p host (default: what this machine has)")
    p.add_argument("--sizes", nargs="*", default=None, help=f"default {' '.join(DEFAULT_SIZES)} (host: up to 256MB)")
    p.add_argument("--movers", nargs="*", help="default: every available mover")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", metavar="FILE", help="write rows as JSON ('-' for stdout)")
    p.add_argument("--chunked", action="store_true",
                   help="d2d in chunks on one GPU: per call | batched | flag-driven, host and GPU time apart "
                        "(benchmarks/movers_chunked.py)")
    p.add_argument("--total", default="1GiB", help="--chunked: bytes copied per row (default 1GiB)")
    p.add_argument("--chunks", nargs="*", help="--chunked: chunk sizes (default 256KiB .. 256MiB)")
    p.add_argument("--chain-bytes", default="8GiB", help="--chunked: bytes of the 3-arena chain ('none': skip it)")
    p.add_argument("--chain-chunk", default="64MiB", help="--chunked: chunk of the chain")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from flashboot.benchmarks.timing import dump_json, print_table

    if args.chunked:
        return _main_chunked(args)
    paths = args.paths or default_paths()
    default = DEFAULT_SIZES if paths != ["host"] else ("1MB", "16MB", "256MB")
    sizes = [parse_bytes(s) for s in (args.sizes or default)]
    rows = run(paths, sizes, args.movers, args.repeats)
    if not rows:  # all([]) is True: an empty table had exited 0
        from flashboot.errors import CapabilityError
        from flashboot.movers import list_movers

        have = "; ".join(f"{m.name}: {' '.join(m.paths)}" for m in list_movers() if m.available) or "none"
        asked = f" of {', '.join(args.movers)}" if args.movers else ""
        raise CapabilityError(f"nothing measured: no available mover{asked} copies on path(s) {', '.join(paths)} "
                              f"on this machine (available: {have})")
    print_table("movers vs bare copy_ (median of repeats after a warm-up; first: the first call, before it)",
                ["mover", "path", "MB", "first ms", "ms", "GB/s", "copy_ GB/s", "ratio", "verified"],
                [[r.mover, r.path, r.nbytes / 1e6, r.first_ms, r.median_ms, r.gbps, r.baseline_gbps, r.ratio,
                  "yes" if r.verified else "NO"] for r in rows])
    dump_json({"rows": rows}, args.json)
    return 0 if all(r.verified for r in rows) else 1


def _main_chunked(args: argparse.Namespace) -> int:
    from flashboot._cuda import device_count
    from flashboot.benchmarks import movers_chunked
    from flashboot.benchmarks.timing import dump_json
    from flashboot.errors import CapabilityError

    if device_count() == 0:
        raise CapabilityError("bench movers --chunked measures GPU copies and needs a CUDA device")
    chunks = [parse_bytes(c) for c in args.chunks] if args.chunks else movers_chunked.DEFAULT_CHUNKS
    report = movers_chunked.run(parse_bytes(args.total), chunks, args.movers, args.repeats,
                                chain_bytes=0 if args.chain_bytes == "none" else parse_bytes(args.chain_bytes), chain_chunk=parse_bytes(args.chain_chunk))
    movers_chunked.print_report(report)
    dump_json(report, args.json)
    return 0 if movers_chunked.verified(report) else 1
