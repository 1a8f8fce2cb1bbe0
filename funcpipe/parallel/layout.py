"""The old path of :mod:`funcpipe.parallel.sharding`, kept so that old code still imports.

A tensor's layout over the mesh is now called its sharding: ``Layout`` is
:class:`~funcpipe.parallel.sharding.Sharding` and ``OpLayout`` is
:class:`~funcpipe.parallel.sharding.OpSharding` (the same classes, under their old names).
"""

from __future__ import annotations

from funcpipe.parallel.sharding import OpSharding, Sharding, gather_tree, shard_tree

Layout = Sharding
OpLayout = OpSharding

__all__ = ["Layout", "OpLayout", "OpSharding", "Sharding", "gather_tree", "shard_tree"]
