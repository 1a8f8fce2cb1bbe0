"""Sharded data parallelism (ZeRO-1 and ZeRO-2, issue 44): SCATTER and GATHER as program
instructions.

The schedule half (text form, the pass, the checker's rules, the simulator's prices, the
timeline) runs here; the runtime half (equal to the unsharded run over processes, optimizer
state per rank) at the end of this file, its jobs in ``tests/jobs_zero.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcpipe as fp
from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule import (
    Costs,
    ascii_timeline,
    check,
    chrome_trace,
    gather,
    parse_instr,
    parse_program,
    reduce,
    scatter,
    shard_data,
    simulate,
    strip_communication,
)
from funcpipe.schedule.generators import CHUNKS, GENERATORS, generate, to_eval
from funcpipe.schedule.ir import Op, Program
from funcpipe.schedule.p2p import PAIR
from funcpipe.schedule.passes import add_reduce, lower
from funcpipe.testing import assert_trees_close
from funcpipe.train.optimizers import adamw
from tests import jobs_zero


# ------------------------------------------------------------------ the instructions
def test_text_form_round_trips() -> None:
    for i in (scatter(1, "data"), gather(0, "data"), scatter(1, "data", 3)):
        assert parse_instr(str(i)) == i
    assert str(scatter(1, "data")) == "SCATTER s1 data"
    assert str(scatter(1, "data", 3)) == "SCATTER s1 m3 data"
    with pytest.raises(ScheduleError, match="only a SCATTER names a microbatch"):
        parse_instr("GATHER s0 m1 data")
    assert str(gather(0, "data")) == "GATHER s0 data"
    assert parse_instr("  GATHER  s2 data ").op is Op.GATHER
    with pytest.raises(ScheduleError, match="without the '\\+'"):
        parse_instr("+ SCATTER s0 data")


def _sharded(name: str, ranks: int = 2, microbatches: int = 4, zero: int = 1) -> Program:
    return shard_data(lower(generate(name, ranks=ranks, microbatches=microbatches)), zero=zero)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_generator_shards_to_a_program_nccl_accepts(name: str, zero: int) -> None:
    for ranks, microbatches in ((2, 4), (4, 8), (3, 5)):
        if CHUNKS[name] is not None and microbatches < ranks:
            continue
        p = _sharded(name, ranks, microbatches, zero)
        check(p, p2p="nccl", layout=PAIR)
        assert parse_program(p.to_text()) == p
        assert shard_data(p) is p  # idempotent
        assert not [i for r in p.ranks for i in r if i.op is Op.REDUCE and i.group == "data"]
        owner = p.replica_of or tuple(range(p.n_stages))
        gathered = {
            (r, owner[i.stage]) for r, ii in enumerate(p.ranks) for i in ii if i.op is Op.GATHER
        }
        # one GATHER per stage a rank holds (replicas of one stage on one rank: one for them)
        assert gathered == {(p.placement[s], owner[s]) for s in range(p.n_stages)}
        if p.training:
            scatters = [i for r in p.ranks for i in r if i.op is Op.SCATTER]
            # ZeRO-1: one per stage; ZeRO-2: one per (stage, microbatch), each named
            want = {(s, -1) for s in range(p.n_stages)}
            if zero == 2:
                want = {(s, m) for m in range(microbatches) for s in p.visits(m)}
            assert sorted((i.stage, i.microbatch) for i in scatters) == sorted(want)
        for instrs in p.ranks:  # the GATHERs open each rank, in the order of first forwards
            heads = [i for i in instrs if i.op is Op.GATHER]
            assert instrs[: len(heads)] == tuple(heads)
            firsts = list(dict.fromkeys(owner[i.stage] for i in instrs if i.op is Op.F))
            assert [owner[i.stage] for i in heads] == firsts
        assert strip_communication(p) == strip_communication(
            lower(generate(name, ranks=ranks, microbatches=microbatches))
        )


@pytest.mark.parametrize("zero", [1, 2])
def test_chimera_shards_its_replicas(zero: int) -> None:
    """Each rank gathers and scatters the replicas it holds; the replica sums add the pieces
    after every SCATTER of the rank."""
    for ranks, microbatches in ((2, 4), (4, 8), (2, 2)):
        p = _sharded("chimera", ranks, microbatches, zero)
        check(p, p2p="nccl", layout=PAIR)
        for instrs in p.ranks:
            last = max(t for t, i in enumerate(instrs) if i.op is Op.SCATTER)
            sums = [t for t, i in enumerate(instrs) if i.group.startswith("replica:")]
            assert sums and min(sums) > last


def test_chimera_is_refused_where_a_replica_sees_no_microbatch() -> None:
    with pytest.raises(InvalidArgument, match="unvisited.*at least 2 microbatches.*zero=0"):
        _sharded("chimera", 2, 1)


def test_a_program_reduced_already_gets_scatters_in_place_of_its_reduces() -> None:
    base = lower(generate("1f1b", ranks=2, microbatches=4))
    reduced = add_reduce(base)
    assert shard_data(reduced) == shard_data(base)
    where = [t for t, i in enumerate(reduced.ranks[0]) if i.op is Op.REDUCE]
    sharded = shard_data(reduced).ranks[0]
    assert [t + 1 for t in where] == [t for t, i in enumerate(sharded) if i.op is Op.SCATTER]


# ------------------------------------------------------------------ the checker's rules
ONE = """\
placement 0
microbatches 2
rank 0: {body}
"""


def _check(body: str) -> None:
    check(parse_program(ONE.format(body=body)), p2p="nccl")


def test_the_checker_accepts_the_simple_order() -> None:
    _check("GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data")
    _check(
        "GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; SCATTER s0 m0 data; B s0 m1; SCATTER s0 m1 data"
    )
    # a SCATTER takes what the stage gathered since the one before it: a late one is sound
    _check(
        "GATHER s0 data; F s0 m0; F s0 m1; B s0 m1; B s0 m0; SCATTER s0 m1 data; SCATTER s0 m0 data"
    )


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        (
            "F s0 m0; GATHER s0 data; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data",
            "before every forward",
        ),
        (
            "GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; SCATTER s0 data; B s0 m1",
            "after every gradient",
        ),
        ("GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1", "if and only if"),
        ("F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data", "if and only if"),
        (
            "GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data; REDUCE s0 data",
            "not both",
        ),
        (
            "GATHER s0 data; GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data",
            "at most one GATHER",
        ),
        ("GATHER s0 tie:w; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 tie:w", "copies"),
        (
            "GATHER s0 data; GATHER s0 d2; F s0 m0; F s0 m1; B s0 m0; B s0 m1; "
            "SCATTER s0 data; SCATTER s0 d2",
            "shards over one group",
        ),
        (  # ZeRO-2: each microbatch's SCATTER after its gradient, one each, not mixed
            "GATHER s0 data; F s0 m0; F s0 m1; SCATTER s0 m0 data; B s0 m0; B s0 m1; "
            "SCATTER s0 m1 data",
            "after microbatch J's gradient contribution",
        ),
        (
            "GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 m1 data",
            "for microbatches \\[0\\]; add SCATTER s0 m0 data",
        ),
        (
            "GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; SCATTER s0 m0 data; B s0 m1; "
            "SCATTER s0 data",
            "one SCATTER per group \\(ZeRO-1\\) or one per microbatch",
        ),
        (
            "GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; SCATTER s0 m0 data; B s0 m1; "
            "SCATTER s0 m1 data; SCATTER s0 m1 data",
            "one per microbatch",
        ),
        (
            "GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 m0 data; "
            "SCATTER s0 m2 data",
            "microbatch 2 does not exist",
        ),
    ],
)
def test_the_checker_rejects_naming_the_rule(body: str, rule: str) -> None:
    with pytest.raises(ScheduleError, match=rule):
        _check(body)


def test_an_eval_program_gathers_and_never_scatters() -> None:
    text = "placement 0\nmicrobatches 1\nmode eval\nrank 0: GATHER s0 data; F s0 m0"
    check(parse_program(text))
    with pytest.raises(ScheduleError, match="eval program"):
        check(parse_program(text + "; SCATTER s0 data"))


# ------------------------------------------------------------------ priced and shown
def test_the_simulator_prices_each_at_half_a_reduce() -> None:
    costs = Costs(reduce=3.0)
    reduced = simulate(add_reduce(lower(generate("1f1b", ranks=2, microbatches=4))), costs)
    sharded = simulate(_sharded("1f1b"), costs)
    for events in sharded.events:
        for e in events:
            if e.instr.op in (Op.SCATTER, Op.GATHER):
                assert e.end - e.start == pytest.approx(1.5)
    # a GATHER at the start of every rank and a SCATTER where the REDUCE was: the same total
    assert sharded.makespan == pytest.approx(reduced.makespan)
    text = ascii_timeline(sharded)
    assert text.splitlines()[0].split("|")[1].startswith("g")
    assert "s|" in text.splitlines()[1] or "s." in text.splitlines()[1]
    names = {e["name"] for e in chrome_trace(sharded)["traceEvents"] if e.get("ph") == "X"}
    assert {"GATHER s0 data", "SCATTER s1 data"} <= names


# ------------------------------------------------------------------ the runtime: one process
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("name", sorted(jobs_zero.SCHEDULES))
@pytest.mark.parametrize("data", [2, 4])
def test_sharded_equals_unsharded_in_one_process(name: str, data: int, zero: int) -> None:
    """Three AdamW steps, tied parameters, uneven shards: losses and parameters equal."""
    ref_losses, ref = jobs_zero.train_local(name, 0, data)
    losses, got = jobs_zero.train_local(name, zero, data)
    assert losses == pytest.approx(ref_losses, abs=1e-12, rel=0)
    assert_trees_close(list(got), list(ref), atol=1e-12, rtol=0)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("data", [2, 4])
def test_chimera_sharded_equals_unsharded_in_one_process(data: int, zero: int) -> None:
    """Chimera at 2 ranks (4 program stages, replicas of 2 model stages, tied across them):
    each rank gathers into leaves of its own, the replica sums add the pieces."""
    ref_losses, ref = jobs_zero.train_local("chimera", 0, data)
    losses, got = jobs_zero.train_local("chimera", zero, data)
    assert losses == pytest.approx(ref_losses, abs=1e-12, rel=0)
    assert_trees_close(list(got), list(ref), atol=1e-12, rtol=0)


def _three_adamw_steps(pipe: Pipeline, params: Any, x: Any, y: Any) -> tuple[float, Any]:
    """Three AdamW steps of ``pipe`` (one process; every copy's shards where it is sharded):
    the last loss and the full params after them."""
    opt = adamw(1e-2)
    values: Any = pipe.shard(params) if pipe.zero else tuple(params)
    states = [opt.init(v) for v in values] if pipe.zero else opt.init(values)
    for _ in range(3):
        loss, grads = pipe.step(values, x, y)
        if pipe.zero:
            new = [opt.update(*a) for a in zip(grads, states, values, strict=True)]
            values, states = [n[0] for n in new], [n[1] for n in new]
        else:
            values, states = opt.update(grads, states, values)
    return float(loss), pipe.gather(values) if pipe.zero else values


@pytest.mark.parametrize("zero", [1, 2])
def test_chimera_at_three_ranks_gathers_the_middle_stage_once(zero: int) -> None:
    """Chimera at 3 ranks: the middle rank holds both replicas of stage 1 (one GATHER, a
    SCATTER each, into one set of leaves); 3 AdamW steps equal the unsharded run."""
    program = generate("chimera", ranks=3, microbatches=6)
    stages, params = jobs_zero.model(3)
    ties = {"E": [(0, "E"), (2, "E")]}
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(12, jobs_zero.W, generator=g, dtype=torch.float64) for _ in range(2))
    runs = []
    for z in (0, zero):
        pipe = Pipeline(stages, program, loss_fn=jobs_zero.mse, ties=ties, data=2, zero=z)
        runs.append(_three_adamw_steps(pipe, params, x, y))
        if z:
            middle = [i for i in pipe.program.ranks[1] if i.op is Op.GATHER]
            assert [str(i) for i in middle] == ["GATHER s1 data"]
    assert runs[1][0] == pytest.approx(runs[0][0], abs=1e-12, rel=0)
    assert_trees_close(list(runs[1][1]), list(runs[0][1]), atol=1e-12, rtol=0)


def _mixed(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["W"] + p["b"].double()) * p["s"].double()


@pytest.mark.parametrize("zero", [1, 2])
def test_any_copy_count_and_mixed_dtypes_need_no_alignment(zero: int) -> None:
    """No shard count is refused for alignment: 3 copies of leaves of 25, 5 and 1 elements
    (pieces 9/8/8, 2/2/1, 1/0/0), a float32 bias and scale beside float64 weights (a bucket of
    each dtype, each padded to equal segments); 3 AdamW steps equal the unsharded run."""
    g = torch.Generator().manual_seed(3)
    stages = [fp.Stage(_mixed, name="a"), fp.Stage(_mixed, name="b")]
    params = [
        {
            "W": torch.randn(5, 5, generator=g, dtype=torch.float64) / 3,
            "b": torch.randn(5, generator=g),
            "s": torch.ones(1),
        }
        for _ in range(2)
    ]
    x, y = (torch.randn(12, 5, generator=g, dtype=torch.float64) for _ in range(2))
    program = generate("1f1b", ranks=2, microbatches=2)
    runs = []
    for z in (0, zero):
        pipe = Pipeline(stages, program, loss_fn=jobs_zero.mse, data=3, zero=z)
        if z:
            assert [c[0]["s"].numel() for c in pipe.shard(params)] == [1, 0, 0]
        runs.append(_three_adamw_steps(pipe, params, x, y))
    assert runs[1][0] == pytest.approx(runs[0][0], abs=1e-12, rel=0)
    got, want = runs[1][1], runs[0][1]
    assert got[0]["b"].dtype == torch.float32
    assert_trees_close([p["W"] for p in got], [p["W"] for p in want], atol=1e-12, rtol=0)
    # float32 leaves: the three copies' sums in another order (float32 rounding)
    assert_trees_close([p["b"] for p in got], [p["b"] for p in want], atol=1e-6, rtol=0)
    assert_trees_close([p["s"] for p in got], [p["s"] for p in want], atol=1e-6, rtol=0)


def test_shards_follow_tensor_split_and_gradients_come_back_as_shards() -> None:
    pipe, params = jobs_zero._pipeline("1f1b", 1, data=2)
    shards = pipe.shard(params)
    assert len(shards) == 2
    e = params[0]["E"]  # 25 elements: 13 and 12
    for c in range(2):
        assert torch.equal(shards[c][0]["E"], torch.tensor_split(e.flatten(), 2)[c])
    assert [s[0]["E"].shape[0] for s in shards] == [13, 12]
    assert [s[0]["b"].shape[0] for s in shards] == [3, 2]
    x, y = jobs_zero.batches(2)[0]
    _, grads = pipe.step(shards, x, y)
    assert [g[0]["E"].shape for g in grads] == [torch.Size([13]), torch.Size([12])]
    full = pipe.gather(shards)
    assert_trees_close(list(full), list(params))
    timeline = pipe.step(shards, x, y, trace=True).timeline
    ops = {e.instr.op for r in timeline.events for e in r}
    assert {Op.GATHER, Op.SCATTER} <= ops


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="zero=3: 0 .*1 .*or 2"):
        jobs_zero._pipeline("1f1b", 3, data=2)
    with pytest.raises(InvalidArgument, match="shard_data\\(zero=0\\)"):
        shard_data(lower(generate("1f1b", ranks=2, microbatches=2)), zero=0)
    with pytest.raises(InvalidArgument, match="data > 1"):
        jobs_zero._pipeline("1f1b", 1, data=1)
    pipe, params = jobs_zero._pipeline("1f1b", 1, data=2)
    x, y = jobs_zero.batches(2)[0]
    with pytest.raises(InvalidArgument, match="shard\\(params\\) first"):
        pipe.step(params, x, y)
    shards = pipe.shard(params)
    with pytest.raises(InvalidArgument, match="list of every copy's shards"):
        pipe.step(shards[0], x, y)
    wrong = [shards[1], shards[0]]
    with pytest.raises(InvalidArgument, match="are copy 1's shards and it is copy 0 of 2"):
        pipe.step(wrong, x, y)
    untagged = [tuple(shards[1]), tuple(shards[0])]  # plain tuples: the pieces' sizes still tell
    with pytest.raises(InvalidArgument, match="copy 0 of 2 holds torch.float64\\[13\\]"):
        pipe.step(untagged, x, y)
    plain, _ = jobs_zero._pipeline("1f1b", 0, data=2)
    with pytest.raises(InvalidArgument, match="Pipeline\\(zero=1 or 2\\)"):
        plain.shard(params)


# ------------------------------------------------------------------ over processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("name", sorted(jobs_zero.SCHEDULES))
def test_sharded_equals_unsharded_over_four_processes(pool, name: str, zero: int) -> None:
    """Pipeline 2 x data 2 over gloo under NCCL's point-to-point rules (strict transport):
    three AdamW steps with tied parameters and uneven shards, sharded against unsharded."""
    for dl, dp in pool(4).run(jobs_zero.zero_vs_unsharded, name, zero=zero):
        assert dl <= 1e-12 and dp <= 1e-12


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [1, 2])
def test_chimera_sharded_over_four_processes(pool, zero: int) -> None:
    """Chimera, pipeline 2 x data 2 over gloo, strict transport, clipped over the world:
    every process holds both model stages (a down and an up replica)."""
    for dl, dp in pool(4).run(jobs_zero.zero_vs_unsharded, "chimera", 0.05, zero=zero):
        assert dl <= 1e-12 and dp <= 1e-12


@pytest.mark.timeout(240)
def test_bf16_with_master_weights_over_four_processes(pool) -> None:
    """bf16 shards over gloo (float32 sums, master weights): bit for bit the unsharded run."""
    for dl, dp in pool(4).run(jobs_zero.zero_vs_unsharded, "interleaved", bf16=True):
        assert dl == 0 and dp == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [1, 2])
def test_four_copies_over_eight_processes(pool, zero: int) -> None:
    """Pipeline 2 x data 4 (ZB-V, strict transport): pieces of 25 elements are 7, 6, 6, 6."""
    pipe, params = jobs_zero._pipeline("zbv", zero, data=4)
    assert [c[0]["E"].numel() for c in pipe.shard(params)] == [7, 6, 6, 6]
    for dl, dp in pool(8).run(jobs_zero.zero_vs_unsharded, "zbv", zero=zero):
        assert dl <= 1e-12 and dp <= 1e-12


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [1, 2])
def test_the_gpt_at_pipeline_2_data_2_tensor_2(pool, zero: int) -> None:
    """The demo's GPT (float64, its embedding tied across the two stages) over eight
    processes: each tensor rank's leaves sharded over the copies of its coordinate; AdamW,
    three steps, equal to the unsharded run. ZeRO-2 adds the copies' averages microbatch by
    microbatch, the unsharded run each copy's microbatches first: float64 rounding, which
    AdamW's normalisation lifts to 1.25e-12 on one attention bias element whose gradient is a
    near-cancelled sum (measured); 4e-12 for it."""
    atol = 1e-12 if zero == 1 else 4e-12
    for worst in pool(8).run(jobs_zero.gpt_zero_vs_unsharded, 2, zero, atol):
        assert worst <= 1e-12


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [1, 2])
def test_clipping_sharded_gradients_over_the_world(pool, zero: int) -> None:
    """Clipped by the global norm: sharded (each piece weighs 1 over the world) equals
    unsharded (each copy's full gradient weighs 1/copies); a norm small enough to clip."""
    for dl, dp in pool(4).run(jobs_zero.zero_vs_unsharded, "1f1b", 0.05, zero=zero):
        assert dl <= 1e-12 and dp <= 1e-12


@pytest.mark.timeout(240)
def test_optimizer_state_per_process_is_one_over_d(pool) -> None:
    """AdamW's two moments per process, sharded over 2 copies against unsharded: 1/2 within
    5% (the leaves of 3969 and 63 elements split unevenly: copy 0 holds the larger pieces)."""
    full = pool(4).run(jobs_zero.state_bytes, 0)
    sharded = pool(4).run(jobs_zero.state_bytes, 1)
    for a, b in zip(sharded, full, strict=True):
        assert abs(a / b - 0.5) <= 0.05 * 0.5
    print("AdamW state bytes per process: unsharded", full, "sharded", sharded)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("name", sorted(jobs_zero.MODEL_STAGES))
def test_one_process_under_nccl_rules(
    monkeypatch: pytest.MonkeyPatch, name: str, zero: int
) -> None:
    """The local transport in strict mode (NCCL's point-to-point rules) runs every training
    generator's sharded program (Chimera's too), and each equals the unsharded run."""
    monkeypatch.setenv("FUNCPIPE_STRICT_P2P", "1")
    ref_losses, ref = jobs_zero.train_local(name, 0, 2)
    losses, got = jobs_zero.train_local(name, zero, 2)
    assert losses == pytest.approx(ref_losses, abs=1e-12, rel=0)
    assert_trees_close(list(got), list(ref), atol=1e-12, rtol=0)


def test_an_eval_program_gathers_shards_and_gives_the_same_loss() -> None:
    program = to_eval(generate("1f1b", ranks=2, microbatches=4))
    stages, params = jobs_zero.model(2)
    ties = {"E": [(0, "E"), (1, "E")]}
    plain = Pipeline(stages, program, loss_fn=jobs_zero.mse, ties=ties, data=2)
    sharded = Pipeline(stages, program, loss_fn=jobs_zero.mse, ties=ties, data=2, zero=1)
    assert [str(i) for i in sharded.program.ranks[1][:1]] == ["GATHER s1 data"]
    x, y = jobs_zero.batches(2)[0]
    want = plain.step(tuple(params), x, y).loss
    got = sharded.step(sharded.shard(params), x, y)
    assert got.grads == (None, None) or all(g == (None, None) for g in got.grads)
    assert float(got.loss) == pytest.approx(float(want), abs=1e-12, rel=0)


def test_the_checker_wants_every_stage_sharded_or_none() -> None:
    p = _sharded("1f1b")
    bare = tuple(i for i in p.ranks[0] if i.op not in (Op.GATHER, Op.SCATTER))
    half = p.replace(ranks=(bare, p.ranks[1]))  # stage 1 sharded, stage 0 reduced in full
    with pytest.raises(ScheduleError, match="every stage a microbatch visits, or none") as info:
        check(add_reduce(half, stages=[0]), p2p="nccl")
    assert "stages [0] have no GATHER" in str(info.value)


def test_the_checker_wants_tie_sums_after_the_scatters() -> None:
    p = _sharded("1f1b")
    rank0 = list(p.ranks[0])
    at = next(t for t, i in enumerate(rank0) if i.op is Op.SCATTER)
    ties = [reduce(0, "tie:E"), reduce(1, "tie:E")]
    good = p.replace(ranks=(tuple([*rank0, ties[0]]), (*p.ranks[1], ties[1])))
    check(good, p2p="nccl")
    bad = p.replace(ranks=(tuple([*rank0[:at], ties[0], *rank0[at:]]), good.ranks[1]))
    with pytest.raises(ScheduleError, match="comes after its rank's SCATTERs"):
        check(bad, p2p="nccl")


def test_shard_learns_the_shapes_from_meta_tensors() -> None:
    """Resuming from saved shards: pipe.shard on meta params teaches the full shapes."""
    pipe, params = jobs_zero._pipeline("1f1b", 1, data=2)
    saved = pipe.shard(params)
    fresh, _ = jobs_zero._pipeline("1f1b", 1, data=2)
    meta = fresh.shard(tuple({k: v.to("meta") for k, v in p.items()} for p in params))
    assert meta[0][0]["E"].is_meta and meta[0][0]["E"].shape == (13,)
    x, y = jobs_zero.batches(2)[0]
    assert float(fresh.step(saved, x, y).loss) == float(pipe.step(saved, x, y).loss)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("name", sorted(jobs_zero.SCHEDULES))
def test_bf16_parameters_with_float32_sums_and_master_weights(name: str, zero: int) -> None:
    """bf16 shards, grad_dtype=float32 (the GATHER fills float32 leaves, the stage computes
    with their bf16 copies), AdamW with float32 master weights on the shards: bit for bit the
    unsharded run (two copies: each average is (a + b) / 2 either way; ZeRO-2's float32 sums
    of per-microbatch averages round below what the bf16 parameters keep, on this model)."""
    ref_losses, ref = jobs_zero.train_local(name, 0, 2, bf16=True)
    losses, got = jobs_zero.train_local(name, zero, 2, bf16=True)
    assert got[0]["E"].dtype == torch.bfloat16
    assert losses == ref_losses
    assert_trees_close(list(got), list(ref), atol=0, rtol=0)


def test_a_zero2_step_traces_a_scatter_per_microbatch() -> None:
    """The executed timeline and its Chrome trace show ZeRO-2's SCATTERs, one per (stage,
    microbatch), and the simulator prices each (at half a REDUCE)."""
    pipe, params = jobs_zero._pipeline("1f1b", 2, data=2)
    x, y = jobs_zero.batches(2)[0]
    res = pipe.step(pipe.shard(params), x, y, trace=True)
    names = {e["name"] for e in chrome_trace(res.timeline)["traceEvents"] if e.get("ph") == "X"}
    want = {f"SCATTER s{s} m{m} data" for s in range(2) for m in range(4)}
    assert want <= names and "SCATTER s0 data" not in names
    one, per_mb = (simulate(_sharded("1f1b", zero=z), Costs(reduce=2.0)) for z in (1, 2))
    assert per_mb.makespan > one.makespan  # 4 SCATTERs a stage, not 1


@pytest.mark.parametrize("zero", [1, 2])
def test_the_checker_wants_every_replica_scattered(zero: int) -> None:
    """Chimera at 3 ranks: rank 1 holds s1 and s4, both replicas of stage 1, gathered once.
    Without s4's own SCATTER its microbatches' gradients would be lost (the checker accepted
    that, and the step trained silently wrong); a REDUCE in its place is refused too."""
    p = _sharded("chimera", 3, 4, zero)
    check(p, p2p="nccl")
    rank1 = p.ranks[1]
    assert {i.stage for i in rank1} >= {1, 4}
    dropped = tuple(i for i in rank1 if not (i.op is Op.SCATTER and i.stage == 4))
    lost = p.replace(ranks=(p.ranks[0], dropped, p.ranks[2]))
    with pytest.raises(ScheduleError, match="stage 4 computes with the parameters gathered"):
        check(lost, p2p="nccl")
    last = max(t for t, i in enumerate(dropped) if i.stage == 4 and i.op in (Op.B, Op.W))
    both = (*dropped[: last + 1], reduce(4, "data"), *dropped[last + 1 :])
    with pytest.raises(ScheduleError, match="REDUCEd or SCATTERed over a group, not both"):
        check(p.replace(ranks=(p.ranks[0], both, p.ranks[2])), p2p="nccl")


@pytest.mark.parametrize("zero", [1, 2])
def test_shard_data_moves_tie_sums_after_the_scatters(zero: int) -> None:
    """A lowered program whose tie REDUCE comes before its data REDUCE is sound unsharded;
    sharded, the tie sum reads the pieces, so shard_data moves it after the rank's SCATTERs
    at either level (at zero=1 it used to leave it where the checker refuses it)."""
    from funcpipe.stages.ties import add_tie_reduce

    base = add_reduce(add_tie_reduce(lower(generate("1f1b", ranks=2, microbatches=4)), {
        "E": [(0, "E"), (1, "E")]
    }))  # fmt: skip
    ranks = []
    for instrs in base.ranks:
        data = next(t for t, i in enumerate(instrs) if i.op is Op.REDUCE and i.group == "data")
        tie = next(t for t, i in enumerate(instrs) if i.group == "tie:E")
        order = [
            *instrs[:data],
            instrs[tie],
            instrs[data],
            *instrs[data + 1 : tie],
            *instrs[tie + 1 :],
        ]
        ranks.append(tuple(order))
    early = base.replace(ranks=tuple(ranks))
    check(early, p2p="nccl")
    sharded = shard_data(early, zero=zero)
    check(sharded, p2p="nccl")
    for instrs in sharded.ranks:
        last = max(t for t, i in enumerate(instrs) if i.op is Op.SCATTER)
        assert min(t for t, i in enumerate(instrs) if i.group == "tie:E") > last


def test_shards_given_to_shard_again_are_refused() -> None:
    """Before: pipe.shard(pipe.shard(params)) ran silently, cutting the pieces again."""
    import funcpipe as fp
    from funcpipe.errors import InvalidArgument
    from funcpipe.schedule import generate

    stages = [fp.Stage(lambda p, t: torch.tanh(p["E"][t])), fp.Stage(lambda p, h: h @ p["U"])]
    params = ({"E": torch.randn(16, 8)}, {"U": torch.randn(8, 16)})
    program = generate("1f1b", ranks=2, microbatches=2)
    pipe = fp.Pipeline(stages, program, loss_fn=fp.token_cross_entropy, data=2, zero=1)
    shards = pipe.shard(params)
    pipe.shard(params)  # the full params again: fine
    with pytest.raises(InvalidArgument, match="was given what shard\\(\\) returned"):
        pipe.shard(shards)


@pytest.mark.timeout(180)
def test_clipping_a_copys_pieces_alone_is_refused(pool) -> None:
    """Before: each copy clipped its pieces by its own norm, so the copies' updates were those
    of other parameters, silently."""
    for said, finite in pool(4).run(jobs_zero.clip_pieces_alone):
        assert "some copies' pieces of a ZeRO step's gradient" in said, said
        assert finite


def _even_pipe() -> tuple[Any, tuple[Any, ...], Any, Any]:
    """ZeRO-1 over 2 copies in one process, every leaf's size even: both copies' pieces have
    the same shapes, so only the copy the shards carry tells them apart."""
    g = torch.Generator().manual_seed(0)
    stages = [fp.Stage(lambda p, t: torch.tanh(p["E"][t])), fp.Stage(lambda p, h: h @ p["U"])]
    params = ({"E": torch.randn(16, 8, generator=g)}, {"U": torch.randn(8, 16, generator=g)})
    program = generate("1f1b", ranks=2, microbatches=2)
    pipe = fp.Pipeline(stages, program, loss_fn=fp.token_cross_entropy, data=2, zero=1)
    tokens = torch.randint(0, 16, (4, 5), generator=g)
    return pipe, params, tokens, torch.roll(tokens, 1, dims=1)


def test_swapped_copies_are_refused_by_the_copy_the_shards_carry() -> None:
    """Before: with every piece the same size, a list of the copies' shards out of order stepped
    and gathered silently (a permuted model)."""
    pipe, params, x, y = _even_pipe()
    shards = pipe.shard(params)
    assert [(s.copy, s.copies) for s in shards] == [(0, 2), (1, 2)]
    swapped = [shards[1], shards[0]]
    with pytest.raises(InvalidArgument, match="shards\\[0\\] are copy 1's shards and it is copy 0"):
        pipe.step(swapped, x, y)
    with pytest.raises(InvalidArgument, match="gather\\(shards\\)\\[0\\] are copy 1's"):
        pipe.gather(swapped)
    grads = pipe.step(shards, x, y).grads
    assert [(g.copy, g.copies) for g in grads] == [(0, 2), (1, 2)]
    opt = adamw(1e-2)
    with pytest.raises(
        InvalidArgument, match="grads are copy 0.s shards \\(of 2\\) and params copy 1.s"
    ):
        opt.update(grads[0], opt.init(shards[1]), shards[1])  # copy 0's grads, copy 1's shards


def test_the_copy_survives_updates_tree_maps_pickling_and_keeps_checkpoint_keys() -> None:
    import io

    import optree
    import torch.utils._pytree as torch_pytree

    from funcpipe.pipeline.zero import Shards
    from funcpipe.train.checkpoint_regions import state_keys

    pipe, params, x, y = _even_pipe()
    shards = pipe.shard(params)
    opt = adamw(1e-2)
    states = [opt.init(s) for s in shards]
    grads = pipe.step(shards, x, y).grads
    new, _ = opt.update(grads[1], states[1], shards[1])
    for tree in (
        new,
        optree.tree_map(torch.neg, shards[1]),
        torch_pytree.tree_map(torch.neg, shards[1]),
    ):
        assert isinstance(tree, Shards) and (tree.copy, tree.copies) == (1, 2)
    plain, _ = opt.update(grads[1], states[1], tuple(shards[1]))  # untagged: taken, unchecked
    assert isinstance(plain, Shards) and plain.copy == 1
    weights = tuple({k: 1.0 for k in p} for p in shards[1])  # a plain tree of clip weights
    from funcpipe.train.clip import _leaf_weights  # (over processes: the demo's clip weights)

    leaves = [t for p in grads[1] for t in p.values()]
    assert _leaf_weights(grads[1], weights, leaves) == [1.0] * len(leaves)
    buf = io.BytesIO()
    torch.save(shards[1], buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert isinstance(back, Shards) and back.copy == 1
    assert_trees_close(list(back), list(shards[1]))
    assert list(state_keys(shards[1])) == list(state_keys(tuple(shards[1])))
    assert list(state_keys(states[1])) == ["step", "mu/0/E", "mu/1/U", "nu/0/E", "nu/1/U"]


@pytest.mark.timeout(180)
def test_another_processs_shards_are_refused(pool) -> None:
    for said in pool(4).run(jobs_zero.another_copys_shards):
        assert "are copy 1's shards and this process is copy 0" in said or (
            "are copy 0's shards and this process is copy 1" in said
        ), said


def test_clipping_one_copys_pieces_alone_in_one_process_is_refused() -> None:
    """Before: in one process, clipping copy 0's gradient pieces on their own clipped by the
    norm of half the gradient, silently; the list of every copy's clips by the whole one."""
    from funcpipe.train import optim

    pipe, params, x, y = _even_pipe()
    shards = pipe.shard(params)
    grads = pipe.step(shards, x, y).grads
    with pytest.raises(InvalidArgument, match="some copies' pieces of a ZeRO step's gradient"):
        optim.clip_by_global_norm(grads[0], 1.0)
    clipped, norm = optim.clip_by_global_norm(grads, 1.0)
    whole = torch.cat([t.flatten() for g in grads for p in g for t in p.values()]).norm()
    torch.testing.assert_close(norm, whole)
    assert [g.copy for g in clipped] == [0, 1]
    held = pipe.held(shards[1])
    assert isinstance(held, type(shards[1])) and held.copy == 1
