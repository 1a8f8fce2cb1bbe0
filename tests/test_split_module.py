"""split_module on plain torch models: names kept, ties found, side inputs, no-gradient values.

Every pipeline result is compared with the unsplit module's own ``loss.backward()`` in float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcpipe as fp
from funcpipe.schedule import generate
from funcpipe.stages.boundaries import infer_boundaries


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h))) * scale * mask[..., None]


class TinyLM(nn.Module):
    """Not a sequence: a table from a buffer and the mask feed every block; the head is tied."""

    def __init__(self, vocab: int = 11, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("freq", torch.linspace(0.5, 1.5, d))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], dtype=self.freq.dtype)
        scale = torch.cos(pos[:, None] * self.freq)  # needs no gradient
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, scale, mask)
        return self.head(h)


def xent(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _data(b: int = 4, t: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 11, (b, t + 1), generator=g)
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, :2] = 0
    return {"ids": ids[:, :-1], "mask": mask, "y": ids[:, 1:]}


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().double()


def _unsplit_grads(
    model: nn.Module, d: dict[str, torch.Tensor], m: int
) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    b = d["ids"].shape[0] // m
    total = torch.zeros((), dtype=torch.float64)
    for j in range(m):
        sl = slice(j * b, (j + 1) * b)
        loss = xent(model(d["ids"][sl], d["mask"][sl]), d["y"][sl]) / m
        loss.backward()
        total += loss.detach()
    return total, dict(model.named_parameters(remove_duplicate=False))


def test_names_ties_and_side_inputs() -> None:
    model, d = _model(), _data()
    sp = fp.split_module(model, ["blocks.2"], example={"ids": d["ids"][:2], "mask": d["mask"][:2]})
    assert sp.points == ("blocks.2",) and sp.inputs == ("ids",)
    names = set(dict(model.named_parameters(remove_duplicate=False)))
    assert set(sp.params[0]) | set(sp.params[1]) == names
    assert "embed.weight" in sp.params[0] and "head.weight" in sp.params[1]
    assert all(k.startswith("blocks.2") or k.startswith("blocks.3") or k == "head.weight"
               for k in sp.params[1])  # fmt: skip
    assert sp.ties == {"embed.weight": [(0, "embed.weight"), (1, "head.weight")]}
    assert sp.side_inputs == {0: ["mask"], 1: ["mask"]}
    for p, name in [(sp.params[0]["embed.weight"], "embed.weight"), (sp.params[1]["blocks.2.fc.bias"], "blocks.2.fc.bias")]:  # fmt: skip
        assert p.data_ptr() == dict(model.named_parameters())[name].data_ptr()  # aliases
    h = sp.stages[0](sp.params[0], d["ids"][:2], mask=d["mask"][:2])
    out = sp.stages[1](sp.params[1], *h, mask=d["mask"][:2])
    torch.testing.assert_close(out, model(d["ids"][:2], d["mask"][:2]), rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "chimera"])
def test_pipeline_equals_unsplit_backward(schedule: str) -> None:
    model, d = _model(), _data()
    prog = generate(schedule, ranks=2, microbatches=2)
    n = max(prog.replica_of) + 1 if prog.replica_of else prog.n_stages
    sp = fp.split_module(model, n, example={"ids": d["ids"][:2], "mask": d["mask"][:2]})
    assert len(sp.stages) == n
    pipe = fp.Pipeline(sp.stages, prog, loss_fn=xent, ties=sp.ties, side_inputs=sp.side_inputs)
    loss, grads = pipe.step(sp.params, sp.batch(d), d["y"])
    ref_loss, named = _unsplit_grads(model, d, 2)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-14)
    for s, g in enumerate(grads):
        for k, v in g.items():
            torch.testing.assert_close(v, named[k].grad, rtol=1e-12, atol=1e-14, msg=f"{s} {k}")


def test_values_needing_no_gradient_are_found() -> None:
    model, d = _model(), _data()
    sp = fp.split_module(model, ["blocks.2"], example={"ids": d["ids"][:2], "mask": d["mask"][:2]})
    prog = generate("1f1b", ranks=2, microbatches=2)
    out0 = sp.stages[0](sp.params[0], d["ids"][:2], mask=d["mask"][:2])
    layout = infer_boundaries(prog, sp.stages, sp.params, (d["ids"][:2],), {0: {"mask": d["mask"][:2]}, 1: {"mask": d["mask"][:2]}})  # fmt: skip
    spec = layout[0]
    assert len(spec.leaves) == len(out0) == 2  # the cos table and the hidden state
    table = next(i for i, t in enumerate(out0) if t.shape == (5, 8))
    assert spec.nograd == {table}
    assert spec.differentiable == (1 - table,)


def test_detached_output_gets_no_gradient_sent() -> None:
    """The documented way: a stage output that is detached is sent without a gradient."""

    def first(p: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x @ p["w"]
        return h, (h * 2).detach()

    def second(p: dict, h: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        return (h @ p["w"] + side).sum(-1)

    g = torch.Generator().manual_seed(0)
    params = tuple({"w": torch.randn(3, 3, generator=g, dtype=torch.float64)} for _ in range(2))
    stages = [fp.Stage(first), fp.Stage(second)]
    prog = generate("1f1b", ranks=2, microbatches=2)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    layout = infer_boundaries(prog, stages, params, (x[:2],), {})
    assert layout[0].nograd == {1} and layout[0].differentiable == (0,)
    loss, grads = fp.Pipeline(stages, prog, loss_fn=lambda o: o.pow(2).mean()).step(params, x)
    ref_loss, ref = fp.reference_step(stages, params, x, lambda o: o.pow(2).mean(), microbatches=2)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref)


def test_find_ties_and_reference_step_ties() -> None:
    w = torch.randn(5, 3, dtype=torch.float64)
    params = ({"emb": w, "b": torch.zeros(3, dtype=torch.float64)}, {"head": {"w": w}})
    ties = fp.find_ties(params)
    assert ties == {"emb": [(0, "emb"), (1, ("head", "w"))]}
    assert "stage 1 ('head', 'w')" in fp.describe_ties(ties)
    assert fp.find_ties(({"a": w}, {"a": w.clone()})) == {}

    def embed(p: dict, ids: torch.Tensor) -> torch.Tensor:
        return p["emb"][ids] + p["b"]

    def head(p: dict, h: torch.Tensor) -> torch.Tensor:
        return h @ p["head"]["w"].T

    stages = [fp.Stage(embed), fp.Stage(head)]
    ids = torch.randint(0, 5, (4, 2))
    loss_fn = lambda o: o.pow(2).mean()  # noqa: E731
    untied = (params[0], {"head": {"w": w.clone() + 1}})  # the first member's value is used
    _, grads = fp.reference_step(stages, untied, ids, loss_fn, ties=ties)
    leaf = w.detach().requires_grad_(True)
    (embed({"emb": leaf, "b": params[0]["b"]}, ids) @ leaf.T).pow(2).mean().backward()
    torch.testing.assert_close(grads[0]["emb"], leaf.grad)
    torch.testing.assert_close(grads[1]["head"]["w"], leaf.grad)
    pipe = fp.Pipeline(
        stages, generate("1f1b", ranks=2, microbatches=1), loss_fn=loss_fn, ties=ties
    )
    _, pgrads = pipe.step(untied, ids)
    torch.testing.assert_close(pgrads, grads)


def test_partition_module_stages_take_side_inputs() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.fc(h) * mask

    torch.manual_seed(0)
    layers = nn.Sequential(Masked(), nn.Tanh(), Masked(), nn.Tanh()).double()
    part = fp.partition(layers, 2)
    x = torch.randn(4, 4, dtype=torch.float64)
    mask = (torch.arange(4.0, dtype=torch.float64) > 0).expand(4, 4).contiguous()
    prog = generate("1f1b", ranks=2, microbatches=2)
    pipe = fp.Pipeline(part.stages, prog, loss_fn=lambda o: o.pow(2).mean(), side_inputs={0: ["mask"], 1: ["mask"]})  # fmt: skip
    loss, grads = pipe.step(part.params, {"inputs": x, "mask": mask})
    layers.zero_grad()
    ref = sum(layers[3](layers[2](layers[1](layers[0](x[j : j + 2], mask[j : j + 2])), mask[j : j + 2])).pow(2).mean() / 2 for j in (0, 2))  # fmt: skip
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    named = dict(layers.named_parameters())
    for g in grads:
        for k, v in g.items():
            torch.testing.assert_close(v, named[k].grad)


def test_points_errors_say_what_to_do() -> None:
    model, d = _model(), _data()
    example = {"ids": d["ids"][:2], "mask": d["mask"][:2]}
    with pytest.raises(fp.InvalidArgument, match=r"not a submodule.*did you mean \['blocks.2"):
        fp.split_module(model, ["block.2"], example=example)
    # (refused before torch.export runs: its 4 blocks bound the cuts)
    with pytest.raises(fp.InvalidArgument, match=r"can be cut in at most 4 places, so into at most 5 stages: .*'blocks' \(4\)"):  # fmt: skip
        fp.split_module(model, 6, example=example)
    with pytest.raises(fp.InvalidArgument, match="not keys of example"):
        fp.split_module(model, 2, example=example, inputs=["x"])
    sp = fp.split_module(model, lambda name, m: name in ("blocks.1", "blocks.3"), example=example)
    assert sp.points == ("blocks.1", "blocks.3") and len(sp.stages) == 3


def test_untraceable_forward_says_what_to_do_instead() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # control flow on a value: torch.export cannot trace it
                return self.b(self.a(x))
            return self.a(x)

    with pytest.raises(fp.FuncpipeError, match="could not trace DataDependent.*by hand"):
        fp.split_module(DataDependent(), ["b"], example=torch.randn(3, 2))


def test_buffer_written_in_forward_is_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3))
    with pytest.raises(
        fp.InvalidArgument,
        match=r"^call module.eval\(\) before split_module: .*writes .*running_mean",
    ):
        fp.split_module(model, ["2"], example=torch.randn(4, 3))
    sp = fp.split_module(model.eval(), ["2"], example=torch.randn(4, 3))
    assert len(sp.stages) == 2


# ---- issue 42: a split model run on other shapes than its example
class MeanBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, length: Any) -> torch.Tensor:
        return h + torch.tanh(self.fc(h)) - h.sum(1, keepdim=True) / length


class LengthLM(nn.Module):
    """Every block divides by the sequence length, read once from the batch: traced on 16 tokens
    the graph holds ``/ 16``; with a dynamic length that size crosses every cut."""

    def __init__(self, vocab: int = 11, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MeanBlock(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, length)
        return self.head(h)


def _length_lm() -> tuple[LengthLM, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (8, 17), generator=torch.Generator().manual_seed(2))
    return LengthLM().double(), ids


def _unsplit_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    model.zero_grad()
    b = x.shape[0] // m
    total = torch.zeros((), dtype=torch.float64)
    for j in range(m):
        loss = xent(model(x[j * b : (j + 1) * b]), y[j * b : (j + 1) * b]) / m
        loss.backward()
        total += loss.detach()
    return total


def test_other_sequence_length_than_the_example_is_refused_before_any_step() -> None:
    """Traced on 16 tokens and stepped on 12, the graph kept ``/ 16``: a silently wrong loss."""
    model, ids = _length_lm()
    sp = fp.split_module(model, 2, example=ids[:2, :16])
    calls: list[int] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return xent(out, y)

    pipe = fp.Pipeline(sp.stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=loss_fn)
    said = r"stage 0 \(made by split_module\) was traced on input 'ids' = i64\[2, 16\] and is given i64\[2, 12\]: dim 1 is 12, the example's 16"  # fmt: skip
    with pytest.raises(fp.InvalidArgument, match=said) as e:
        pipe.step(sp.params, ids[:, :12], ids[:, 1:13])
    assert "dynamic_shapes={'ids': {1: torch.export.Dim(" in str(e.value)
    assert not calls  # refused by shape inference, before any stage ran on data
    with pytest.raises(fp.InvalidArgument, match=said):
        fp.reference_step(sp.stages, sp.params, ids[:, :12], xent, targets=ids[:, 1:13], microbatches=4)  # fmt: skip
    with pytest.raises(fp.InvalidArgument, match=said):
        sp.stages[0](sp.params[0], ids[:2, :12])
    # the example's shape still runs, and equals the unsplit model
    loss, _ = pipe.step(sp.params, ids[:, :16], ids[:, 1:17])
    torch.testing.assert_close(loss, _unsplit_loss(model, ids[:, :16], ids[:, 1:17], 4))


def test_microbatch_size_other_than_the_example_names_the_microbatches() -> None:
    model, d = _model(), _data()
    sp = fp.split_module(model, 2, example={"ids": d["ids"][:2], "mask": d["mask"][:2]})
    pipe = fp.Pipeline(
        sp.stages,
        generate("1f1b", ranks=2, microbatches=1),  # one microbatch of 4 rows; the example has 2
        loss_fn=xent,
        ties=sp.ties,
        side_inputs=sp.side_inputs,
    )
    with pytest.raises(fp.InvalidArgument, match=r"dim 0 \(the microbatch size, where the batch dim is 0\) is 4, the example's 2") as e:  # fmt: skip
        pipe.step(sp.params, sp.batch(d), d["y"])
    assert "The example is one microbatch" in str(e.value) and "dynamic_shapes=" in str(e.value)


def test_side_input_of_another_dtype_is_refused() -> None:
    model, d = _model(), _data()
    sp = fp.split_module(model, 2, example={"ids": d["ids"][:2], "mask": d["mask"][:2]})
    said = r"side input 'mask' = f64\[2, 5\] and is given f32\[2, 5\]: its dtype is float32, the example's float64"  # fmt: skip
    with pytest.raises(fp.InvalidArgument, match=said):
        sp.stages[0](sp.params[0], d["ids"][:2], mask=d["mask"][:2].float())
    with pytest.raises(fp.InvalidArgument, match=r"traced on input 'ids' = i64\[2, 5\] and is given \[1, 2\] \(a list\)"):  # fmt: skip
        sp.stages[0](sp.params[0], [1, 2], mask=d["mask"][:2])


def test_split_stages_under_autocast_pass_low_precision_on() -> None:
    """autocast_stage: a floating input may come in the autocast dtype (not a mismatch)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(4, 4)
    sp = fp.split_module(model, ["1"], example=x[:2])
    stages = [fp.autocast_stage(s, torch.bfloat16) for s in sp.stages]
    h = stages[0](sp.params[0], x[:2])
    assert h[0].dtype == torch.bfloat16  # a linear's output under autocast crosses the cut
    assert stages[1](sp.params[1], *h).shape == (2, 4)
    with pytest.raises(fp.InvalidArgument, match="its dtype is bfloat16, the example's float32"):
        sp.stages[1](sp.params[1], *h)  # without autocast the traced float32 is required


