"""FlashLoad, stage by stage (paper sections 3.4-3.5, 3.9), in the order the bytes flow.

``prepack`` (checkpoint -> per-rank images, offline) -> ``staging`` (preloader: disk -> /dev/shm,
``.ready``) -> ``server`` (the served-load daemon; ``service``: its pid file and background run)
-> ``client`` (the engine's side of a served load) / ``stage`` (pin early in the engine) ->
``pipeline`` (``load`` and ``prepare``: one arena filled by a source of ``sources/`` that ``choose``
picks, views, verify; ``landing`` holds the steps every source shares, ``report`` what a load hands
back) -> ``bind`` (a meta module's parameters become views).
``shm`` holds what several stages share: where a rank is staged and its ``.ready`` file.

The public names are re-exported by :mod:`flashboot` (``flashboot.load``, ``flashboot.stage``...).
"""
