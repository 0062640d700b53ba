"""``flashboot preload DIR``: stage rank images into shared memory; optionally serve loads from them."""

from __future__ import annotations

from flashboot.errors import FlashBootError, one_line
from flashboot.units import timeout_arg


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "preload", help="stage rank images disk -> /dev/shm (O_DIRECT, many threads); --serve keeps them pinned",
        description="Stage each rank's pre-packed image into shared memory and mark it ready (.ready). With "
                    "--serve, stay resident: keep the images pinned and copy them into engines' arenas on request "
                    "(flashboot.load(..., served=True)).")
    p.add_argument("image_dir", metavar="DIR", help="pre-packed image directory (flashboot prepack --out)")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="ranks to stage (default: all)")
    p.add_argument("--shm-dir", default=None, help="staging root (default: $FLASHBOOT_SHM or /dev/shm/flashboot)")
    p.add_argument("--threads", type=int, default=16, help="reader threads (default 16)")
    p.add_argument("--io", choices=("auto", "direct", "buffered"), default="auto",
                   help="auto: O_DIRECT, buffered where the filesystem refuses it (reported); direct: refuse otherwise")
    p.add_argument("--chunk-bytes", default="64MiB", help="bytes per read (default 64MiB)")
    p.add_argument("--device", action="append", default=[], metavar="RANK=DEV",
                   help="GPU a rank loads onto, for NUMA placement (default: cuda:<rank mod #GPUs>)")
    p.add_argument("--numa-policy", choices=("preferred", "bind"), default="preferred")
    p.add_argument("--verify", action="store_true", help="recompute the chunk checksums of the staged bytes")
    p.add_argument("--force", action="store_true", help="re-stage ranks that are already staged")
    p.add_argument("--serve", action="store_true", help="stay resident: pin once, serve loads on a Unix socket")
    p.add_argument("--no-pin", action="store_true", help="with --serve: do not pin (copies run at pageable speed)")
    p.add_argument("--allow-group", default=None, metavar="GROUP",
                   help="with --serve: members of GROUP (name or gid) may ask for loads too (default: this user only)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--background", action="store_true", help="run as a detached service (pid file, log)")
    action.add_argument("--stop", action="store_true",
                        help="stop the running preloader of DIR: it takes no new load, finishes those in flight "
                             "within --timeout, then cancels them")
    action.add_argument("--status", action="store_true", help="say what is staged and whether a preloader runs")
    action.add_argument("--unstage", action="store_true", help="remove the staged files of DIR")
    p.add_argument("--timeout", type=timeout_arg, default=30.0,
                   help="seconds to wait for --background/--stop (default 30)")
    p.set_defaults(func=main)


def _config(args):
    from flashboot.flashload.staging import PreloadConfig
    from flashboot.units import parse_bytes

    devices = {}
    for spec in args.device:
        rank, sep, dev = spec.partition("=")
        if not sep or not rank.strip().isdigit():
            raise FlashBootError(f"--device wants RANK=DEVICE (e.g. 0=cuda:0), got {spec!r}")
        if int(rank) in devices:  # the last one had won without a word
            raise FlashBootError(f"--device names rank {int(rank)} twice ({devices[int(rank)]!r} and {dev.strip()!r})")
        devices[int(rank)] = dev.strip()
    config = PreloadConfig(args.image_dir, ranks=args.ranks, shm_dir=args.shm_dir, threads=args.threads, io=args.io,
                           chunk_bytes=parse_bytes(args.chunk_bytes), devices=devices, numa_policy=args.numa_policy,
                           verify=args.verify, force=args.force, serve=args.serve, pin=not args.no_pin,
                           allow_group=args.allow_group)
    if devices:
        staged = config.resolved_ranks()
        stray = sorted(set(devices) - set(staged))
        if stray:  # a typo'd rank had been ignored, its rank placed by the default instead
            raise FlashBootError(f"--device names rank(s) {stray}, which this preload does not stage (ranks {staged})")
    return config


def main(args) -> int:
    from flashboot.flashload import service, staging
    from flashboot.flashload import shm as shm_files

    if args.stop:
        print(service.stop_service(args.image_dir, args.shm_dir, timeout_s=args.timeout,
                                   log=lambda line: print(line, flush=True)))
        return 0
    if args.unstage:
        removed = staging.unstage(args.image_dir, args.ranks, shm_dir=args.shm_dir)
        where = shm_files.staging_dir(args.image_dir, args.shm_dir)
        names = ", ".join(p.name for p in removed if p != where) or "nothing"
        print(f"removed from {where}: {names}" + ("; and the folder itself" if where in removed else ""))
        return 0
    if args.status:
        return _status(args)
    config = _config(args)
    if args.background:
        pid = service.start_background(config, timeout_s=args.timeout)
        print(f"preloader started in the background: pid {pid}, pid file {shm_files.pid_file(config.image_dir, config.shm_dir)}, "
              f"log {shm_files.log_file(config.image_dir, config.shm_dir)}")
        return 0
    with _Progress() as progress:
        service.run_service(config, log=progress.log, progress=progress.update)
    return 0


