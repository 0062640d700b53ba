"""``flashboot seed``, ``flashboot clone`` and ``flashboot hold``: FlashClone from the shell."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time

from flashboot.units import timeout_arg


def _common(p: argparse.ArgumentParser, *, store_required: bool = True) -> None:
    p.add_argument("--store", required=store_required, metavar="HOST:PORT",
                   help="rendezvous store (torch.distributed TCPStore)")
    p.add_argument("--name", default="default", help="namespace in the store (default: default)")
    p.add_argument("--token-file", help="file holding the shared token (default: $FLASHBOOT_TOKEN)")
    p.add_argument("--timeout", type=timeout_arg, default=60.0, metavar="S",
                   help="bound on every wait (default 60 s)")


def register(subparsers) -> None:
    p = subparsers.add_parser("seed", help="publish an image (or a held arena) for cloning; runs until stopped")
    p.add_argument("dir", nargs="?", help="pre-packed image directory (loaded with FlashLoad when staged)")
    p.add_argument("--device", default=None, help="cuda index (0), cuda:N or cpu (default: cuda:0 where present)")
    p.add_argument("--rank", type=int, default=0, help="image rank to load (default 0)")
    p.add_argument("--held", metavar="NAME", help="seed from an arena a holder keeps (with --registry)")
    p.add_argument("--registry", metavar="DIR", help="holder registry directory (for --held)")
    p.add_argument("--no-nccl", action="store_true", help="do not answer the NCCL-broadcast fallback")
    p.add_argument("--nixl", action="store_true",
                   help="also serve NIXL READs (clones on other hosts; needs pip install flashboot[nixl])")
    p.add_argument("--no-host-store", action="store_true",
                   help="never host the store: wait for the one at --store (flashboot store, torchrun's) and join it")
    _common(p)
    p.set_defaults(func=run_seed)

    p = subparsers.add_parser("clone", help="clone the seed published at --store into a new arena")
    p.add_argument("--device", default=None, help="cuda index (0), cuda:N or cpu (default: cuda:0 where present)")
    p.add_argument("--schedule", default="chain", choices=("chain", "star", "ring"))
    p.add_argument("--clones", type=int, default=None,
                   help="how many clones join (start barrier); ring: the member count")
    p.add_argument("--chunk-bytes", default=None, help="pipeline chunk, e.g. 256MiB (default: 256 MiB; 1 GiB for a star or --clones 1)")
    p.add_argument("--mover", default=None, help="registry mover (default copy_engine on CUDA, host on cpu)")
    p.add_argument("--verify", action="store_true", help="prove the clone byte-exact against the seed's checksums")
    p.add_argument("--image", default=None, help="host image: ring shard source, or fallback when no source is left")
    p.add_argument("--transport", default="auto", choices=("auto", "posix_fd", "fabric", "nixl", "nccl"),
                   help="auto (default) takes the first that reaches the seed: posix_fd, fabric, nixl, nccl")
    p.add_argument("--no-retry", action="store_true", help="fail instead of re-attaching when a source fails")
    p.add_argument("--pin-early", action="store_true",
                   help="ring: map and pin the shard before the start barrier (off the critical path)")
    p.add_argument("--run", default=None, metavar="NAME",
                   help="ring only: name of this load in the store (default ring); freed when its last member "
                        "exits, never when one is SIGKILLed (then name another)")
    p.add_argument("--serve", action="store_true", help="stay up as a source after cloning, until SIGTERM")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON ('-' for stdout)")
    _common(p)
    p.set_defaults(func=run_clone)

    p = subparsers.add_parser("hold", help="keep arenas alive after their engine exits (runs until stopped)")
    p.add_argument("--registry", metavar="DIR", help="registry directory of held arenas")
    p.add_argument("--list", action="store_true", help="list what the registry holds and exit")
    p.add_argument("--release", metavar="NAME", help="ask the running holder to drop NAME and exit")
    _common(p, store_required=False)
    p.set_defaults(func=run_hold)


def _print(text: str) -> None:
    print(text, flush=True)


def run_seed(args: argparse.Namespace) -> int:
    from flashboot.flashclone import seed
    from flashboot.errors import FlashBootError
    from flashboot.service_loop import announce_and_serve

    if args.dir is None and args.held is None:
        raise FlashBootError("seed needs an image DIR or --held NAME (with --registry)")
    if args.dir is not None and args.held is not None:
        raise FlashBootError(f"seed takes an image DIR or --held NAME, not both (got {args.dir!r} and --held "
                             f"{args.held!r})")
    if args.registry is not None and args.held is None:  # it had been ignored without a word
        raise FlashBootError(f"--registry {args.registry} is where --held NAME is looked up; seeding the image "
                             f"{args.dir!r} takes no registry")
    owned = None
    if args.held is not None:
        from flashboot.flashclone.holder import open_held

        if args.registry is None:
            raise FlashBootError("--held needs --registry DIR")
        owned = source = open_held(args.held, args.device, registry=args.registry)
    else:
        source = args.dir
    try:
        s = seed(args.store, source, args.device, token_file=args.token_file, name=args.name, rank=args.rank,
                 timeout_s=args.timeout, serve_nccl=not args.no_nccl, nixl=args.nixl,
                 host_store=not args.no_host_store)
    except BaseException:
        if owned is not None:
            owned.close()
        raise
    def announce() -> None:
        role = "hosting" if s.rendezvous.is_server else "joined"
        _print(f"seed ready: {s.manifest.describe()} on {s.arena.device}; {role} store {s.address} "
               f"(namespace {args.name!r}, generation {s.generation}); serving until SIGTERM")
        if s.rendezvous.is_server:
            print(f"flashboot seed: note: this process hosts the store at {s.address}; if it dies, clones lose "
                  f"the store with it (run `flashboot store {s.address}` first to keep the store apart)",
                  file=sys.stderr)

    try:
        announce_and_serve(s, announce)
    finally:
        if owned is not None:
            owned.close()
    _print("seed stopped")
    return 0


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt("SIGTERM") while the clone runs, as SIGINT does: the clone
    then says it failed and withdraws, where a plain SIGTERM left its successors waiting for it.
    (The serve loops' stop_on_signals sets an event instead; a clone has no loop to check one.)"""
    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_clone(args: argparse.Namespace) -> int:
    from flashboot._lazy import import_early

    # torch's import is the longest part of a fresh clone's start (3-4 s on the H200 VMs): it
    # starts before FlashClone's own modules are imported, not after
    import_early("torch")
    from flashboot.errors import FlashBootError

    if args.run is not None and args.schedule != "ring":
        raise FlashBootError(f"--run names a ring load; a {args.schedule} has no run name (use --name for a "
                             "namespace of its own)")
    if args.pin_early and args.schedule != "ring":  # clone() ignores it outside a ring: it had been taken silently
        raise FlashBootError(f"--pin-early pins a ring member's shard of --image; a {args.schedule} clone has no "
                             "shard to pin")
    if args.image is not None and not os.path.exists(args.image):
        # checked before the store and the warm-up: a ring met it only after both, as a traceback, and a
        # chain or star only once it needed its fallback
        raise FlashBootError(f"--image {args.image}: no such image directory or file")
    report_file, created = None, False
    if args.json and args.json != "-":
        # opened before cloning: a path that cannot be written fails now, not after the clone
        created = not os.path.lexists(args.json)
        try:
            report_file = open(args.json, "a")  # truncated when the report is written: a failure keeps the old one
        except OSError as exc:
            raise FlashBootError(f"--json {args.json}: cannot write there ({exc.strerror})") from None
    rc = None
    try:
        with report_file if report_file is not None else contextlib.nullcontext():
            rc = _clone_and_report(args, report_file)
            return rc
    finally:
        if created and rc != 0:  # no report: leave no empty file where there was none
            with contextlib.suppress(OSError):
                if os.path.getsize(args.json) == 0:
                    os.unlink(args.json)


