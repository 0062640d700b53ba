"""Shared by tests that edit a pre-packed image on purpose. Not a conftest (tests import it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def rewrite_metadata(rank_dir, meta: dict) -> None:
    """Write ``meta`` as ``rank_dir/metadata.json`` and re-record its sha256 in the job's
    ``prepack.json`` (when ``rank_dir`` has one above it), as a consistent re-pre-pack would (and
    drop ``tensors.bin``, whose columns were bound to the old bytes): a
    test that means to reach the strict reader behind the digest check uses this; a plain write
    is refused by the digest check first."""
    rank_dir = Path(rank_dir)
    raw = json.dumps(meta).encode()
    (rank_dir / "metadata.json").write_bytes(raw)
    (rank_dir / "tensors.bin").unlink(missing_ok=True)  # its columns were bound to the old bytes: JSON-only now
    job_path = rank_dir.parent / "prepack.json"
    if job_path.is_file():
        job = json.loads(job_path.read_text())
        for entry in job["ranks"]:
            if entry["dir"] == rank_dir.name:
                entry["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
        job_path.write_text(json.dumps(job))
