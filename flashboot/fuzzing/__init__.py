"""Fuzzing the trust boundaries: seeded mutation campaigns over every reader of outside bytes.

Each :class:`Reader` takes one kind of outside input (``metadata.json``, ``prepack.json``, an
image directory, a ``.ready`` file, a rendezvous record, a manifest, an arena descriptor, a
preloader request with its fds), starts from real seeds (a tiny Qwen3-MoE pre-pack, a real
arena, a real preloader) and is fed mutations of them. The contract, checked on every input:

* it parses into a valid object (``parsed``; then the reader's own invariants are checked again,
  independently of the reader: an object that breaks one is ``wrong``), or
* it is refused with a :class:`~flashboot.errors.FlashBootError` (``refused``);
* anything else is a ``crash``: another exception, an fd or a mapping left open, a view that
  reaches outside its image, a reply that names no FlashBoot error.

Mutations are structural (a field deleted, retyped, set to a huge, negative, non-finite or
deeply nested value, swapped with another field, renamed) on the parsed JSON, and byte-level
(truncation, a flipped or non-UTF-8 byte, a spliced slice) on the text. Everything is seeded:
``run_campaign(readers, n, seed)`` tries the same inputs on every run.

``python -m flashboot.fuzzing --inputs N`` (``make fuzz``) runs a long campaign and prints the
counts per reader; ``--atheris`` drives the byte-level readers with atheris' coverage-guided
mutator instead (one process per reader).
"""

from .campaign import (
           Counts,
           Finding,
           LeakProbe,
           Outcome,
           Reader,
           format_counts,
           run_campaign,
)
from .corpus import READERS, Corpus
from .image_readers import fuzz_work_dir, make_seed_image
from .mutate import mutate_bytes, mutate_document, mutate_json

__all__ = ["READERS", "Corpus", "Counts", "Finding", "LeakProbe", "Outcome", "Reader", "format_counts",
           "fuzz_work_dir", "make_seed_image", "mutate_bytes", "mutate_document", "mutate_json", "run_campaign"]
