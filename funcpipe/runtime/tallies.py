"""A rank's tallies at the end of its step: summed over the processes that ran the same stage.

Each forward's :func:`funcpipe.stages.tally.tally` values are collected per owner stage (the
model stage whose params ran: Chimera's replicas share one). Once the rank's reductions are
done, :func:`reduce_tallies` sums each owner's tallies over the data copies (the transport
group ``RankInputs.tally_group``) and then, for a stage the program replicates on other ranks
(Chimera), over those ranks (the in-program group ``replica:<owner>``); one collective after
the other on the same tensors, each waited before the next is posted (a group a rank is alone
in is a no-op). In one process (``tally_group`` None) nothing is posted: the Pipeline sums
every rank's.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from funcpipe.runtime.pending import wait_for
from funcpipe.runtime.rank_io import RankInputs, RankResult
from funcpipe.runtime.transport_common import Handle, Transport

__all__ = ["reduce_tallies"]


def reduce_tallies(
    transport: Transport,
    by_owner: dict[int, dict[str, torch.Tensor]],
    x: RankInputs,
    result: RankResult,
) -> Generator[Handle, None, None]:
    """Sum ``by_owner``'s tallies over the copies and the replicas, into ``result.tallies``."""
    p = x.program
    owners = p.replica_of or ()
    replicated = {o for o in owners if owners.count(o) > 1}
    for o in sorted(by_owner):
        names = sorted(by_owner[o])
        tensors = [by_owner[o][k] for k in names]
        if tensors and x.tally_group is not None:
            yield from wait_for(transport.all_reduce(tensors, x.tally_group))
            if o in replicated:
                yield from wait_for(transport.all_reduce(tensors, f"replica:{o}"))
        for k, t in zip(names, tensors, strict=True):
            got = result.tallies.get(k)
            result.tallies[k] = t if got is None else got + t
