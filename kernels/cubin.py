"""Triton kernels compiled ahead of time: a cubin cache on disk, and launches through the CUDA
driver (``cuModuleLoadData`` / ``cuModuleGetFunction`` / ``cuLaunchKernel``) without importing Triton.

Importing Triton, building its launcher and reading its cache cost 0.7-2.3 s in a fresh process
on an H200 host; loading a cubin costs about a millisecond. An entry is a directory
``<cache>/<kernel>-sm<arch>-triton<version>-<variant>/`` holding ``kernel.cubin`` and
``entry.json``: the key it was built for (kernel, hash of the kernel's source file, GPU arch,
Triton version, constexprs, warps, stages, the arguments' specialisation), the cubin's size and
sha256, and what a launch needs from Triton's compiled metadata (the parameter list, warps,
shared memory, the scratch pointers Triton appends). A stale entry (another source hash,
another key) is refused and rebuilt by the caller; a corrupt one raises :class:`KernelCacheError`.

The launch reproduces Triton's own (``backends/nvidia/driver.c``), its driver calls made through
ctypes (:mod:`flashboot.kernels.launch_ctypes`: ``cuda.bindings``' import alone would exceed a
first call's budget): grid as given,
``32 * num_warps`` threads, the metadata's dynamic shared memory, the kernel's non-constexpr
arguments in order, then one null pointer per scratch buffer Triton appends (global, and from
3.5 on profile). Kernels that need more (clusters, cooperative or PDL launches, scratch memory,
over 48 KiB of shared memory) are not cached: they keep Triton's launcher.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, NamedTuple

from flashboot.errors import FlashBootError, KernelCacheError
from flashboot.fileio import fsync_dir

_ENTRY_FORMAT = 1
_CTYPES = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
           "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
           "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "fp64": ctypes.c_double}
_MAX_STATIC_SHARED = 48 << 10  # above this Triton opts the function into more (cuFuncSetAttribute): not cached
_MAX_SHARED = 228 << 10  # above this Triton's launch adds a shared-memory-mode attribute


def cache_dir() -> Path:
    """``$FLASHBOOT_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/flashboot/kernels`` (``~/.cache/...``)."""
    explicit = os.environ.get("FLASHBOOT_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashboot" / "kernels"


@functools.cache
def triton_version() -> str | None:
    """The installed Triton's version as ``triton.__version__`` says it, read from that line of
    its package without importing it (None: not installed): 0.2-0.3 ms of a fresh process's
    first checksum on a 2-core host, where importing Triton costs seconds and
    ``importlib.metadata.version`` 0.5-0.7 ms. An upgraded Triton gives another key, so its
    cubins are rebuilt."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    for line in Path(spec.origin).read_text().splitlines():
        name, eq, value = line.partition("=")
        if eq and name.strip() == "__version__":
            return value.strip().strip("\"'") or None
    return None


def source_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# NamedTuples, not dataclasses: defining a dataclass costs about a millisecond, paid by a fresh
# process's first checksum, which imports this module (budget: 20 ms for the whole call).
class KernelKey(NamedTuple):
    """What a cubin was built for; a cached entry is used only for an equal key."""

    kernel: str
    source_sha256: str
    arch: int  # compute capability as Triton's target: 90 for sm_90
    triton: str
    variant: str  # constexprs, warps, stages and specialisation in a few words (a directory name)
    build: dict  # the same in full: {constexpr: value, "num_warps":, "num_stages":, "specialisation":}

    def path(self, root: Path | None = None) -> Path:
        return (root or cache_dir()) / f"{self.kernel}-sm{self.arch}-triton{self.triton}-{self.variant}"

    def as_json(self) -> dict:
        return self._asdict()


class CachedKernel(NamedTuple):
    """A cubin and what launching it needs."""

    key: KernelKey
    path: Path
    cubin: bytes
    function: str
    params: tuple[tuple[str, str], ...]  # (name, Triton type) of the non-constexpr arguments, in order
    num_warps: int
    shared: int
    scratch_pointers: int  # null pointers Triton's launcher appends (global / profile scratch)


class LaunchLayout(NamedTuple):
    """How Triton's launcher passes a compiled kernel's arguments to ``cuLaunchKernel``."""

    params: tuple[tuple[str, str], ...]
    """(name, Triton type) of the arguments passed, in order: the non-constexpr ones Triton did
    not specialise into constants."""
    positions: tuple[int, ...]
    """Each param's position among the kernel's declared arguments (a runner's ``*args``)."""
    scratch_pointers: int
    """Pointers Triton appends after them: global scratch, and from Triton 3.5 on profile scratch."""
    needs: tuple[str, ...]
    """What the launch needs beyond a plain ``cuLaunchKernel`` of the function (then only
    Triton's launcher launches it): clusters, a cooperative grid, PDL, profile scratch,
    oversized shared memory, instrumentation, arguments of types not reproduced here."""


