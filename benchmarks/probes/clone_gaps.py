"""Probe: where a same-GPU star clone's transfer loses time against one D2D copy (issue 19's 0.85x).

Against a running seed (``python -m flashboot.benchmarks.clone_boot seed ...``), an engine-like
process (torch and its CUDA context, flashboot imported) clones it several times. Every copy the
copy-engine mover issues gets a timing event just before and just after it on its stream, and
every mapping of source segments its host time, so each clone splits into: the GPU's copy time,
the GPU idle between copies (the host had not issued the next one yet), and the host's mapping
during the transfer. Modes, one clone each, in this order:
  first     the first clone in the process (what the engine does; segments mapped ahead as usual)
  again     the same, a second time (the driver warm)
  all-ahead every source segment mapped before the transfer (the mapping moves into alloc)
  chunk4g   4 GiB chunks
Then the D2D ceiling of the same bytes in the same process. One JSON line per mode on stdout.

Usage (repository root, GPU machine, a seed serving on STORE):
    python3 benchmarks/probes/clone_gaps.py --store 127.0.0.1:29731 [--device cuda:0]
"""
import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--modes", default="first again all-ahead chunk4g")
    ap.add_argument("--profile", help="file for cProfile's stats of the first mode's Executor (construction and run)")
    a = ap.parse_args()

    import torch

    torch.zeros(1, device=a.device)
    import flashboot
    import flashboot.flashclone.cloning  # noqa: F401  (the package imports the clone's machinery on first use)
    from flashboot.arena.range import Arena
    from flashboot.cuda_streams import Event
    from flashboot.movers.copy_engine import CopyEngineMover

    clone_mod = sys.modules["flashboot.flashclone.cloning"]

    index = int(a.device.split(":")[1])
    marks: list = []  # (host s, event before, event after, nbytes)
    maps: list = []  # (host s at start, host ms, segments)
    t_ref = [0.0]

    real_copy = CopyEngineMover._copy

    def timed_copy(self, dst, src, nbytes, path, stream):
        before, after = Event(index, timing=True), Event(index, timing=True)
        host = time.perf_counter() - t_ref[0]
        before.record(stream)
        real_copy(self, dst, src, nbytes, path, stream)
        after.record(stream)
        marks.append((host, before, after, nbytes))

    real_map = Arena._map_pending

    def timed_map(self, first, last, out):
        t0 = time.perf_counter()
        todo = sum(1 for i in range(first, last) if not self._mapped[i]) if self._map_segment is not None else 0
        real_map(self, first, last, out)
        if todo:
            maps.append((t0 - t_ref[0], (time.perf_counter() - t0) * 1e3, todo))

    real_ahead = clone_mod._map_ahead

    def ahead_all(session, steps, sources, report):
        t0 = time.perf_counter()
        before = {id(ep.arena): ep.arena.map_stats["segments"] for ep in sources.endpoints.values() if ep.arena}
        for ep in sources.endpoints.values():
            if ep.arena is not None and not ep.arena.closed:
                ep.arena.map_range()
        report.map_ahead_ms = (time.perf_counter() - t0) * 1e3
        report.segments_mapped_ahead = sum(ep.arena.map_stats["segments"] - before.get(id(ep.arena), 0)
                                           for ep in sources.endpoints.values() if ep.arena and not ep.arena.closed)

    from flashboot.flashclone.executor import Executor

    real_init, real_run = Executor.__init__, Executor.run
    exec_marks: list = []  # host ms: Executor built (start, end), run entered

    def marked_init(self, *args, **kw):
        t0 = time.perf_counter() - t_ref[0]
        real_init(self, *args, **kw)
        exec_marks.append(("init", round(t0 * 1e3, 3), round((time.perf_counter() - t_ref[0]) * 1e3, 3)))

    def marked_run(self):
        exec_marks.append(("run", round((time.perf_counter() - t_ref[0]) * 1e3, 3)))
        return real_run(self)

    Executor.__init__, Executor.run = marked_init, marked_run
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()

        def prof_init(self, *args, **kw):
            prof.runcall(marked_init, self, *args, **kw)

        def prof_run(self):
            return prof.runcall(marked_run, self)

        Executor.__init__, Executor.run = prof_init, prof_run
    CopyEngineMover._copy = timed_copy
    Arena._map_pending = timed_map
    nbytes = 0
    for mode in a.modes.split():
        marks.clear()
        maps.clear()
        exec_marks.clear()
        clone_mod._map_ahead = ahead_all if mode == "all-ahead" else real_ahead
        kw = {"chunk_bytes": 4 << 30} if mode == "chunk4g" else {}
        t_ref[0] = time.perf_counter()
        with flashboot.clone(a.store, a.device, "star", timeout_s=60, **kw) as r:
            rep = r.report
            torch.cuda.synchronize()
            copies = [(host, b.elapsed_ms(e), n) for host, b, e, n in marks]
            gaps = [marks[i][2].elapsed_ms(marks[i + 1][1]) for i in range(len(marks) - 1)]
            nbytes = rep.nbytes
            # the transfer window as the host saw it began ttx ms after t_ref: the report's other phases
            print(json.dumps({
                "mode": mode, "nbytes": rep.nbytes, "transfer_ms": round(rep.transfer_ms, 3),
                "gbps": round(rep.gbps, 1), "stream_gbps": round(rep.stream_gbps, 1),
                "ready_ms": round(rep.ready_ms, 2), "alloc_ms": round(rep.alloc_ms, 3),
                "map_ahead": [round(rep.map_ahead_ms, 3), rep.segments_mapped_ahead],
                "map_during_copy": [round(rep.map_during_copy_ms, 3), rep.segments_mapped_during_copy],
                "copies": len(copies), "gpu_copy_ms": round(sum(c[1] for c in copies), 3),
                "gpu_gap_ms": round(sum(gaps), 3), "gaps_ms": [round(g, 3) for g in gaps],
                "copy_ms_each": [round(c[1], 3) for c in copies], "copy_mb_each": [c[2] >> 20 for c in copies],
                "issue_host_ms": [round(c[0] * 1e3, 3) for c in copies],
                "maps": [(round(t * 1e3, 3), round(ms, 3), n) for t, ms, n in maps],
                "executor": list(exec_marks), "profiled": prof is not None,
            }), flush=True)
        if prof is not None:
            Executor.__init__, Executor.run = marked_init, marked_run
            import io
            import pstats

            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            with open(a.profile, "w") as f:
                f.write(text.getvalue())
            prof = None
    CopyEngineMover._copy, Arena._map_pending, clone_mod._map_ahead = real_copy, real_map, real_ahead
    Executor.__init__, Executor.run = real_init, real_run
    from flashboot.benchmarks.clone import copy_ceiling

    ceiling = copy_ceiling([a.device], nbytes, repeats=3)
    print(json.dumps({"mode": "ceiling", "gbps": round(ceiling["gbps"], 1),
                      "ms": round(nbytes / ceiling["gbps"] / 1e6, 3)}), flush=True)


if __name__ == "__main__":
    main()
