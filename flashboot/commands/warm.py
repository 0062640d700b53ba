"""``flashboot warm [--device D]``: at install, write FlashBoot's bytecode and compile the checksum
kernels into the on-disk caches."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("warm", help="write FlashBoot's bytecode and compile the checksum kernels ahead of "
                                           "time (Triton / numba caches)",
                              description="Write the bytecode of every FlashBoot module, as a wheel's install does "
                                          "(an editable install under PYTHONDONTWRITEBYTECODE never does, and every "
                                          "fresh process then compiles what it imports), then run each checksum path "
                                          "once on DEVICE so a fresh process's first verified load finds it compiled "
                                          "(on CUDA: the cubins). Once per machine and version.")
    p.add_argument("--device", default=None, help="cuda index, cuda:N or cpu (default: cuda:0 where present)")
    p.set_defaults(func=main)


_UNWRITTEN = "flashboot warm: cannot write "  # compile_bytecode's warning for a module it could not write


def main(args) -> int:
    import sys
    import time
    import warnings

    from flashboot.bytecode import compile_bytecode
    from flashboot.kernels.warm import warm_checksum
    from flashboot.memory import Device

    device = Device.parse(args.device)  # a bad --device is refused before any work, not after the bytecode
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = compile_bytecode()
    print(f"bytecode of {len(written)} modules written in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    # one line for the modules it could not write: a user who may not write the installed package had
    # been shown a two-line warning per module (some 400 lines), and the other warnings lost among them
    unwritten = [str(w.message) for w in caught if str(w.message).startswith(_UNWRITTEN)]
    for w in caught:
        if not str(w.message).startswith(_UNWRITTEN):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if unwritten:
        more = f"; and {len(unwritten) - 1} more module(s) alike" if len(unwritten) > 1 else ""
        print(f"{unwritten[0]}{more}", file=sys.stderr)

    for path, ms in warm_checksum(device).items():
        print(f"checksum ({path} path) compiled or loaded in {ms:.1f} ms")
    return 0
