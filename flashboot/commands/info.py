"""``flashboot info`` (what this machine offers: CUDA devices, VMM, handle types, peer access,
movers) and ``flashboot movers`` (one line per registered mover)."""

from __future__ import annotations

import json
import os
from typing import Any

from flashboot import __version__, _cuda
from flashboot.errors import CapabilityError

_GIB = 1 << 30


def _no_cuda_reason() -> str:
    if os.environ.get("FLASHBOOT_FORCE_HOST") == "1":
        return "FLASHBOOT_FORCE_HOST=1 hides the CUDA devices"
    try:
        _cuda.driver()
    except CapabilityError as exc:
        return str(exc)
    return "the CUDA driver reports no device"


@_cuda.keeps_context
def _device_info(index: int) -> dict[str, Any]:
    from flashboot.arena import _cu_device, _device_attribute, preflight_handle

    drv = _cuda.driver()
    dev = _cu_device(index)
    name = _cuda.check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
    total = int(_cuda.check(drv.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))
    _cuda.use_device(index)
    free, _ = _cuda.check(drv.cuMemGetInfo(), "cuMemGetInfo")
    major = _device_attribute(index, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
    minor = _device_attribute(index, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
    vmm = bool(_device_attribute(index, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"))
    handles = {}
    if vmm:
        for handle in ("posix_fd", "fabric"):
            support = preflight_handle(index, handle)
            handles[handle] = {"supported": support.supported, "reason": support.reason}
    return {
        "index": index, "name": name, "total_bytes": total, "free_bytes": int(free),
        "compute_capability": f"{major}.{minor}", "vmm": vmm, "handle_types": handles,
    }


def collect_info() -> dict[str, Any]:
    """Everything ``flashboot info`` reports, as a JSON-ready dict."""
    from flashboot.arena import HOST_GRANULARITY, can_access_peer
    from flashboot.movers import list_movers

    info: dict[str, Any] = {"flashboot": __version__, "cuda": None, "devices": [], "peer_access": []}
    if _cuda.cuda_available():
        drv = _cuda.driver()
        version = int(_cuda.check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
        n = _cuda.device_count()
        info["cuda"] = {"driver_version": f"{version // 1000}.{version % 1000 // 10}", "device_count": n}
        info["devices"] = [_device_info(i) for i in range(n)]
        info["peer_access"] = [[can_access_peer(i, j) for j in range(n)] for i in range(n)]
        first = info["devices"][0]["handle_types"] if n else {}
        if first.get("posix_fd", {}).get("supported"):
            kind = "fabric+posix_fd" if first.get("fabric", {}).get("supported") else "posix_fd"
            info["arena_backend"] = {"kind": "cuda", "handle_type": kind}
        else:
            info["arena_backend"] = {"kind": "cuda", "handle_type": None}
    else:
        info["no_cuda_reason"] = _no_cuda_reason()
        info["arena_backend"] = {"kind": "host", "handle_type": "memfd", "granularity": HOST_GRANULARITY}
    from flashboot.flashclone.transports.registry import list_transports

    info["transports"] = [t.to_dict() for t in list_transports()]
    info["movers"] = [_mover_dict(m) for m in list_movers()]
    return info


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def format_info(info: dict[str, Any]) -> str:
    """The human-readable report of :func:`collect_info`."""
    lines = [f"FlashBoot {info['flashboot']}"]
    if info["cuda"] is None:
        lines.append(f"CUDA: none ({info['no_cuda_reason']})")
        gran = info["arena_backend"]["granularity"]
        lines.append(
            f"Arenas use the host backend: memfd shared memory mapped MAP_SHARED, {gran >> 20} MiB granularity, "
            "shared across processes by pidfd_getfd or a Unix socket."
        )
    else:
        cuda = info["cuda"]
        lines.append(f"CUDA: {cuda['device_count']} device(s), driver API {cuda['driver_version']}")
        for d in info["devices"]:
            lines.append(
                f"  cuda:{d['index']}  {d['name']}  {d['total_bytes'] / _GIB:.1f} GiB "
                f"(free {d['free_bytes'] / _GIB:.1f} GiB)  compute {d['compute_capability']}  VMM {_yes(d['vmm'])}"
            )
            for handle, s in d["handle_types"].items():
                detail = "" if s["supported"] else f" ({s['reason']})"
                lines.append(f"      handle {handle:<9} {'works' if s['supported'] else 'not usable'}{detail}")
        n = cuda["device_count"]
        if n > 1:
            lines.append("Peer access (row maps the column's memory):")
            lines.append("          " + " ".join(f"cuda:{j:<3}" for j in range(n)))
            for i, row in enumerate(info["peer_access"]):
                cells = " ".join(f"{'-' if i == j else _yes(v):<8}" for j, v in enumerate(row))
                lines.append(f"  cuda:{i:<3} {cells}")
        kind = info["arena_backend"]["handle_type"]
        lines.append(f"Arenas: CUDA VMM, shareable as {kind}" if kind else "Arenas: CUDA VMM without a shareable handle type")
    lines.append("Clone transports (auto tries them in this order):")
    lines.extend("  " + _transport_line(t) for t in info["transports"])
    lines.append("Movers:")
    lines.extend("  " + _mover_line(m) for m in info["movers"])
    lines.append("  " + triton_kernels_line())
    return "\n".join(lines)


def _transport_line(t: dict[str, Any]) -> str:
    state = "works" if t["available"] else f"unavailable: {t['reason']}"
    return f"{t['name']:<9} {t['reach']:<14} {'+'.join(t['memory']):<12} {state}; setup: {t['setup']}"


def _mover_dict(m) -> dict[str, Any]:
    return {"name": m.name, "paths": list(m.paths), "available": m.available, "reason": m.reason,
            "summary": m.summary, "batched": m.batched}


def _mover_line(m: dict[str, Any]) -> str:
    state = "available" if m["available"] else f"unavailable: {m['reason']}"
    return f"{m['name']:<12} {' '.join(m['paths']):<16} {state}"


def triton_kernels_line() -> str:
    """Where the Triton kernels (copy, checksum) run on this machine. Said beside the movers because
    the two differ without a GPU: the kernels also run under ``TRITON_INTERPRET=1`` on host
    memory (how GPU-less CI tests them), while the ``triton_*`` movers copy GPU memory and so are
    unavailable."""
    from flashboot._cuda import cuda_available
    from flashboot.kernels.copy import interpreting

    if cuda_available():
        return "Triton kernels (copy, checksum): compiled for the GPU"
    if interpreting():
        return ("Triton kernels (copy, checksum): run here under TRITON_INTERPRET=1, on host memory (how the tests "
                "check them; slow); the triton_* movers copy GPU memory, so they need a CUDA device")
    return ("Triton kernels (copy, checksum): no CUDA device, so they run only under TRITON_INTERPRET=1 (on host "
            "memory, as the tests set it); the triton_* movers copy GPU memory, so they need a CUDA device")


def _run_info(args) -> int:
    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _run_movers(args) -> int:
    from flashboot.movers import list_movers

    movers = [_mover_dict(m) for m in list_movers()]
    if args.json:
        print(json.dumps(movers, indent=2))
    else:
        for m in movers:
            print(_mover_line(m))
        print(triton_kernels_line())
    return 0


def register(subparsers) -> None:
    """Add ``info`` and ``movers`` to the flashboot command line."""
    p = subparsers.add_parser("info", help="CUDA devices, VMM and handle types, peer access, movers")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_run_info)
    p = subparsers.add_parser("movers", help="one line per mover: name, paths, availability")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_run_movers)