def _clone_and_report(args: argparse.Namespace, report_file) -> int:
    from flashboot.flashclone import clone, linger, prepare_clone
    from flashboot.units import parse_bytes

    # first thing: the CUDA context, CuPy, the checksum kernel... load while torch is imported
    # and the store is reached
    prepared = prepare_clone(args.device, verify=args.verify, mover=args.mover)
    chunk = parse_bytes(args.chunk_bytes) if args.chunk_bytes else None
    try:
        with _sigterm_as_interrupt():
            result = clone(args.store, args.device, args.schedule, verify=args.verify, timeout_s=args.timeout,
                           mover=args.mover, chunk_bytes=chunk, token_file=args.token_file, name=args.name,
                           clones=args.clones, image=args.image, transport=args.transport,
                           retry=not args.no_retry, pin_early=args.pin_early, prepared=prepared,
                           run=args.run or "ring")
    except KeyboardInterrupt as exc:  # clone() published "failed" and left; one line, no traceback
        signame = str(exc) if str(exc) in ("SIGTERM", "SIGHUP") else "SIGINT"  # SIGHUP: the cli's handler
        print(f"flashboot clone: stopped by {signame} before the clone finished", file=sys.stderr)
        return 128 + signal.Signals[signame]
    # with --json -, stdout carries the report alone (`| jq`): the summary goes to stderr
    say = _print if args.json != "-" else lambda text: print(text, file=sys.stderr, flush=True)
    try:
        say(result.report.summary())
        if args.json:
            text = json.dumps(result.report.to_dict(), indent=2)
            if report_file is None:
                _print(text)
            else:
                if report_file.seekable():  # a file: replace what an earlier run left (a pipe, /dev/stdout or
                    report_file.seek(0)     # a FIFO cannot seek: that had been a traceback after the clone)
                    report_file.truncate()
                report_file.write(text + "\n")
                report_file.flush()
        if args.serve:
            from flashboot.service_loop import stop_on_signals

            stop = threading.Event()
            with stop_on_signals(stop):  # taken before the line is said (see service_loop.announce_and_serve)
                say("serving as a source until SIGTERM")
                linger(result, forever=True, stop=stop)
        else:
            linger(result, timeout_s=args.timeout)  # until a chain successor has read from us
    finally:
        result.close()
    return 0


