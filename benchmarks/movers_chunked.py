"""``flashboot bench movers --chunked``: what a pipeline pays per chunk, mover by mover.

One GPU, d2d between two arenas of ``total`` bytes (default 1 GiB), against the single-copy
ceiling of the same run (one copy-engine copy of all the bytes, measured before and after the
rows, so drift shows). For every mover and chunk size, three modes:

- ``per_call``: one call per chunk (``ChunkBatch.copy_chunk``: validated once, then the launch),
- ``batched``: the whole list in one call (``ChunkBatch.run``: cuMemcpyBatchAsync or one launch
  over a device-side descriptor table),
- ``flag``: the flag-driven kernel (:class:`~flashboot.kernels.flag_copy.FlagChainCopy`, the
  predecessor's flags raised up front): one launch that copies chunk by chunk.

``host_ms`` is the time the host spends issuing a mode's calls (perf_counter around them, nothing
held back); ``gpu_ms`` the device's time from the first copy to the last (CUDA events, in a second
pass with the stream held by a spin kernel while the host issues: work issued ahead, as a
pipeline issues it). When issuing is slower than copying, ``gpu_ms`` grows with ``host_ms``:
the comparison of the two says which side bounds a mode.

The copy engine's batch merges runs of chunks contiguous in both ranges into one copy (as NIXL
and UCX do with descriptor lists), so its ``copy_engine`` batched row of an in-order chunk list
issues one copy (``copies`` says how many went out); ``copy_engine unmerged`` keeps one copy per
chunk, which shows the engine's per-copy cost (~5 us of device time on an H200), also spread
over 4 and 8 streams. The SM descriptor-table kernel is the ``triton_sm`` batched row.

Also measured: the host cost of one ``mover.copy`` (2,000 back-to-back 4 KiB copies), a copy
that checksums what it writes against a plain SM copy (digests compared with the checksum
kernel's), two copies at once on one GPU per mover a chain uses (``concurrent``: the aggregate
two hops share there, which the chunk-size notebook's model reads), and a chain of three arenas
on one GPU (seed -> c1 -> c2): the flag-driven kernels against the copy engine ordered by stream
memory operations (cuStreamWaitValue32 / cuStreamWriteValue32), on the same chunks, each beside
its first hop alone on the same plan and the two hops' aggregate; with two GPUs also the flag
chain seed (GPU 0) -> c1 (GPU 1) -> c2 (GPU 0), whose hops are P2P.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from flashboot.benchmarks.movers import check_sizes
from flashboot.benchmarks.timing import check_count

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_CHUNKS = (256 << 10, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
PER_CALL_COPIES = 2000
PER_CALL_SAMPLES = 5
"""Samples of :func:`per_call_cost_us` per mover; the median is reported."""
CE_STREAMS = (4, 8)
"""Streams the copy engine's extra batched rows spread a batch over (several copy engines at once)."""
REPORT_FORMAT = 2
"""2: rows carry ``copies``; ``concurrent`` rows; chain rows carry ``model``, ``hops``, ``devices``,
the hop alone and the aggregate. :func:`load_report` reads format 1 too."""
FUSED_KNOBS = ({}, {"programs_per_sm": 2}, {"programs_per_sm": 6}, {"block_words": 2048, "num_warps": 8, "programs_per_sm": 2})
"""Copy + checksum: the defaults first, then a few other grids (the GPU decides; the first row is the default's)."""


@dataclass
class ChunkRow:
    mover: str
    mode: str  # per_call | batched | flag
    chunk_bytes: int
    n_chunks: int
    host_ms: float
    gpu_ms: float
    gbps: float
    ratio: float  # gbps / the single-copy ceiling of the same run
    verified: bool
    copies: int = 0  # copies or launches issued for all chunks (a merged batch issues fewer copies than chunks)


@dataclass
class ChunkedReport:
    total_bytes: int
    ceiling_gbps_before: float
    ceiling_gbps_after: float
    per_call_us: dict[str, float] = field(default_factory=dict)  # mover -> host µs per mover.copy (4 KiB, spans)
    per_call_tensor_us: dict[str, float] = field(default_factory=dict)  # the same with torch tensors as arguments
    rows: list[ChunkRow] = field(default_factory=list)
    checksum: list[dict] = field(default_factory=list)
    concurrent: list[dict] = field(default_factory=list)
    chain: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # a section that raised: named here, and the run fails
    format: int = REPORT_FORMAT

    @property
    def ceiling_gbps(self) -> float:
        return max(self.ceiling_gbps_before, self.ceiling_gbps_after)


