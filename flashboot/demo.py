"""The demo behind ``make demo``: every stage of FlashBoot on small data, verified, with a report.

1. movers: create an arena, fill it, copy it with every mover this machine supports on every
   path it has, verify each copy by checksum, print a table.
2. pipeline: a small Qwen3-MoE built with transformers from its config (random weights,
   ``save_pretrained``) is pre-packed (tp=1 and tp=2), staged into shared memory, loaded into an
   arena, bound to a meta-initialised model, and generates; its logits must equal those of the
   same model loaded the standard way, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console

from .memory import Device, span_of
from .units import parse_bytes

console = Console(width=140)


def _mover_round(device: Device, nbytes: int) -> bool:
    import torch

    from .arena import Arena
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
        console.print(f"arena: {nbytes / 1e6:.1f} MB on {src.device} ({src.handle_type}), checksum {expected:#018x}")
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
            for info in list_movers():
                if path not in info.paths:
                    continue
                if not info.available:
                    rows.append([info.name, path, "-", "-", f"unavailable: {info.reason}"])
                    continue
                dst = make_dst()
                try:
                    target = dst.bytes() if hasattr(dst, "bytes") else dst
                    target.fill_(0xAB)
                    # The copy runs on the destination's GPU (the source's for d2h): its stream.
                    runs_on = span_of(source if path == "d2h" else target).device
                    stream = torch.cuda.Stream(device=runs_on.index) if cuda else None
                    t0 = time.perf_counter()
                    create_mover(info.name).copy(target, source, nbytes, stream=stream)
                    if stream is not None:
                        stream.synchronize()
                    ms = (time.perf_counter() - t0) * 1e3
                    ok = checksum(target) == expected
                    ok_all &= ok
                    rows.append([info.name, path, f"{ms:.2f}", f"{nbytes / ms / 1e6:.1f}", "ok" if ok else "MISMATCH"])
                finally:
                    if hasattr(dst, "close"):
                        dst.close()
        print_table("every mover on every path (first call: includes warm-up/compile)",
                    ["mover", "path", "ms", "GB/s", "checksum"], rows)
        return ok_all


def _pipeline(device: Device, workdir: Path) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    from . import bind, load, prepack
    from .benchmarks.timing import print_table
    from .flashload.staging import stage_rank
    from .layouts import read_image
    from .layouts.tiny import save_tiny_model, tiny_config

    hf = workdir / "hf"
    # Stage where the preloader would: tmpfs, which can be pinned (a disk file may not be).
    shm = Path(tempfile.mkdtemp(prefix="flashboot-demo-", dir="/dev/shm")) if os.path.isdir("/dev/shm") else workdir / "shm"
    t0 = time.perf_counter()
    save_tiny_model("qwen3_moe", hf, dtype=torch.bfloat16)
    console.print(f"checkpoint: tiny Qwen3-MoE (8 experts, 2 layers) saved with save_pretrained in {hf} "
                  f"({(time.perf_counter() - t0) * 1e3:.0f} ms)")
    rows = []
    for tp in (1, 2):
        rep = prepack(str(hf), str(workdir / f"tp{tp}"), tp=tp, progress=False)
        img = read_image(workdir / f"tp{tp}", 0)
        rows.append([f"tp={tp}", rep.family, rep.world_size, f"{rep.image_nbytes / 1e6:.2f}",
                     len(img.tensors), f"{rep.seconds.get('total', 0) * 1e3:.0f}"])
    print_table("pre-pack: one image per rank, laid out like the arena",
                ["layout", "family", "ranks", "image MB", "tensors (rank 0)", "ms"], rows)

    try:
        staged = stage_rank(workdir / "tp1", 0, shm_dir=shm, device=str(device))
        console.print(f"preload: rank 0 staged into {shm} ({staged.io_mode})")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16)
        with load(workdir / "tp1", 0, str(device), shm_dir=shm, verify=True) as loaded:
            bound = bind(model, loaded)
            console.print(f"load: {loaded.report.summary()}")
            console.print(f"bind: {len(loaded.tensors)} tensors are views into one {loaded.arena.nbytes / 1e6:.1f} MB arena "
                          f"({loaded.arena.handle_type}); recomputed buffers: {', '.join(bound.recomputed) or 'none'}")
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
        shutil.rmtree(shm, ignore_errors=True)
    return same and same_gen


def run_demo(device=None, size: str = "64MB", workdir: str | None = None) -> bool:
    """Run every demo stage; returns True when every check passed."""
    dev = Device.parse(device)
    if not dev.is_cuda:
        console.print("[bold]no CUDA device: running on the host backend (memfd arenas, host mover)[/bold]")
    ok = _mover_round(dev, parse_bytes(size))
    with tempfile.TemporaryDirectory(prefix="flashboot-demo-", dir=workdir) as tmp:
        ok &= _pipeline(dev, Path(tmp))
    console.print("[green]demo passed[/green]" if ok else "[red]demo FAILED[/red]")
    return ok
