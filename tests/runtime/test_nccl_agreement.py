"""The NCCL model of the checker and the strict transport agree: a lowered program, randomly
re-grouped and with receives moved, that ``check(..., p2p="nccl", layout=Pipeline.p2p_layout)``
accepts runs under the strict transport (FUNCPIPE_STRICT_P2P=1) to the reference gradients,
and one it rejects is stopped by the strict transport with a CommunicationError (never a hang).
At 3 and 4 ranks a group can join messages to two peers: both post it as one batch per peer,
each on its pair's queue (the layout ``"pair"``: a process group per pair of ranks)."""

from __future__ import annotations

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

import funcpipe as fp
from funcpipe.errors import CommunicationError, ScheduleError
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule import check
from funcpipe.schedule.ir import COMM_OPS, Instr, Op, Program
from funcpipe.testing import assert_trees_close
from tests.jobs_runtime import data, mse, toy


def _fix_groups(instrs: list[Instr]) -> list[Instr]:
    """Drop ``joined`` where it no longer follows a SEND/RECV."""
    out: list[Instr] = []
    for i in instrs:
        if i.joined and not (out and out[-1].op in COMM_OPS):
            i = i.join(False)
        out.append(i)
    return out


@st.composite
def _mutated(draw: st.DrawFn) -> tuple[Program, Program]:
    name = draw(
        st.sampled_from(["1f1b", "zb-h1", "interleaved", "zbv", "gpipe", "looped-bfs", "chimera"])
    )
    ranks = draw(st.integers(2, 4))
    m = draw(st.integers(1, 4))
    program = fp.schedule.generate(name, ranks=ranks, microbatches=m)
    stages, _ = toy(len(set(program.replica_of or range(program.n_stages))))
    lowered = Pipeline(stages, program, loss_fn=mse).program
    ranks = [list(r) for r in lowered.ranks]
    for _ in range(draw(st.integers(1, 4))):
        r = draw(st.integers(0, len(ranks) - 1))
        instrs = ranks[r]
        comm = [t for t, i in enumerate(instrs) if i.op in COMM_OPS]
        if not comm:
            continue
        t = draw(st.sampled_from(comm))
        what = draw(st.sampled_from(["toggle", "earlier", "later"]))
        if what == "toggle":
            instrs[t] = instrs[t].join(not instrs[t].joined)
        else:
            u = t - 1 if what == "earlier" else t + 1
            if 0 <= u < len(instrs):
                instrs[t], instrs[u] = instrs[u], instrs[t]
        ranks[r] = _fix_groups(instrs)
    try:
        mutated = lowered.replace(ranks=tuple(tuple(r) for r in ranks))
        check(mutated)  # gloo's rules: the program is complete and runs with buffered sends
    except ScheduleError:
        assume(False)
    return lowered, mutated


@given(_mutated())
def test_the_checker_and_the_strict_transport_agree(pair: tuple[Program, Program]) -> None:
    _lowered, program = pair
    stages, params = toy(len(set(program.replica_of or range(program.n_stages))))
    x, y = data(8)
    try:
        check(program, p2p="nccl", layout=Pipeline.p2p_layout)
        accepted = True
    except ScheduleError:
        accepted = False
    event(f"nccl {'accepts' if accepted else 'rejects'}")
    pipe = Pipeline(stages, program, loss_fn=mse)  # checked under gloo's rules here (CPU)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUNCPIPE_STRICT_P2P", "1")
        if accepted:
            got = pipe.step(params, x, y)
            ref = fp.reference_step(
                stages, params, x, mse, targets=y, microbatches=program.microbatches
            )
            assert_trees_close((got.loss, got.grads), ref)
        else:
            with pytest.raises(CommunicationError):
                pipe.step(params, x, y)


def test_the_lowered_programs_are_accepted_and_run_strict() -> None:
    """The unmutated side of the same comparison, for every schedule above at 2 ranks."""
    for name in ("1f1b", "zb-h1", "interleaved", "zbv", "gpipe"):
        stages, _ = toy(fp.schedule.generate(name, ranks=2, microbatches=3).n_stages)
        pipe = Pipeline(stages, fp.schedule.generate(name, ranks=2, microbatches=3), loss_fn=mse)
        check(pipe.program, p2p="nccl")
        assert any(i.op is Op.RECV for r in pipe.program.ranks for i in r)
