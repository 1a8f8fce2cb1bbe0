"""The communicators point-to-point messages travel on are the ones the checker models (issue
32): one process group per pair of ranks that exchange messages, every message of a pair on it.
Recorded in real multi-process steps over gloo with torch.distributed's send and receive, the
one message path."""

from __future__ import annotations

import pytest

from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule.generators import GENERATORS
from funcpipe.schedule.p2p import PAIR
from tests import jobs_strict


@pytest.mark.timeout(600)
def test_every_message_of_every_schedule_travels_on_its_pairs_process_group(pool) -> None:
    assert Pipeline.p2p_layout == PAIR  # the layout each program is checked under
    names = sorted(GENERATORS)
    results = pool(4).run(jobs_strict.p2p_process_groups, names)
    for rank, per_name in enumerate(results):
        for name in names:
            worst, peers, seen = per_name[name]
            assert worst < 1e-10, (name, rank, worst)
            assert seen or not peers, (name, rank)  # every rank with peers sent or received
            groups = {ranks for _, ranks in seen}
            # the model: a process group of exactly this rank and one peer per message
            assert groups <= {tuple(sorted((rank, p))) for p in peers}, (name, rank, groups)
            assert all(len(g) == 2 for g in groups), (name, rank, groups)
