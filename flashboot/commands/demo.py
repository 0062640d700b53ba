"""``flashboot demo``: the main job, end to end, on the GPU when there is one, else on the host backend."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the whole pipeline on a small model and print what happened")
    p.add_argument("--device", default=None, help="cuda index or cpu (default: cuda:0 where present)")
    p.add_argument("--size", default="64MB", help="arena bytes for the mover round (default 64MB)")
    p.add_argument("--workdir", default=None,
                   help="an existing folder to hold the demo's temporary checkpoint and images, removed when it ends "
                        "(default: the system's temp folder; the headline's image and staged copies go to /dev/shm)")
    p.set_defaults(func=main)


def main(args) -> int:
    from flashboot.demo import run_demo

    return 0 if run_demo(device=args.device, size=args.size, workdir=args.workdir) else 1
