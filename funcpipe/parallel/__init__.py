"""Tensor parallelism: mesh, autograd-correct collectives, sharding specs and sharded ops.

- :mod:`~funcpipe.parallel.mesh`: :class:`ParallelConfig` (pure validation), :func:`build_mesh`,
  :class:`Mesh` / :class:`Axis` / :class:`Place`.
- :mod:`~funcpipe.parallel.layout`: :class:`Layout`, :class:`OpLayout` (shard and gather).
- :mod:`~funcpipe.parallel.collectives`: the forward/backward pairs and :func:`count_bytes`.
- :mod:`~funcpipe.parallel.spec`: :func:`shard_spec`, an einops pattern plus a mesh map.
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
from funcpipe.parallel.layout import Layout, OpLayout, gather_tree, shard_tree
from funcpipe.parallel.mesh import MODES, Axis, Mesh, ParallelConfig, Place, build_mesh
from funcpipe.parallel.spec import Plan, PlanRow, ShardSpec, shard_spec

__all__ = [
    "MODES",
    "Axis",
    "ByteCounter",
    "Layout",
    "Mesh",
    "OpLayout",
    "ParallelConfig",
    "Place",
    "Plan",
    "PlanRow",
    "Record",
    "ShardSpec",
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
