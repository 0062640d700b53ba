"""Where a load's bytes come from, one module per source: ``served`` (the preloader daemon copies
into the arena), ``pinned`` (the staged image pinned in this process), ``disk`` (the image file
streamed through a bounded ring). Each offers the same steps to :mod:`flashboot.flashload.pipeline`:
the plain load's copy, :func:`flashboot.prepare`'s early copy (``start_prepared``), its check
(``verify_prepared``) and what a prepared load reports about it (``report_prepared``).
Sources import neither each other nor :mod:`flashboot.flashload.choose`."""
