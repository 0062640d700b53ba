"""FlashClone: replicate a resident arena GPU->GPU by mapping it, with no NCCL communicator.

A **seed** (:func:`seed`) holds the weights in an arena, exports it once, publishes its
:class:`~flashboot.flashclone.manifest.Manifest` and descriptor to the rendezvous store and stays passive.
A **clone** (:func:`clone`) checks the manifest and the token, takes a position by arrival order,
creates its own arena (and a small flags arena), maps its source's arena and copies it with a
registry mover, following a plan from :mod:`flashboot.schedulers`:

* ``star``: every clone reads every chunk from the seed;
* ``chain``: clone k reads from clone k-1 (the seed for k = 1), chunk by chunk, each chunk as
  soon as its predecessor's flag says it is in place, so all links run at once;
* ``ring``: N members each load a 1/N byte shard of a host image, then gather the rest from their
  predecessor (:func:`ring_load`, or ``clone(schedule="ring", image=..., clones=N)``).

Transport (:mod:`flashboot.flashclone.transports`, one module each, registered with what they
reach, which memory they move and what they cost to set up): ``posix_fd`` maps the source's arena
by POSIX fds taken with ``pidfd_getfd`` on the same host; ``fabric`` by fabric handles across the
hosts of an NVLink domain with IMEX; ``nixl`` READs it through a NIXL agent from any host (a seed
started with ``nixl=True``; ``pip install flashboot[nixl]``); ``nccl`` has the seed broadcast it
over torch.distributed (gloo on the host backend). ``auto`` takes the first that reaches the seed
in that order; the report's ``transport`` says which, and ``transport_note`` why.

The early call: :func:`prepare_clone` starts the one-time costs a clone can pay before it knows
its source (the CUDA context, the copy engine's first stream, the checksum kernel...) in a background thread;
``clone(..., prepared=...)`` joins it. The CLI's ``flashboot clone`` makes it first thing.

Faults: every wait has a deadline. A source that exits (or stalls) mid-transfer stops the run with
a named error; with ``retry=True`` (default) the clone re-attaches upstream (the source's own
source), or to another clone that holds the whole image, or to the host image (``image=``), and
finishes; otherwise it releases what it mapped and raises.

Where the store lives: in a process of its own (``flashboot store HOST:PORT``,
:class:`StoreServer`) or any TCPStore the caller already runs (torchrun's), so a seed that dies
takes only its own records with it. A clone that holds every byte when the store disappears
keeps its weights and says so in ``report.warnings``; one that does not finishes from ``image=``
when given, else raises naming the step.
"""

from .._lazy import lazy_getattr

# Imported on first use: a process that needs one piece (a restart asking the holder, a store)
# does not import the clone's machinery (executor, schedulers, transports: ~20 ms of Python).
# No module is named after a function it exports (the import system would set the package's
# attribute to the module once anyone imported it by path): clone() lives in cloning.py.
_LAZY = {
    "clone": "flashboot.flashclone.cloning",
    "linger": "flashboot.flashclone.cloning",
    "CloneError": "flashboot.flashclone.report",
    "CloneReport": "flashboot.flashclone.report",
    "CloneResult": "flashboot.flashclone.report",
    "ring_load": "flashboot.flashclone.ring",
    "Seed": "flashboot.flashclone.seeding",
    "seed": "flashboot.flashclone.seeding",
    "StoreServer": "flashboot.flashclone.store",
    "serve_store": "flashboot.flashclone.store",
    "CloneWarmup": "flashboot.flashclone.warmup",
    "prepare_clone": "flashboot.flashclone.warmup",
}

__getattr__ = lazy_getattr("flashboot.flashclone", _LAZY, globals())

__all__ = ["CloneError", "CloneReport", "CloneResult", "CloneWarmup", "Seed", "StoreServer", "clone", "linger",
           "prepare_clone", "ring_load", "seed", "serve_store"]