def test_split_stages_refuse_params_of_other_dtypes_or_shapes() -> None:
    """The traced graph holds the module's parameter shapes and dtypes: other params are
    refused naming the param, both specs and the fix (they failed inside torch, or computed in
    another dtype without a word); under autocast the params stay as traced and pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    x = torch.randn(2, 4)
    sp = fp.split_module(model, ["1"], example=x)
    low = {k: v.to(torch.bfloat16) for k, v in sp.params[0].items()}
    with pytest.raises(fp.InvalidArgument, match=r"param '0.weight' = f32\[8, 4\] and is given bf16\[8, 4\]"):  # fmt: skip
        sp.stages[0](low, x)
    half = {**sp.params[1], "1.weight": sp.params[1]["1.weight"][:2]}  # a tensor-parallel piece
    with pytest.raises(fp.InvalidArgument, match=r"param '1.weight' = f32\[4, 8\] and is given f32\[2, 8\]"):  # fmt: skip
        sp.stages[1](half, torch.randn(2, 8))
    with pytest.raises(fp.InvalidArgument, match=r"param '0.bias' = f32\[8\] and is given \[0.0\]"):  # fmt: skip
        sp.stages[0]({**sp.params[0], "0.bias": [0.0]}, x)
    (h,) = fp.autocast_stage(sp.stages[0], torch.bfloat16)(sp.params[0], x)
    assert h.dtype == torch.bfloat16
    ref = model(x)
    torch.testing.assert_close(sp.stages[1](sp.params[1], *sp.stages[0](sp.params[0], x)), ref)


def test_dynamic_sizes_cross_cuts_and_equal_the_unsplit_model() -> None:
    """A size made symbolic by dynamic_shapes and read in later stages (the length each block
    divides by) is read there from an input's shape: it used to be refused as a non-tensor
    crossing the cut, with the advice to move the cut."""
    from torch.export import Dim

    model, ids = _length_lm()
    dims = {"ids": {0: Dim("batch", max=64), 1: Dim("seq", min=2, max=32)}}
    sp = fp.split_module(model, 3, example=ids[:2, :16].clone(), dynamic_shapes=dims)
    assert repr(sp.stages[1].fn.check.specs[0].show(sp.stages[1].fn.check.names)) == "'f64[batch, seq, 8]'"  # fmt: skip
    pipe = fp.Pipeline(sp.stages, generate("1f1b", ranks=3, microbatches=2), loss_fn=xent)
    for rows, length in [(6, 12), (8, 16), (4, 7)]:
        x, y = ids[:rows, :length], ids[:rows, 1 : length + 1]
        loss, grads = pipe.step(sp.params, x, y)
        torch.testing.assert_close(loss, _unsplit_loss(model, x, y, 2), rtol=1e-13, atol=1e-13)
        named = dict(model.named_parameters())
        for g in grads:
            for k, v in g.items():
                torch.testing.assert_close(v, named[k].grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(fp.InvalidArgument, match=r"= i64\[batch, seq\] and is given i64\[2, 40\]: dim 1 is 40, outside 2..32"):  # fmt: skip
        sp.stages[0](sp.params[0], ids[:2].repeat(1, 3)[:, :40])
    model, d = _model(), _data()
    seq = Dim("seq", min=2, max=32)
    both = {"ids": {1: seq}, "mask": {1: seq}}
    example = {"ids": d["ids"][:2].clone(), "mask": d["mask"][:2]}  # its own: not a view
    sp = fp.split_module(model, 2, example=example, dynamic_shapes=both)
    with pytest.raises(fp.InvalidArgument, match=r"side input 'mask' = f64\[2, seq\] and is given f64\[2, 4\]: dim 1 is 4 where input 'ids' dim 1 is 5, and the trace found them one size \(seq\)"):  # fmt: skip
        sp.stages[0](sp.params[0], d["ids"][:2], mask=d["mask"][:2, :4])


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        pooled = self.a(x).mean(0)  # the rows are gone: nothing after the cut has that size
        return self.b(pooled).expand(rows, 4)


def test_symbolic_size_no_later_input_holds_is_refused_saying_why() -> None:
    from torch.export import Dim

    said = r"the size 'sym_size_int.*' \(.*a dim that dynamic_shapes= made symbolic\) is made before stage 1 from b and read in it.*no tensor the stage takes has a dim of that size.*leave it out of dynamic_shapes="  # fmt: skip
    with pytest.raises(fp.InvalidArgument, match=said):
        fp.split_module(Pooled(), ["b"], example=torch.randn(3, 4), dynamic_shapes={"x": {0: Dim("rows")}})  # fmt: skip
