"""``funcpipe.plan(...)``: predict one layout, or search for the best."""

from __future__ import annotations

from typing import Any

from funcpipe.errors import InvalidArgument
from funcpipe.planner.calibration import DEFAULT, Calibration
from funcpipe.planner.cluster import Cluster, cluster
from funcpipe.planner.estimate import Estimate, estimate
from funcpipe.planner.layout import ClusterLayout, check_gpus
from funcpipe.planner.model import Transformer
from funcpipe.planner.pipeline import simulable
from funcpipe.planner.search import search

__all__ = ["plan"]


def plan(
    model: Transformer,
    *,
    gpus: int,
    global_batch: int,
    gpu: str | Cluster = "h100-sxm",
    layout: ClusterLayout | None = None,
    top: int = 1,
    calibration: Calibration = DEFAULT,
    overlap_grad_reduce: bool = True,
    **space: Any,
) -> list[Estimate]:
    """Predict ``model``'s training step on ``gpus`` GPUs of ``gpu`` (a preset name of
    :data:`funcpipe.planner.GPUS` or a :class:`~funcpipe.planner.Cluster`).

    With ``layout`` given: a one-element list, that layout priced with the simulator (it may not
    fit: see ``fits``), or with the closed form when its program would be longer than
    :data:`~funcpipe.planner.pipeline.MAX_SIMULATED` (``simulated`` is then ``False``).
    Without: the ``top`` fastest layouts that fit, best first (:func:`funcpipe.planner.search`;
    ``space`` narrows it). ``global_batch`` is in sequences. At most
    :data:`~funcpipe.planner.layout.MAX_GPUS` GPUs.
    """
    if not isinstance(model, Transformer):
        raise InvalidArgument(f"plan(model={model!r}): pass a funcpipe.planner.Transformer")
    for name, value in (("gpus", gpus), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"plan({name}={value!r}): a positive integer")
    check_gpus(gpus, "plan")
    where = cluster(gpu)
    if layout is not None:
        if layout.gpus != gpus:
            raise InvalidArgument(
                f"plan(gpus={gpus}, layout={layout.short()!r}): the layout has "
                f"{layout.gpus} GPUs; make tensor x pipeline x data equal gpus"
            )
        p, v = layout.pipeline, layout.interleave
        m = global_batch // (layout.data * layout.microbatch)  # checked by estimate
        return [
            estimate(
                model,
                where,
                layout,
                global_batch=global_batch,
                calibration=calibration,
                simulate=simulable(p, m, v),
                overlap_grad_reduce=overlap_grad_reduce,
            )
        ]
    return search(
        model,
        where,
        gpus=gpus,
        global_batch=global_batch,
        calibration=calibration,
        top=top,
        overlap_grad_reduce=overlap_grad_reduce,
        **space,
    )
