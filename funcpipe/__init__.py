"""funcpipe: pure-functional pipeline-parallel training for PyTorch.

Stages are pure functions ``stage(params, *inputs) -> outputs`` over explicit params pytrees;
parameters, gradients and optimizer state are values that go in and come out.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# Old module paths (before the regrouping of 2026-11-28, docs/design.md "The tree") keep working:
# ``import funcpipe.train.optim`` or ``from funcpipe.cut import split_module`` gives the module at its
# new place, the very same object (so classes, isinstance checks and monkeypatches agree).
_MOVED = {
    "funcpipe.checkpoint": "funcpipe.train.checkpoint",
    "funcpipe.cli_plan": "funcpipe.cli.plan",
    "funcpipe.cli_schedule": "funcpipe.cli.schedule",
    "funcpipe.compile": "funcpipe.stages.compile",
    "funcpipe.cut": "funcpipe.stages.split_module",
    "funcpipe.data": "funcpipe.train.data",
    "funcpipe.demo": "funcpipe.cli.demo",
    "funcpipe.groups": "funcpipe.distributed.groups",
    "funcpipe.launcher": "funcpipe.distributed.launcher",
    "funcpipe.loss_scale": "funcpipe.train.loss_scale",
    "funcpipe.microbatch": "funcpipe.pipeline.microbatch",
    "funcpipe.optim": "funcpipe.train.optim",
    "funcpipe.partition": "funcpipe.stages.partition",
    "funcpipe.precision": "funcpipe.stages.precision",
    "funcpipe.profile": "funcpipe.measure.profile",
    "funcpipe.reference": "funcpipe.pipeline.reference",
    "funcpipe.runtime.plan": "funcpipe.stages.boundaries",
    "funcpipe.runtime.strict": "funcpipe.runtime.nccl_rules",
    "funcpipe.shapes": "funcpipe.stages.shapes",
    "funcpipe.sharing": "funcpipe.stages.ties",
    "funcpipe.stage": "funcpipe.stages.stage",
    "funcpipe.throughput": "funcpipe.train.throughput",
    "funcpipe.ties": "funcpipe.stages.ties",
    "funcpipe.tour": "funcpipe.cli.tour",
    "funcpipe.tune": "funcpipe.measure.tune",
    "funcpipe.validate": "funcpipe.pipeline.checks",
    "funcpipe.world": "funcpipe.distributed.world",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of :data:`_MOVED` and loads it as the module at its new place."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(_MOVED[spec.name])
        self._spec = module.__spec__  # the import system overwrites it; exec_module restores it
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self._spec


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

from funcpipe import schedule, testing
from funcpipe.distributed.launcher import Pool, launch
from funcpipe.errors import (
    CommunicationError,
    FuncpipeError,
    InvalidArgument,
    NonFiniteError,
    RankFailed,
    ScheduleError,
    ShapeInferenceError,
    ShapeInferenceWarning,
)
from funcpipe.measure import profile, tune
from funcpipe.measure.profile import measure_memory, measure_stages, profile_stages
from funcpipe.pipeline.microbatch import merge, microbatch_sizes, split
from funcpipe.pipeline.pipeline import Pipeline, StepResult
from funcpipe.pipeline.reference import reference_step
from funcpipe.stages.compile import compile_stage
from funcpipe.stages.partition import Partition, partition
from funcpipe.stages.precision import autocast_stage
from funcpipe.stages.shapes import StageSpec, TensorSpec, infer_specs
from funcpipe.stages.split_module import ModuleSplit, split_module
from funcpipe.stages.stage import Stage, as_inputs, compose, from_module
from funcpipe.stages.ties import describe_ties, find_ties
from funcpipe.train import data, loss_scale, optim
from funcpipe.train.losses import token_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "CommunicationError",
    "FuncpipeError",
    "InvalidArgument",
    "ModuleSplit",
    "NonFiniteError",
    "Partition",
    "Pipeline",
    "Pool",
    "RankFailed",
    "ScheduleError",
    "ShapeInferenceError",
    "ShapeInferenceWarning",
    "Stage",
    "StageSpec",
    "StepResult",
    "TensorSpec",
    "__version__",
    "as_inputs",
    "autocast_stage",
    "compile_stage",
    "compose",
    "data",
    "describe_ties",
    "find_ties",
    "from_module",
    "infer_specs",
    "launch",
    "loss_scale",
    "measure_memory",
    "measure_stages",
    "merge",
    "microbatch_sizes",
    "optim",
    "partition",
    "profile",
    "profile_stages",
    "reference_step",
    "schedule",
    "split",
    "split_module",
    "testing",
    "token_cross_entropy",
    "tune",
]

# tensor parallelism (mesh, autograd-correct collectives, sharding specs, ops): funcpipe.parallel
from funcpipe import parallel
from funcpipe.parallel import ParallelConfig, build_mesh, shard_spec

__all__ += ["ParallelConfig", "build_mesh", "parallel", "shard_spec"]

# the cluster planner (pure Python, no torch): funcpipe.plan(...) predicts or searches layouts;
# the package is funcpipe.planner (search, estimate, Transformer, ClusterLayout ...). The old
# package path funcpipe.plan.X names it too, while funcpipe.plan itself stays the function.
from funcpipe import planner
from funcpipe.planner import plan

sys.modules.setdefault("funcpipe.plan", planner)
_PLANNER = "api calibration cluster comm compute estimate layout model pipeline published search"
_MOVED.update({f"funcpipe.plan.{m}": f"funcpipe.planner.{m}" for m in _PLANNER.split()})

__all__ += ["plan", "planner"]

# Old paths of modules already loaded are entered now, and named on their parent package as a
# submodule would be (``import funcpipe.launcher; funcpipe.launcher.launch``) unless that name is
# taken: importing them later then leaves the package's attributes alone (``funcpipe.partition``
# stays the function, not the module).
for _old, _new in _MOVED.items():
    if _new in sys.modules:
        sys.modules.setdefault(_old, sys.modules[_new])
        _parent, _, _leaf = _old.rpartition(".")
        if not hasattr(sys.modules[_parent], _leaf):
            setattr(sys.modules[_parent], _leaf, sys.modules[_new])