def launch_layout(compiled: Any) -> LaunchLayout:
    """The :class:`LaunchLayout` of Triton's ``CompiledKernel`` (``.src``, ``.metadata``)."""
    md = compiled.metadata
    refuse = {"num_ctas": getattr(md, "num_ctas", 1) != 1,
              "cooperative grid": bool(getattr(md, "launch_cooperative_grid", False)),
              "PDL": bool(getattr(md, "launch_pdl", False)),
              "profile scratch": getattr(md, "profile_scratch_size", 0) > 0,
              f"shared memory over {_MAX_SHARED:,} bytes": md.shared > _MAX_SHARED,
              "instrumentation": bool(getattr(md, "instrumentation_mode", "")),
              "host tensor descriptors": bool(getattr(md, "tensordesc_meta", None))}
    signature = compiled.src.signature
    names = list(signature)
    constants = {names[k[0]] if isinstance(k, tuple) else k for k in compiled.src.constants}
    params = [(n, t) for n, t in signature.items() if t != "constexpr" and n not in constants]
    unknown = [f"{n}: {t}" for n, t in params if not t.startswith("*") and t not in _CTYPES]
    scratch = sum(hasattr(md, f) for f in ("global_scratch_size", "profile_scratch_size"))
    return LaunchLayout(tuple(map(tuple, params)), tuple(names.index(n) for n, _ in params), scratch,
                        tuple([what for what, yes in refuse.items() if yes] + unknown))


def save(key: KernelKey, compiled: Any, root: Path | None = None) -> CachedKernel:
    """Write Triton's ``CompiledKernel`` (from ``triton.compile``) as the entry of ``key``,
    atomically (a reader sees the old entry or the new one). FlashBootError when the kernel needs
    a launch feature this module does not reproduce."""
    md = compiled.metadata
    layout = launch_layout(compiled)
    needs = list(layout.needs)
    needs += ["global scratch"] if getattr(md, "global_scratch_size", 0) > 0 else []
    # a module loaded here has no attribute raised past the static limit (Triton's own load sets it)
    needs += [f"shared memory over {_MAX_STATIC_SHARED:,} bytes"] if md.shared > _MAX_STATIC_SHARED else []
    if needs:
        raise FlashBootError(f"{key.kernel}: cannot launch it without Triton (needs {', '.join(needs)})")
    params, scratch = [list(p) for p in layout.params], layout.scratch_pointers
    cubin = compiled.asm["cubin"]
    entry = {"format": _ENTRY_FORMAT, "key": key.as_json(), "cubin_bytes": len(cubin),
             "cubin_sha256": hashlib.sha256(cubin).hexdigest(), "function": md.name, "params": params,
             "num_warps": md.num_warps, "shared": md.shared, "scratch_pointers": scratch}
    path = key.path(root)
    path.mkdir(parents=True, exist_ok=True)
    for name, data in (("kernel.cubin", cubin), ("entry.json", json.dumps(entry, indent=1).encode())):
        fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                # on disk before the rename: after a crash the name must not point at a short file
                os.fsync(f.fileno())
            os.replace(tmp, path / name)  # cubin first: an entry.json always finds the cubin it describes
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    fsync_dir(path)  # the renames themselves survive a crash
    return CachedKernel(key, path, cubin, md.name, tuple(map(tuple, params)), md.num_warps, md.shared, scratch)


def discard(key: KernelKey, root: Path | None = None) -> None:
    """Remove the entry of ``key`` (a corrupt one, before rebuilding it). Renamed aside first, so
    a concurrent :func:`save` of a fresh entry under the same name is never half deleted; an entry
    already gone (another process discarded it) is no error."""
    import shutil  # only on this rare path: a fresh process's first checksum imports this module

    path = key.path(root)
    aside = path.with_name(f".{path.name}.discarded-{os.getpid()}-{threading.get_ident()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _check_entry(entry: dict) -> None:
    """Refuse a launch field of the wrong shape: it would otherwise surface as a KeyError or
    TypeError at the launch, far from the file that caused it."""
    if not isinstance(entry.get("function"), str) or not entry["function"]:
        raise ValueError(f"'function' must be a kernel name, got {entry.get('function')!r}")
    import reprlib

    params = entry.get("params")
    if not isinstance(params, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
            and (p[1].startswith("*") or p[1] in _CTYPES) for p in params):
        raise ValueError(f"'params' must list [name, type] pairs of pointer or {sorted(_CTYPES)} types, "
                         f"got {reprlib.repr(params)}")
    for name, low in (("num_warps", 1), ("shared", 0), ("scratch_pointers", 0)):
        v = entry.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name!r} must be an int >= {low}, got {v!r}")


