"""The demo behind ``make demo``: every stage of FlashBoot on small data, verified, with a report.

1. movers: create an arena, fill it, copy it with every mover this machine supports on every
   path it has (warmed up, median of 3 GPU times as ``bench movers`` measures them, against a
   bare ``copy_`` of the same bytes, beside each mover's host cost per call), verify each copy by
   checksum, print a table.
2. pipeline: a small Qwen3-MoE built with transformers from its config (random weights,
   ``save_pretrained``) is pre-packed (tp=1 and tp=2), staged into shared memory, loaded into an
   arena, bound to a meta-initialised model, and generates; its logits must equal those of the
   same model loaded the standard way, bit for bit.
3. the headline: a multi-GB synthetic MoE image (sized to the free memory; 32 MB on the host
   backend), first load in a fresh process with the early call and served, and safetensors,
   against one bulk pinned H2D of the same bytes (``flashboot bench boot``'s machinery), and the
   boot end to end: a fresh process, the early call, 0.25 s of engine work, the load.
4. with two GPUs: FlashClone of 1 GiB to the second GPU, its setup beside NCCL's and its rate
   beside the P2P ceiling (``flashboot bench clone``'s machinery).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from .memory import Device, span_of
from .units import format_bytes, parse_bytes

console = Console(width=140)


def _copy_ms(fn, stream, repeats: int = 3) -> float:
    """Median ms of ``fn(stream)``: GPU time with CUDA events (``bench movers``' helper) on a
    stream, the host clock for a synchronous host copy (``stream`` None)."""
    from .benchmarks.timing import time_cuda, time_host

    if stream is None:
        return time_host(lambda: fn(None), repeats=repeats).median_ms
    return time_cuda(lambda s: fn(s), device=stream.device.index, repeats=repeats, stream=stream).median_ms


def _mover_round(device: Device, nbytes: int) -> bool:
    """Every mover on every path, warmed up (one untimed copy: Triton compiles on its first call),
    then the median of 3 against a bare ``copy_`` of the same bytes on the same path: the ceiling."""
    import torch

    from .arena import Arena
    from .benchmarks.movers_chunked import per_call_cost_us
    from .benchmarks.timing import print_table
    from .kernels.checksum import checksum
    from .movers import create_mover, list_movers

    cuda = device.is_cuda
    n_gpus = torch.cuda.device_count() if cuda else 0
    with Arena.create(nbytes, device=str(device), access="all" if n_gpus > 1 else None) as src:
        nbytes = src.nbytes
        data = src.bytes()
        data.view(torch.int64).random_()
        expected = checksum(src)
        console.print(f"arena: {format_bytes(nbytes)} on {src.device} ({src.handle_type}), checksum {expected:#018x}")
        endpoints = []  # (path, make_dst, source)
        if cuda:
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            endpoints.append(("d2h", lambda: pinned, src))
            endpoints.append(("h2d", lambda: Arena.create(nbytes, device=str(device)), pinned))
            endpoints.append(("d2d", lambda: Arena.create(nbytes, device=str(device)), src))
            if n_gpus > 1:
                peer = (device.index + 1) % n_gpus
                endpoints.append(("p2p", lambda: Arena.create(nbytes, device=peer, access="all"), src))
        else:
            endpoints.append(("host", lambda: Arena.create(nbytes, device="cpu"), src))
        rows, ok_all = [], True
        for path, make_dst, source in endpoints:
            dst = make_dst()
            try:
                target = dst.bytes() if hasattr(dst, "bytes") else dst
                source_t = source.bytes() if hasattr(source, "bytes") else source
                # The copy runs on the destination's GPU (the source's for d2h): its stream.
                runs_on = span_of(source if path == "d2h" else target).device
                stream = torch.cuda.Stream(device=runs_on.index) if cuda else None

                def bare(s=stream):
                    with torch.cuda.stream(s) if s is not None else _nullcontext():
                        target.copy_(source_t, non_blocking=True)

                ceiling_ms = _copy_ms(bare, stream)
                rows.append(["torch copy_ (ceiling)", path, f"{ceiling_ms:.2f}", f"{nbytes / ceiling_ms / 1e6:.1f}",
                             "1.00", "-", "-"])
                for info in list_movers():
                    if path not in info.paths:
                        continue
                    if not info.available:
                        rows.append([info.name, path, "-", "-", "-", "-", f"unavailable: {info.reason}"])
                        continue
                    mover = create_mover(info.name)
                    target.fill_(0xAB)

                    def copy(s=stream, mover=mover):
                        mover.copy(target, source, nbytes, stream=s)

                    copy()  # warm-up: compile, first launch
                    if stream is not None:
                        stream.synchronize()
                    ok = checksum(target) == expected
                    ok_all &= ok
                    ms = _copy_ms(copy, stream)
                    per_call = f"{per_call_cost_us(mover, target, source, stream):.1f}" if cuda else "-"
                    rows.append([info.name, path, f"{ms:.2f}", f"{nbytes / ms / 1e6:.1f}", f"{ceiling_ms / ms:.2f}",
                                 per_call, "ok" if ok else "MISMATCH"])
            finally:
                if hasattr(dst, "close"):
                    dst.close()
        what = ("GPU time of one copy (CUDA events, the copy enqueued behind a spin kernel: what the device "
                "spends)" if cuda else "wall time of one synchronous copy")
        print_table(f"every mover on every path, {format_bytes(nbytes)}, warmed up, median of 3: {what}; x ceiling: "
                    "vs a bare copy_ of the same bytes, same run; host µs/call: the host's cost of one 4 KiB "
                    "mover.copy, what a chunked pipeline pays per chunk",
                    ["mover", "path", "ms", "GB/s", "x ceiling", "host µs/call", "checksum"], rows)
        return ok_all


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _headline_load(device: Device) -> bool:
    """A multi-GB synthetic MoE image (sized to the free memory), each loader's first call in a
    fresh process, against one bulk pinned H2D of the same bytes in this run."""
    from .benchmarks import boot
    from .benchmarks.checkpoints import CHECKPOINT_A
    from .pinning import device_free_bytes

    if device.is_cuda:
        shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        nbytes = min(4 << 30, device_free_bytes(device) // 4, shm_free // 4)
    else:
        nbytes = 32 << 20
    spec = dataclasses.replace(CHECKPOINT_A.scaled(nbytes / CHECKPOINT_A.nbytes), name=f"A-{nbytes / 1e9:.2f}GB")
    loaders = ["flashload prepared", "flashload served", "safetensors"]
    root = Path(tempfile.mkdtemp(prefix="fbdemo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)) / "boot"
    try:
        out = boot.run(shapes=[], specs=[spec], scale=1.0, device=str(device), root=str(root), loaders=loaders,
                       end_to_end=(0.25,), log=lambda line: console.print(f"  {escape(str(line))}"))
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    boot.print_results(out)
    from .benchmarks.boot_e2e import headline

    line = headline(out)
    console.print(f"[bold]{escape(line or 'boot end to end: no result')}[/bold]")
    e2e = out["shapes"][0].get("end_to_end") or {}
    e2e_ok = line is not None and all("error" not in r for r in e2e.get("rows", [{"error": e2e.get("error")}]))
    return e2e_ok and all("error" not in r and all(c["verified"] for c in r["calls"])
                          for r in out["shapes"][0]["loaders"])


def _headline_clone(device: Device) -> bool:
    """FlashClone of 1 GiB to the second GPU beside NCCL: setup before the first byte, and GB/s
    against the P2P copy ceiling of the same run."""
    from .benchmarks import clone as clone_bench

    out = clone_bench.run(1 << 30, device=str(device), clone_counts=(1,), sections=("ceiling", "clone", "nccl"),
                          repeats=3, timeout_s=120)
    clone_bench.print_results(out)
    return all(r.get("verified", True) for c in out.get("clone", ()) for r in c["reports"])


def _pipeline(device: Device, workdir: Path) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    from . import bind, load, prepack
    from .benchmarks.timing import print_table
    from .flashload.staging import stage_rank
    from .layouts import read_image
    from .layouts.tiny import save_tiny_model, tiny_config

    hf = workdir / "hf"
    t0 = time.perf_counter()
    save_tiny_model("qwen3_moe", hf, dtype=torch.bfloat16)
    console.print(f"checkpoint: tiny Qwen3-MoE (8 experts, 2 layers) saved with save_pretrained in {escape(str(hf))} "
                  f"({(time.perf_counter() - t0) * 1e3:.0f} ms)")
    rows = []
    for tp in (1, 2):
        rep = prepack(str(hf), str(workdir / f"tp{tp}"), tp=tp, progress=False)
        img = read_image(workdir / f"tp{tp}", 0)
        rows.append([f"tp={tp}", rep.family, rep.world_size, format_bytes(rep.image_nbytes),
                     len(img.tensors), f"{rep.seconds.get('total', 0) * 1e3:.0f}"])
    print_table("pre-pack: one image per rank, laid out like the arena",
                ["layout", "family", "ranks", "image", "tensors (rank 0)", "ms"], rows)

    shm = None
    try:  # the staging directory is made inside: whatever fails after, it is removed
        # Stage where the preloader would: tmpfs, which can be pinned (a disk file may not be).
        shm = Path(tempfile.mkdtemp(prefix="flashboot-demo-", dir="/dev/shm")) if os.path.isdir("/dev/shm") else workdir / "shm"
        staged = stage_rank(workdir / "tp1", 0, shm_dir=shm, device=str(device))
        console.print(f"preload: rank 0 staged into {escape(str(shm))} ({staged.io_mode})")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16)
        with load(workdir / "tp1", 0, str(device), shm_dir=shm, verify=True) as loaded:
            bound = bind(model, loaded)
            console.print(f"load: {escape(loaded.report.summary())}")
            console.print(f"bind: {len(loaded.tensors)} tensors are views into one {format_bytes(loaded.arena.nbytes)} arena "
                          f"({loaded.arena.handle_type}); recomputed buffers: {escape(', '.join(bound.recomputed) or 'none')}")
            ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).to(str(device)).eval()
            prompt = torch.tensor([[1, 5, 9, 14, 3, 7]], device=str(device))
            model.eval()
            with torch.no_grad():
                same = torch.equal(model(prompt).logits, ref(prompt).logits)
            out = model.generate(prompt, max_new_tokens=8, do_sample=False)
            same_gen = torch.equal(out, ref.generate(prompt, max_new_tokens=8, do_sample=False))
            console.print(f"generate: {out[0].tolist()}")
            console.print(f"logits bitwise equal to from_pretrained: {same}; same generated tokens: {same_gen}")
            del model, ref
    finally:
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    return same and same_gen


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def run_demo(device=None, size: str = "64MB", workdir: str | None = None) -> bool:
    """Run every demo stage; returns True when every check passed."""
    from .errors import FlashBootError

    dev = Device.parse(device)
    nbytes = parse_bytes(size)
    # before any work: a missing directory had been found only after the whole mover round
    if workdir is not None and not os.path.isdir(workdir):
        raise FlashBootError(f"demo --workdir {workdir}: no such directory")
    if workdir is not None and not os.access(workdir, os.W_OK | os.X_OK):
        raise FlashBootError(f"demo --workdir {workdir}: not writable by this user")
    if not dev.is_cuda:
        console.print("[bold]no CUDA device: running on the host backend (memfd arenas, host mover)[/bold]")
    ok = _mover_round(dev, nbytes)
    with tempfile.TemporaryDirectory(prefix="flashboot-demo-", dir=workdir) as tmp:
        ok &= _pipeline(dev, Path(tmp))
        console.print("[bold]the headline: first load in a fresh process, against the PCIe ceiling[/bold]")
        ok &= _headline_load(dev)
    if dev.is_cuda and _gpu_count() > 1:
        console.print("[bold]FlashClone to the second GPU, beside NCCL[/bold]")
        ok &= _headline_clone(dev)
    console.print("[green]demo passed[/green]" if ok else "[red]demo FAILED[/red]")
    return ok