def _gate(stream, ms: float = 20.0) -> None:
    """Keep ``stream`` busy for about ``ms`` so the host's enqueue never waits for the GPU."""
    import torch

    from flashboot.benchmarks.timing import _SLEEP_CYCLES_PER_MS

    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * _SLEEP_CYCLES_PER_MS))


def _timed(issue, stream, repeats: int) -> tuple[float, float]:
    """Median ``(host_ms, gpu_ms)`` of ``issue(stream)`` over ``repeats`` (one warm-up).

    Two passes per repeat: the host's time with nothing held back (a stream held by a gate would
    fill the launch queue and make the host wait for the GPU), then the device's time with the
    stream gated, so the copies run back to back as far as the host keeps up."""
    import statistics

    import torch

    issue(stream)
    stream.synchronize()
    hosts, gpus = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        issue(stream)
        hosts.append((time.perf_counter() - t0) * 1e3)
        stream.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _gate(stream)
        start.record(stream)
        issue(stream)
        end.record(stream)
        end.synchronize()
        gpus.append(start.elapsed_time(end))
    return statistics.median(hosts), statistics.median(gpus)


def _ceiling(dst, src, nbytes: int, stream, repeats: int) -> float:
    from flashboot.movers import create_mover

    mover = create_mover("copy_engine")
    _, ms = _timed(lambda s: mover.copy(dst, src, nbytes, stream=s), stream, repeats)
    return nbytes / (ms * 1e-3) / 1e9


def per_call_cost_us(mover, dst, src, stream, copies: int = PER_CALL_COPIES) -> float:
    """Host µs per ``mover.copy`` of 4 KiB, ``copies`` back to back (warmed up). Not gated: a 4 KiB
    copy runs faster than it is issued, so the launch queue never fills and the host never waits."""
    for _ in range(20):
        mover.copy(dst, src, 4096, stream=stream)
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(copies):
        mover.copy(dst, src, 4096, stream=stream)
    us = (time.perf_counter() - t0) / copies * 1e6
    stream.synchronize()
    return us


