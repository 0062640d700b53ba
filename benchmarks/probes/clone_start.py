"""Probe: what a plain clone's first phase (``start`` in ``CloneReport.phases()``) spends, in an
engine-like process (torch imported, its CUDA context made, ``flashboot`` and
``flashboot.flashclone`` imported): the steps ``flashboot.clone`` takes before it imports the
store's client, timed one by one, then the warm-up's parts once joined. With ``--profile``, the
same steps under cProfile (the caller's thread), its top entries by cumulative time.

Usage (repository root, GPU machine): ``python3 benchmarks/probes/clone_start.py [--device cuda:0] [--profile]``
"""
import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    import torch

    torch.zeros(1, device=a.device)  # the engine's CUDA context (none on cpu)
    import flashboot
    import flashboot.flashclone.cloning  # noqa: F401  (the package imports the clone's machinery on first use)

    fc = sys.modules["flashboot.flashclone.cloning"]
    marks = [("begin", time.perf_counter())]

    def steps() -> object:
        from flashboot.memory import Device

        dev = Device.parse(a.device)
        marks.append(("Device.parse", time.perf_counter()))
        import flashboot.arena  # noqa: F401

        marks.append(("import flashboot.arena", time.perf_counter()))
        import flashboot.movers  # noqa: F401

        marks.append(("import flashboot.movers", time.perf_counter()))
        warm = fc.CloneWarmup(dev, verify=True, mover=fc._default_mover(dev, None))
        marks.append(("CloneWarmup() (threads started)", time.perf_counter()))
        fc._check_mover(dev, fc._default_mover(dev, None), create=False)
        marks.append(("_check_mover", time.perf_counter()))
        fc.AgentWarmup.start_for("auto", "clone", 60)
        marks.append(("AgentWarmup.start_for", time.perf_counter()))
        import torch.distributed  # noqa: F401

        marks.append(("import torch.distributed", time.perf_counter()))
        return warm

    if a.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        warm = prof.runcall(steps)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
        print(text.getvalue())
    else:
        warm = steps()
    t_join = time.perf_counter()
    from flashboot.flashclone.report import CloneReport

    warm.join(CloneReport("star", 1, a.device, 0), 60)
    print(json.dumps({"steps_ms": {name: round((t - marks[i][1]) * 1e3, 3) for i, (name, t) in enumerate(marks[1:])},
                      "start_ms": round((marks[-1][1] - marks[0][1]) * 1e3, 3),
                      "join_ms": round((time.perf_counter() - t_join) * 1e3, 3), "warm_parts_ms": warm.parts,
                      "profiled": a.profile, "modules": sorted(m for m in sys.modules if m.startswith("cuda"))[:8]}))


if __name__ == "__main__":
    main()