def _refit_listed(name: str, record: dict, registry) -> str:
    """What in-place refits made of the held bytes (:mod:`flashboot.flashclone.holder_refit`), for
    ``hold --list``: nothing when they are the image's."""
    from flashboot.errors import FlashBootError
    from flashboot.flashclone.holder_refit import read_refit

    try:
        state = read_refit(name, record.get("request"), registry=registry)
    except FlashBootError as exc:
        return f"; refit record unreadable: {exc}"
    if state is None:
        return ""
    if "torn" in state:
        torn = state["torn"]
        return (f"; TORN by an in-place refit (versions {', '.join(map(str, torn['versions']))} mixed, "
                f"{torn['last_whole']} the last whole one)")
    return f"; refit version {state['version']}, not the image's bytes"


def run_hold(args: argparse.Namespace) -> int:
    from flashboot.errors import FlashBootError
    from flashboot.flashclone.holder import Holder, held_record, holder_gone, list_held, release
    from flashboot.service_loop import announce_and_serve

    # each of these had been taken and one of the two silently ignored (the registry, --list won)
    if args.registry is not None and args.store is not None:
        raise FlashBootError("hold keeps its records in --registry DIR or in --store HOST:PORT, not both")
    if args.list and args.release is not None:
        raise FlashBootError("--list and --release NAME are two commands: give one")
    if args.list:
        if args.registry is None:
            raise FlashBootError("--list needs --registry DIR")
        now = time.time()
        for name, rec in list_held(args.registry).items():
            d = rec.get("descriptor") or {}
            image = rec.get("image") or {}
            what = (f", image {image.get('key')} rank {image.get('rank')} ({image.get('nbytes', 0):,} bytes, metadata "
                    f"{str(image.get('metadata_sha256'))[:12]}, {image.get('device')})" if image else ", image unknown")
            age = f", held {now - rec['since']:.0f} s" if isinstance(rec.get("since"), (int, float)) else ""
            gone = holder_gone(rec) if d else None  # a killed holder's records stay: they had read as held
            stale = f"; STALE: {gone}, and the memory went with it" if gone else ""
            _print(f"{name}: {d.get('nbytes', 0):,} bytes, {d.get('backend')} arena {d.get('arena_id')}, "
                   f"holder pid {rec.get('holder_pid')}{what}{age}{_refit_listed(name, rec, args.registry)}{stale}"
                   if d else f"{name}: {rec.get('error')}")
        return 0
    where = {"registry": args.registry} if args.registry else {"store": args.store, "token_file": args.token_file,
                                                               "namespace": args.name}
    if args.registry is None and args.store is None:
        raise FlashBootError("hold needs --registry DIR or --store HOST:PORT")
    if args.release is not None:  # `--release ""` is a bad name, not "no --release": it had started a holder
        # release() returns at once for a name no one holds: that had printed "released NAME"
        record = held_record(args.release, timeout_s=args.timeout, **where)  # --timeout bounds the store's connect
        if record is None:
            place = (f"registry {args.registry!r} (`flashboot hold --registry {args.registry} --list` names what is)"
                     if args.registry else f"the store at {args.store} (namespace {args.name!r})")
            raise FlashBootError(f"nothing is held as {args.release!r} in {place}")
        gone = holder_gone(record) if "descriptor" in record else None
        if gone is not None:  # no holder will answer: the wait had run out blaming a holder that is not there
            stale = (f"; remove its stale record {os.path.join(args.registry, 'held', args.release + '.json')}"
                     if args.registry else "")
            raise FlashBootError(f"{args.release!r} is held no more: {gone}, and its memory went with it{stale}")
        release(args.release, timeout_s=args.timeout, **where)
        _print(f"released {args.release}")
        return 0
    holder = Holder(**where) if args.registry else Holder(store=args.store, token_file=args.token_file,
                                                          namespace=args.name, timeout_s=args.timeout)
    def say_problem(err: str) -> None:
        print(f"flashboot hold: {err}", file=sys.stderr, flush=True)

    def announce() -> None:
        _print(f"holder ready ({holder.kv.where()}); serving until SIGTERM")
        for err in holder.errors:  # a holder before this one, taken as gone
            say_problem(err)
        # each problem as it happens: an older engine refused, a planted request had been said only at the stop
        holder.errors.echo = say_problem

    announce_and_serve(holder, announce)
    _print("holder stopped")
    return 0
