"""funcpipe: pure-functional pipeline-parallel training for PyTorch.

Stages are pure functions ``stage(params, *inputs) -> outputs`` over explicit params pytrees;
parameters, gradients and optimizer state are values that go in and come out.
"""

from funcpipe import parallel, planner, schedule, testing
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

# tensor parallelism (mesh, autograd-correct collectives, sharding specs, ops)
from funcpipe.parallel import ParallelConfig, build_mesh, shard_spec
from funcpipe.pipeline.microbatch import merge, microbatch_sizes, split
from funcpipe.pipeline.pipeline import Pipeline, StepResult
from funcpipe.pipeline.reference import reference_step

# the cluster planner (pure Python, no torch): funcpipe.plan(...) predicts or searches layouts;
# the package is funcpipe.planner (search, estimate, Transformer, ClusterLayout ...)
from funcpipe.planner import plan
from funcpipe.stages.compile import compile_stage
from funcpipe.stages.partition import Partition, partition
from funcpipe.stages.precision import autocast_stage
from funcpipe.stages.shapes import StageSpec, TensorSpec, infer_specs
from funcpipe.stages.split_module import ModuleSplit, split_module
from funcpipe.stages.stage import Stage, as_inputs, compose, from_module
from funcpipe.stages.tally import tally
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
    "ParallelConfig",
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
    "build_mesh",
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
    "parallel",
    "partition",
    "plan",
    "planner",
    "profile",
    "profile_stages",
    "reference_step",
    "schedule",
    "shard_spec",
    "split",
    "split_module",
    "tally",
    "testing",
    "token_cross_entropy",
    "tune",
]
