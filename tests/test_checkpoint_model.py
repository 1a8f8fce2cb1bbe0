"""checkpoint.save_model / load_model in one process: regions, another stage split of the GPT
and of a split_module model, old checkpoints, and mismatches refused before anything is read.
The runs over processes (pipeline x tensor x data) are in tests/test_checkpoint_reshard.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import funcpipe as fp
from funcpipe import optim
from funcpipe.errors import InvalidArgument
from funcpipe.models import gpt
from funcpipe.parallel.mesh import Place
from funcpipe.parallel.sharding import Sharding
from funcpipe.train import checkpoint
from funcpipe.tree import tree_map
from tests.test_split_module import TinyLM, _data

CFG = gpt.GPTConfig(vocab=32, context=8, d_model=16, heads=4, layers=3, mlp=32)
Region = checkpoint.Region


# ------------------------------------------------------------------------------- regions
@pytest.mark.parametrize(("n", "d"), [(10, 3), (12, 4), (5, 8), (7, 1)])
def test_flat_shard_is_tensor_split(n: int, d: int) -> None:
    x = torch.arange(n * 3.0).reshape(n, 3)
    whole = Region.whole(x.shape)
    for c, piece in enumerate(torch.tensor_split(x.flatten(), d)):
        r = whole.flat_shard(d, c)
        assert torch.equal(r.take(x), piece) and r.held_shape == tuple(piece.shape)
        assert Region.parse(r.text(), x.shape) == r


def test_assemble_any_region_from_any_pieces() -> None:
    full = torch.arange(8 * 6.0).reshape(8, 6)
    place = [Place(k, {"tensor": k}, {"tensor": 2}) for k in range(2)]
    rows = [Region.of(Sharding.of("tensor", None), (4, 6), p) for p in place]
    cols = [Region.of(Sharding.of(None, "tensor"), (8, 3), p) for p in place]
    assert rows[1].box == ((4, 8), (0, 6)) and cols[1].box == ((0, 8), (3, 6))
    zero = [cols[c].flat_shard(3, k) for c in range(2) for k in range(3)]  # tensor 2, then ZeRO 3
    for saved in (rows, cols, zero, [Region.whole(full.shape)]):
        pieces = [(r, r.take(full).clone()) for r in saved]
        for want in (*rows, *zero, Region.whole(full.shape), rows[0].flat_shard(4, 3)):
            got = fp.train.checkpoint_regions.assemble(want, pieces)
            assert torch.equal(got, want.take(full))
    short, _ = fp.train.checkpoint_regions.coverage(Region.whole(full.shape), rows[:1])
    assert short == 24


# ------------------------------------------------------------------------- the GPT, 1 process
def _trained(n: int) -> tuple[tuple[Any, ...], Any, optim.Optimizer]:
    """The GPT's params per stage after one AdamW update with made-up gradients."""
    params = gpt.split(gpt.init(CFG, seed=0, dtype=torch.float64), CFG, n)
    opt = optim.adamw(1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    grads = tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)
    if n > 1:  # tied: both copies get the same gradient
        grads = (*grads[:-1], {**grads[-1], "wte": grads[0]["wte"]})
    params, state = opt.update(grads, opt.init(params), params)
    return params, state, opt