def load(key: KernelKey, root: Path | None = None) -> tuple[CachedKernel | None, str]:
    """The cached entry of ``key``, or ``(None, why)``: none yet, or a stale one (another
    source hash or build), which the caller rebuilds. KernelCacheError when it is corrupt."""
    path = key.path(root)
    try:
        raw = (path / "entry.json").read_bytes()
    except FileNotFoundError:
        return None, f"no cubin cached at {path}"
    try:
        entry = json.loads(raw)
        found_key = entry["key"]
        expected_size, expected_sha = int(entry["cubin_bytes"]), entry["cubin_sha256"]
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise KernelCacheError(f"{path / 'entry.json'}: unreadable kernel cache entry ({type(exc).__name__}: {exc}); "
                               f"delete {path} or run `flashboot warm`") from None
    if entry.get("format") != _ENTRY_FORMAT or found_key != key.as_json():
        if isinstance(found_key, dict) and found_key.get("source_sha256") != key.source_sha256:
            why = (f"source sha256 {str(found_key.get('source_sha256'))[:12]}..., the kernel's source is now "
                   f"{key.source_sha256[:12]}...")
        else:
            why = f"key {found_key}, expected {key.as_json()}"
        return None, f"stale cubin at {path} refused (built for {why})"
    try:
        _check_entry(entry)
    except ValueError as exc:
        raise KernelCacheError(f"{path / 'entry.json'}: unreadable kernel cache entry ({exc}); "
                               f"delete {path} or run `flashboot warm`") from None
    try:
        cubin = (path / "kernel.cubin").read_bytes()
    except FileNotFoundError:
        cubin = b""
    sha = hashlib.sha256(cubin).hexdigest()
    if len(cubin) != expected_size or sha != expected_sha:
        raise KernelCacheError(f"{path / 'kernel.cubin'}: corrupt cubin: {len(cubin):,} bytes with sha256 {sha[:16]}..., "
                               f"its entry expects {expected_size:,} bytes with sha256 {expected_sha[:16]}...; "
                               f"delete {path} or run `flashboot warm`")
    return CachedKernel(key, path, cubin, entry["function"], tuple(map(tuple, entry["params"])), entry["num_warps"],
                        entry["shared"], entry["scratch_pointers"]), ""


class CubinLauncher:
    """A cached kernel loaded into each device's primary context on first use, launched with
    ``cuLaunchKernel`` as Triton would launch it (the driver through ctypes:
    :mod:`flashboot.kernels.launch_ctypes`)."""

    def __init__(self, cached: CachedKernel):
        self.cached = cached
        self._functions: dict[int, int] = {}
        self._lock = threading.Lock()
        self._types = [ctypes.c_uint64 if t.startswith("*") else _CTYPES[t] for _, t in cached.params]
        self._types += [ctypes.c_uint64] * cached.scratch_pointers

    def function(self, device: int) -> int:
        """The kernel's ``CUfunction`` in device ``device``'s primary context (loaded once)."""
        fn = self._functions.get(device)
        if fn is None:
            from .launch_ctypes import load_function

            with self._lock:
                fn = self._functions.get(device)
                if fn is None:
                    fn = self._functions[device] = load_function(self.cached.cubin, self.cached.function, device,
                                                                 str(self.cached.path / "kernel.cubin"))
        return fn

    def pack(self, args: tuple) -> tuple[ctypes.Array, list]:
        """``cuLaunchKernel``'s ``kernelParams`` for the kernel's non-constexpr ``args`` (pointers
        as ints), then a null pointer per scratch buffer: an array of pointers to each value, and
        the values, which must outlive the launch."""
        if len(args) != len(self.cached.params):
            raise FlashBootError(f"{self.cached.key.kernel}: {len(args)} arguments for its {len(self.cached.params)} "
                                 f"parameters {[n for n, _ in self.cached.params]}")
        values = [t(a) for t, a in zip(self._types, (*args, *[0] * self.cached.scratch_pointers))]
        return (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values]), values

    def launch(self, grid: tuple[int, ...], args: tuple, *, device: int, stream: int) -> None:
        """Launch on ``grid`` (1-3 dims) with the kernel's non-constexpr ``args`` (pointers as
        ints) on ``device``'s raw ``stream`` handle, ``device``'s context current."""
        from .launch_ctypes import launch_kernel

        params, _keep = self.pack(args)  # the values the params point at, alive until the driver read them
        gx, gy, gz = (*grid, 1, 1)[:3]
        if gx * gy * gz == 0:
            return
        launch_kernel(self.function(device), (gx, gy, gz), 32 * self.cached.num_warps, self.cached.shared, stream,
                      params, f"cuLaunchKernel({self.cached.function}, grid {gx}x{gy}x{gz})")


__all__ = ["CachedKernel", "CubinLauncher", "KernelKey", "LaunchLayout", "cache_dir", "discard", "launch_layout",
           "load", "save", "source_sha256", "triton_version"]
