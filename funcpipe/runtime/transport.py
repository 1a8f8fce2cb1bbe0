"""Transports: how the interpreter moves tensors between ranks.

Two implementations of one small interface:

- :class:`LocalWorld` / :class:`LocalTransport`: every rank in this process. Messages go through
  per-pair FIFO mailboxes and are copied into the receiver's buffers, exactly as over a wire.
- :class:`DistTransport`: ``torch.distributed`` point-to-point (gloo on CPU, NCCL on CUDA) and
  collectives over named process groups: the one path of every multi-process run, so a CPU test
  sends over the same calls and groups as a GPU run (docs/design.md, "One message path").

Point-to-point goes through one call, :meth:`Transport.post`: a sequence of :class:`P2P` sends and
receives posted together, one :class:`Handle` per operation. Both transports have the
communicator layout :data:`funcpipe.schedule.p2p.PAIR` (``.layout``), the one the checker models:
the operations of a group with one peer are one batch on that pair's queue (over
torch.distributed: one ``batch_isend_irecv`` on the pair's process group, even for a single
operation); a group with several peers is one batch per peer, posted in the order of their first
operations. A send's handle is done once its tensors may be released; the transport keeps a send
only until then (``held_bytes``, ``peak_held_bytes``).

Receives fill buffers the receiver allocated from its own shape inference: no metadata and no
pickled objects travel, only tensors.

This module names them all; they live in :mod:`funcpipe.runtime.transport_common` (the
interface and what both share), :mod:`funcpipe.runtime.transport_local` and
:mod:`funcpipe.runtime.transport_dist`.
"""

from __future__ import annotations

from funcpipe.runtime.transport_common import (
    DONE,
    P2P,
    RECV,
    SEND,
    STRICT_ENV,
    Handle,
    Transport,
    by_peer,
    post_by_peer,
    strict_from_env,
)
from funcpipe.runtime.transport_dist import DistTransport
from funcpipe.runtime.transport_local import LocalTransport, LocalWorld

__all__ = [
    "DONE",
    "P2P",
    "RECV",
    "SEND",
    "STRICT_ENV",
    "DistTransport",
    "Handle",
    "LocalTransport",
    "LocalWorld",
    "Transport",
    "by_peer",
    "post_by_peer",
    "strict_from_env",
]
