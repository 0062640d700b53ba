"""``flashboot sim``: run a schedule's plan on a simulated topology and report per-clone GB/s."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    p = subparsers.add_parser("sim", help="simulate chain/star/ring cloning on a topology (h200-x2, h200-x8, gb300-nvl72, or a YAML file)")
    p.add_argument("--topology", required=True, help="shipped name or path to a topology YAML")
    p.add_argument("--schedule", required=True, help="chain, star or ring")
    p.add_argument("--clones", required=True, type=int, help="number of clones (ring: members)")
    p.add_argument("--model-bytes", required=True, help="image bytes per rank: 217e9, 217GB, 41.4GB, 256MiB")
    p.add_argument("--chunk-bytes", default=None, help="chunk size (default: 256 MiB; 1 GiB for a star or a chain of one clone)")
    p.add_argument("--pin", action="store_true", help="host loads pay the pin (cudaHostRegister) on the critical path")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=main)


def main(args) -> int:
    from flashboot.sim import simulate_schedule
    from flashboot.units import format_bytes, parse_bytes

    total = parse_bytes(args.model_bytes)
    chunk = parse_bytes(args.chunk_bytes) if args.chunk_bytes is not None else None
    result = simulate_schedule(args.topology, args.schedule, args.clones, total, chunk,
                               {"pin_on_critical_path": args.pin})
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(f"{result.schedule} on {result.topology}: {len(result.receivers)} receivers, "
          f"{format_bytes(total)}, chunk {format_bytes(result.chunk_bytes)}, {result.n_steps} steps")
    print(f"{'receiver':<10} {'gpu':>4} {'first byte ms':>14} {'done ms':>10} {'GB/s':>8}")
    seeds = len(result.placement) - len(result.receivers)  # seeds are the first participants
    for k, name in enumerate(result.receivers):
        print(f"{name:<10} {result.placement[seeds + k]:>4} {result.first_byte_s[k] * 1e3:>14.3f} "
              f"{result.finish_s[k] * 1e3:>10.2f} {result.per_clone_gbps[k]:>8.1f}")
    print(f"time to the last clone: {result.last_clone_s * 1e3:.2f} ms; mean {result.mean_gbps:.1f} GB/s per clone; "
          f"head-to-tail gradient {result.head_to_tail * 100:.1f} %")
    return 0