def _by_name(trees: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for tree in trees:
        for k, v in checkpoint.state_keys(tree).items():
            assert k not in out or torch.equal(out[k], v)
            out[k] = v
    return out


@pytest.mark.parametrize(("saved", "loaded"), [(2, 3), (3, 1), (1, 4), (2, 2)])
def test_gpt_saved_at_one_stage_split_loads_at_another(
    tmp_path: Path, saved: int, loaded: int
) -> None:
    params, state, opt = _trained(saved)
    checkpoint.save_model(tmp_path / "ck", params, opt_state=state, step=1)
    like = gpt.split(gpt.init(CFG, seed=1, dtype=torch.float64), CFG, loaded)
    got = checkpoint.load_model(tmp_path / "ck", like, opt_state=opt.init(like))
    assert got.step == 1 and got.opt_state.step == 1 and len(got.params) == loaded
    for mine, theirs in (
        (got.params, params),
        (got.opt_state.mu, state.mu),
        (got.opt_state.nu, state.nu),
    ):
        a, b = _by_name(mine), _by_name(theirs)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_files_are_keyed_by_model_names(tmp_path: Path) -> None:
    params, state, _ = _trained(2)
    checkpoint.save_model(tmp_path / "ck", params, opt_state=state, step=1)
    info = json.loads((tmp_path / "ck" / "funcpipe.json").read_text())
    assert info["keys"] == "named" and info["scalars"] == {"opt/step": "int"}
    assert info["tensors"]["params/blocks/2/attn/qkv/weight"] == {
        "shape": [48, 16],
        "dtype": "torch.float64",
    }
    assert "params/wte@0:32,0:16" in info["checksums"]  # the tied copies: one key
    assert "opt/mu/blocks/0/mlp/fc1/weight@0:32,0:16" in info["checksums"]


# ------------------------------------------------------------------------- split_module
def test_module_split_saved_at_two_stages_loads_at_three(tmp_path: Path) -> None:
    d = _data()
    example = {"ids": d["ids"][:2], "mask": d["mask"][:2]}
    torch.manual_seed(0)
    model = TinyLM().double()
    two = fp.split_module(model, ["blocks.2"], example=example)
    three = fp.split_module(model, ["blocks.1", "blocks.3"], example=example)
    params = tree_map(lambda p: p + 0.5, two.params)  # not the module's values
    checkpoint.save_model(tmp_path / "ck", params, step=7)
    like = tree_map(torch.zeros_like, three.params)
    got = checkpoint.load_model(tmp_path / "ck", like)
    assert got.step == 7 and got.opt_state is None
    names = {n for p in three.params for n in p}
    assert {n for p in got.params for n in p} == names
    assert {"embed.weight", "head.weight"} <= names  # the tied names, both present
    assert three.ties == {"embed.weight": [(0, "embed.weight"), (2, "head.weight")]}
    want = {n: t for p in params for n, t in p.items()}
    for stage in got.params:
        for name, t in stage.items():
            assert torch.equal(t, want[name]), name


# ------------------------------------------------------------------------ old and mismatched
def test_old_checkpoints_load_as_before_and_load_model_says_how_to_convert(tmp_path: Path) -> None:
    params, state, opt = _trained(2)
    checkpoint.save(tmp_path / "old", {"params": params, "opt": state}, step=1)
    like = {"params": params, "opt": opt.init(params)}
    again = checkpoint.load(tmp_path / "old", like)  # same layout: as before
    assert torch.equal(again["params"][1]["wte"], params[1]["wte"])
    with pytest.raises(InvalidArgument, match=r"written by checkpoint.save .*save_model\(new_path"):
        checkpoint.load_model(tmp_path / "old", params, opt_state=state)
    checkpoint.save_model(tmp_path / "new", params, opt_state=state)
    with pytest.raises(InvalidArgument, match="read it with checkpoint.load_model"):
        checkpoint.load(tmp_path / "new", like)


def _sentinel(like: Any) -> Any:
    return tree_map(lambda t: torch.full_like(t, 7.0), like)


def test_mismatches_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    params, state, _ = _trained(2)
    checkpoint.save_model(tmp_path / "ck", params, opt_state=state, step=1)
    wider = gpt.GPTConfig(vocab=32, context=8, d_model=32, heads=4, layers=3, mlp=32)
    other = _sentinel(gpt.split(gpt.init(wider, dtype=torch.float64), wider, 2))
    before = tree_map(torch.clone, other)
    with pytest.raises(
        InvalidArgument,
        match=r"does not fit this model: 'params/blocks/0/attn/norm/bias' was saved as "
        r"torch.float64 of full shape \(16,\), this run has torch.float64 of full shape "
        r"\(32,\).*\(38 in all\). Nothing was read",
    ):
        checkpoint.load_model(tmp_path / "ck", other)
    assert all(
        torch.equal(a, b)
        for a, b in zip(_by_name(other).values(), _by_name(before).values(), strict=True)
    )
    deeper = gpt.GPTConfig(vocab=32, context=8, d_model=16, heads=4, layers=5, mlp=32)
    like = gpt.split(gpt.init(deeper, dtype=torch.float64), deeper, 2)
    with pytest.raises(
        InvalidArgument,
        match=r"it has no 'params/blocks/3/attn/norm/bias'.*it holds 120 tensors: \['params/blocks.*another model",
    ):
        checkpoint.load_model(tmp_path / "ck", like)
    sgd = optim.sgd(0.1, momentum=0.9)
    with pytest.raises(
        InvalidArgument, match=r"it has no 'opt/momentum/.*optimizer state of another kind"
    ):
        checkpoint.load_model(tmp_path / "ck", params, opt_state=sgd.init(params))
    f32 = tree_map(lambda t: t.float(), params)
    with pytest.raises(
        InvalidArgument, match="was saved as torch.float64 .* this run has torch.float32"
    ):
        checkpoint.load_model(tmp_path / "ck", f32)
    with pytest.raises(InvalidArgument, match="params=dict"):
        checkpoint.load_model(tmp_path / "ck", params[0])


def test_a_region_no_saved_piece_covers(tmp_path: Path) -> None:
    """Saved by a rank holding one tensor shard only: the other half is in no piece."""
    full = {"w": torch.arange(12.0).reshape(4, 3)}
    lay = checkpoint.Naming(
        shardings=({"w": Sharding.of("tensor", None)},),
        place=Place(0, {"tensor": 0}, {"tensor": 2}),
    )
    checkpoint.save_model(tmp_path / "ck", ({"w": full["w"][:2]},), naming=lay)
    with pytest.raises(
        InvalidArgument,
        match=r"'params/w': 6 element\(s\) of the region 0:4,0:3 this rank holds are in no saved piece",
    ):
        checkpoint.load_model(tmp_path / "ck", (full,))
    half = checkpoint.load_model(tmp_path / "ck", ({"w": torch.zeros(2, 3)},), naming=lay)
    assert torch.equal(half.params[0]["w"], full["w"][:2])


def _piece(tree: Any, d: int, c: int) -> Any:
    return tree_map(lambda t: torch.tensor_split(t.flatten(), d)[c].clone(), tree)


def _equal(a: Any, b: Any) -> bool:
    x, y = _by_name(a), _by_name(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_zero_style_flat_optimizer_shards_round_trip(tmp_path: Path) -> None:
    """Optimizer state held as flat piece c of d (ZeRO-1's torch.tensor_split(leaf.flatten(),
    d)[c]): each piece saved (one process: a checkpoint of its own) loads back at its sharding,
    and state saved whole loads at other shardings. (Pieces saved d ways loading d' ways is
    the region arithmetic of test_a_flat_piece_reads_only_the_saved_pieces_holding_its_range;
    saved sharded over processes and loaded whole: tests/test_demo.py's resume at --zero 0.)"""
    params, state, _ = _trained(1)
    for c in range(3):  # three "ranks" of one save, written one after the other here
        lay = checkpoint.Naming(opt_shard=(3, c))
        mine = state._replace(mu=_piece(state.mu, 3, c), nu=_piece(state.nu, 3, c))
        checkpoint.save_model(tmp_path / f"ck{c}", params, opt_state=mine, naming=lay)
        back = checkpoint.load_model(tmp_path / f"ck{c}", params, opt_state=mine, naming=lay)
        assert _equal(back.opt_state.mu, mine.mu) and _equal(back.opt_state.nu, mine.nu)
    checkpoint.save_model(tmp_path / "whole", params, opt_state=state)
    for d, c in ((3, 2), (2, 0), (5, 4)):
        like = state._replace(mu=_piece(state.mu, d, c), nu=_piece(state.nu, d, c))
        lay = checkpoint.Naming(opt_shard=(d, c))
        got = checkpoint.load_model(tmp_path / "whole", params, opt_state=like, naming=lay)
        assert _equal(got.opt_state.mu, like.mu) and _equal(got.opt_state.nu, like.nu)


def test_a_damaged_table_in_funcpipe_json_is_named(tmp_path: Path) -> None:
    params, _, _ = _trained(1)
    checkpoint.save_model(tmp_path / "ck", params)
    info_path = tmp_path / "ck" / "funcpipe.json"
    info = json.loads(info_path.read_text())
    info["tensors"]["params/wte"]["shape"] = "32x16"
    info_path.write_text(json.dumps(info))
    with pytest.raises(fp.FuncpipeError, match="its funcpipe.json has no valid 'tensors'"):
        checkpoint.load_model(tmp_path / "ck", params)


def test_bf16_params_with_float32_master_weights_load_at_another_split(tmp_path: Path) -> None:
    opt = optim.adamw(1e-2, master_weights=True)
    params = gpt.split(gpt.init(CFG, seed=0, dtype=torch.bfloat16), CFG, 2)
    grads = tree_map(lambda p: torch.full_like(p, 0.5), params)
    params, state = opt.update(grads, opt.init(params), params)
    checkpoint.save_model(tmp_path / "ck", params, opt_state=state, step=1)
    like = gpt.split(gpt.init(CFG, seed=1, dtype=torch.bfloat16), CFG, 3)
    got = checkpoint.load_model(tmp_path / "ck", like, opt_state=opt.init(like))
    for field in ("master", "mu", "nu"):
        mine, theirs = _by_name(getattr(got.opt_state, field)), _by_name(getattr(state, field))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert all(t.dtype == torch.float32 for t in mine.values())
    assert _equal(got.params, params) and got.opt_state.step == 1


def test_a_flat_piece_reads_only_the_saved_pieces_holding_its_range() -> None:
    """Loading ZeRO pieces: a rank's piece is assembled from the saved pieces that hold its
    range only (every copy's were read before: d times the I/O), at any piece count, from
    whole, flat or tensor-parallel saves, exactly."""
    from funcpipe.train.checkpoint_regions import Region, assemble, coverage

    full = torch.randn(6, 10, dtype=torch.float64)
    whole = Region((6, 10), ((0, 6), (0, 10)))

    def tp(t: int, i: int) -> Region:
        return Region((6, 10), ((0, 6), (i * 10 // t, (i + 1) * 10 // t)))

    flat4 = [whole.flat_shard(4, c) for c in range(4)]
    assert coverage(whole.flat_shard(4, 2), flat4) == (0, [2])
    assert coverage(whole.flat_shard(8, 3), flat4) == (0, [1, 2])  # 24-31 of 0-59: 15-29, 30-44
    assert coverage(whole, flat4) == (0, [0, 1, 2, 3])
    assert coverage(tp(2, 0).flat_shard(2, 1), [tp(2, 0), tp(2, 1)]) == (0, [0])
    saves = {
        "whole": [whole],
        "flat3": [whole.flat_shard(3, c) for c in range(3)],
        "tensor2": [tp(2, i) for i in range(2)],
        "tensor2 flat2": [tp(2, i).flat_shard(2, c) for i in range(2) for c in range(2)],
    }
    wants = [whole, whole.flat_shard(4, 1), tp(2, 1), tp(5, 3), tp(2, 0).flat_shard(3, 2)]
    for name, regions in saves.items():
        stored = [(r, r.take(full).clone()) for r in regions]
        for want in wants:
            missing, used = coverage(want, regions)
            got = assemble(want, [stored[k] for k in used])
            assert missing == 0 and torch.equal(got.reshape(-1), want.take(full).reshape(-1)), (
                name,
                want,
            )
