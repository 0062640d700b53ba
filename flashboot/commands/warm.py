"""``flashboot warm [--device D]``: compile the checksum kernels into the on-disk caches (at install)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("warm", help="compile the checksum kernels ahead of time (Triton / numba caches)",
                              description="Run each checksum path once on DEVICE so a fresh process's first "
                                          "verified load finds it compiled (on CUDA: the cubins, and the bytecode "
                                          "of the modules its first call imports). Once per machine and version.")
    p.add_argument("--device", default=None, help="cuda index, cuda:N or cpu (default: cuda:0 where present)")
    p.set_defaults(func=main)


def main(args) -> int:
    from flashboot.kernels.warm import warm_checksum

    for path, ms in warm_checksum(args.device).items():
        print(f"checksum ({path} path) compiled or loaded in {ms:.1f} ms")
    return 0
