"""The demo behind ``make demo``: every stage of FlashBoot on small data, verified, with a report.

Stage 1 (movers): create an arena, fill it, copy it with every mover this machine supports on
every path it has, verify each copy by checksum, print a table.
"""

from __future__ import annotations

import time

from rich.console import Console

from .memory import Device
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
                    stream = torch.cuda.Stream(device=device.index) if cuda else None
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


def run_demo(device=None, size: str = "64MB", workdir: str | None = None) -> bool:
    """Run every demo stage; returns True when every check passed."""
    dev = Device.parse(device)
    if not dev.is_cuda:
        console.print("[bold]no CUDA device: running on the host backend (memfd arenas, host mover)[/bold]")
    ok = _mover_round(dev, parse_bytes(size))
    console.print("[green]demo passed[/green]" if ok else "[red]demo FAILED[/red]")
    return ok
