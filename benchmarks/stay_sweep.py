"""Issue 17's sweep: the driver's ways to release, create and hand over an arena's segments,
side by side in one run, against the bulk H2D ceiling of the same run (one CUDA GPU).

Raw VMM steps (cuda-bindings, the arena's own allocation properties) on ranges the size of
checkpoint A (13.76 GB in 256 MiB segments), so every variant runs on the same bytes:

* **release**: the order and granularity of ``cuMemUnmap`` / ``cuMemRelease`` at sleep (the
  arena's way: every handle released, then one unmap of the whole range), and how fast the wake
  right after it runs (create + map + access, then one bulk H2D);
* **aftermath**: a bulk H2D into memory mapped long before, ``d`` ms after a release of another
  range: whether the driver's work after a release (its scrub of the freed memory?) slows the copy
  engine, and for how long; the same with the SM copy kernel reading the pinned backup;
* **wake**: right after a release, all segments created then one bulk copy, or pipelined (each
  segment's copy issued once it is mapped), by the copy engine or the SM kernel, and after a rest;
* **swap**: image A (resident) to sleep and B (reserved) awake with A's bytes: A released before,
  during or after B's copy, or A's physical handles handed to B (A unmapped, its handles mapped at
  B's addresses: no release, no create; the guarantee holds since A's memory is B's).

Run: ``python3 -m flashboot.benchmarks.stay_sweep --json out.json`` (benchmarks/gpu_stay_sweep.sh).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from flashboot.errors import FlashBootError

REST_S = 0.6
"""The rest before a measured cycle, so that the release before it is over (the 13:18 run: 0.5 s was enough)."""
AFTERMATH_MS = (0, 20, 50, 100, 200, 500)
"""Delays between a release and the H2D the aftermath rows time."""
RELEASE_MODES = ("release_then_unmap", "unmap_then_release", "per_segment", "unmap_segments_then_release",
                 "unmap_two_threads")
"""How :class:`_Range` releases its segments (the first is the arena's way at 15:00)."""


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class _Range:
    """One reserved range of ``nbytes`` on CUDA device ``index``, backed (or not) by segments."""

    def __init__(self, index: int, nbytes: int, segment_bytes: int):
        from flashboot import _cuda
        from flashboot.arena.backing_cuda import _allocation_prop, _granularity
        from flashboot.arena.segments import _round_up, _segment_sizes

        self.drv, self.check, self.index = _cuda.driver(), _cuda.check, index
        self.prop = _allocation_prop(index, fabric=False)
        granularity = _granularity(self.prop)
        self.nbytes = _round_up(nbytes, granularity)
        self.segment_bytes = segment_bytes
        self.sizes = _segment_sizes(self.nbytes, segment_bytes)
        self.ptr = int(self.check(self.drv.cuMemAddressReserve(self.nbytes, granularity, 0, 0), "reserve"))
        self.handles: list = []

    def addr(self, i: int) -> int:
        return self.ptr + i * self.segment_bytes

    def _access(self, ptr: int, n: int) -> None:
        d = self.drv.CUmemAccessDesc()
        d.location.type = self.drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        d.location.id = self.index
        d.flags = self.drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.check(self.drv.cuMemSetAccess(ptr, n, [d], 1), "cuMemSetAccess")

    def back(self, ready=None, handles: list | None = None) -> dict:
        """Create (or take ``handles``) and map every segment; ``ready(i)`` after each one's grant
        (pipelined), else one grant at the end. Returns ms spent creating, mapping, granting."""
        ms = {"create_ms": 0.0, "map_ms": 0.0, "access_ms": 0.0}
        given = list(handles) if handles is not None else []
        for i, size in enumerate(self.sizes):
            t0 = time.perf_counter()
            h = given.pop(0) if given else self.check(self.drv.cuMemCreate(size, self.prop, 0), "cuMemCreate")
            t1 = time.perf_counter()
            self.check(self.drv.cuMemMap(self.addr(i), size, 0, h, 0), "cuMemMap")
            self.handles.append(h)
            t2 = time.perf_counter()
            ms["create_ms"] += (t1 - t0) * 1e3
            ms["map_ms"] += (t2 - t1) * 1e3
            if ready is not None:
                self._access(self.addr(i), size)
                ms["access_ms"] += (time.perf_counter() - t2) * 1e3
                ready(i)
        if ready is None:
            t = time.perf_counter()
            self._access(self.ptr, self.nbytes)
            ms["access_ms"] += (time.perf_counter() - t) * 1e3
        return ms

    def _unmap(self, ptr: int, n: int) -> None:
        self.check(self.drv.cuMemUnmap(ptr, n), "cuMemUnmap")

    def _release_handles(self) -> None:
        for h in self.handles:
            self.check(self.drv.cuMemRelease(h), "cuMemRelease")

    def release(self, mode: str) -> dict:
        """Unmap and release every segment as ``mode`` (:data:`RELEASE_MODES`); ms per call kind."""
        t0 = time.perf_counter()
        out = {}
        if mode == "release_then_unmap":
            self._release_handles()
            t1 = time.perf_counter()
            self._unmap(self.ptr, self.nbytes)
            out = {"release_ms": (t1 - t0) * 1e3, "unmap_ms": (time.perf_counter() - t1) * 1e3}
        elif mode == "unmap_then_release":
            self._unmap(self.ptr, self.nbytes)
            t1 = time.perf_counter()
            self._release_handles()
            out = {"unmap_ms": (t1 - t0) * 1e3, "release_ms": (time.perf_counter() - t1) * 1e3}
        elif mode == "per_segment":
            for i, (h, size) in enumerate(zip(self.handles, self.sizes)):
                self._unmap(self.addr(i), size)
                self.check(self.drv.cuMemRelease(h), "cuMemRelease")
        elif mode == "unmap_segments_then_release":
            for i, size in enumerate(self.sizes):
                self._unmap(self.addr(i), size)
            t1 = time.perf_counter()
            self._release_handles()
            out = {"unmap_ms": (t1 - t0) * 1e3, "release_ms": (time.perf_counter() - t1) * 1e3}
        elif mode == "unmap_two_threads":
            from flashboot import _cuda

            half = len(self.sizes) // 2
            split = half * self.segment_bytes
            errors: list[BaseException] = []

            def other() -> None:
                try:
                    _cuda.use_device(self.index)
                    self._unmap(self.ptr + split, self.nbytes - split)
                except BaseException as exc:
                    errors.append(exc)

            th = threading.Thread(target=other)
            th.start()
            self._unmap(self.ptr, split)
            th.join(60)
            if errors:
                raise errors[0]
            t1 = time.perf_counter()
            self._release_handles()
            out = {"unmap_ms": (t1 - t0) * 1e3, "release_ms": (time.perf_counter() - t1) * 1e3}
        else:
            raise FlashBootError(f"unknown release mode {mode!r}; known: {', '.join(RELEASE_MODES)}")
        self.handles = []
        out["total_ms"] = (time.perf_counter() - t0) * 1e3
        return out

    def unmap_keep(self) -> tuple[list, float]:
        """Unmap the whole range and give up its handles (still allocated); returns them and the ms."""
        t0 = time.perf_counter()
        self._unmap(self.ptr, self.nbytes)
        handles, self.handles = self.handles, []
        return handles, (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        if self.handles:
            self.release("release_then_unmap")
        self.check(self.drv.cuMemAddressFree(self.ptr, self.nbytes), "cuMemAddressFree")


class _Copier:
    """H2D copies from the pinned backup: the copy engine (``cuMemcpyHtoDAsync``) or the SM
    kernel (flashboot's Triton copy reading the pinned pages over PCIe), on one stream."""

    def __init__(self, index: int, backup, nbytes: int):
        import torch

        from flashboot import _cuda
        from flashboot.kernels.copy import SM_TUNING, SMCopyLauncher, _knobs
        from flashboot.memory import Device

        self.drv, self.check, self.index = _cuda.driver(), _cuda.check, index
        self.src = backup.span(nbytes)
        # the SM kernel reads the backup through its device pointer (the same address under UVA
        # on our hosts; asked, not assumed)
        self.src_dev_ptr = int(self.check(self.drv.cuMemHostGetDevicePointer(self.src.ptr, 0),
                                          "cuMemHostGetDevicePointer"))
        self.dev = Device("cuda", index)
        self.torch_stream = torch.cuda.Stream(device=index)
        self.stream = self.torch_stream.cuda_stream
        self.sm = SMCopyLauncher(_knobs(SM_TUNING, {}))

    def copy(self, kind: str, dst_ptr: int, offset: int, n: int) -> None:
        if kind == "ce":
            self.check(self.drv.cuMemcpyHtoDAsync(dst_ptr, self.src.ptr + offset, n, self.stream), "cuMemcpyHtoDAsync")
        else:
            from flashboot.memory import Span

            self.sm(Span(dst_ptr, n, self.dev), Span(self.src_dev_ptr + offset, n, self.dev), n, self.stream)

    def bulk(self, kind: str, rng: _Range) -> None:
        self.copy(kind, rng.ptr, 0, self.src.nbytes)

    def segment(self, kind: str, rng: _Range, i: int) -> None:
        off = i * rng.segment_bytes
        n = min(rng.sizes[i], self.src.nbytes - off)
        if n > 0:
            self.copy(kind, rng.addr(i), off, n)

    def sync(self) -> None:
        self.torch_stream.synchronize()


def _free(index: int) -> int:
    from flashboot.memory import Device
    from flashboot.pinning import device_free_bytes

    return device_free_bytes(Device("cuda", index))


def run(*, nbytes: int, repeats: int = 3, index: int = 0, segment_bytes: int = 256 << 20,
        out: dict | None = None) -> dict:
    """Every row of the sweep (module doc), into ``out`` (medians in ms) as each section ends, so
    a failure part-way leaves the sections before it; the copy engine's rows come first, the SM
    kernel's last."""
    from flashboot import _cuda
    from flashboot.flashload.lifecycle import HostBackup
    from flashboot.memory import Device

    _cuda.use_device(index)
    out = {} if out is None else out
    backup = HostBackup(nbytes, Device("cuda", index))
    out.update(nbytes=nbytes, segment_bytes=segment_bytes, repeats=repeats, pin_ms=backup.pin_ms)
    ranges: list[_Range] = []
    try:
        copier = _Copier(index, backup, nbytes)
        a, b, x = (_Range(index, nbytes, segment_bytes) for _ in range(3))
        ranges += [a, b, x]
        x.back()  # mapped long before: the aftermath rows copy into it

        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        def ceiling(kind: str) -> float:
            samples = [timed(lambda: (copier.bulk(kind, x), copier.sync())) for _ in range(repeats + 1)]
            return _median(samples[1:])

        out["ceiling_before"] = {"ce_ms": ceiling("ce")}
        out["h2d_ms"] = out["ceiling_before"]["ce_ms"]

        # release: each mode, then at once the wake (create + map + access, one bulk CE copy)
        out["release"] = {}
        for mode in RELEASE_MODES:
            rows = []
            for _ in range(repeats):
                time.sleep(REST_S)
                free0 = _free(index)
                a.back()
                r = a.release(mode)
                r["free_shortfall_bytes"] = free0 - _free(index)
                t0 = time.perf_counter()
                r.update({f"wake_{k}": v for k, v in a.back().items()})
                copier.bulk("ce", a)
                copier.sync()
                r["wake_ms"] = (time.perf_counter() - t0) * 1e3
                a.release("release_then_unmap")
                rows.append(r)
            out["release"][mode] = {k: _median([row[k] for row in rows if k in row]) for k in rows[0]}

        # swap: A resident -> asleep, B reserved -> awake with the bytes
        out["swap"] = {}
        for variant in ("before", "during", "after", "handover", "handover_bulk"):
            samples, parts = [], []
            for _ in range(repeats):
                time.sleep(REST_S)
                a.back()
                p: dict = {}
                t0 = time.perf_counter()
                if variant == "before":
                    a.release("release_then_unmap")
                    b.back(ready=lambda i: copier.segment("ce", b, i))
                    copier.sync()
                elif variant == "during":
                    b.back(ready=lambda i: copier.segment("ce", b, i))
                    a.release("release_then_unmap")
                    copier.sync()
                elif variant == "after":
                    b.back(ready=lambda i: copier.segment("ce", b, i))
                    copier.sync()
                    a.release("release_then_unmap")
                else:
                    free0 = _free(index)
                    handles, p["unmap_keep_ms"] = a.unmap_keep()
                    if variant == "handover":
                        p.update(b.back(ready=lambda i: copier.segment("ce", b, i), handles=handles))
                    else:
                        p.update(b.back(handles=handles))
                        copier.bulk("ce", b)
                    copier.sync()
                    p["free_change_bytes"] = free0 - _free(index)
                samples.append((time.perf_counter() - t0) * 1e3)
                parts.append(p)
                b.release("release_then_unmap")
            out["swap"][variant] = {"ms": _median(samples),
                                    **{k: _median([q[k] for q in parts if k in q]) for k in parts[0]}}

        def aftermath(kind: str) -> None:
            """An H2D into x (mapped long ago) d ms after a release of a; None: no release."""
            for d in (None, *AFTERMATH_MS):
                samples = []
                for _ in range(repeats):
                    time.sleep(REST_S)
                    if d is not None:
                        a.back()
                        a.release("release_then_unmap")
                        time.sleep(d / 1e3)
                    samples.append(timed(lambda: (copier.bulk(kind, x), copier.sync())))
                out["aftermath"][f"{kind}_{'no_release' if d is None else f'{d}ms'}"] = _median(samples)

        def wake(kind: str) -> None:
            """Right after a release (the level-1 wake): bulk or pipelined, and pipelined after a rest."""
            for shape in ("bulk", "pipelined", "pipelined_rested"):
                samples = []
                for _ in range(repeats):
                    time.sleep(REST_S)
                    a.back()
                    a.release("release_then_unmap")
                    if shape.endswith("rested"):
                        time.sleep(REST_S)
                    t0 = time.perf_counter()
                    if shape == "bulk":
                        a.back()
                        copier.bulk(kind, a)
                    else:
                        a.back(ready=lambda i: copier.segment(kind, a, i))
                    copier.sync()
                    samples.append((time.perf_counter() - t0) * 1e3)
                    a.release("release_then_unmap")
                out["wake"][f"{kind}_{shape}"] = _median(samples)

        out["aftermath"], out["wake"] = {}, {}
        aftermath("ce")
        wake("ce")
        out["ceiling_after"] = {"ce_ms": ceiling("ce")}
        out["h2d_ms"] = min(out["ceiling_before"]["ce_ms"], out["ceiling_after"]["ce_ms"])
        # the SM kernel last: it reads the pinned backup over PCIe, which the copy engine rows do not depend on
        try:
            out["ceiling_before"]["sm_ms"] = ceiling("sm")
        except Exception as exc:
            out["sm_error"] = f"{type(exc).__name__}: {exc}"
            return out
        aftermath("sm")
        wake("sm")
        out["ceiling_after"]["sm_ms"] = ceiling("sm")
    finally:
        for rng in ranges:
            try:
                rng.close()
            except Exception as exc:  # report, keep closing the others
                out.setdefault("close_errors", []).append(repr(exc))
        backup.close()
    return out


def print_results(out: dict) -> None:
    nan = float("nan")
    h2d, before, after = out["h2d_ms"], out["ceiling_before"], out.get("ceiling_after", {})
    gb = out["nbytes"] / 1e9
    print(f"stay sweep: {gb:.2f} GB in {out['segment_bytes'] >> 20} MiB segments, median of {out['repeats']}; "
          f"CE H2D ceiling {before['ce_ms']:.1f} / {after.get('ce_ms', nan):.1f} ms (before / after); "
          f"SM H2D {before.get('sm_ms', nan):.1f} / {after.get('sm_ms', nan):.1f} ms {out.get('sm_error', '')}")
    print("release mode                    total ms  unmap ms release ms  short GB  wake ms (x H2D)  wake create/map/access ms")
    for mode, r in out["release"].items():
        print(f"  {mode:<29} {r['total_ms']:8.2f} {r.get('unmap_ms', nan):9.2f} {r.get('release_ms', nan):9.2f}"
              f"  {r['free_shortfall_bytes'] / 1e9:11.2f}  {r['wake_ms']:7.1f} ({h2d / r['wake_ms']:.3f}x)  "
              f"{r['wake_create_ms']:.2f}/{r['wake_map_ms']:.2f}/{r['wake_access_ms']:.2f}")
    print("swap of A (resident) for B (reserved), ms and / H2D ceiling (target <= 1.10)")
    for variant, s in out.get("swap", {}).items():
        extra = ", ".join(f"{k} {v:.2f}" if not k.endswith("bytes") else f"{k} {v / 1e9:.2f} GB"
                          for k, v in s.items() if k != "ms")
        print(f"  {variant:<14} {s['ms']:7.1f} ({s['ms'] / h2d:.3f}x)  {extra}")
    print("aftermath: H2D into memory mapped long ago, after a release of another range (x H2D ceiling)")
    print("  " + ", ".join(f"{k} {v:.1f} ({h2d / v:.3f}x)" for k, v in out.get("aftermath", {}).items()))
    print("wake right after a release (create+map+access and copy), x H2D ceiling")
    print("  " + ", ".join(f"{k} {v:.1f} ({h2d / v:.3f}x)" for k, v in out.get("wake", {}).items()))
    if out.get("close_errors"):
        print(f"close errors: {out['close_errors']}")


def main(argv: list[str] | None = None) -> int:
    import json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=13.76, help="bytes per range, in GB (default: checkpoint A)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    out: dict = {}
    try:
        run(nbytes=int(args.gb * 1e9), repeats=args.repeats, index=args.device, out=out)
    finally:  # what was measured before a failure is printed and kept
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        if "release" in out:
            print_results(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
