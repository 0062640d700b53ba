"""``flashboot bench soak``: many cycles of load -> bind -> close, of a served load -> bind ->
close, of seed -> clone -> close, of sleep -> wake of one bound image, and of publish -> refit
into one resident engine (atomic and in place in turn), in one process, with the resources it holds sampled after
every cycle: open fds, memfds, mapped bytes (/proc/self/maps: mappings of files and memfds,
where arenas, staged images and image files live; anonymous mappings such as malloc's 64 MiB
per-thread heaps come and go with the allocator and are covered by resident bytes instead),
resident bytes (Rss, /proc/self/smaps_rollup), pinned and locked bytes (VmPin + VmLck), GPU
memory in use (where a GPU exists), threads and child processes.

A leak shows as an upward trend: after a warm-up (the first 10 % of the cycles: caches fill,
kernels compile, pools grow to their working size), the mean of the last 20 % of the samples is
compared with the mean of the first 20 %; the run fails when it rose by more than a small slack
per resource (one fd, one thread; for bytes, the larger of an absolute and a relative slack).
A steady leak of L per cycle raises the last window's mean by L times the cycles between the two
windows' centres (0.72 x the cycles: 360 of 500), so one fd or one thread per cycle exceeds its
slack 360 times over at 500 cycles, while for bytes the smallest leak a run detects is its slack
over that span (mapped bytes: at least 8 MiB / 360 = ~23 KiB per cycle at 500 cycles, ~230 KiB at 50); the
table prints it per resource. The noise of a steady process stays within the slacks. Every cycle's bytes are also
checked against the source. The served cycles' daemon runs in this process (a thread), so its
fds, mappings and threads are counted too.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flashboot.errors import FlashBootError

KINDS = ("load", "served", "clone", "sleep", "refit")
WARMUP_FRACTION = 0.1
WINDOW_FRACTION = 0.2
SLACK = {
    # resource: (absolute, relative to the first window's mean)
    "fds": (1.0, 0.0),
    "memfds": (0.5, 0.0),
    "mapped_bytes": (8 << 20, 0.01),
    "resident_bytes": (16 << 20, 0.02),
    "pinned_bytes": (1 << 20, 0.0),
    "gpu_used_bytes": (64 << 20, 0.0),
    "threads": (1.0, 0.0),
    "children": (0.5, 0.0),
}
"""How far the last window's mean may sit above the first's before it counts as a leak."""


# ================================================================================ sampling
def _children() -> int:
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                n += len(f.read().split())
        except OSError:
            pass
    return n


def _status_kb(*keys: str) -> int:
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                total += int(rest.split()[0])
    return total * 1024


def _gpu_used_bytes() -> int:
    from flashboot import _cuda

    n = _cuda.device_count()
    if not n:
        return 0
    import cupy

    used = 0
    for i in range(n):
        with cupy.cuda.Device(i):
            free, total = cupy.cuda.runtime.memGetInfo()
        used += total - free
    return used


def sample() -> dict[str, int]:
    """This process's resources now (see the module doc)."""
    fds = memfds = 0
    for fd in os.listdir("/proc/self/fd"):
        fds += 1
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                memfds += 1
        except OSError:
            pass
    mapped = 0
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and not fields[5].startswith("["):  # a file or memfd, not [heap], [stack], anon
                lo, _, hi = fields[0].partition("-")
                mapped += int(hi, 16) - int(lo, 16)
    resident = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                resident = int(line.split()[1]) * 1024
    return {"fds": fds, "memfds": memfds, "mapped_bytes": mapped, "resident_bytes": resident,
            "pinned_bytes": _status_kb("VmPin", "VmLck"),
            "gpu_used_bytes": _gpu_used_bytes(), "threads": len(os.listdir("/proc/self/task")),
            "children": _children()}


# =================================================================================== trend
@dataclass
class Trend:
    resource: str
    first_mean: float
    last_mean: float
    slack: float
    start: int
    end: int
    span: int = 1
    """Samples between the two windows' centres: a leak of L per cycle raises the mean by L x span."""

    @property
    def rising(self) -> bool:
        return self.last_mean > self.first_mean + self.slack

    @property
    def detects_per_cycle(self) -> float:
        """The smallest steady leak per cycle this run would see (the slack over the span)."""
        return self.slack / max(1, self.span)


