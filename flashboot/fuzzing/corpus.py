"""Every reader, built once over one work directory and one seed image."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import FlashBootError
from .campaign import Reader
from .checkpoint_reader import checkpoint_reader, index_reader
from .clone_readers import descriptor_reader, held_reader, manifest_reader, record_reader
from .image_readers import (
    image_reader,
    job_reader,
    lone_rank_reader,
    make_seed_image,
    metadata_reader,
    ready_reader,
)
from .preloader_reader import _Preloader, preloader_reader

READERS = ("metadata", "image", "lone", "job", "ready", "record", "sealed", "manifest", "descriptor", "preloader",
           "checkpoint", "index", "held")


class Corpus:
    """The seed image and every reader over it, in a working directory; :meth:`close` stops the preloader."""

    def __init__(self, work: str | os.PathLike, names=READERS, image_dir: str | os.PathLike | None = None):
        self.work = Path(work)
        image = Path(image_dir) if image_dir is not None else make_seed_image(self.work / "seed")
        self.image_dir = image
        self.preloader: _Preloader | None = None
        self.readers: list[Reader] = []
        for name in names:
            if name == "metadata":
                self.readers.append(metadata_reader(image))
            elif name == "image":
                self.readers.append(image_reader(image, self.work))
            elif name == "lone":
                self.readers.append(lone_rank_reader(image, self.work))
            elif name == "job":
                self.readers.append(job_reader(image, self.work))
            elif name == "ready":
                self.readers.append(ready_reader(self.work))
            elif name == "record":
                self.readers.append(record_reader(image, sealed_garbage=False))
            elif name == "sealed":
                self.readers.append(record_reader(image, sealed_garbage=True))
            elif name == "manifest":
                self.readers.append(manifest_reader(image))
            elif name == "descriptor":
                self.readers.append(descriptor_reader())
            elif name == "checkpoint":
                self.readers.append(checkpoint_reader(self.work))
            elif name == "index":
                self.readers.append(index_reader(self.work))
            elif name == "held":
                self.readers.append(held_reader(self.work))
            elif name == "preloader":
                reader, self.preloader = preloader_reader(image, self.work)
                self.readers.append(reader)
            else:
                raise FlashBootError(f"unknown fuzz reader {name!r}; known: {', '.join(READERS)}")
            self.readers[-1].warm_up()
        self._by_name = dict(zip(names, self.readers))

    def reader(self, name: str) -> Reader:
        """The reader called ``name`` (one of :data:`READERS`)."""
        return self._by_name[name]

    def close(self) -> None:
        if self.preloader is not None:
            self.preloader.close()
            self.preloader = None