def _status(args) -> int:
    from flashboot.flashload import client, service
    from flashboot.flashload import shm as shm_files
    from flashboot.flashload.status import leftover_staging_dirs, rank_states, status_ranks

    st = service.service_status(args.image_dir, args.shm_dir)
    state = (f"running (pid {st.pid}{', serving' if st.serve else ''})" if st.running else
             f"not running (stale pid file {st.path}, pid {st.pid})" if st.stale else "not running")
    print(one_line(f"preloader for {args.image_dir}: {state}"))
    # keyed by where the path leads now: one started while it led elsewhere runs on
    elsewhere = list(shm_files.started_elsewhere(args.image_dir, args.shm_dir)) if st.pid is None else []
    for other, real in elsewhere:
        print(one_line(f"  a preloader started for {args.image_dir} (pid {other.pid}{', serving' if other.serve else ''}) "
                       f"still runs, for {real}, where it led then: `flashboot preload {args.image_dir} --stop` "
                       "stops it"))
    warning = shm_files.not_shared_memory_warning(args.shm_dir)
    if warning:
        print(one_line(f"  {warning}"))
    root = shm_files.shm_root(args.shm_dir)
    if root.exists() and not root.is_dir():
        print(one_line(f"  the staging root {root} is not a directory: nothing can be staged there; "
                       "use another --shm-dir"))
    daemon = None
    sock = st.path.with_name(shm_files.socket_path(args.image_dir, args.shm_dir).name)
    if st.running and st.serve and st.pid > 0 and not sock.exists():
        # a stop removes it at once, then the loads in flight finish: asked, it had waited 10 s for none
        print(one_line(f"  the serving daemon (pid {st.pid}) takes no request: its socket {sock} is gone (it is "
                       "stopping, finishing the loads in flight, or starting); the states below are from the "
                       "staged files"))
    elif st.running and st.serve:
        try:
            daemon = client.serve_status(args.image_dir, args.shm_dir)
            if daemon.get("warming"):
                print(f"  the serving daemon (pid {st.pid}) is warming up (imports, CUDA contexts, kernels); ranks "
                      "are staged after it")
        except FlashBootError as exc:  # busy or hung: the staged files still say what a load would find
            print(one_line(f"  the serving daemon (pid {st.pid}) did not answer: {exc}; the states below are from the "
                           "staged files"))
    ranks, refused = (args.ranks, "") if args.ranks else status_ranks(args.image_dir, args.shm_dir, daemon)
    if refused and not ranks and st.pid is None and not elsewhere:  # nothing staged, held or running for it:
        raise FlashBootError(refused)  # the image's own error, in every command's words
    if refused:  # moved away, deleted: what it left staged still takes memory, and is listed below
        print(one_line(f"  the image {args.image_dir} is refused ({refused}); the ranks below are those still staged "
                       "or held"))
    for rs in rank_states(args.image_dir, ranks, args.shm_dir, daemon=daemon,
                          preloader_pid=st.pid if st.running else None):
        print(one_line(f"  {rs.line()}"))
    for d in leftover_staging_dirs(args.shm_dir):
        what = ", ".join(sorted(p.name for p in d.iterdir())) or "empty"
        print(one_line(f"  leftover: {d} ({what}): no staged rank and no preloader; remove it with `rm -r {d}`"))
    return 0


class _Progress:
    """A rich progress bar per rank (bytes, GB/s), and log lines printed above it."""

    def __enter__(self):
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TransferSpeedColumn,
        )

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
        self.tasks = {}
        self.bar.__enter__()
        return self

    def update(self, rank: int, done: int, total: int) -> None:
        if rank not in self.tasks:
            self.tasks[rank] = self.bar.add_task(f"rank {rank}", total=total)
        self.bar.update(self.tasks[rank], completed=done)

    def log(self, line: str) -> None:
        # text, not markup ('[/x]' in a --shm-dir had raised MarkupError, '[red]' vanished), and one line
        # however long: at the console's width (80 columns in a pipe, a log file, the journal) a path or a
        # message had been split over lines that grep no longer found
        self.bar.console.print(one_line(line), markup=False, highlight=False, soft_wrap=True)

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)


def standalone(argv: list[str] | None = None) -> int:
    """``python -m flashboot.commands.preload DIR ...``: the background service's entry point.

    It builds only this command's parser, so the service does not depend on every other
    command of the console script importing cleanly."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="flashboot")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["preload", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except FlashBootError as exc:
        print(f"flashboot preload: error: {one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(standalone())
