"""split_module on plain torch models: names kept, ties found, side inputs, no-gradient values.

Every pipeline result is compared with the unsplit module's own ``loss.backward()`` in float64.
"""

from __future__ import annotations

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
    with pytest.raises(fp.InvalidArgument, match="longest run of blocks 'blocks' has 4 blocks"):
        fp.split_module(model, 5, example=example)
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
    with pytest.raises(fp.InvalidArgument, match=r"writes .*running_mean.*eval\(\)"):
        fp.split_module(model, ["2"], example=torch.randn(4, 3))
    sp = fp.split_module(model.eval(), ["2"], example=torch.randn(4, 3))
    assert len(sp.stages) == 2