def trend(resource: str, series: list[float], *, slack_abs: float, slack_rel: float = 0.0,
          warmup_fraction: float = WARMUP_FRACTION, window_fraction: float = WINDOW_FRACTION) -> Trend:
    """Mean of the last ``window_fraction`` of ``series`` (after dropping the first
    ``warmup_fraction``) against the mean of the first; ``rising`` when above by more than
    ``max(slack_abs, slack_rel * |first mean|)``. Needs 10 samples at least."""
    if len(series) < 10:
        raise FlashBootError(f"a trend needs 10 samples at least, got {len(series)} of {resource}")
    s = series[int(len(series) * warmup_fraction):]
    w = max(1, int(len(s) * window_fraction))
    first, last = statistics.fmean(s[:w]), statistics.fmean(s[-w:])
    return Trend(resource, first, last, max(slack_abs, slack_rel * abs(first)), int(series[0]), int(series[-1]),
                 span=len(s) - w)


# ================================================================================== cycles
def _module_for(tensors: dict):
    """A meta-initialised torch module with a parameter of each tensor's name, shape and dtype."""
    import torch

    root = torch.nn.Module()
    with torch.device("meta"):
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype), requires_grad=False))
    return root


def _make_image(root: Path) -> Path:
    """A small pre-packed image (7 tensors, ~3 MB) made by flashboot.prepack from safetensors."""
    import json

    import torch
    from safetensors.torch import save_file

    import flashboot

    ckpt = root / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(3)
    tensors = {f"layers.{i}.w": torch.randn(256, 1024, generator=g).bfloat16() for i in range(6)}
    tensors["embed"] = torch.randn(100, 64, generator=g)
    save_file(tensors, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "tiny_bag", "_name_or_path": "org/soak"}))
    flashboot.prepack(ckpt, root / "img", chunk_bytes=1 << 20, progress=False)
    return root / "img"


def _equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8).to(a.device)))


class _LoadCycle:
    """load -> bind -> close (``served``: the daemon of this process copies)."""

    def __init__(self, image: Path, device: str, shm: Path, served: bool):
        from flashboot.layouts import read_image

        self.image, self.device, self.shm, self.served = image, device, shm, served
        ref = read_image(image, 0)
        self.reference = {n: ref.view(n).clone() for n in ref.tensors}
        ref.close()

    def __call__(self) -> bool:
        import flashboot

        loaded = flashboot.load(self.image, 0, self.device, served=self.served, shm_dir=self.shm, timeout_s=30)
        try:
            module = _module_for(loaded.tensors)
            flashboot.bind(module, loaded)
            exact = all(_equal(p, self.reference[n]) for n, p in module.named_parameters())
            del module  # the views go before the arena
        finally:
            loaded.close()
            if loaded.release_thread is not None:  # the background unpin of a load that pinned itself
                loaded.release_thread.join(60)
        return exact


class _SleepCycle:
    """sleep -> wake of one loaded, bound image: level 1 (from the backup) and level 2 (from the
    disk: no daemon serves it) in turn; the bound parameters are checked after every wake."""

    def __init__(self, image: Path, device: str, no_daemon: Path):
        import flashboot

        self.loaded = flashboot.load(image, 0, device, stream=True)
        self.module = _module_for(self.loaded.tensors)
        flashboot.bind(self.module, self.loaded)
        self.reference = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        self.no_daemon, self.cycles = no_daemon, 0

    def __call__(self) -> bool:
        self.loaded.sleep(level=1 + self.cycles % 2)
        self.cycles += 1
        self.loaded.wake(shm_dir=self.no_daemon)
        return all(_equal(p, self.reference[n]) for n, p in self.module.named_parameters())

    def close(self) -> None:
        del self.module  # the views go before the arena
        self.loaded.close()


