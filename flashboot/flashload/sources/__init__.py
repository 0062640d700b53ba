"""Where a load's bytes come from, one module per source, each registering a
:class:`~flashboot.flashload.sources.base.Source` with
:func:`~flashboot.flashload.sources.base.register_source`: ``served`` (the preloader daemon copies
into the arena), ``disk`` (the image file streamed through a bounded ring), ``pinned`` (the staged
image pinned in this process). A source says whether it fits a load (``offer``), starts
:func:`flashboot.prepare`'s early copy (``start_prepared``), checks it (``verify_prepared``) and
says what a prepared load reports about it (``report_prepared``). Sources import neither each
other nor :mod:`flashboot.flashload.choose`; a new source is one more module imported here.
"""

from . import disk, pinned, served  # noqa: F401  (each registers its source)
from .base import Offer, Source, register_source, registered_sources, source_for_mode

__all__ = ["Offer", "Source", "register_source", "registered_sources", "source_for_mode"]
