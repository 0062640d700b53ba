"""``python -m flashboot.fuzzing``: a long seeded campaign, or atheris' coverage-guided one."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from .campaign import Counts, Finding, format_counts, run_campaign
from .corpus import READERS, Corpus
from .image_readers import fuzz_work_dir, make_seed_image


def _atheris_main(name: str, runs: int, work: str) -> None:
    """One reader under atheris (coverage-guided): the fuzzer's bytes are the reader's input,
    starting from the reader's seeds. Prints one JSON line of counts."""
    import atheris

    with atheris.instrument_imports():
        import flashboot.arena  # noqa: F401
        import flashboot.flashclone.rendezvous  # noqa: F401
        import flashboot.flashload.server  # noqa: F401
        import flashboot.flashload.shm  # noqa: F401
        import flashboot.layouts.format  # noqa: F401
        import flashboot.layouts.image  # noqa: F401
    corpus = Corpus(work, [name], image_dir=os.environ.get("FLASHBOOT_FUZZ_IMAGE"))
    reader = corpus.readers[0]
    seeds_dir = Path(work) / f"atheris-seeds-{name}"
    seeds_dir.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(reader.seeds):
        (seeds_dir / f"seed-{i}").write_bytes(s)
    c = Counts()
    t0 = time.perf_counter()

    def one(data: bytes) -> None:
        o = reader.run_one(data)
        c.tried += 1
        setattr(c, o.kind, getattr(c, o.kind) + 1)
        if o.kind in ("crash", "wrong") and len(c.findings) < 20:
            c.findings.append(Finding(name, o.kind, o.detail, data))
        if c.tried == runs:
            c.seconds = time.perf_counter() - t0
            _report_atheris(name, c)
            corpus.close()
            os._exit(0)

    atheris.Setup([sys.argv[0], f"-runs={runs + 10}", "-rss_limit_mb=4096", str(seeds_dir)], one)
    atheris.Fuzz()


def _report_atheris(name: str, c: Counts) -> None:
    print(json.dumps({"reader": name, "tried": c.tried, "parsed": c.parsed, "refused": c.refused, "crash": c.crash,
                      "wrong": c.wrong, "seconds": c.seconds,
                      "findings": [{"kind": f.kind, "detail": f.detail, "input": f.data[:2000].hex()}
                                   for f in c.findings]}), flush=True)


def limit_memory(gib: float) -> None:
    """Cap this process's address space at ``gib`` GiB (RLIMIT_AS): a reader that tries to allocate
    for a field like ``world_size = 2**62`` then raises MemoryError instead of exhausting the host."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = int(gib * (1 << 30))
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft == resource.RLIM_INFINITY or soft > want:
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))


def main(argv: list[str] | None = None) -> int:
    """``python -m flashboot.fuzzing [--inputs N] [--seed S] [--readers a,b] [--atheris]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flashboot.fuzzing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=100_000, help="inputs per reader (default 100,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--readers", default=",".join(READERS), help=f"comma-separated subset of {', '.join(READERS)}")
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided (atheris), one process per reader")
    ap.add_argument("--findings", default=None, help="write every finding (input hex, detail) to this JSON file")
    ap.add_argument("--atheris-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memory-gib", type=float, default=8.0,
                    help="address-space limit of this process (a reader that asks for more fails with MemoryError, "
                         "a finding, instead of taking the machine's memory); default 8")
    args = ap.parse_args(argv)
    limit_memory(args.memory_gib)
    names = [n for n in args.readers.split(",") if n]
    work = Path(args.work) if args.work else fuzz_work_dir()
    if args.atheris_child:
        _atheris_main(args.atheris_child, args.inputs, str(work))
        return 0
    if args.atheris:
        return _run_atheris(names, args, work)
    corpus = Corpus(work, names)
    try:
        def progress(name: str, c: Counts) -> None:
            print(f"  {name}: {c.tried:,} tried, {c.crash} crashes, {c.wrong} wrong", file=sys.stderr, flush=True)

        counts = run_campaign(corpus.readers, args.inputs, args.seed, progress=progress)
    finally:
        corpus.close()
    print(format_counts(counts))
    findings = [f for c in counts.values() for f in c.findings]
    for f in findings:
        print(f"\n[{f.reader}] {f.kind}: {f.detail}\n  input: {f.data[:300]!r}")
    if args.findings:
        Path(args.findings).write_text(json.dumps([{"reader": f.reader, "kind": f.kind, "detail": f.detail,
                                                    "input": f.data.hex()} for f in findings], indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if findings else 0


def _run_atheris(names: list[str], args, work: Path) -> int:
    import subprocess

    image = make_seed_image(work / "seed")
    bad = 0
    rows: dict[str, Counts] = {}
    for name in names:
        env = dict(os.environ, FLASHBOOT_FUZZ_IMAGE=str(image))
        proc = subprocess.run([sys.executable, "-m", "flashboot.fuzzing", "--atheris-child", name, "--inputs",
                               str(args.inputs), "--work", str(work / f"atheris-{name}")],
                              capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("{\"reader\"")), None)
        if line is None:
            print(f"[{name}] atheris run ended without counts (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            bad += 1
            continue
        d = json.loads(line)
        rows[name] = Counts(d["tried"], d["parsed"], d["refused"], d["crash"], d["wrong"], d["seconds"])
        for f in d["findings"]:
            bad += 1
            print(f"[{name}] {f['kind']}: {f['detail']}\n  input: {bytes.fromhex(f['input'])[:300]!r}")
    print(format_counts(rows))
    return 1 if bad else 0