class _CloneCycle:
    """seed -> clone -> close, each cycle on a fresh store the seed hosts."""

    def __init__(self, device: str, nbytes: int = 4 << 20):
        import torch

        from flashboot.arena import Arena

        self.device, self.token = device, secrets.token_hex(16)
        self.arena = Arena.create(nbytes, device)
        g = torch.Generator().manual_seed(5)
        self.data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        self.arena.bytes()[:nbytes].copy_(self.data.to(self.arena.bytes().device))
        self.nbytes = nbytes

    def __call__(self) -> bool:
        import flashboot
        from flashboot.flashclone.rendezvous import free_port

        address = f"127.0.0.1:{free_port()}"
        with flashboot.seed(address, self.arena, self.device, token=self.token, checksum_chunk_bytes=1 << 20,
                            timeout_s=30):
            with flashboot.clone(address, self.device, "chain", token=self.token, timeout_s=30) as r:
                return _equal(r.arena.bytes()[:self.nbytes], self.data)

    def close(self) -> None:
        self.arena.close()


class _RefitCycle:
    """publish version i -> refit the resident engine to it (atomic and in place in turn); the
    trainer's two weight sets alternate, and the engine's views must hold the one just published."""

    def __init__(self, image: Path, device: str):
        from safetensors.torch import load_file

        import flashboot
        from flashboot.flashclone.rendezvous import Rendezvous, free_port
        from flashboot.weight_update import Publisher

        self.token = secrets.token_hex(16)
        self.address = f"127.0.0.1:{free_port()}"
        self.store = Rendezvous.connect(self.address, self.token, host=True, timeout_s=30)
        base = load_file(image.parent / "ckpt" / "model.safetensors", device=device)
        self.sets = [base, {n: (t.float() + 1).to(t.dtype) for n, t in base.items()}]
        self.loaded = flashboot.load(image, 0, device, timeout_s=30)
        self.publisher = Publisher(image, 0, store=self.address, device=device, token=self.token, timeout_s=30)
        self.version = 0

    def __call__(self) -> bool:
        self.version += 1
        published = self.sets[self.version % 2]
        self.publisher.publish(published, self.version)
        self.loaded.refit(self.address, self.version, atomic=self.version % 2 == 1, token=self.token, timeout_s=30)
        return all(_equal(v, published[n]) for n, v in self.loaded.tensors.items())

    def close(self) -> None:
        self.publisher.close()
        self.loaded.close()
        self.store.close()


@dataclass
class SoakResult:
    kind: str
    cycles: int
    exact: int
    seconds: float
    start: dict
    end: dict
    trends: list[Trend] = field(default_factory=list)

    @property
    def leaking(self) -> list[str]:
        return [t.resource for t in self.trends if t.rising]


def soak(kind: str, cycle: Callable[[], bool], cycles: int, *, after_cycle: Callable[[int], None] | None = None,
         progress: Callable[[str, int], None] | None = None) -> SoakResult:
    """Run ``cycle`` ``cycles`` times, sampling after each; ``after_cycle(i)`` runs before the sample."""
    samples: list[dict] = []
    exact = 0
    t0 = time.perf_counter()
    for i in range(cycles):
        exact += bool(cycle())
        if after_cycle is not None:
            after_cycle(i)
        samples.append(sample())
        if progress is not None:
            progress(kind, i + 1)
    seconds = time.perf_counter() - t0
    trends = [trend(k, [s[k] for s in samples], slack_abs=a, slack_rel=r) for k, (a, r) in SLACK.items()]
    return SoakResult(kind, cycles, exact, seconds, samples[0], samples[-1], trends)


