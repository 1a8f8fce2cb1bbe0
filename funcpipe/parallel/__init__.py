"""Tensor parallelism: mesh, autograd-correct collectives, sharding specs and sharded ops.

- :mod:`~funcpipe.parallel.mesh`: :class:`ParallelConfig` (pure validation), :func:`build_mesh`,
  :class:`Mesh` / :class:`Axis` / :class:`Place`.
- :mod:`~funcpipe.parallel.sharding`: :class:`Sharding`, :class:`OpSharding` (shard and gather);
  ``Layout`` / ``OpLayout`` and :mod:`funcpipe.parallel.layout` are their old names.
- :mod:`~funcpipe.parallel.collectives`: the forward/backward pairs and :func:`count_bytes`.
- :mod:`~funcpipe.parallel.spec`: :func:`shard_spec`, an einops pattern plus a mesh map; its
  :class:`Collectives` table (``Plan`` / ``PlanRow`` are the old names).
- :mod:`~funcpipe.parallel.ops` (1D, vocab, sequence, ring attention) and
  :mod:`~funcpipe.parallel.summa` (2D, 2.5D, 3D): the ops, used as ``ops.row_parallel_linear``.
"""

from funcpipe.parallel import ops, summa
from funcpipe.parallel.collectives import (
    ByteCounter,
    Record,
    all_gather,
    all_reduce,
    all_reduce_max,
    broadcast,
    copy_to_group,
    count_bytes,
    gather_from_group,
    reduce_from_group,
    reduce_scatter,
    reduce_to,
    ring_shift,
    ring_volume,
    split_to_group,
)
from funcpipe.parallel.mesh import MODES, Axis, Mesh, ParallelConfig, Place, build_mesh
from funcpipe.parallel.sharding import OpSharding, Sharding, gather_tree, shard_tree
from funcpipe.parallel.spec import CollectiveRow, Collectives, ShardSpec, shard_spec

# the old names, for old code: a tensor's layout over the mesh is now its sharding, and "plan"
# means only the cluster planner
Layout = Sharding
OpLayout = OpSharding
Plan = Collectives
PlanRow = CollectiveRow

__all__ = [
    "MODES",
    "Axis",
    "ByteCounter",
    "CollectiveRow",
    "Collectives",
    "Layout",
    "Mesh",
    "OpLayout",
    "OpSharding",
    "ParallelConfig",
    "Place",
    "Plan",
    "PlanRow",
    "Record",
    "ShardSpec",
    "Sharding",
    "all_gather",
    "all_reduce",
    "all_reduce_max",
    "broadcast",
    "build_mesh",
    "copy_to_group",
    "count_bytes",
    "gather_from_group",
    "gather_tree",
    "ops",
    "reduce_from_group",
    "reduce_scatter",
    "reduce_to",
    "ring_shift",
    "ring_volume",
    "shard_spec",
    "shard_tree",
    "split_to_group",
    "summa",
]
