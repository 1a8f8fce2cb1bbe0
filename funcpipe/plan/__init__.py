"""Plan a transformer's parallel layout on a GPU cluster: predict step time, MFU and memory per
GPU for any (tensor, pipeline, data, microbatch, interleave, recompute, sequence parallel,
schedule) layout, and search for the best one. Pure Python: no torch, no process group.

See docs/planner.md. The package is callable: ``funcpipe.plan(...)`` is
:func:`funcpipe.plan.api.plan`.
"""

import sys
import types
from typing import Any

from funcpipe.plan.api import plan
from funcpipe.plan.calibration import DEFAULT as DEFAULT_CALIBRATION
from funcpipe.plan.calibration import Calibration
from funcpipe.plan.cluster import GPU, GPUS, Cluster, Link, cluster
from funcpipe.plan.estimate import Estimate, estimate
from funcpipe.plan.layout import RECOMPUTE, SCHEDULES, Layout
from funcpipe.plan.model import Transformer
from funcpipe.plan.search import candidates, search

__all__ = [
    "DEFAULT_CALIBRATION",
    "GPU",
    "GPUS",
    "RECOMPUTE",
    "SCHEDULES",
    "Calibration",
    "Cluster",
    "Estimate",
    "Layout",
    "Link",
    "Transformer",
    "candidates",
    "cluster",
    "estimate",
    "plan",
    "search",
]


class _CallablePackage(types.ModuleType):
    """Lets ``funcpipe.plan(...)`` call :func:`funcpipe.plan.api.plan` while ``funcpipe.plan``
    stays the package (``import funcpipe.plan as p``, ``from funcpipe.plan import search``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[Estimate]:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
