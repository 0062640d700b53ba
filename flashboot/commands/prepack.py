"""``flashboot prepack``, ``flashboot inspect`` and ``flashboot verify``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("prepack", help="pre-pack a Hugging Face safetensors checkpoint into per-rank images")
    p.add_argument("hf_dir", help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="image directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1); ranks = max(tp, ep)")
    p.add_argument("--target", default="transformers", choices=["transformers", "sglang"],
                   help="tensor naming of the engine that binds the image (default transformers)")
    p.add_argument("--family", default=None, help="force a family rule (default: by config.json model_type)")
    p.add_argument("--chunk-bytes", default="64MiB", help="checksum chunk size (default 64MiB)")
    p.add_argument("--model-id", default=None, help="model id recorded in the key (default: from path/config)")
    p.add_argument("--revision", default=None, help="revision recorded in the key (default: hub snapshot hash)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_prepack_main)

    p = subparsers.add_parser("inspect", help="summarise a pre-packed image directory")
    p.add_argument("dir", help="image directory (or one rank's directory)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_inspect_main)

    p = subparsers.add_parser("verify", help="recompute an image's checksums; non-zero exit names the first bad chunk")
    p.add_argument("dir", help="image directory (or one rank's directory)")
    p.add_argument("--rank", type=int, default=None, help="verify one rank (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_verify_main)


def table_console():
    """A rich console for a table: the terminal's width on a tty (cells wrap, never cut), and no
    width limit when the output goes to a file or a pipe (rich would assume 80 columns)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=_UNBOUNDED_COLUMNS, soft_wrap=True)


_UNBOUNDED_COLUMNS = 10_000


def _prepack_main(args) -> int:
    from rich.markup import escape
    from rich.table import Table

    from flashboot.flashload.prepack import prepack
    from flashboot.units import format_bytes, parse_bytes

    report = prepack(args.hf_dir, args.out, args.tp, args.ep, target=args.target, family=args.family,
                     chunk_bytes=parse_bytes(args.chunk_bytes), model_id=args.model_id, revision=args.revision,
                     progress=False if args.no_progress else None)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
        return 0
    console = table_console()
    for w in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(str(w))}", highlight=False)
    # paths and names come from the user or the checkpoint: '[/x]' in them is text, not markup
    table = Table(title=f"pre-packed {escape(str(report.family))} ({escape(str(report.target))}) tp={report.tp_size} "
                        f"ep={report.ep_size} -> {escape(str(report.out_dir))}")
    for col in ("rank", "image", "experts", "non-experts", "tensors"):
        table.add_column(col, justify="right", overflow="fold")
    for r in report.ranks:
        table.add_row(str(r.rank), format_bytes(r.image_nbytes), format_bytes(r.expert_nbytes),
                      format_bytes(r.non_expert_nbytes), str(r.tensors))
    console.print(table)
    s = report.seconds
    console.print(f"read {format_bytes(report.read_nbytes)} once, wrote {format_bytes(report.written_nbytes)} in "
                  f"{s['write']:.2f} s ({report.read_gbps:.2f} GB/s read, {report.write_gbps:.2f} GB/s written); "
                  f"checksums {s['checksum']:.2f} s, total {s['total']:.2f} s", highlight=False)
    return 0


def summarize(path) -> dict:
    """What ``flashboot inspect`` shows, as a dict: job, key, and per rank the regions,
    tensor counts and dtypes (every rank's metadata is validated on the way)."""
    from flashboot.layouts.format import METADATA_FILE
    from flashboot.layouts.image import read_image_metadata, read_job

    path = Path(path)
    if (path / METADATA_FILE).is_file():
        metas = [read_image_metadata(path)]
    else:
        job = read_job(path)
        metas = [read_image_metadata(path, r) for r in sorted(job.ranks)]
    m0 = metas[0]
    ranks = []
    for m in metas:
        counts = {"experts": 0, "non_experts": 0}
        dtypes: dict[str, int] = {}
        for t in m.tensors.values():
            counts[t.region] += 1
            dtypes[t.dtype] = dtypes.get(t.dtype, 0) + 1
        ranks.append({"rank": m.parallel.rank, **m.parallel.to_dict(), "image_nbytes": m.image_nbytes,
                      "regions": {k: v.to_dict() for k, v in m.regions.items()}, "tensor_counts": counts,
                      "dtypes": dtypes, "experts": m.experts.to_dict() if m.experts else None,
                      "chunks": len(m.checksums.digests), "chunk_bytes": m.checksums.chunk_bytes})
    return {"path": str(path), "format_version": m0.format_version, "flashboot_version": m0.flashboot_version,
            "job_id": m0.job_id, "family": m0.family.to_dict(), "target": m0.target, "source": m0.source.to_dict(),
            "tp_size": m0.parallel.tp_size, "ep_size": m0.parallel.ep_size, "world_size": m0.parallel.world_size,
            "key": m0.key.to_dict(), "warnings": list(m0.warnings), "ranks": ranks}


def _inspect_main(args) -> int:
    from rich.markup import escape
    from rich.table import Table

    from flashboot.units import format_bytes

    s = summarize(args.dir)
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    console = table_console()
    key = s["key"]
    e = lambda v: escape(str(v))  # noqa: E731 - an image's strings are text, not markup ('[red]' in a model id)
    console.print(f"[bold]{e(s['path'])}[/bold]: format v{e(s['format_version'])} (flashboot {e(s['flashboot_version'])}), "
                  f"family {e(s['family']['name'])}{' (generic fallback)' if s['family']['fallback'] else ''}, "
                  f"target {e(s['target'])}, tp={s['tp_size']} ep={s['ep_size']} ({s['world_size']} ranks)",
                  highlight=False)
    console.print(f"key: {e(key['model_id'])}@{e(key['revision'] or '?')} {e(key['config_hash'])} dtypes "
                  f"{e('+'.join(key['dtypes']))} [dim]{e(key['digest'])}[/dim]", highlight=False)
    for w in s["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {e(w)}", highlight=False)
    table = Table()
    for col in ("rank", "tp", "ep", "experts", "image", "expert region", "non-expert region", "tensors", "dtypes",
                "chunks"):
        table.add_column(col, justify="right", overflow="fold")
    for r in s["ranks"]:
        ex = r["experts"]
        table.add_row(str(r["rank"]), f"{r['tp_rank']}/{r['tp_size']}", f"{r['ep_rank']}/{r['ep_size']}",
                      f"{ex['local_start']}..{ex['local_start'] + ex['local_count'] - 1} of {ex['num_experts']}"
                      if ex else "-",
                      format_bytes(r["image_nbytes"]), format_bytes(r["regions"]["experts"]["nbytes"]),
                      format_bytes(r["regions"]["non_experts"]["nbytes"]),
                      f"{r['tensor_counts']['experts']}+{r['tensor_counts']['non_experts']}",
                      e(", ".join(f"{k}:{v}" for k, v in sorted(r["dtypes"].items()))),
                      f"{r['chunks']} x {format_bytes(r['chunk_bytes'])}")
    console.print(table)
    return 0


def _verify_main(args) -> int:
    from flashboot.errors import ChecksumMismatchError
    from flashboot.layouts.image import verify_image
    from flashboot.units import format_bytes

    try:
        results = verify_image(args.dir, args.rank, progress=not args.no_progress and sys.stderr.isatty())
    except ChecksumMismatchError as exc:
        print(f"flashboot verify: FAILED: {exc}", file=sys.stderr)
        return 1
    for r in results:
        print(f"rank {r.rank}: {format_bytes(r.nbytes)} in {r.chunks} chunks: OK ({r.path})")
    return 0
