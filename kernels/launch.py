"""Launch a Triton kernel with its compiled object cached, so a repeated launch costs the launch.

``kernel[grid](...)`` binds and specialises every argument in Python on every call (tens of
microseconds), and the movers' tensor views of raw pointers (CuPy ``UnownedMemory`` + DLPack)
cost as much again. :func:`launch` pays that once per *specialisation* -- device, constexprs,
warps, stages, pointer dtypes, and the facts Triton specialises scalars on (16-byte alignment of
pointers; integers equal to 1, divisible by 16, or past int32) -- and afterwards launches the
compiled function itself with plain ints, through Triton's launcher (:func:`_direct_runner`) or
the compiled kernel's runner. (A runner calling ``cuLaunchKernel`` through ctypes on a parameter
array built once was tried and measured slower on an H200: 14.2 / 15.5 us per SM / TMA mover call
against 12.3 / 13.9 through Triton's C launcher, 2026-12-01.)

Under ``TRITON_INTERPRET=1`` there is nothing to cache: every launch goes through
``kernel[grid]`` with the tensor views, on host memory.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from .views import interpreting, launch_on_index

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass(frozen=True, eq=False)
class LaunchConfig:
    """Everything of a launch that is fixed for a mover: built once (``functools.cache`` in the
    wrappers), so it is hashed by identity on every launch (a field-wise hash costs a microsecond).

    ``constexprs``: ``(name, value)`` pairs of the kernel's ``tl.constexpr`` parameters, which
    must come after its runtime parameters. ``pointers``: for each runtime argument, the name of
    the element type its pointer views (``None`` for a scalar).
    """

    constexprs: tuple[tuple[str, Any], ...]
    pointers: tuple[Any, ...]
    num_warps: int
    num_stages: int

    @functools.cached_property
    def constexpr_values(self) -> tuple[Any, ...]:
        return tuple(v for _, v in self.constexprs)

    @functools.cached_property
    def is_pointer(self) -> tuple[bool, ...]:
        return tuple(p is not None for p in self.pointers)


def _specialisation(args: tuple[int, ...], is_pointer: tuple[bool, ...]) -> tuple:
    """A superset of what Triton specialises the runtime arguments on (a finer key is only a
    second compile, never a wrong kernel)."""
    return tuple([(a & 15 == 0) if p else (a == 1, a & 15 == 0, _I32_MIN <= a <= _I32_MAX)
                  for a, p in zip(args, is_pointer)])


_compiled: dict[tuple, Any] = {}
_runners: dict[tuple, Any] = {}
"""(compiled-kernel key, grid) -> the compiled kernel's bound runner (``CompiledKernel[grid]``)."""
_RUNNERS_MAX = 4096


def launch(kernel, config: LaunchConfig, grid: tuple[int, ...], args: tuple[int, ...], *, device: int,
           stream: int, views: Callable[[], tuple]) -> Callable[..., None] | None:
    """Launch ``kernel`` on ``grid`` with runtime ``args`` (pointers as ints) on CUDA ``device``'s
    ``stream`` (a raw handle). ``views()`` returns the same arguments with pointers as tensors:
    used for the first launch of a specialisation (which compiles) and under the interpreter.

    Returns the compiled kernel's runner that launched (None when this launch compiled or
    interpreted): a caller that knows its next launches have the same specialisation and grid
    may keep it and call ``runner(*args, *config.constexpr_values, stream=handle)`` itself,
    while :func:`current_device` is ``device`` (a mover's hot path: no key to build)."""
    key = (id(kernel), config, device, _specialisation(args, config.is_pointer))  # kernels are module globals: id is stable, and a JITFunction's hash is not free
    runner = _runners.get((key, grid))
    if runner is None:
        compiled = _compiled.get(key)
        if compiled is None:  # the first launch of this specialisation, or the interpreter (never cached)
            if interpreting():
                kernel[grid](*views(), **dict(config.constexprs), num_warps=config.num_warps,
                             num_stages=config.num_stages)
                return None
            with launch_on_index(device, stream):
                _compiled[key] = kernel[grid](*views(), **dict(config.constexprs), num_warps=config.num_warps,
                                              num_stages=config.num_stages)
            return None
        # A compiled kernel's runner reads grid[0..2] (``kernel[grid]`` pads the grid itself, it does not).
        grid3 = (*grid, 1, 1)[:3]
        runner = compiled[grid3]
        runner = _direct_runner(compiled, grid3, runner) or runner
        if len(_runners) >= _RUNNERS_MAX:
            _runners.clear()
        _runners[(key, grid)] = runner
    # the compiled function belongs to ``device``'s context: make it current only when it is not
    if current_device() != device:
        import torch

        with torch.cuda.device(device):
            runner(*args, *config.constexpr_values, stream=stream)
    else:
        runner(*args, *config.constexpr_values, stream=stream)
    return runner


