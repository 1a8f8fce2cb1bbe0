"""funcpipe: pure-functional pipeline-parallel training for PyTorch.

Stages are pure functions ``stage(params, *inputs) -> outputs`` over explicit params pytrees;
parameters, gradients and optimizer state are values that go in and come out.
"""

from funcpipe import data, loss_scale, optim, profile, schedule, testing, tune
from funcpipe.compile import compile_stage
from funcpipe.cut import ModuleSplit, split_module
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
from funcpipe.launcher import Pool, launch
from funcpipe.microbatch import merge, microbatch_sizes, split
from funcpipe.partition import Partition, partition
from funcpipe.pipeline import Pipeline, StepResult
from funcpipe.precision import autocast_stage
from funcpipe.profile import measure_memory, measure_stages, profile_stages
from funcpipe.reference import reference_step
from funcpipe.shapes import StageSpec, TensorSpec, infer_specs
from funcpipe.sharing import describe_ties, find_ties
from funcpipe.stage import Stage, as_inputs, compose, from_module

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
    "tune",
]

# tensor parallelism (mesh, autograd-correct collectives, sharding specs, ops): funcpipe.parallel
from funcpipe import parallel
from funcpipe.parallel import ParallelConfig, build_mesh, shard_spec

__all__ += ["ParallelConfig", "build_mesh", "parallel", "shard_spec"]

# the cluster planner (pure Python, no torch): the package is callable, funcpipe.plan(...) is
# funcpipe.plan.api.plan; funcpipe.plan.search, .estimate, .Transformer, .Layout ... beside it
from funcpipe import plan  # noqa: E402

__all__ += ["plan"]