def run(*, cycles: int = 500, kinds=KINDS, device: str | None = None, root: str | None = None,
        after_cycle: Callable[[int], None] | None = None, progress=None) -> list[SoakResult]:
    """Soak each of ``kinds`` for ``cycles`` cycles on ``device`` (default: cuda:0, else cpu)."""
    from flashboot._cuda import device_count

    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise FlashBootError(f"unknown soak kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if cycles < 10:
        raise FlashBootError(f"a soak needs 10 cycles at least, got {cycles}")
    device = device or ("cuda:0" if device_count() else "cpu")
    from flashboot.benchmarks.serve import _private_shm

    work = Path(root or tempfile.mkdtemp(prefix="flashboot-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    shm = Path(_private_shm("flashboot-soak-"))  # pinning (CUDA) needs tmpfs pages
    results = []
    try:
        image = _make_image(work) if {"load", "served", "sleep", "refit"} & set(kinds) else None
        for kind in kinds:
            if kind == "load":
                from flashboot.flashload.staging import stage_rank

                stage_rank(image, 0, shm_dir=shm, device=device)  # what the preloader would have done
                results.append(soak(kind, _LoadCycle(image, device, shm, False), cycles,
                                    after_cycle=after_cycle, progress=progress))
            elif kind == "served":
                results.append(_soak_served(image, device, shm, cycles, after_cycle, progress))
            elif kind == "sleep":
                cyc = _SleepCycle(image, device, work / "no-daemon")
                try:
                    results.append(soak(kind, cyc, cycles, after_cycle=after_cycle, progress=progress))
                finally:
                    cyc.close()
            else:
                cyc = _CloneCycle(device) if kind == "clone" else _RefitCycle(image, device)
                try:
                    results.append(soak(kind, cyc, cycles, after_cycle=after_cycle, progress=progress))
                finally:
                    cyc.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return results


def _soak_served(image, device, shm, cycles, after_cycle, progress) -> SoakResult:
    from flashboot.flashload import staging
    from flashboot.flashload.server import PreloadServer

    logs: list[str] = []
    server = PreloadServer(staging.PreloadConfig(str(image), shm_dir=str(shm), serve=True, devices={0: device}),
                           log=logs.append)
    thread = threading.Thread(target=server.run, name="flashboot-soak-daemon", daemon=True)
    thread.start()
    try:
        if not server.residents[0].event.wait(60) or server.residents[0].error is not None:
            raise FlashBootError(f"the in-process daemon did not hold the image: {logs}")
        return soak("served", _LoadCycle(image, device, shm, True), cycles, after_cycle=after_cycle, progress=progress)
    finally:
        server.stop.set()
        thread.join(60)


# ===================================================================================== CLI
def _fmt(resource: str, v: float) -> str:
    return f"{v / 2**20:,.1f} MiB" if resource.endswith("bytes") else f"{v:,.1f}"


def _fmt_small(resource: str, v: float) -> str:
    return f"{v / 2**10:,.1f} KiB" if resource.endswith("bytes") else f"{v:,.3f}"


def print_results(results: list[SoakResult]) -> None:
    from flashboot.benchmarks.timing import print_table

    rows = []
    for r in results:
        for t in r.trends:
            rows.append([r.kind, t.resource, _fmt(t.resource, t.start), _fmt(t.resource, t.end),
                         _fmt(t.resource, t.first_mean), _fmt(t.resource, t.last_mean), _fmt(t.resource, t.slack),
                         _fmt_small(t.resource, t.detects_per_cycle), "RISING" if t.rising else "flat"])
    print_table("soak: resources at start and end, means of the first and last 20 % after warm-up",
                ["what", "resource", "start", "end", "first 20 %", "last 20 %", "slack", "sees a leak per cycle of",
                 "trend"], rows)
    for r in results:
        print(f"{r.kind}: {r.cycles} cycles in {r.seconds:.1f} s, {r.exact}/{r.cycles} byte-exact"
              + (f"; LEAKING: {', '.join(r.leaking)}" if r.leaking else "; no upward trend"))


def register_bench(sub) -> None:
    p = sub.add_parser("soak", help="500 cycles of load/bind/close, served load, seed/clone/close, sleep/wake, "
                                    "publish/refit; fails on a leak",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=500)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--device", default=None, help="default cuda:0 where a GPU exists, else cpu")
    p.add_argument("--json", default=None, metavar="PATH", help="write results as JSON ('-' for stdout)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from flashboot.benchmarks.timing import dump_json

    results = run(cycles=args.cycles, kinds=args.kinds, device=args.device)
    print_results(results)
    dump_json([{**r.__dict__, "leaking": r.leaking} for r in results], args.json)
    return 0 if all(not r.leaking and r.exact == r.cycles for r in results) else 1


__all__ = ["run", "soak", "sample", "trend", "Trend", "SoakResult", "print_results", "register_bench", "main", "SLACK"]
