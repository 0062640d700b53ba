"""Refit: new weights from a trainer into running engines, in place, at copy speed.

Trainer side, :func:`publish` packs named tensors into an arena laid out as the engines' image
(one kernel launch) and publishes it as a FlashClone seed with a version; engine side,
``LoadedImage.refit`` (:func:`refit`) copies it under the live views, atomically by default.
"""

from .engine import RefitError, RefitReport, refit
from .plan import PackPlan, PublishError, plan_pack
from .publish import PublishReport, Publisher, publish

__all__ = ["PackPlan", "PublishError", "PublishReport", "Publisher", "RefitError", "RefitReport", "plan_pack",
           "publish", "refit"]