_LAUNCHER_PARAMS = ("gridX", "gridY", "gridZ", "stream", "function")
_LAUNCHER_NAMED = ("kernel_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook")
"""Triton's CUDA launcher (``CompiledKernel.run``) takes ``gridX, gridY, gridZ, stream,
function``, then the packed metadata, the hooks' metadata and the two hooks, named (Triton 3.7
and later) or as the first of ``*args`` (before), then the kernel's arguments: the runner of
``CompiledKernel[grid]`` calls it so in every Triton 3."""


def _direct_runner(compiled: Any, grid3: tuple[int, int, int], runner: Callable[..., None]) -> Callable[..., None] | None:
    """A runner that calls ``compiled``'s launcher itself, skipping what only launch hooks read
    (the runner's closure builds their metadata, a dict, on every launch, and the launcher calls
    the empty hook chains): about 2 us of a 10 us launch. None where the launcher's signature is
    not the one known (another Triton: the runner then launches). While a profiler has installed
    launch hooks (``triton.knobs.runtime``), each launch goes through the runner, hooks and all."""
    import inspect

    try:
        from triton import knobs
    except ImportError:  # Triton before knobs: the runner it has
        return None
    run = getattr(compiled, "run", None)
    function, packed = getattr(compiled, "function", None), getattr(compiled, "packed_metadata", None)
    if run is None or function is None or not hasattr(knobs, "runtime"):
        return None
    try:
        params = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):
        return None
    names, rest = tuple(p.name for p in params[:5]), params[5:]
    named = tuple(p.name for p in rest[:4]) == _LAUNCHER_NAMED
    if names != _LAUNCHER_PARAMS or not rest or not (named or rest[0].kind is inspect.Parameter.VAR_POSITIONAL):
        return None
    runtime = knobs.runtime
    gx, gy, gz = grid3
    refused: list[str] = []

    def direct(*args: Any, stream: int) -> None:
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if refused or _hooked(enter) or _hooked(leave):
            runner(*args, stream=stream)
            return
        try:
            run(gx, gy, gz, stream, function, packed, None, None, None, *args)
        except TypeError as exc:  # the launcher parses its arguments before it launches: nothing ran
            refused.append(str(exc))
            warnings.warn(f"Triton's launcher refused the direct call ({exc}); this kernel launches through its "
                          "compiled runner from now on", RuntimeWarning, stacklevel=2)
            runner(*args, stream=stream)

    return direct


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is installed: a chain with calls in it, or any other callable."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def current_device() -> int:
    """The calling thread's current CUDA device (CuPy's ``cudaGetDevice``: the driver's current
    context, which the launch uses; torch's ``current_device`` costs a microsecond more)."""
    global _get_device
    if _get_device is None:
        import cupy

        _get_device = cupy.cuda.runtime.getDevice
    return _get_device()


_get_device: Callable[[], int] | None = None


__all__ = ["LaunchConfig", "current_device", "launch"]
