"""``flashboot load DIR --rank R --device D``: FlashLoad one staged rank and print where the time went."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("load", help="load one rank into an arena and print the phases",
                              description="Load rank R of a pre-packed image onto device D and print the per-phase "
                                          "timings: from the copy `flashboot preload` staged, or streamed from disk "
                                          "when none is staged (--stream, --no-stream).")
    p.add_argument("image_dir", metavar="DIR")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda index, cuda:N or cpu (default: cuda:0 where present)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--served", action="store_true", help="have the running `flashboot preload --serve` copy it")
    how.add_argument("--pin-early", action="store_true",
                     help="stage and pin first (flashboot.stage), then time the load alone")
    how.add_argument("--stream", action="store_true", default=None,
                     help="read the image straight from disk through a bounded ring (default: when nothing is staged)")
    how.add_argument("--no-stream", dest="stream", action="store_false",
                     help="never stream: wait for the preloader's .ready")
    p.add_argument("--stream-buffer", default=None, metavar="BYTES",
                   help="ring size of a streamed load, e.g. 256MiB (default 256 MiB or $FLASHBOOT_STREAM_BUFFER_BYTES)")
    check = p.add_mutually_exclusive_group()
    check.add_argument("--verify", action="store_true", default=None,
                       help="recompute the chunk checksums on the device (default: served loads on CUDA, by the daemon; "
                            "in-process loads on CUDA once the kernel is loaded; not on the host backend)")
    check.add_argument("--no-verify", dest="verify", action="store_false", help="skip the checksums")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the staged image (default 60)")
    p.add_argument("--shm-dir", default=None)
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON ('-' for stdout)")
    p.set_defaults(func=main)


def main(args) -> int:
    import contextlib
    import sys

    import flashboot
    from flashboot.errors import FlashBootError
    from flashboot.benchmarks.timing import check_json_path, dump_json, print_table
    from flashboot.units import format_rate, parse_bytes

    if args.stream_buffer is not None and (args.stream is False or args.served or args.pin_early):
        # a load that never streams has no ring: the size had been taken and ignored
        never = "--no-stream" if args.stream is False else "--served" if args.served else "--pin-early"
        raise FlashBootError(f"--stream-buffer sizes a streamed load's ring; a {never} load never streams")
    buffer = parse_bytes(args.stream_buffer) if args.stream_buffer else None
    check_json_path(args.json)

    staged = None
    if args.pin_early:
        staged = flashboot.stage(args.image_dir, args.rank, args.device, timeout_s=args.timeout,
                                 shm_dir=args.shm_dir).wait()
    try:
        with flashboot.load(args.image_dir, args.rank, args.device, timeout_s=args.timeout, served=args.served,
                            staged=staged, verify=args.verify, shm_dir=args.shm_dir, stream=args.stream,
                            stream_buffer_bytes=buffer) as loaded:
            r = loaded.report
            if loaded.release_thread is not None:
                loaded.release_thread.join()
    finally:
        if staged is not None:
            staged.close()
    rows = [[phase, ms] for phase, ms in r.phases().items()]
    rows.append(["total", r.total_ms])
    if "other" in r.phases():
        rows[-2][0] = "other (imports, first-use set-up, Python)"
    # with --json -, stdout carries the JSON alone (`| jq`): the table goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext():
        print(f"rank {r.rank} -> {r.device} ({r.mode}): {r.nbytes:,} bytes, {r.tensors} tensors")
        print_table("phases", ["what", "ms"], rows)
        extra = f"; pinned early in {r.pinned_early_ms:.1f} ms (off the critical path)" if r.pinned_early_ms else ""
        print(f"{format_rate(r.nbytes, r.total_ms)} end to end, H2D {format_rate(r.nbytes, r.h2d_ms)} in {r.chunks} "
              f"chunk(s){extra}")
        print(r.verified_text())
        if r.details.get("note"):
            print(r.details["note"])
    dump_json(r.to_dict(), args.json)
    return 0
