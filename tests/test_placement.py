"""Where tensors live: one rule for the whole step (issue 28).

A rank's received activations and gradients, the loss, metrics, its part of the batch and the
targets live where its stages' parameters are, or on ``Pipeline(device=...)``; a rank whose
stages have no parameters uses ``device=`` (else the process group backend's device).

On a CPU-only machine the meta device stands in for a second device: with every parameter on
meta and ``device="meta"``, a step runs without data, and a dispatch mode records every tensor
an operation makes off meta. The only ones allowed are the views that split the caller's CPU
batch into microbatches before each microbatch is moved, and the draw of the step's seed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import funcpipe as fp
from funcpipe.schedule.generators import generate
from tests import jobs_precision as J

SPLITTING = {"aten.slice.Tensor", "aten.split.Tensor", "aten.split_with_sizes.default"}
# the step's random seed, one int drawn from torch's CPU generator on the host (step(seed=None);
# funcpipe.stages.keys.draw_seed): a host value, never data on a device
SPLITTING |= {"aten.randint.low"}


class OffMeta(TorchDispatchMode):
    """Records every operation whose output is a tensor that is not on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.seen.add(str(func))
        return out


def _free(params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h * 2  # a stage without parameters


def _with_mask(params: dict[str, torch.Tensor], h: torch.Tensor, *, mask: torch.Tensor) -> Any:
    return J.layer(params, h) * mask


RANKS = {"gpipe": 3, "1f1b": 3, "zb-h1": 3, "zbv": 2, "dualpipev": 2, "chimera": 4}


@pytest.mark.parametrize("name", list(RANKS))
def test_nothing_leaves_the_device_it_was_told(name: str) -> None:
    """A parameter-less stage in the middle, a side input and tied weights on the last stage,
    targets and a metric."""
    program = generate(name, ranks=RANKS[name], microbatches=4)
    n = len(set(program.replica_of)) if program.replica_of else program.n_stages
    stages = [fp.Stage(J.layer, name=f"l{k}") for k in range(n)]
    params = [{k: v.to("meta") for k, v in p.items()} for p in J.params(n, torch.float32)]
    stages[1], params[1] = fp.Stage(_free, name="free"), {}  # a parameter-less stage
    stages[-1] = fp.Stage(_with_mask, name="masked")  # a side input
    x, y = J.batch(8, torch.float32)
    owners = program.replica_of or tuple(range(program.n_stages))
    pipe = fp.Pipeline(
        stages,
        program,
        loss_fn=J.mse,
        metric_fn=J.mse,
        side_inputs={s: ["mask"] for s, o in enumerate(owners) if o == n - 1},
        ties={"w": [(0, "w"), (n - 1, "w")]},
        device="meta",
    )
    batch = {"inputs": x, "mask": torch.ones(8, J.D)}
    with OffMeta() as watch:
        result = pipe.step(params, batch, y)
    assert watch.seen <= SPLITTING, watch.seen - SPLITTING
    assert result.loss.device.type == "meta" and result.metric.device.type == "meta"
    for g in result.grads:
        assert all(v.device.type == "meta" for v in g.values())


def test_meta_params_need_device_meta() -> None:
    """Without device="meta", a meta parameter is a placeholder for another rank's stage."""
    program = generate("1f1b", ranks=2, microbatches=2)
    params = [{k: v.to("meta") for k, v in p.items()} for p in J.params(2, torch.float32)]
    pipe = fp.Pipeline([fp.Stage(J.layer)] * 2, program, loss_fn=J.mse)
    with pytest.raises(fp.InvalidArgument, match="meta device"):
        pipe.step(params, *J.batch(4, torch.float32))