def run(total: int = GiB, chunk_sizes=DEFAULT_CHUNKS, movers: list[str] | None = None, repeats: int = 5,
        chain_bytes: int = 8 * GiB, chain_chunk: int = 64 * MiB, checksum_chunk: int = 4 * MiB) -> ChunkedReport:
    """Measure every available d2d mover (``movers`` to choose) on one GPU; see the module doc."""
    import torch

    from flashboot.arena import Arena
    from flashboot.kernels.checksum import checksum, chunk_checksums
    from flashboot.kernels.flag_copy import FlagChainCopy
    from flashboot.movers import create_mover, list_movers

    check_count(repeats, "repeats")
    total, chunk_sizes = check_sizes([total], "total")[0], check_sizes(chunk_sizes, "chunk sizes")
    names = [m.name for m in list_movers() if m.available and "d2d" in m.paths and (movers is None or m.name in movers)]
    stream = torch.cuda.Stream(device=0)
    with Arena.create(total, device=0) as a, Arena.create(total, device=0) as b:
        src, dst = a.bytes()[:total], b.bytes()[:total]
        src.view(torch.int64).random_()
        torch.cuda.synchronize()
        expected = checksum(src)
        report = ChunkedReport(total, _ceiling(dst, src, total, stream, repeats), 0.0)
        for name in names:  # spans, as the schedules pass them; then tensors, the convenience path
            mover = create_mover(name)
            report.per_call_us[name] = statistics.median(
                per_call_cost_us(mover, b.span(), a.span(), stream) for _ in range(PER_CALL_SAMPLES))
            report.per_call_tensor_us[name] = statistics.median(
                per_call_cost_us(mover, dst, src, stream) for _ in range(PER_CALL_SAMPLES))
        # (row label, mover, its options, modes): the copy engine also unmerged, and over several streams
        variants = [(name, name, {}, ("per_call", "batched")) for name in names]
        if "triton_tma" in names:  # the batches' kernel before the Gluon ring, in the same run
            variants.append(("triton_tma table", "triton_tma", {"batch_kernel": "table"}, ("batched",)))
        if "copy_engine" in names:
            variants.append(("copy_engine unmerged", "copy_engine", {"merge_contiguous": False}, ("batched",)))
            for k in CE_STREAMS:
                variants.append((f"copy_engine unmerged x{k} streams", "copy_engine",
                                 {"batch_streams": k, "merge_contiguous": False}, ("batched",)))
            variants.append((f"copy_engine x{CE_STREAMS[0]} streams", "copy_engine", {"batch_streams": CE_STREAMS[0]},
                             ("batched",)))
        for chunk in chunk_sizes:
            chunks = [(o, o, min(chunk, total - o)) for o in range(0, total, chunk)]
            for label, name, options, modes in variants:
                batch = create_mover(name, **options).batch(dst, src, chunks)

                def per_call(s, batch=batch):
                    for i in range(len(chunks)):
                        batch.copy_chunk(i, stream=s)

                issuers = {"per_call": per_call, "batched": lambda s, batch=batch: batch.run(stream=s)}
                for mode in modes:
                    copies = len(chunks) if mode == "per_call" else batch_copies(batch)
                    report.rows.append(_row(label, mode, chunk, len(chunks), issuers[mode], stream, repeats, dst,
                                            expected, total, copies))
            flags = torch.ones(len(chunks), dtype=torch.int32, device="cuda:0")
            done = torch.zeros_like(flags)
            flag_copy = FlagChainCopy(dst, src, chunk, ready=flags, done=done)

            def flag_issue(s, flag_copy=flag_copy):
                flag_copy.launch(1, stream=s, timeout_s=30.0)  # the ready flags stay at 1: every chunk is ready

            report.rows.append(_row("flag_kernel", "flag", chunk, len(chunks), flag_issue, stream, repeats, dst,
                                    expected, total, 1))
        report.checksum = _section(report, "copy + checksum", lambda: _checksum_rows(
            dst, src, total, checksum_chunk, stream, repeats, chunk_checksums))
        report.concurrent = _section(report, "two copies at once", lambda: concurrent_rows(
            dst, src, total, chain_chunk, stream, repeats, expected))
        report.ceiling_gbps_after = _ceiling(dst, src, total, stream, repeats)
    ceiling = report.ceiling_gbps
    for r in report.rows:
        r.ratio = r.gbps / ceiling
    for c in report.concurrent:
        c["ratio"] = c["aggregate_gbps"] / ceiling
    if chain_bytes:
        chain_repeats = max(1, repeats // 2)
        report.chain = _section(report, "chain on one GPU", lambda: chain_rows(
            chain_bytes, chain_chunk, repeats=chain_repeats, ceiling_gbps=ceiling))
        if torch.cuda.device_count() >= 2:
            report.chain += _section(report, "chain over two GPUs", lambda: chain_rows(
                chain_bytes, chain_chunk, repeats=chain_repeats, devices=(0, 1, 0)))
    return report


def batch_copies(batch) -> int:
    """Copies or launches ``batch.run`` issues: the count the mover's batch keeps (the copy
    engine's merged runs), one per entry where the mover batches with :class:`Mover`'s default
    (one call per chunk: a researcher's mover had been reported as 1 copy), else one launch."""
    from flashboot.movers import Mover

    copies = getattr(batch.prepared, "copies", None)
    if copies is not None:
        return copies
    return len(batch) if type(batch.mover)._copy_batch is Mover._copy_batch else 1


def _section(report: ChunkedReport, name: str, measure) -> list[dict]:
    """``measure()``'s rows; a section that raises leaves its rows out and its error in
    ``report.errors`` (printed, in the JSON, and the run fails), so the rows measured before it
    still come back from a one-shot GPU run."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed: verified() fails on it
        import traceback

        report.errors.append(f"{name}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
        return []


def _row(name, mode, chunk, n_chunks, issue, stream, repeats, dst, expected, total, copies) -> ChunkRow:
    import torch

    from flashboot.kernels.checksum import checksum

    dst.fill_(0xAB)  # poison: a mode that writes nothing cannot pass the checksum
    stream.wait_stream(torch.cuda.current_stream())
    host_ms, gpu_ms = _timed(issue, stream, repeats)
    stream.synchronize()
    gbps = total / (gpu_ms * 1e-3) / 1e9
    return ChunkRow(name, mode, chunk, n_chunks, host_ms, gpu_ms, gbps, 0.0, checksum(dst) == expected, copies)


def concurrent_rows(dst, src, total: int, chunk: int, stream, repeats: int, expected: int) -> list[dict]:
    """Two copies at once on one GPU, each of half the bytes on a stream of its own, per mover a
    chain uses (``copy_engine``; ``flag_kernel``: two flag-driven kernels, every flag raised) and
    ``triton_sm``: the aggregate GB/s they reach together is what two hops of a chain share on
    that GPU (the chunk-size notebook's model reads it)."""
    import statistics

    import torch

    from flashboot.kernels.checksum import checksum
    from flashboot.kernels.flag_copy import FlagChainCopy
    from flashboot.movers import create_mover

    half = total // 32 * 16  # 16-byte aligned halves (the flag kernel's requirement)
    parts = [(dst[:half], src[:half]), (dst[half:total], src[half:total])]
    s1, s2 = torch.cuda.Stream(device=0), torch.cuda.Stream(device=0)
    ce, sm = create_mover("copy_engine"), create_mover("triton_sm")
    flags = []
    for d, s in parts:
        n = -(-d.numel() // chunk)
        flags.append(FlagChainCopy(d, s, chunk, ready=torch.ones(n, dtype=torch.int32, device="cuda:0"),
                                   done=torch.zeros(n, dtype=torch.int32, device="cuda:0")))
    issuers = {
        "copy_engine": lambda: [ce.copy(d, s, stream=st) for (d, s), st in zip(parts, (s1, s2))],
        "flag_kernel": lambda: [f.launch(1, stream=st, timeout_s=30.0) for f, st in zip(flags, (s1, s2))],
        "triton_sm": lambda: [sm.copy(d, s, stream=st) for (d, s), st in zip(parts, (s1, s2))],
    }
    out = []
    for mover, issue in issuers.items():
        dst.fill_(0xAB)
        torch.cuda.synchronize()
        samples = []
        for rep in range(repeats + 1):  # the first run warms up
            _gate(stream)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            s1.wait_event(start)
            s2.wait_event(start)
            issue()
            stream.wait_stream(s1)
            stream.wait_stream(s2)
            end.record(stream)
            end.synchronize()
            if rep:
                samples.append(start.elapsed_time(end))
        ms = statistics.median(samples)
        out.append({"mover": mover, "copies": 2, "nbytes": total, "gpu_ms": ms, "aggregate_gbps": total / ms / 1e6,
                    "ratio": 0.0, "verified": checksum(dst) == expected})
    return out


def _checksum_rows(dst, src, total, chunk, stream, repeats, chunk_checksums) -> list[dict]:
    """Copy + checksum in one pass vs a plain SM copy of the same bytes; digests vs the kernel's."""
    import torch

    from flashboot.kernels.copy_verify import start_copy_with_checksums
    from flashboot.movers import create_mover

    sm = create_mover("triton_sm")
    _, plain_ms = _timed(lambda s: sm.copy(dst, src, total, stream=s), stream, repeats)
    plain = total / plain_ms / 1e6
    rows = []
    for knobs in FUSED_KNOBS:
        pending: list = []
        dst.fill_(0xAB)  # poison: the digests must come from bytes this pass wrote
        stream.wait_stream(torch.cuda.current_stream())
        # The device's time of the pass: the clock stops at the launch's end, before the host reads
        # the digests back (that read-back and its Python would count as GPU time otherwise).
        _, fused_ms = _timed(lambda s: pending.append(start_copy_with_checksums(dst, src, chunk, stream=s, **knobs)),
                             stream, repeats)
        identical = pending[-1].digests() == chunk_checksums(dst, chunk)
        fused = total / fused_ms / 1e6
        what = "copy + checksum (one pass)" + (" " + ", ".join(f"{k}={v}" for k, v in knobs.items()) if knobs else "")
        rows.append({"what": what, "knobs": knobs, "chunk_bytes": chunk, "gpu_ms": fused_ms, "gbps": fused,
                     "plain_copy_gbps": plain, "ratio": fused / plain, "bit_identical": identical})
    return rows


def chain_rows(nbytes: int, chunk: int, *, repeats: int = 2, ceiling_gbps: float | None = None,
               devices: tuple[int, int, int] = (0, 0, 0)) -> list[dict]:
    """seed -> c1 -> c2 with the arenas on ``devices``: the flag-driven kernels and (all on one
    GPU) the copy engine ordered by stream memory operations, on the same chunks.

    Per method: both hops at once (``hop1_*``: the first hop's own time in the chain, ``chain_*``:
    until the last byte of c2), then the first hop alone on the same plan (seed -> c1 only,
    ``alone_*``), and the two hops' ``aggregate_gbps`` (2 x bytes / chain time), each against the
    ceiling: one copy-engine copy of the bytes on one GPU (``ceiling_gbps``), or seed -> c1 over
    P2P measured here when the hops cross GPUs. A hop alone near the ceiling and an aggregate near
    it too say that the hops are limited by the memory bandwidth they share, not by the mover.
    """
    import contextlib
    import itertools
    import statistics

    import cupy
    import torch

    from flashboot import _cuda
    from flashboot.arena import Arena
    from flashboot.kernels.checksum import checksum
    from flashboot.kernels.flag_copy import FlagChainCopy

    seed_dev, c1_dev, c2_dev = devices
    gpus = sorted(set(devices))
    n = -(-nbytes // chunk)
    out = []
    with contextlib.ExitStack() as arenas:
        seed, c1, c2 = (arenas.enter_context(Arena.create(nbytes, device=d, access=[g for g in gpus if g != d] or None))
                        .bytes()[:nbytes] for d in devices)
        seed.view(torch.int64).random_()
        torch.cuda.synchronize(seed_dev)
        expected = checksum(seed)
        s1, s2 = torch.cuda.Stream(device=c1_dev), torch.cuda.Stream(device=c2_dev)
        if len(gpus) > 1 or ceiling_gbps is None:  # P2P: the copy engine's seed -> c1 of this run
            ceiling_gbps = _ceiling(c1, seed, nbytes, s1, repeats)
        ready = torch.full((n,), -1, dtype=torch.int32, device=f"cuda:{seed_dev}")
        f1 = torch.zeros(n, dtype=torch.int32, device=f"cuda:{c1_dev}")
        f2 = torch.zeros(n, dtype=torch.int32, device=f"cuda:{c2_dev}")
        k1 = FlagChainCopy(c1, seed, chunk, ready=ready, done=f1)
        k2 = FlagChainCopy(c2, c1, chunk, ready=f1, done=f2)
        drv = _cuda.driver()
        geq = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        epochs = itertools.count(2)  # every run raises the flags to a new epoch

        def flag_run(epoch: int, hops: int) -> None:
            if hops == 2:
                k2.launch(epoch, stream=s2, timeout_s=60.0)  # the downstream kernel first: it waits on flags
            k1.launch(epoch, stream=s1, timeout_s=60.0)

        def flag_wait(hops: int) -> None:
            k1.wait()
            if hops == 2:
                k2.wait()

        def memops_run(epoch: int, hops: int) -> None:
            cs1, cs2 = drv.CUstream(s1.cuda_stream), drv.CUstream(s2.cuda_stream)
            for i in range(n):  # the executor's CUDA backend, on the same chunks
                lo, nb = i * chunk, min(chunk, nbytes - i * chunk)
                cupy.cuda.runtime.memcpyAsync(c1.data_ptr() + lo, seed.data_ptr() + lo, nb, 4, s1.cuda_stream)
                _cuda.check(drv.cuStreamWriteValue32(cs1, drv.CUdeviceptr(f1.data_ptr() + 4 * i), epoch, 0), "write")
                if hops == 2:
                    _cuda.check(drv.cuStreamWaitValue32(cs2, drv.CUdeviceptr(f1.data_ptr() + 4 * i), epoch, geq), "wait")
                    cupy.cuda.runtime.memcpyAsync(c2.data_ptr() + lo, c1.data_ptr() + lo, nb, 4, s2.cuda_stream)
                    _cuda.check(drv.cuStreamWriteValue32(cs2, drv.CUdeviceptr(f2.data_ptr() + 4 * i), epoch, 0), "write")

        methods = [("flag kernels", ("flag_kernel", "flag"), flag_run, flag_wait)]
        if len(gpus) == 1:  # the stream-memop chain is the one-GPU comparison (its waits poll local memory)
            methods.append(("copy engine + stream memops", ("copy_engine", "per_call"), memops_run, None))

        def sync_all() -> None:
            for g in gpus:
                torch.cuda.synchronize(g)

        for method, model, run_once, wait in methods:
            row: dict = {"method": method, "model": list(model), "hops": 2, "devices": list(devices), "nbytes": nbytes,
                         "chunk_bytes": chunk, "ceiling_gbps": ceiling_gbps}
            ok = True
            for hops in (2, 1):
                samples = []
                for rep in range(repeats + 1):  # the first run compiles and warms up
                    epoch = next(epochs)
                    c1.fill_(0xAB)
                    c2.fill_(0xAB)
                    ready.fill_(epoch)  # the seed's flags: every chunk ready (read by the flag kernels only)
                    sync_all()
                    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("s1", "e1", "s2", "e2")}
                    _gate(s1)  # both methods issue ahead of the copies (the host's enqueue is not timed)
                    ev["s1"].record(s1)
                    s2.wait_event(ev["s1"])  # c2's clock starts with c1's, on c2's own GPU
                    ev["s2"].record(s2)
                    run_once(epoch, hops)
                    ev["e1"].record(s1)
                    ev["e2"].record(s2)
                    if wait is not None:
                        wait(hops)
                    sync_all()
                    if rep:
                        samples.append((ev["s1"].elapsed_time(ev["e1"]), ev["s2"].elapsed_time(ev["e2"])))
                hop1_ms = statistics.median(s[0] for s in samples)
                ok = ok and checksum(c1) == expected and (hops == 1 or checksum(c2) == expected)
                if hops == 2:
                    chain_ms = statistics.median(s[1] for s in samples)
                    row.update(hop1_ms=hop1_ms, chain_ms=chain_ms, hop1_gbps=nbytes / hop1_ms / 1e6,
                               chain_gbps=nbytes / chain_ms / 1e6, aggregate_gbps=2 * nbytes / chain_ms / 1e6)
                else:
                    row.update(alone_ms=hop1_ms, alone_gbps=nbytes / hop1_ms / 1e6)
            for key in ("hop1", "chain", "alone", "aggregate"):
                row[f"{key}_ratio"] = row[f"{key}_gbps"] / ceiling_gbps
            row["verified"] = ok
            out.append(row)
    return out


def run_host(total: int = 32 * MiB, chunk_sizes=(256 << 10, 1 * MiB, 4 * MiB, 16 * MiB), repeats: int = 5) -> ChunkedReport:
    """The host backend's version of :func:`run` (the notebook's fallback without a GPU): the
    ``host`` mover between two host arenas, one call per chunk and batched; times are the host's
    clock (the copy is synchronous), the ceiling one host copy of all the bytes."""
    import statistics

    import numpy as np

    from flashboot.arena import Arena
    from flashboot.kernels.checksum import checksum
    from flashboot.movers import create_mover

    check_count(repeats, "repeats")
    total, chunk_sizes = check_sizes([total], "total")[0], check_sizes(chunk_sizes, "chunk sizes")
    mover = create_mover("host")

    def median_ms(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    with Arena.create(total, device="cpu") as a, Arena.create(total, device="cpu") as b:
        src, dst = a.bytes().numpy()[:total], b.bytes().numpy()[:total]
        src[:] = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
        expected = checksum(src)
        ceiling = [total / median_ms(lambda: mover.copy(dst, src, total)) / 1e6]
        report = ChunkedReport(total, ceiling[0], 0.0)
        for chunk in chunk_sizes:
            batch = mover.batch(dst, src, [(o, o, min(chunk, total - o)) for o in range(0, total, chunk)])

            def per_call(batch=batch):
                for i in range(len(batch)):
                    batch.copy_chunk(i, stream=None)

            for mode, fn in (("per_call", per_call), ("batched", lambda batch=batch: batch.run(stream=None))):
                dst[:] = 0xAB
                ms = median_ms(fn)
                gbps = total / ms / 1e6
                copies = len(batch) if mode == "per_call" else len(batch.runs()[2])
                report.rows.append(ChunkRow("host", mode, chunk, len(batch), ms, ms, gbps, 0.0, checksum(dst) == expected,
                                            copies))
        report.ceiling_gbps_after = total / median_ms(lambda: mover.copy(dst, src, total)) / 1e6
    for r in report.rows:
        r.ratio = r.gbps / report.ceiling_gbps
    return report


def load_report(path) -> dict:
    """A ``--json`` file of ``bench movers --chunked`` as a plain dict (rows as dicts). A format-1
    report (before ``concurrent`` and the chain rows' ``model``) reads with ``concurrent`` empty
    and each chain's model from :data:`flashboot.sim.mover_fit.CHAIN_MODELS`."""
    from flashboot._json import loads
    from flashboot.errors import FlashBootError
    from flashboot.sim.mover_fit import CHAIN_MODELS

    with open(path, "rb") as f:
        data = loads(f.read(), str(path))  # a truncated file had raised JSONDecodeError without its path
    if not isinstance(data, dict) or "rows" not in data or "total_bytes" not in data:  # a JSON string: AttributeError
        raise FlashBootError(f"{path}: not a `bench movers --chunked` report (no rows/total_bytes)")
    data.setdefault("format", 1)
    data.setdefault("concurrent", [])
    for chain in data.get("chain", []):
        chain.setdefault("hops", 2)
        if "model" not in chain and chain.get("method") in CHAIN_MODELS:
            chain["model"] = list(CHAIN_MODELS[chain["method"]])
    return data


def print_report(report: ChunkedReport) -> None:
    from flashboot.benchmarks.timing import print_table

    print_table(f"host cost of one mover.copy (4 KiB, {PER_CALL_COPIES:,} back to back, median of "
                f"{PER_CALL_SAMPLES})", ["mover", "µs per call (spans)", "µs per call (torch tensors)"],
                [[m, us, report.per_call_tensor_us.get(m, float("nan"))] for m, us in report.per_call_us.items()])
    print_table(f"{report.total_bytes / GiB:g} GiB d2d in chunks; ceiling: one copy-engine copy of it, "
                f"{report.ceiling_gbps_before:,.0f} GB/s before, {report.ceiling_gbps_after:,.0f} after "
                "(copy_engine batched merges contiguous chunks: 'copies' went out)",
                ["mover", "mode", "chunk MiB", "chunks", "copies", "host ms", "GPU ms", "GB/s", "x ceiling", "verified"],
                [[r.mover, r.mode, r.chunk_bytes / MiB, r.n_chunks, r.copies, r.host_ms, r.gpu_ms, r.gbps, r.ratio,
                  "yes" if r.verified else "NO"] for r in report.rows])
    if report.checksum:
        print_table("copy + checksum in one pass vs a plain SM copy", ["what", "GB/s", "plain GB/s", "ratio", "bit-identical"],
                    [[c["what"], c["gbps"], c["plain_copy_gbps"], c["ratio"], c["bit_identical"]] for c in report.checksum])
    if report.concurrent:
        print_table("two copies at once on one GPU (half the bytes each, two streams): the aggregate two hops share",
                    ["mover", "GPU ms", "aggregate GB/s", "x ceiling", "verified"],
                    [[c["mover"], c["gpu_ms"], c["aggregate_gbps"], c["ratio"], c["verified"]] for c in report.concurrent])
    for error in report.errors:
        print(f"FAILED section {error}")
    if report.chain:
        print_table("chain seed -> c1 -> c2: each hop in the chain, the first hop alone on the same plan, and the two "
                    "hops' aggregate (2 x bytes / chain time), against the ceiling (one GPU: one copy-engine copy; "
                    "across GPUs: the copy engine's P2P seed -> c1)",
                    ["what", "GPUs", "GiB", "chunk MiB", "hop 1 GB/s", "x ceiling", "chain GB/s", "x ceiling",
                     "alone GB/s", "x ceiling", "aggregate GB/s", "x ceiling", "ceiling GB/s", "verified"],
                    [[c["method"], "->".join(map(str, c["devices"])), c["nbytes"] / GiB, c["chunk_bytes"] / MiB,
                      c["hop1_gbps"], c["hop1_ratio"], c["chain_gbps"], c["chain_ratio"], c["alone_gbps"],
                      c["alone_ratio"], c["aggregate_gbps"], c["aggregate_ratio"], c["ceiling_gbps"], c["verified"]]
                     for c in report.chain])


def verified(report: ChunkedReport) -> bool:
    return (not report.errors and all(r.verified for r in report.rows) and all(c["bit_identical"] for c in report.checksum)
            and all(c["verified"] for c in report.concurrent) and all(c["verified"] for c in report.chain))


__all__ = ["ChunkRow", "ChunkedReport", "batch_copies", "run", "run_host", "load_report", "chain_rows", "concurrent_rows", "per_call_cost_us",
           "print_report", "verified", "DEFAULT_CHUNKS"]
