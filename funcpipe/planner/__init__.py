"""Plan a transformer's parallel layout on a GPU cluster: predict step time, MFU, tokens/s and
memory per GPU for any (tensor, pipeline, data, expert, microbatch, interleave, recompute,
sequence parallel, schedule, sharding) layout of a dense model or a mixture of experts, and
search for the best one. Pure Python: no torch, no process group.

See docs/planner.md. ``funcpipe.plan(...)`` is :func:`funcpipe.planner.api.plan`; everything else is here
(``from funcpipe.planner import estimate``).
"""

from funcpipe.planner.api import plan
from funcpipe.planner.calibration import DEFAULT as DEFAULT_CALIBRATION
from funcpipe.planner.calibration import Calibration
from funcpipe.planner.cluster import GPU, GPUS, Cluster, Link, cluster
from funcpipe.planner.estimate import Estimate, estimate
from funcpipe.planner.layout import RECOMPUTE, SCHEDULES, ZERO, ClusterLayout
from funcpipe.planner.model import MLPS, Transformer
from funcpipe.planner.search import candidates, search

__all__ = [
    "DEFAULT_CALIBRATION",
    "GPU",
    "GPUS",
    "MLPS",
    "RECOMPUTE",
    "SCHEDULES",
    "ZERO",
    "Calibration",
    "Cluster",
    "ClusterLayout",
    "Estimate",
    "Link",
    "Transformer",
    "candidates",
    "cluster",
    "estimate",
    "plan",
    "search",
]
