"""The bad-input catalogue: user mistakes across the API, the error each one raises, and the docs.

Every row of :data:`CASES` makes one mistake. ``test_catalogue[<id>]`` asserts the exact error
class and the keywords of its message (a ``funcpipe:`` traceback note counts as part of the
message: that is what the user reads). ``docs/errors.md`` is rendered from the same rows, with
the message each one actually produces; ``test_docs_are_up_to_date`` fails when it is stale.

Regenerate the page with::

    .venv/bin/python tests/test_errors_catalogue.py --write-docs
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import funcpipe as fp  # noqa: E402
from funcpipe.errors import (  # noqa: E402
    FuncpipeError,
    InvalidArgument,
    ScheduleError,
    ShapeInferenceError,
)
from funcpipe.models import moe  # noqa: E402
from funcpipe.models.gpt import GPTConfig  # noqa: E402
from funcpipe.parallel import ops, summa  # noqa: E402
from funcpipe.parallel.mesh import Axis, ParallelConfig  # noqa: E402
from funcpipe.parallel.routing import dispatch  # noqa: E402
from funcpipe.parallel.sharding import Sharding  # noqa: E402
from funcpipe.schedule import (  # noqa: E402
    Program,
    check,
    forward,
    generate,
    lower,
    parse_program,
    read_csv,
    send,
)
from funcpipe.train import checkpoint, checkpoint_write, optim  # noqa: E402

DOCS = ROOT / "docs" / "errors.md"
F32 = torch.float32


@dataclass(frozen=True)
class Case:
    """One user mistake: ``make()`` commits it; ``error`` and ``keywords`` are what the user sees.

    ``fixed`` says where an up-front check or a clearer message was added for this mistake (it
    used to give a bare torch error, a ``KeyError`` or a ``PicklingError``); empty when the
    error was already clear.
    """

    id: str
    area: str
    mistake: str
    make: Callable[[], object]
    error: type[BaseException]
    keywords: tuple[str, ...]
    fixed: str = ""


# ------------------------------------------------------------------------------ building blocks
def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _tanh_layer(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ params["w"])


def _params(*shapes: tuple[int, int], dtype: torch.dtype = F32) -> tuple[dict[str, Any], ...]:
    g = torch.Generator().manual_seed(0)
    return tuple({"w": torch.randn(*s, generator=g, dtype=dtype)} for s in shapes)


def _two_stages(**kw: Any) -> fp.Pipeline:
    stages = [fp.Stage(_tanh_layer, name="first"), fp.Stage(_tanh_layer, name="second")]
    kw.setdefault("loss_fn", _mse)
    return fp.Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), **kw)


def _xy(batch: int = 8, width: int = 4, *, targets: int | None = None) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch if targets is None else targets, width, generator=g)
    return x, y


def _step(pipe: fp.Pipeline, params: Any, x: Any, y: Any) -> None:
    pipe.step(params, x, y)


def _edit(program: Program, rank: int, fn: Callable[[list[Any]], list[Any]]) -> Program:
    ranks = [list(r) for r in program.ranks]
    ranks[rank] = fn(ranks[rank])
    return program.replace(ranks=tuple(tuple(r) for r in ranks))


def _1f1b() -> Program:
    return generate("1f1b", ranks=2, microbatches=2)


def _later_microbatch_changes(change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A stage that returns something else from its second real call on."""
    calls = {"real": 0}

    def fickle(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = _tanh_layer(params, x)
        if not (x.is_meta or is_fake(x)):  # shape inference runs without data
            calls["real"] += 1
            if calls["real"] > 1:
                return change(out)
        return out

    stages = [fp.Stage(fickle, name="fickle"), fp.Stage(_tanh_layer, name="second")]
    pipe = fp.Pipeline(stages, _1f1b(), loss_fn=_mse)
    pipe.step(_params((4, 4), (4, 4)), *_xy())


def _raises_on_input(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    raise ValueError(f"this stage only takes 3 features; got x of shape {tuple(x.shape)}")


def _returns_int(params: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    return x.shape[0]


def _positive_rows(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x[x[:, 0] > 0]


@contextlib.contextmanager
def _one_process_group() -> Iterator[None]:
    """A gloo process group of this process alone (world size 1), for the duration."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _program_wider_than_world() -> None:
    with _one_process_group():
        _two_stages(transport="dist")


def _mesh_narrower_than_program() -> None:
    from funcpipe.parallel.mesh import build_mesh

    with _one_process_group():
        mesh = build_mesh({"pipeline": 1, "tensor": 1})
        _two_stages(transport="dist", mesh=mesh)


def _tmp() -> str:
    return tempfile.mkdtemp(prefix="fp-catalogue-")


def _saved() -> str:
    return checkpoint.save(os.path.join(_tmp(), "ck"), {"w": torch.ones(3), "step": 2}, step=2)


def _foreign_directory() -> None:
    target = os.path.join(_tmp(), "my-notes")
    os.makedirs(target)
    checkpoint.save(target, {"w": torch.ones(3)})


def _update_mismatch() -> None:
    opt = optim.sgd(0.1)
    params = {"w": torch.ones(2)}
    opt.update({"v": torch.ones(2)}, opt.init(params), params)


def _side_inputs_missing() -> None:
    pipe = _two_stages(side_inputs={1: ["mask"]})
    x, y = _xy()
    pipe.step(_params((4, 4), (4, 4)), {"inputs": x}, y)


def _tie(members: list[tuple[int, str]], params: tuple[dict[str, Any], ...]) -> None:
    pipe = _two_stages(ties={"w": members})
    x, y = _xy(targets=None)
    if params[1]["w"].shape[1] != 4:
        y = torch.randn(8, params[1]["w"].shape[1])
    pipe.step(params, x, y)


def _2d_mismatch() -> None:
    row, col = Axis("tensor_row", 1, 0, None), Axis("tensor_col", 1, 0, None)
    summa.linear_2d(torch.randn(2, 3, 5), {"weight": torch.randn(4, 4)}, row=row, col=col)


def _deadlock() -> Program:
    low = lower(_1f1b())  # rank 0 waits for a gradient before sending the activation it needs
    return _edit(low, 0, lambda r: [r[0], r[4].join(False), r[5], r[6], r[1], r[2], r[3], r[7]])


# ------------------------------------------------------------- issue 33: silently wrong results
def _inference_params() -> None:
    with torch.inference_mode():
        params = _params((4, 4), (4, 4))
    _two_stages().step(params, *_xy())


def _inside_inference_mode() -> None:
    pipe, params, (x, y) = _two_stages(), _params((4, 4), (4, 4)), _xy()
    with torch.inference_mode():
        pipe.step(params, x, y)


def _shared_without_tie() -> None:
    w = _params((4, 4))[0]["w"]
    _two_stages().step(({"w": w}, {"w": w}), *_xy())


def _returns_none(params: dict[str, torch.Tensor], x: torch.Tensor) -> None:
    torch.tanh(x @ params["w"])  # computed, never returned


def _within(seconds: float, make: Callable[[], object]) -> object:
    """``make()``, whose error must come within ``seconds`` (else an AssertionError saying how
    long it took, which the catalogue's test reports as the wrong error)."""
    start = time.monotonic()
    try:
        return make()
    finally:
        took = time.monotonic() - start
        if took >= seconds:
            raise AssertionError(f"the error came after {took:.1f} s, not within {seconds:g} s")


def _no_cuda() -> None:
    from unittest import mock

    with mock.patch.object(torch.cuda, "is_available", lambda: False):
        _two_stages(device="cuda")


def _cli(*argv: str) -> None:
    from funcpipe.cli.app import _build_parser

    args = _build_parser().parse_args(list(argv))
    args.handler(args)


def _under_a_file() -> str:
    root = _tmp()
    Path(root, "notes.txt").write_text("")
    return os.path.join(root, "notes.txt", "run")


def _disk_full() -> None:
    import errno
    from unittest import mock

    class FullDisk(checkpoint_write.FileSystemWriter):
        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch.object(checkpoint_write, "FileSystemWriter", FullDisk):
        checkpoint.save(os.path.join(_tmp(), "ck"), {"w": torch.ones(3)})


def _flipped_bit() -> None:
    path = checkpoint.save(os.path.join(_tmp(), "ck"), {"w": torch.arange(4096.0)})
    metadata = checkpoint._SafeReader(path).read_metadata()
    item = next(v for k, v in metadata.storage_data.items() if k.fqn == "w")
    data = Path(path, item.relative_path)
    raw = bytearray(data.read_bytes())
    raw[item.offset + item.length // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    checkpoint.load(path, {"w": torch.zeros(4096)})


def _demo(*argv: str) -> None:
    from funcpipe.cli import demo

    demo.run(demo.parse(["--steps", "2", "--device", "cpu", *argv]))


# ------------------------------------------------- issue 42: split_module run on other shapes
class _LengthLM(nn.Module):
    """Divides by the sequence length it reads from the batch: traced on 16 tokens, ``/ 16``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.fc, self.head = nn.Embedding(11, 4), nn.Linear(4, 4), nn.Linear(4, 11)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.fc(h).sum(1, keepdim=True) / ids.shape[1])


def _split_lm_step(rows: int, length: int, microbatches: int) -> None:
    """Split on microbatches of 2 rows and 16 tokens, stepped on ``rows`` x ``length``."""
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (8, 17))
    parts = fp.split_module(_LengthLM(), ["head"], example=ids[:2, :16])
    pipe = fp.Pipeline(
        parts.stages,
        generate("1f1b", ranks=2, microbatches=microbatches),
        loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
    )
    pipe.step(parts.params, ids[:rows, :length], ids[:rows, 1 : length + 1])


def _split_other_dtype() -> None:
    parts = fp.split_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), ["1"], example=torch.randn(2, 4))  # fmt: skip
    pipe = fp.Pipeline(parts.stages, _1f1b(), loss_fn=_mse)
    pipe.step(parts.params, torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4))


def _split_params_other_dtype() -> None:
    parts = fp.split_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), ["1"], example=torch.randn(2, 4))  # fmt: skip
    low = [{k: v.to(torch.bfloat16) for k, v in p.items()} for p in parts.params]
    pipe = fp.Pipeline(parts.stages, _1f1b(), loss_fn=_mse)
    pipe.step(low, torch.randn(4, 4), torch.randn(4, 4))


class _Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]  # read in the second stage, after the rows are pooled away
        return self.b(self.a(x).mean(0)).expand(rows, 4)


def _symbolic_size_across_cut() -> None:
    from torch.export import Dim

    rows = {"x": {0: Dim("rows")}}
    fp.split_module(_Pooled(), ["b"], example=torch.randn(3, 4), dynamic_shapes=rows)


# ------------------------------------------------ issue 42 (i42d): loss scale, checkpoints, CLI
def _scale_to_floor() -> None:
    """Three overflows in a row from a scale of 4: 2, then 1 (the floor), then one at 1."""
    state = fp.loss_scale.init(4.0)
    for _ in range(3):
        state = fp.loss_scale.update(state, False)


def _corrupt_info() -> None:
    path = checkpoint.save(os.path.join(_tmp(), "ck"), {"w": torch.ones(3)})
    Path(path, "funcpipe.json").write_text('{"format": "funcpipe.train.checkpoint", "ver')
    checkpoint.load(path, {"w": torch.ones(3)})


def _disk_fills_in_torch_save() -> None:
    """The disk fills after 700 bytes of a data file, inside torch.save's zip writer."""
    import contextlib
    import errno
    from unittest import mock

    class Filling(checkpoint_write.FileSystemWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            create, left = self.fs.create_stream, [700]

            class Stream:
                def __init__(self, inner: Any) -> None:
                    self.inner = inner

                def write(self, data: Any) -> Any:
                    left[0] -= memoryview(data).nbytes
                    if left[0] < 0:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return self.inner.write(data)

                def __getattr__(self, name: str) -> Any:
                    return getattr(self.inner, name)

            @contextlib.contextmanager
            def stream(path: Any, mode: str) -> Iterator[Any]:
                with create(path, mode) as f:
                    yield Stream(f) if str(path).endswith(".distcp") else f

            self.fs.create_stream = stream  # type: ignore[method-assign]

    with mock.patch.object(checkpoint_write, "FileSystemWriter", Filling):
        checkpoint.save(os.path.join(_tmp(), "ck"), {"w": torch.ones(3)})


def _emptied_data_file() -> None:
    path = checkpoint.save(os.path.join(_tmp(), "ck"), {"w": torch.ones(3)})
    Path(path, "__0_0.distcp").write_bytes(b"")
    checkpoint.load(path, {"w": torch.ones(3)})


def _binary_csv() -> None:
    path = Path(_tmp(), "schedule.csv")
    path.write_bytes(bytes(range(256)))
    read_csv(path)


def _zero_layout(level: int) -> None:
    from funcpipe.planner import ClusterLayout

    ClusterLayout(data=2, zero=level)


def _plan(layers: int = 32, heads: int = 32, *, pipeline: int | None = None, **kw: Any) -> None:
    from funcpipe.planner import ClusterLayout, Transformer

    model = Transformer(layers=layers, hidden=64 * heads, heads=heads, vocab=50000, seq=2048)
    layout = None if pipeline is None else ClusterLayout(pipeline=pipeline)
    fp.plan(model, gpu="h100-sxm", layout=layout, **kw)


# ------------------------------------------------------ issue 43 (i43-errs): split_module's errors
def _split_whole_batch_example() -> None:
    """The whole batch of 8 rows given as the example, stepped in 4 microbatches of 2."""
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (8, 17))
    parts = fp.split_module(_LengthLM(), ["head"], example=ids[:, :16])
    pipe = fp.Pipeline(
        parts.stages,
        generate("1f1b", ranks=2, microbatches=4),
        loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
    )
    pipe.step(parts.params, ids[:, :16], ids[:, 1:17])


def _split_batchnorm_training() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(4)])
    fp.split_module(model, ["2"], example=torch.randn(6, 4))  # still in training mode


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.b(self.a(x))
        return self.a(x)


def _split_cut_name_typo() -> None:
    from collections import OrderedDict

    body = nn.Sequential(OrderedDict(attn=nn.Linear(4, 4), mlp=nn.Linear(4, 4)))
    fp.split_module(nn.Sequential(OrderedDict(body=body)), ["body.mpl"], example=torch.randn(2, 4))


def _pair_then_mean() -> Callable[..., Any]:
    """A loss_fn that returns (sum, count) on its first call and a mean after."""
    calls = {"n": 0}

    def loss(o: torch.Tensor, y: torch.Tensor) -> Any:
        calls["n"] += 1
        sq = ((o - y) ** 2).sum()
        return (sq, o.numel()) if calls["n"] == 1 else sq / o.numel()

    return loss


def _masked_pair(o: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) over the entries whose target is not 0 (0 plays ignore_index)."""
    keep = y != 0
    return ((o - y) ** 2 * keep).sum(), keep.sum()


# --------------------------------------------------------- issue 51: what clusters and users do
def _resume_at_another_batch() -> None:
    out = _tmp()
    checkpoint.save(os.path.join(out, "checkpoint"), {"w": torch.ones(1)}, step=1)
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump({"batch": 8, "data": 1, "context": 64, "seed": 0, "corpus_bytes": 3_000_000,
                   "precision": "fp32"}, f)  # fmt: skip
    _demo("--out", out, "--resume", "--batch", "4")


def _modified_while_saved() -> None:
    os.environ["FUNCPIPE_TEST_CHECKPOINT_PAUSE"] = "background:0.3"
    try:
        params = [{"w": torch.ones(4)}]
        pending = checkpoint.save_model_async(os.path.join(_tmp(), "ck"), params, step=1)
        params[0]["w"].mul_(2)  # an in-place update of what the save is writing
        pending.wait()
    finally:
        del os.environ["FUNCPIPE_TEST_CHECKPOINT_PAUSE"]


# ------------------------------------------ issue 44 (i44-ckpt): checkpoints keyed by model names
def _model_saved() -> str:
    params = ({"w1": torch.ones(4, 3)}, {"w2": torch.ones(3, 2)})
    return checkpoint.save_model(os.path.join(_tmp(), "ck"), params, step=2)


def _gpt_split(blocks: Any) -> Any:
    from funcpipe.models import gpt

    cfg = GPTConfig(vocab=16, context=4, d_model=8, heads=2, layers=3)
    return gpt.split(gpt.init(cfg), cfg, 2, blocks=blocks)


def _half_saved() -> str:
    """Saved by tensor rank 0 of 2 alone: rows 2-3 of w are in no piece."""
    naming = checkpoint.Naming(
        shardings=({"w": Sharding.of("tensor", None)},),
        place=fp.parallel.Place(0, {"tensor": 0}, {"tensor": 2}),
    )
    return checkpoint.save_model(
        os.path.join(_tmp(), "ck"), ({"w": torch.ones(2, 3)},), naming=naming
    )


def _zero_even() -> tuple[Any, Any, Any]:
    """ZeRO-1 over 2 copies in one process, every leaf of even size (the copies' pieces have one
    shape), its shards and a batch."""
    stages = [fp.Stage(lambda p, t: torch.tanh(p["E"][t])), fp.Stage(lambda p, h: h @ p["U"])]
    pipe = fp.Pipeline(
        stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=fp.token_cross_entropy,
        data=2, zero=1,
    )  # fmt: skip
    shards = pipe.shard(({"E": torch.randn(16, 8)}, {"U": torch.randn(8, 16)}))
    tokens = torch.randint(0, 16, (4, 5))
    return pipe, shards, (tokens, tokens.roll(1, dims=1))


def _zero_swapped() -> None:
    pipe, shards, batch = _zero_even()
    pipe.step([shards[1], shards[0]], *batch)


def _zero_mixed_copies() -> None:
    pipe, shards, batch = _zero_even()
    grads = pipe.step(shards, *batch).grads
    opt = optim.adamw(1e-2)
    opt.update(grads[0], opt.init(shards[1]), shards[1])


def _export_by_paths() -> None:
    old = checkpoint.save(os.path.join(_tmp(), "ck"), {"params": ({"w": torch.ones(2)},)})
    checkpoint.export(old, os.path.join(_tmp(), "model.safetensors"))


def _safetensors_of_another_model() -> None:
    ck = checkpoint.save_model(os.path.join(_tmp(), "ck"), ({"w": torch.ones(4, 3)},))
    out = os.path.join(_tmp(), "model.safetensors")
    checkpoint.export(ck, out)
    checkpoint.load_safetensors(out, ({"w": torch.zeros(3, 4), "b": torch.zeros(3)},))


def _moe_experts_not_divisible() -> None:
    config = moe.MoEConfig(d_model=4, experts=6, ffn=3)
    moe.moe(moe.init(config), torch.randn(2, 4), config, axis=Axis("expert", 4, 0, None))


def _expert_mesh() -> Any:
    from types import SimpleNamespace

    config = ParallelConfig.from_dict({"pipeline": 2, "expert": 2}, world_size=4)
    return SimpleNamespace(config=config)


def _experts_not_named() -> None:
    from funcpipe.pipeline.experts import check_experts

    check_experts(None, 2, mesh=_expert_mesh(), transport="dist", ties={})


def _experts_as_paths_alone() -> None:
    from funcpipe.schedule import generate

    stages = [fp.Stage(_tanh_layer), fp.Stage(_tanh_layer)]
    fp.Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=_mse, experts=["w"])


def _gpt_expert_width_over_tensor_ranks() -> None:
    from funcpipe.models import gpt

    config = gpt.GPTConfig(experts=4, expert_ffn=6, mlp=8, heads=4, vocab=64)
    gpt.stages(config, 1, axis=Axis("tensor", 4, 0, None))


def _gpt_moe_tokens_without_the_expert_tensor_axis() -> None:
    from funcpipe.models import gpt

    config = gpt.GPTConfig(experts=4, moe_tensor="tokens")
    gpt.stages(config, 1, axis=Axis("tensor", 2, 0, None))


def _moe_tokens_that_do_not_divide_over_tensor() -> None:
    config = moe.MoEConfig(d_model=4, experts=4, ffn=4)
    full = moe.init(config)
    mine = {**full, "w_in": full["w_in"][:2], "w_out": full["w_out"][:2]}
    spread, tensor = Axis("expert_tensor", 2, 0, None), Axis("tensor", 2, 0, None)
    moe.moe(mine, torch.randn(3, 4), config, axis=spread, tensor=tensor, split="tokens")


def _moe_params_of_another_tensor_split() -> None:
    config = moe.MoEConfig(d_model=4, experts=2, ffn=4)
    moe.moe(moe.init(config), torch.randn(2, 4), config, tensor=Axis("tensor", 2, 0, None))


def _moe_load_of_another_layer() -> None:
    config = moe.MoEConfig(d_model=4, experts=8, ffn=3)
    moe.moe(moe.init(config), torch.randn(2, 4), config, load=torch.full((4,), 0.25))


def _tally_changes_shape() -> None:
    from funcpipe.schedule import generate
    from funcpipe.stages.tally import tally

    def stage(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        tally("rows", torch.ones(x.shape[0]))  # a tally whose shape follows the microbatch
        return x * p["w"]

    pipe = fp.Pipeline([fp.Stage(stage)], generate("gpipe", ranks=1, microbatches=2),
                       loss_fn=lambda o: o.sum())  # fmt: skip
    pipe.step(({"w": torch.ones(2)},), torch.ones(3, 2))


def _counts_of_another_layout() -> None:
    from funcpipe.models import gpt_balance

    config = GPTConfig(layers=2, experts=4)
    gpt_balance.batch_load({"blocks.1.moe.counts": torch.ones(8)}, config)


def _moe_bias_of_another_layer() -> None:
    config = moe.MoEConfig(d_model=4, experts=8, ffn=3)
    moe.moe(moe.init(config), torch.randn(2, 4), config, torch.zeros(6))


# ------------------------------------------------------------------------------------ the rows
CASES: list[Case] = [
    # ---- schedules
    Case(
        "schedule-deadlock",
        "schedules",
        "a hand-edited lowered program where rank 0 waits for a gradient before sending the "
        "activation that gradient depends on",
        lambda: check(_deadlock()),
        ScheduleError,
        ("rank 0, step 2", "deadlock", "rule: no deadlock"),
    ),
    Case(
        "schedule-missing-instruction",
        "schedules",
        "a training program missing the backward of stage 1, microbatch 1",
        lambda: check(_edit(_1f1b(), 1, lambda r: r[:-1])),
        ScheduleError,
        ("no backward", "s1 m1", "rule: in training every (stage, microbatch) has one backward"),
    ),
    Case(
        "schedule-duplicated-instruction",
        "schedules",
        "the same forward twice on one rank",
        lambda: check(_edit(_1f1b(), 0, lambda r: [r[0], *r])),
        ScheduleError,
        ("rank 0, step 1", "duplicate of rank 0, step 0", "F s0 m0"),
    ),
    Case(
        "schedule-wrong-peer",
        "schedules",
        "a SEND addressed to the wrong rank",
        lambda: check(
            _edit(lower(_1f1b()), 0, lambda r: [r[0], send("act", (0, 1), 0, 0), *r[2:]])
        ),
        ScheduleError,
        ("the peer is rank 0 but stage 1 is placed on rank 1",),
    ),
    Case(
        "schedule-stage-on-two-ranks",
        "schedules",
        "an instruction for stage 0 on rank 1, though stage 0 is placed on rank 0",
        lambda: check(_edit(_1f1b(), 1, lambda r: [forward(0, 0), *r])),
        ScheduleError,
        ("stage 0 is placed on rank 0, not rank 1", "change the placement"),
    ),
    Case(
        "schedule-backward-before-forward",
        "schedules",
        "a backward placed before its own forward",
        lambda: check(_edit(_1f1b(), 0, lambda r: [r[2], r[0], r[1], r[3]])),
        ScheduleError,
        ("B s0 m0", "needs F s0 m0, which comes later on this rank"),
    ),
    Case(
        "schedule-microbatch-out-of-range",
        "schedules",
        "an instruction for microbatch 5 in a program of 2 microbatches",
        lambda: check(_edit(_1f1b(), 0, lambda r: [*r, forward(0, 5)])),
        ScheduleError,
        ("microbatch 5 does not exist (0..1)",),
    ),
    Case(
        "schedule-missing-recv",
        "schedules",
        "a lowered program with a SEND whose RECV was deleted",
        lambda: check(_edit(lower(_1f1b()), 1, lambda r: r[1:])),
        ScheduleError,
        ("rank 1",),
    ),
    Case(
        "schedule-placement-out-of-range",
        "schedules",
        "a placement naming a rank the program does not have",
        lambda: Program(ranks=((),), placement=(0, 1), microbatches=1),
        ScheduleError,
        ("placement[1]=1", "the program has 1 rank(s)"),
    ),
    Case(
        "schedule-text-unknown-instruction",
        "schedules",
        "program text with an instruction that does not exist",
        lambda: parse_program("placement 0 1\nmicrobatches 2\nrank 0\n  X s0 m0\n"),
        ScheduleError,
        ("line 4", "cannot parse instruction 'X s0 m0'", "the forms are"),
    ),
    Case(
        "schedule-pair-malformed",
        "schedules",
        "an overlapped pair ('&') of two forwards",
        lambda: parse_program("placement 0 0\nmicrobatches 1\nrank 0\n  F s0 m0\n  & F s1 m0\n"),
        ScheduleError,
        ("the pair 'F s0 m0' & 'F s1 m0' is not an F with a B or I", "drop the '&'"),
    ),
    Case(
        "schedule-pair-not-independent",
        "schedules",
        "an overlapped pair whose backward needs (through another rank) its forward",
        lambda: check(
            parse_program(
                "placement 0 1\nmicrobatches 2\nrank 0: F s0 m0; F s0 m1; & B s0 m0; B s0 m1\n"
                "rank 1: F s1 m0; F s1 m1; B s1 m0; B s1 m1\n"
            )
        ),
        ScheduleError,
        ("'B s0 m0' (step 2) needs what 'F s0 m1' (step 1) produces", "which waits for rank 1"),
    ),
    Case(
        "schedule-text-missing-header",
        "schedules",
        "program text without its placement header",
        lambda: parse_program("microbatches 2\nrank 0\n  F s0 m0\n"),
        ScheduleError,
        ("no 'placement' header",),
    ),
    Case(
        "schedule-text-python-code",
        "schedules",
        "program text that is Python code (it is read as text, never run)",
        lambda: parse_program("__import__('os').system('echo pwned')"),
        ScheduleError,
        ("line 1", "unknown header"),
    ),
    Case(
        "schedule-csv-malformed-cell",
        "schedules",
        "a torch.distributed.pipelining CSV with a cell that is not an action",
        lambda: read_csv("0F0,0Q1\n,1F0\n"),
        ScheduleError,
        ("CSV row 0 (rank 0), column 1", "cannot read cell '0Q1'"),
    ),
    Case(
        "schedule-csv-communication-cell",
        "schedules",
        "a CSV with communication cells, read with comms='reject'",
        lambda: read_csv("0F0,0SEND_F0\n,1F0\n", comms="reject"),
        ScheduleError,
        ("'0SEND_F0' is a communication or FSDP action", "comms='skip'"),
    ),
    Case(
        "schedule-unknown-generator",
        "schedules",
        "a schedule name that does not exist",
        lambda: generate("1f2b", ranks=2, microbatches=4),
        InvalidArgument,
        ("name='1f2b' is not a schedule", "1f1b"),
    ),
    Case(
        "schedule-zero-microbatches",
        "schedules",
        "a schedule of 0 microbatches",
        lambda: generate("1f1b", ranks=2, microbatches=0),
        InvalidArgument,
        ("microbatches=0", ">= 1"),
    ),
    Case(
        "pipeline-schedule-not-a-program",
        "schedules",
        "a schedule name where a Program is expected",
        lambda: fp.Pipeline([fp.Stage(_tanh_layer)] * 2, "1f1b", loss_fn=_mse),
        InvalidArgument,
        ("schedule='1f1b'", "generate('1f1b'"),
    ),
    Case(
        "pipeline-training-without-loss",
        "schedules",
        "a training schedule without loss_fn",
        lambda: fp.Pipeline([fp.Stage(_tanh_layer)] * 2, _1f1b()),
        InvalidArgument,
        ("needs loss_fn", "to_eval(program)"),
    ),
    Case(
        "plan-gpus-beyond-limit",
        "schedules",
        "funcpipe plan --gpus 1000000000",
        lambda: _plan(gpus=10**9, global_batch=512),
        InvalidArgument,
        ("plan(gpus=1000000000)", "up to 1,048,576 GPUs", "at most that many"),
        "funcpipe/planner/layout.py check_gpus (the search walked every number up to the GPU "
        "count: no answer in 150 s)",
    ),
    Case(
        "plan-stages-beyond-limit",
        "schedules",
        "funcpipe plan with a fixed layout of a million pipeline stages",
        lambda: _plan(10**7, pipeline=10**6, gpus=10**6, global_batch=512),
        InvalidArgument,
        ("pipeline=1000000", "1,000,000 stages", "at most 1,024 pipeline stages"),
        "funcpipe/planner/estimate.py check_layout (simulated without a limit: no answer in 150 s)",
    ),
    Case(
        "plan-search-too-many-layouts",
        "schedules",
        "funcpipe plan searching 720,720 GPUs for 720,720 layers (157,680 layouts with 3 sharding levels)",
        lambda: _plan(720720, gpus=720720, global_batch=8 * 720720),
        InvalidArgument,
        ("more than 20,000 layouts", "narrow it", "price one layout"),
        "funcpipe/planner/search.py (priced every layout, for minutes)",
    ),
    Case(
        "plan-batch-no-data-size-divides",
        "schedules",
        "funcpipe plan with a global batch of 7 on 64 GPUs, for a model of 2 layers and 2 heads",
        lambda: _plan(2, 2, gpus=64, global_batch=7),
        InvalidArgument,
        ("global_batch=7 is not a multiple of any data size", "16, 32 or 64", "a multiple of 16"),
        "funcpipe/planner/search.py (said 'add GPUs, allow recompute, or use a GPU with more "
        "memory')",
    ),
    Case(
        "plan-zero-level-unknown",
        "schedules",
        "a planner layout with a sharding level the runtime does not have (ZeRO-3)",
        lambda: _zero_layout(3),
        InvalidArgument,
        ("ClusterLayout(zero=3)", "1 (ZeRO-1", "2 (ZeRO-2"),
    ),
    Case(
        "cli-schedule-png-unwritable",
        "schedules",
        "funcpipe schedule --png a path under a file",
        lambda: _cli("schedule", "1f1b", "-p", "2", "-m", "2", "--png", _under_a_file() + ".png"),
        InvalidArgument,
        ("--png", "cannot be written", "is a file, not a directory", "a directory you can write"),
        "funcpipe/cli/schedule.py _write_files (was an uncaught FileExistsError)",
    ),
    Case(
        "schedule-csv-binary-file",
        "schedules",
        "a binary file given to funcpipe check (read_csv) as a torch pipelining CSV",
        _binary_csv,
        InvalidArgument,
        ("is not a text file", "byte 0x80 at offset 128 is not UTF-8", "_dump_csv"),
        "funcpipe/schedule/interop.py read_csv (was an uncaught UnicodeDecodeError)",
    ),
    # ---- stages and partitions
    Case(
        "partition-more-stages-than-layers",
        "stages and partitions",
        "partition a 2-layer model into 3 stages",
        lambda: fp.partition(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 3),
        InvalidArgument,
        ("stages=3", "only 2 layers", "at most 2 stages"),
    ),
    Case(
        "partition-unknown-method",
        "stages and partitions",
        "partition with an unknown by=",
        lambda: fp.partition(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2, by="magic"),
        InvalidArgument,
        ("by='magic'", "'uniform', 'parameters', 'profile'"),
    ),
    Case(
        "partition-cut-out-of-range",
        "stages and partitions",
        "explicit cut indices past the last layer",
        lambda: fp.partition(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2, by=[5]),
        InvalidArgument,
        ("by=[5]", "strictly increasing"),
    ),
    Case(
        "stage-not-callable",
        "stages and partitions",
        "a Stage made of something that is not a function",
        lambda: fp.Stage(3),
        InvalidArgument,
        ("fn=3", "from_module"),
    ),
    Case(
        "pipeline-stage-count",
        "stages and partitions",
        "one stage for a two-stage schedule",
        lambda: fp.Pipeline([fp.Stage(_tanh_layer)], _1f1b(), loss_fn=_mse),
        InvalidArgument,
        ("2 model stage(s) but 1 stage(s)",),
    ),
    Case(
        "stage-raises-on-example",
        "stages and partitions",
        "a stage that raises on the first microbatch (here: its own input check)",
        lambda: fp.Pipeline(
            [fp.Stage(_raises_on_input, name="picky"), fp.Stage(_tanh_layer)],
            _1f1b(),
            loss_fn=_mse,
        ).step(_params((4, 4), (4, 4)), *_xy()),
        ShapeInferenceError,
        ("stage 0 ('picky')", "ValueError: this stage only takes 3 features", "real microbatch"),
    ),
    Case(
        "stage-returns-non-tensor",
        "stages and partitions",
        "a stage that returns an int",
        lambda: fp.Pipeline(
            [fp.Stage(_returns_int), fp.Stage(_tanh_layer)], _1f1b(), loss_fn=_mse
        ).step(_params((4, 4), (4, 4)), *_xy()),
        InvalidArgument,
        ("returned a non-tensor leaf", "pytrees of tensors"),
    ),
    Case(
        "stage-data-dependent-shape",
        "stages and partitions",
        "shape inference with fallback='error' on a stage whose output shape depends on data",
        lambda: fp.infer_specs(
            [fp.Stage(_positive_rows, name="filter")], [{}], torch.randn(6, 2), fallback="error"
        ),
        ShapeInferenceError,
        ("stage 0 ('filter') cannot run on tensors without data", "fallback='real'"),
    ),
    Case(
        "stage-output-dtype-changes",
        "stages and partitions",
        "a stage that returns float64 for a later microbatch, float32 for the first",
        lambda: _later_microbatch_changes(lambda t: t.double()),
        InvalidArgument,
        ("stage 0 ('fickle') returned output #0 = f64[4, 4] for microbatch 1", "saw f32[4, 4]"),
        "funcpipe/runtime/stage_call.py: outputs checked against the inferred specs before "
        "they are sent (was a CommunicationError on the receiver, a mismatched receive over gloo)",
    ),
    Case(
        "stage-output-shape-changes",
        "stages and partitions",
        "a stage that returns a narrower tensor for a later microbatch than inferred",
        lambda: _later_microbatch_changes(lambda t: t[:, :2]),
        InvalidArgument,
        ("returned output #0 = f32[4, 2] for microbatch 1", "saw f32[4, 4]"),
        "funcpipe/runtime/stage_call.py (same check)",
    ),
    Case(
        "stages-dtype-mismatch",
        "stages and partitions",
        "a float64 batch into a stage whose weights are float32 (shape inference, run without data, does not check "
        "matmul dtypes, so this surfaces when the stage runs)",
        lambda: _two_stages().step(_params((4, 4), (4, 4)), _xy()[0].double(), _xy()[1]),
        RuntimeError,
        ("same dtype", "funcpipe: raised by stage 0 ('first'), microbatch 0, rank 0", "f64[4, 4]"),
        "funcpipe/runtime/stage_call.py: a note on the stage's own error names the stage, the "
        "microbatch, the rank and the input specs (it was a bare torch error)",
    ),
    Case(
        "split-module-other-length",
        "stages and partitions",
        "a model split on 16 tokens, stepped on 12",
        lambda: _split_lm_step(8, 12, 4),
        InvalidArgument,
        (
            "stage 0 (made by split_module) was traced on input 'ids' = i64[2, 16]",
            "is given i64[2, 12]: dim 1 is 12, the example's 16",
            "dynamic_shapes=",
        ),
        "funcpipe/stages/split_inputs.py: each split stage checks its inputs against the traced "
        "shapes and dtypes (the graph specialised to 16 tokens ran on 12: a silently wrong loss)",
    ),
    Case(
        "split-module-microbatch-size",
        "stages and partitions",
        "a model split on microbatches of 2 rows, stepped on microbatches of 4",
        lambda: _split_lm_step(8, 16, 2),
        InvalidArgument,
        (
            "dim 0 (the microbatch size, where the batch dim is 0) is 4, the example's 2",
            "The example is one microbatch",
        ),
        "funcpipe/stages/split_inputs.py (same check; a model whose view holds the traced rows "
        "failed in shape inference, blamed on the stage; others ran silently)",
    ),
    Case(
        "split-module-input-dtype",
        "stages and partitions",
        "a float64 batch into a model split on a float32 example",
        _split_other_dtype,
        InvalidArgument,
        ("= f32[2, 4] and is given f64[2, 4]", "its dtype is float64, the example's float32"),
        "funcpipe/stages/split_inputs.py (same check; was torch's dtype error from inside the stage)",
    ),
    Case(
        "split-module-param-dtype",
        "stages and partitions",
        "bf16 params into a model split in float32 (inputs left in float32)",
        _split_params_other_dtype,
        InvalidArgument,
        (
            "was traced with param '0.weight' = f32[4, 4] and is given bf16[4, 4]",
            "split the model again in the dtype you train in",
        ),
        "funcpipe/stages/split_inputs.py param_problem, checked at every stage call (was torch's "
        "'mat1 and mat2 must have the same dtype' from inside the stage)",
    ),
    Case(
        "split-module-symbolic-size-across-cut",
        "stages and partitions",
        "a size dynamic_shapes made symbolic, read after a cut where no input has it",
        _symbolic_size_across_cut,
        InvalidArgument,
        (
            "the size 'sym_size_int_1' (rows, a dim that dynamic_shapes= made symbolic)",
            "no tensor the stage takes has a dim of that size",
            "leave it out of dynamic_shapes=",
        ),
        "funcpipe/stages/split_module.py: such a size is read from the later stage's input "
        "where one has it, else this (was 'move the cut point', whatever the cut)",
    ),
    # ---- batches and microbatches
    Case(
        "batch-leaves-disagree",
        "batches and microbatches",
        "Pipeline.step with a batch whose leaves have different batch sizes",
        lambda: _two_stages().step(
            _params((4, 4), (4, 4)), (torch.randn(8, 4), torch.randn(6, 4)), torch.randn(8, 4)
        ),
        InvalidArgument,
        ("disagree on the batch size", "batch[0]: 8 (dim 0), batch[1]: 6 (dim 0)"),
    ),
    Case(
        "batch-smaller-than-microbatches",
        "batches and microbatches",
        "a batch of 1 sample for 2 microbatches",
        lambda: _two_stages().step(_params((4, 4), (4, 4)), *_xy(1)),
        InvalidArgument,
        ("1 samples", "microbatches=2", "microbatches <= 1"),
    ),
    Case(
        "batch-empty",
        "batches and microbatches",
        "an empty batch",
        lambda: fp.split(torch.randn(0, 4), 2),
        InvalidArgument,
        ("empty",),
    ),
    Case(
        "targets-batch-size",
        "batches and microbatches",
        "targets with fewer samples than the batch",
        lambda: _two_stages().step(_params((4, 4), (4, 4)), *_xy(8, targets=6)),
        InvalidArgument,
        ("targets have 6 samples", "the batch has 8"),
        "funcpipe/pipeline/microbatch.py split_targets, called by Pipeline.step before any work (was a "
        "broadcasting error inside loss_fn)",
    ),
    Case(
        "batch-shape-stage-rejects",
        "batches and microbatches",
        "a batch of 5 features for a stage that takes 4",
        lambda: _two_stages().step(_params((4, 4), (4, 4)), torch.randn(8, 5), torch.randn(8, 4)),
        ShapeInferenceError,
        ("stage 0 ('first') cannot run on tensors without data", "[4, 5] X [4, 4]"),
    ),
    Case(
        "batch-dim-out-of-range",
        "batches and microbatches",
        "split along a dim the batch does not have",
        lambda: fp.split(torch.randn(4, 3), 2, dim=3),
        InvalidArgument,
        ("dim=3 is out of range", "[-2, 1]"),
    ),
    Case(
        "merge-nothing",
        "batches and microbatches",
        "merge of an empty list",
        lambda: fp.merge([]),
        InvalidArgument,
        ("at least one microbatch",),
    ),
    Case(
        "params-count",
        "batches and microbatches",
        "params for one stage given to a two-stage pipeline",
        lambda: _two_stages().step(_params((4, 4)), *_xy()),
        InvalidArgument,
        ("one pytree per stage (2)", "length 1"),
    ),
    Case(
        "params-non-tensor-leaf",
        "batches and microbatches",
        "a params pytree holding a Python number",
        lambda: _two_stages().step(({"w": 3}, {"w": torch.randn(4, 4)}), *_xy()),
        InvalidArgument,
        ("params[0]['w']=3", "torch.as_tensor"),
    ),
    Case(
        "side-inputs-missing",
        "batches and microbatches",
        "side_inputs naming a batch field the batch does not have",
        _side_inputs_missing,
        InvalidArgument,
        ("batch keys ['mask']", "it has ['inputs']"),
    ),
    Case(
        "loss-not-scalar",
        "batches and microbatches",
        "a loss_fn that returns one value per element",
        lambda: fp.Pipeline(
            [fp.Stage(_tanh_layer)] * 2, _1f1b(), loss_fn=lambda o, y: (o - y) ** 2
        ).step(_params((4, 4), (4, 4)), *_xy()),
        InvalidArgument,
        ("loss_fn must return a scalar tensor", "(4, 4)"),
    ),
    Case(
        "loss-targets-shape",
        "batches and microbatches",
        "targets of 7 features for outputs of 4 (same batch size)",
        lambda: _two_stages().step(_params((4, 4), (4, 4)), torch.randn(8, 4), torch.randn(8, 7)),
        RuntimeError,
        (
            "size of tensor a (4) must match",
            "funcpipe: raised by loss_fn after stage 1",
            "outputs f32[4, 4]; targets f32[4, 7]",
        ),
        "funcpipe/runtime/stage_call.py: a note on loss_fn's error names the stage, microbatch, "
        "rank and the output and target specs (it was a bare torch error)",
    ),
    Case(
        "side-inputs-string",
        "batches and microbatches",
        "side_inputs naming one field as a string, {1: 'mask'}, not a list",
        lambda: _two_stages(side_inputs={1: "mask"}),
        InvalidArgument,
        ("side_inputs[1]='mask' is a string", "side_inputs={1: ['mask']}"),
        "funcpipe/pipeline/checks.py side_input_stages (the string was read as its letters: "
        "'side_inputs need batch keys ['a', 'k', 'm', 's']')",
    ),
    Case(
        "microbatches-over-data-share",
        "batches and microbatches",
        "in one process with data=2, more microbatches than each copy's share of the batch",
        lambda: fp.Pipeline(
            [fp.Stage(_tanh_layer)] * 2,
            generate("1f1b", ranks=2, microbatches=6),
            loss_fn=_mse,
            data=2,
        ).step(_params((4, 4), (4, 4)), *_xy(8)),
        InvalidArgument,
        ("the batch has 8 samples", "data=2", "smallest share 4", "at least 12 samples"),
        "funcpipe/pipeline/checks.py data_shares (said 'batch has 4 samples', counting one "
        "copy's share as the batch)",
    ),
    Case(
        "params-whole-model-every-stage",
        "batches and microbatches",
        "the whole model's state_dict passed as every stage's params",
        lambda: (lambda sd: _two_stages().step((sd, sd), *_xy()))(
            {"w": torch.randn(4, 4), "b": torch.randn(4)}
        ),
        InvalidArgument,
        ("params[0] and params[1] hold the same 2 tensor(s)", "parts.params"),
        "funcpipe/pipeline/checks.py shared_storage (asked to declare a tie for every shared "
        "tensor)",
    ),
    Case(
        "batch-differs-across-processes",
        "batches and microbatches",
        "two processes of one pipeline given batches of 8 and 6 samples (each rank raises this)",
        lambda: __import__("tests.jobs_runtime").jobs_runtime.batch_sizes_differ_on_two_processes(),
        InvalidArgument,
        (
            "the processes were given batches of different shapes",
            "process 0 has batch f64[8, 6], process 1 has batch f64[6, 6]",
        ),
        "funcpipe/pipeline/agreement.py step_agreement, at every step (blamed a stage whose "
        "'output shapes depend on values', or, when one rank's batch changed alone, a hang "
        "until the deadline)",
    ),
    # ---- meshes and parallel configs
    Case(
        "parallel-2d-not-square",
        "meshes and parallel configs",
        "ParallelConfig with a 2D tensor size that is not a square",
        lambda: ParallelConfig.from_dict({"tensor": {"size": 8, "mode": "2d"}}, world_size=8),
        InvalidArgument,
        ("size 8", "square q*q", "size=4 or size=9"),
    ),
    Case(
        "parallel-3d-not-cube",
        "meshes and parallel configs",
        "a 3D tensor size that is not a cube",
        lambda: ParallelConfig.from_dict({"tensor": {"size": 4, "mode": "3d"}}, world_size=4),
        InvalidArgument,
        ("cube c*c*c", "size=8"),
    ),
    Case(
        "parallel-world-not-divisible",
        "meshes and parallel configs",
        "a world size that pipeline x tensor does not divide",
        lambda: ParallelConfig.from_dict({"pipeline": 3}, world_size=4),
        InvalidArgument,
        ("world_size=4 is not divisible by pipeline (3)",),
    ),
    Case(
        "parallel-unknown-key",
        "meshes and parallel configs",
        "a misspelt config key",
        lambda: ParallelConfig.from_dict({"pipe": 2}, world_size=4),
        InvalidArgument,
        ("unknown key(s) ['pipe']", "'pipeline'"),
    ),
    Case(
        "parallel-unknown-mode",
        "meshes and parallel configs",
        "a tensor-parallel mode that does not exist",
        lambda: ParallelConfig.from_dict({"tensor": {"size": 2, "mode": "4d"}}, world_size=2),
        InvalidArgument,
        ("mode='4d' is unknown", "'2.5d'"),
    ),
    Case(
        "pipeline-dist-without-process-group",
        "meshes and parallel configs",
        "transport='dist' in a process without torch.distributed",
        lambda: _two_stages(transport="dist"),
        InvalidArgument,
        ("transport='dist' needs torch.distributed initialised", "transport='local'"),
        "funcpipe/pipeline/checks.py: checked before the process-group sizes are read (was torch's "
        "ValueError 'Default process group has not been initialized')",
    ),
    Case(
        "pipeline-program-wider-than-world",
        "meshes and parallel configs",
        "a 2-rank program in a world of 1 process",
        _program_wider_than_world,
        InvalidArgument,
        ("the world has 1 processes but the program has 2 ranks",),
    ),
    Case(
        "pipeline-mesh-vs-program",
        "meshes and parallel configs",
        "a mesh with pipeline=1 for a 2-rank program",
        _mesh_narrower_than_program,
        InvalidArgument,
        ("mesh has pipeline=1 but the program has 2 ranks",),
    ),
    Case(
        "pipeline-mesh-local",
        "meshes and parallel configs",
        "a mesh with the in-process transport",
        lambda: _two_stages(mesh=object()),
        InvalidArgument,
        ("mesh= describes processes", "transport='dist'"),
    ),
    # ---- tensor-parallel shapes
    Case(
        "tp-heads-not-divisible",
        "tensor-parallel shapes",
        "3 attention heads over a tensor axis of 2",
        lambda: ops.parallel_attention(
            torch.randn(2, 3, 6), {}, axis=Axis("tensor", 2, 0, None), num_heads=3
        ),
        InvalidArgument,
        ("num_heads=3 is not divisible by the tensor axis size 2",),
    ),
    Case(
        "tp-shard-not-divisible",
        "tensor-parallel shapes",
        "sharding a dim of 5 over 2 tensor ranks",
        lambda: Sharding.of("tensor", None).shard(
            torch.randn(5, 4), ParallelConfig.from_dict({"tensor": 2}, world_size=2).place(0)
        ),
        InvalidArgument,
        ("dim 0 of shape (5, 4) has size 5", "multiple of 2"),
    ),
    Case(
        "tp-gpt-vocab",
        "tensor-parallel shapes",
        "a GPT whose vocabulary the tensor-parallel size does not divide",
        lambda: GPTConfig(vocab=256, heads=4, d_model=64).check_tensor(3),
        InvalidArgument,
        ("GPTConfig(vocab=256) must be divisible by the tensor-parallel size 3",),
    ),
    Case(
        "tp-cross-entropy-float-targets",
        "tensor-parallel shapes",
        "float targets for the vocabulary-parallel cross-entropy",
        lambda: ops.vocab_parallel_cross_entropy(
            torch.randn(2, 3, 4), torch.randn(2, 3), axis=Axis("tensor", 1, 0, None)
        ),
        InvalidArgument,
        ("target must hold integer ids",),
    ),
    Case(
        "tp-linear-2d-shapes",
        "tensor-parallel shapes",
        "a 2D (SUMMA) linear whose input width does not match its weight block",
        _2d_mismatch,
        InvalidArgument,
        ("linear_2d: x[..., 5] (in/q) does not match weight of shape (4, 4)",),
    ),
    # ---- ties
    Case(
        "tie-different-shapes",
        "ties",
        "a tie between parameters of different shapes",
        lambda: _tie([(0, "w"), (1, "w")], _params((4, 4), (4, 3))),
        InvalidArgument,
        ("ties['w']", "torch.float32[4, 3]", "one shape and dtype"),
    ),
    Case(
        "tie-missing-path",
        "ties",
        "a tie naming a parameter the stage does not have",
        lambda: _tie([(0, "w"), (1, "v")], _params((4, 4), (4, 4))),
        InvalidArgument,
        ("path 'v' does not name a leaf",),
    ),
    Case(
        "tie-one-member",
        "ties",
        "a tie of one parameter",
        lambda: _two_stages(ties={"w": [(0, "w")]}),
        InvalidArgument,
        ("at least two (stage, path) pairs",),
    ),
    Case(
        "tie-unknown-stage",
        "ties",
        "a tie naming stage 5 of a two-stage model",
        lambda: _two_stages(ties={"w": [(0, "w"), (5, "w")]}),
        InvalidArgument,
        ("names stage 5", "stages are 0..1"),
    ),
    Case(
        "tie-members-as-lists",
        "ties",
        "a tie whose members are lists, [stage, path], not tuples",
        lambda: _two_stages(ties={"w": [[0, "w"], [1, "w"]]}),
        InvalidArgument,
        ("ties['w'][0]=[0, 'w'] is a list", "ties={'w': [(0, 'w'), (1, 'w')]}"),
        "funcpipe/pipeline/checks.py tie_containers (said 'list at least two (stage, path) pairs' "
        "of a tie that lists two)",
    ),
    Case(
        "ties-not-a-dict",
        "ties",
        "ties= given as a list of (stage, path) pairs, without a name",
        lambda: _two_stages(ties=[(0, "w"), (1, "w")]),
        InvalidArgument,
        ("ties=[(0, 'w'), (1, 'w')] is a list", "{name: [(stage, path), ...]}"),
        "funcpipe/pipeline/checks.py tie_containers (was an AttributeError: 'list' object has no "
        "attribute 'items')",
    ),
    Case(
        "tie-copies-differ-over-processes",
        "ties",
        "over processes, tied copies that hold different values (each process seeded its own; "
        "here one process holds both)",
        lambda: __import__("tests.jobs_runtime").jobs_runtime.tied_copies_in_one_process(),
        InvalidArgument,
        (
            "ties['E']: the tied copies hold different values",
            "stage 0 'E' on process 0 and stage 1 'E' on process 0",
        ),
        "funcpipe/pipeline/agreement.py tie_agreement, at a Pipeline's first step (each stage "
        "trained its own copy: silently wrong)",
    ),
    # ---- optimizers and checkpoints
    Case(
        "adamw-negative-lr",
        "optimizers and checkpoints",
        "adamw(lr=-1)",
        lambda: optim.adamw(lr=-1),
        InvalidArgument,
        ("lr=-1", ">= 0", "warmup_cosine"),
    ),
    Case(
        "adamw-betas",
        "optimizers and checkpoints",
        "a beta of 1.5",
        lambda: optim.adamw(1e-3, betas=(1.5, 0.9)),
        InvalidArgument,
        ("betas=(1.5, 0.9)", "[0, 1)"),
    ),
    Case(
        "sgd-negative-momentum",
        "optimizers and checkpoints",
        "sgd(momentum=-1)",
        lambda: optim.sgd(0.1, momentum=-1),
        InvalidArgument,
        ("momentum=-1",),
    ),
    Case(
        "clip-negative-norm",
        "optimizers and checkpoints",
        "clip_by_global_norm with max_norm=-1",
        lambda: optim.clip_by_global_norm({"w": torch.ones(2)}, -1.0),
        InvalidArgument,
        ("max_norm=-1.0", "> 0"),
    ),
    Case(
        "schedule-total-before-warmup",
        "optimizers and checkpoints",
        "warmup_cosine with fewer total steps than warmup steps",
        lambda: optim.warmup_cosine(1.0, warmup=10, total=5),
        InvalidArgument,
        ("total=5 < warmup=10",),
    ),
    Case(
        "optimizer-grads-structure",
        "optimizers and checkpoints",
        "grads that do not have the structure of the params",
        _update_mismatch,
        InvalidArgument,
        ("expected key(s): ['v'], got key(s): ['w']", "grads must be shaped like params"),
    ),
    Case(
        "checkpoint-load-missing-path",
        "optimizers and checkpoints",
        "checkpoint.load of a path that does not exist",
        lambda: checkpoint.load("runs/no-such-checkpoint", {"w": torch.ones(3)}),
        InvalidArgument,
        ("path='runs/no-such-checkpoint' is not a complete funcpipe checkpoint", "latest"),
    ),
    Case(
        "checkpoint-load-wrong-shape",
        "optimizers and checkpoints",
        "loading into a template of another shape",
        lambda: checkpoint.load(_saved(), {"w": torch.ones(4), "step": 0}),
        InvalidArgument,
        ("checkpoint key 'w'", "shape (3,)", "like has torch.float32 of shape (4,)"),
    ),
    Case(
        "checkpoint-load-missing-key",
        "optimizers and checkpoints",
        "loading a key the checkpoint does not hold",
        lambda: checkpoint.load(_saved(), {"v": torch.ones(3)}),
        InvalidArgument,
        ("has no key(s) ['v']", "it has ['step', 'w']"),
    ),
    Case(
        "checkpoint-save-string-leaf",
        "optimizers and checkpoints",
        "saving a state with a string in it",
        lambda: checkpoint.save(os.path.join(_tmp(), "ck"), {"name": "run-1"}),
        InvalidArgument,
        ("state['name']='run-1' is a str",),
    ),
    Case(
        "checkpoint-save-over-foreign-directory",
        "optimizers and checkpoints",
        "saving over a directory that is not a checkpoint",
        _foreign_directory,
        InvalidArgument,
        ("exists and is not a complete funcpipe checkpoint", "refusing to replace it"),
    ),
    Case(
        "loss-scale-at-floor",
        "optimizers and checkpoints",
        "a float16 model whose gradients overflow at every step, however far the loss scale backs off",
        _scale_to_floor,
        fp.loss_scale.LossScaleFloorError,
        ("already at its floor, min_scale=1.0", "non-finite gradients", "check_finite=True"),
        "funcpipe/train/loss_scale.py update: the scale stops at min_scale (was backed off to 0.0, "
        "after which every step was skipped without a word)",
    ),
    Case(
        "checkpoint-load-corrupt-info",
        "optimizers and checkpoints",
        "loading a checkpoint whose funcpipe.json was cut short (its .metadata is there)",
        _corrupt_info,
        InvalidArgument,
        ("its funcpipe.json is corrupt", "line 1", "load an earlier checkpoint"),
        "funcpipe/train/checkpoint.py load (said 'no funcpipe.json and .metadata')",
    ),
    Case(
        "checkpoint-save-disk-fills-in-torch-save",
        "optimizers and checkpoints",
        "checkpoint.save when the disk fills in the middle of a data file",
        _disk_fills_in_torch_save,
        OSError,
        ("No space left on device", "rank 0 could not write the checkpoint"),
        "funcpipe/train/checkpoint.py _save_error: the OSError behind torch's zip writer error "
        "(was 'RuntimeError: ... unexpected pos 704 vs 598')",
    ),
    Case(
        "checkpoint-load-emptied-data-file",
        "optimizers and checkpoints",
        "loading a checkpoint whose data file was emptied",
        _emptied_data_file,
        fp.FuncpipeError,
        ("is damaged: its data file '__0_0.distcp' is 0 bytes", "truncated", "earlier checkpoint"),
        "funcpipe/train/checkpoint_integrity.py check_files, before torch reads (was a bare "
        "EOFError)",
    ),
    Case(
        "load-model-other-sizes",
        "optimizers and checkpoints",
        "checkpoint.load_model into a model of other sizes",
        lambda: checkpoint.load_model(
            _model_saved(), ({"w1": torch.ones(8, 3)}, {"w2": torch.ones(3, 2)})
        ),
        InvalidArgument,
        (
            "does not fit this model",
            "'params/w1' was saved as torch.float32 of full shape (4, 3)",
            "full shape (8, 3)",
            "Nothing was read",
        ),
    ),
    Case(
        "load-model-missing-name",
        "optimizers and checkpoints",
        "checkpoint.load_model of another model's checkpoint (a name it does not hold)",
        lambda: checkpoint.load_model(
            _model_saved(), ({"w1": torch.ones(4, 3)}, {"w3": torch.ones(3)})
        ),
        InvalidArgument,
        ("it has no 'params/w3'", "another model's checkpoint", "Naming(names=...)"),
    ),
    Case(
        "load-model-old-checkpoint",
        "optimizers and checkpoints",
        "checkpoint.load_model of a checkpoint written by checkpoint.save",
        lambda: checkpoint.load_model(_saved(), ({"w": torch.ones(3)},)),
        InvalidArgument,
        ("written by checkpoint.save", "still loads with checkpoint.load", "save_model(new_path"),
    ),
    Case(
        "load-named-checkpoint-with-load",
        "optimizers and checkpoints",
        "checkpoint.load of a checkpoint written by checkpoint.save_model",
        lambda: checkpoint.load(_model_saved(), {"params": ({"w1": torch.ones(4, 3)},)}),
        InvalidArgument,
        ("written by checkpoint.save_model", "read it with checkpoint.load_model"),
    ),
    Case(
        "load-model-region-not-saved",
        "optimizers and checkpoints",
        "checkpoint.load_model of a tensor whose saved shards do not cover what this rank holds",
        lambda: checkpoint.load_model(_half_saved(), ({"w": torch.ones(4, 3)},)),
        InvalidArgument,
        ("'params/w': 6 element(s) of the region 0:4,0:3", "in no saved piece"),
    ),
    Case(
        "naming-shardings-without-place",
        "optimizers and checkpoints",
        "checkpoint.Naming with shardings but no place",
        lambda: checkpoint.Naming(shardings=({"w": Sharding.of("tensor", None)},)),
        InvalidArgument,
        ("needs place=", "mesh.place"),
    ),
    Case(
        "save-model-one-tree",
        "optimizers and checkpoints",
        "checkpoint.save_model of one params dict instead of a tuple per stage",
        lambda: checkpoint.save_model(os.path.join(_tmp(), "ck"), {"w": torch.ones(3)}),
        InvalidArgument,
        ("params=dict", "a tuple with one pytree per stage"),
    ),
    Case(
        "gpt-blocks-not-adding-up",
        "optimizers and checkpoints",
        "gpt.split with blocks per stage that do not add up to the model's layers",
        lambda: _gpt_split(blocks=(1, 1)),
        InvalidArgument,
        ("blocks=(1, 1)", "add up to layers=3"),
    ),
    # ---- launcher
    Case(
        "pool-zero",
        "launcher",
        "Pool(0)",
        lambda: fp.Pool(0),
        InvalidArgument,
        ("size=0", "int >= 1"),
    ),
    Case(
        "pool-backend",
        "launcher",
        "a backend funcpipe does not launch",
        lambda: fp.Pool(2, backend="mpi"),
        InvalidArgument,
        ("backend='mpi'", "'gloo'"),
    ),
    Case(
        "pool-timeout",
        "launcher",
        "a timeout of 0 seconds",
        lambda: fp.Pool(2, timeout=0),
        InvalidArgument,
        ("timeout=0", "> 0"),
    ),
    Case(
        "pool-negative-grace",
        "launcher",
        "a negative grace period",
        lambda: fp.Pool(2, grace=-1),
        InvalidArgument,
        ("grace=-1", ">= 0"),
        "funcpipe/distributed/launcher.py: checked up front (was accepted)",
    ),
    Case(
        "launch-zero",
        "launcher",
        "launch(fn, 0)",
        lambda: fp.launch(abs, 0),
        InvalidArgument,
        ("nprocs=0", "int >= 1"),
        "funcpipe/distributed/launcher.py: names launch's own argument (the message said size=0)",
    ),
    Case(
        "launch-lambda",
        "launcher",
        "launching a lambda (the rank processes cannot import it)",
        lambda: fp.launch(lambda rank: rank, 2),
        InvalidArgument,
        ("cannot be sent to the rank processes", "module-level function"),
        "funcpipe/distributed/launcher.py: checked before any process starts (was a PicklingError from "
        "Pool.run, after starting the processes)",
    ),
    Case(
        "launch-pg-timeout-of-a-millisecond",
        "launcher",
        "a process group timeout of a millisecond (pg_timeout=0.001, as if it were milliseconds)",
        lambda: fp.launch(abs, 2, pg_timeout=0.001),
        InvalidArgument,
        ("pg_timeout=0.001", "at least 1 s", "bounds joining the group", "not milliseconds"),
        "funcpipe/distributed/timeouts.py: checked before any process starts (was a rank's socket "
        "connect or store timeout, not naming the option)",
    ),
    Case(
        "launch-rank-returns-without-stepping",
        "launcher",
        "one process returning without stepping while the other steps (2 processes; the failed "
        "rank's traceback is left out here)",
        lambda: __import__("tests.jobs_faults").jobs_faults.launched(
            "return_early", "without-stepping", timeout=60
        ),
        fp.RankFailed,
        ("rank 1 returned while ranks [0] were still in step 1", "the same number of steps"),
        "funcpipe/distributed/launcher.py, collect.py: a returned rank is recorded in the store "
        "and let go after grace= seconds, and the peer whose wait breaks names it (was a wait "
        "until the process group's timeout, then gloo's bare timeout)",
    ),
    Case(
        "launch-pg-timeout-shorter-than-the-first-step",
        "launcher",
        "a process group timeout shorter than a peer's delay before the first step (rank 1 starts "
        "it 16 s late, pg_timeout=8; the failed rank's traceback is left out here)",
        lambda: _within(
            50.0,  # (as tests/test_launch_timeouts.py checks the same job at the second step)
            lambda: __import__("tests.jobs_faults").jobs_faults.launched(
                "slow_first_step", 16.0, 0, timeout=60, pg_timeout=8, grace=1
            ),
        ),
        fp.RankFailed,
        (
            "rank 0 raised CommunicationError",
            "longer than the process group's timeout (8 s)",
            "raise pg_timeout= of funcpipe.launch or funcpipe.Pool",
        ),
        "funcpipe/distributed/launcher.py: a bare torch.distributed timeout leaving the job is "
        "raised as the transport's CommunicationError (was gloo's bare 'Timed out waiting "
        "8000ms'; the same wait at the second step already said this)",
    ),
    # ---- issue 33: mistakes that used to give a silently wrong result
    Case(
        "step-inside-inference-mode",
        "autograd context and loss_fn",
        "Pipeline.step of a training program inside torch.inference_mode() (inside "
        "torch.no_grad() the step now computes the true gradients, as reference_step does)",
        _inside_inference_mode,
        InvalidArgument,
        ("inside torch.inference_mode()", "cannot be differentiated", "to_eval(program)"),
        "funcpipe/pipeline/checks.py autograd_context; Pipeline.step enables grad itself (under "
        "no_grad it returned the right loss and all-zero gradients)",
    ),
    Case(
        "params-inference-tensors",
        "autograd context and loss_fn",
        "parameters made under torch.inference_mode()",
        _inference_params,
        InvalidArgument,
        ("params[0]['w'] is an inference tensor", ".clone() outside inference_mode"),
        "funcpipe/pipeline/checks.py inference_tensors, on a pipeline's first step (was torch's "
        "RuntimeError from the interpreter)",
    ),
    Case(
        "loss-detached",
        "autograd context and loss_fn",
        "a loss_fn whose result is detached from the outputs",
        lambda: fp.Pipeline(
            [fp.Stage(_tanh_layer)] * 2, _1f1b(), loss_fn=lambda o, y: _mse(o, y).detach()
        ).step(_params((4, 4), (4, 4)), *_xy()),
        InvalidArgument,
        ("loss_fn after stage 1", "does not require grad", "every gradient would be zero"),
        "funcpipe/runtime/stage_call.py, where the loss is computed (was all-zero gradients)",
    ),
    Case(
        "loss-needs-targets",
        "autograd context and loss_fn",
        "a step without the targets loss_fn(outputs, targets) needs",
        lambda: _two_stages().step(_params((4, 4), (4, 4)), _xy()[0]),
        InvalidArgument,
        ("loss_fn=_mse needs 2 positional arguments", "without targets"),
        "funcpipe/pipeline/checks.py loss_targets, before any work (was a TypeError from loss_fn)",
    ),
    Case(
        "loss-takes-no-targets",
        "autograd context and loss_fn",
        "targets passed to a loss_fn(outputs)",
        lambda: fp.Pipeline(
            [fp.Stage(_tanh_layer)] * 2, _1f1b(), loss_fn=lambda out: out.square().mean()
        ).step(_params((4, 4), (4, 4)), *_xy()),
        InvalidArgument,
        ("takes 1 positional argument(s) but step was given targets",),
        "funcpipe/pipeline/checks.py loss_targets, before any work (was a TypeError from loss_fn)",
    ),
    Case(
        "loss-scale-tensor-nan",
        "tensor arguments",
        "step(loss_scale=torch.tensor(nan))",
        lambda: _two_stages().step(
            _params((4, 4), (4, 4)), *_xy(), loss_scale=torch.tensor(float("nan"))
        ),
        InvalidArgument,
        ("loss_scale=tensor(nan)", "finite and > 0"),
        "funcpipe/pipeline/checks.py tensor_loss_scale: read on the CPU; on an accelerator a bad "
        "scale becomes NaN on the device, never read (was accepted)",
    ),
    Case(
        "loss-scale-tensor-zero",
        "tensor arguments",
        "step(loss_scale=torch.tensor(0.))",
        lambda: _two_stages().step(_params((4, 4), (4, 4)), *_xy(), loss_scale=torch.tensor(0.0)),
        InvalidArgument,
        ("loss_scale=tensor(0.0)", "finite and > 0"),
        "funcpipe/pipeline/checks.py tensor_loss_scale (was accepted: all-zero gradients)",
    ),
    Case(
        "params-shared-without-tie",
        "tensor arguments",
        "two stages holding the same tensor (a tied embedding) without ties=",
        _shared_without_tie,
        InvalidArgument,
        ("params[0]['w'] and params[1]['w'] share memory", "ties={'shared': [(0, 'w'), (1, 'w')]}"),
        "funcpipe/pipeline/checks.py shared_storage, on a pipeline's first step (trained silently "
        "with gradients never summed)",
    ),
    Case(
        "batch-on-meta",
        "tensor arguments",
        "a batch on the meta device",
        lambda: _two_stages().step(
            _params((4, 4), (4, 4)), torch.empty(8, 4, device="meta"), _xy()[1]
        ),
        InvalidArgument,
        ("batch is on the meta device", "device='meta' for a dry run"),
        "funcpipe/pipeline/checks.py meta_inputs (was torch's error from inside a stage)",
    ),
    Case(
        "pipeline-cuda-without-cuda",
        "tensor arguments",
        "Pipeline(device='cuda') in a process without CUDA",
        _no_cuda,
        InvalidArgument,
        ("device='cuda'", "no CUDA device"),
        "funcpipe/pipeline/checks.py device_available, at construction (was torch's AssertionError "
        "at the first step)",
    ),
    Case(
        "stage-returns-none",
        "tensor arguments",
        "a stage function that forgets to return",
        lambda: fp.Pipeline(
            [fp.Stage(_returns_none, name="forgetful"), fp.Stage(_tanh_layer)],
            _1f1b(),
            loss_fn=_mse,
        ).step(_params((4, 4), (4, 4)), *_xy()),
        InvalidArgument,
        ("stage 0 ('forgetful') returned None", "forget to return"),
        "funcpipe/stages/boundaries.py, in shape inference (was a TypeError from the next stage)",
    ),
    Case(
        "cli-schedule-too-large",
        "command line",
        "funcpipe schedule 1f1b -p 2 -m 4000000",
        lambda: _cli("schedule", "1f1b", "-p", "2", "-m", "4000000"),
        InvalidArgument,
        ("8,000,000 (stage, microbatch) pairs", "-m 10000", "--no-size-limit"),
        "funcpipe/cli/schedule.py (ran for tens of minutes and about 20 GB)",
    ),
    Case(
        "checkpoint-save-not-a-directory",
        "checkpoint I/O",
        "checkpoint.save under a path whose parent is a file",
        lambda: checkpoint.save(_under_a_file(), {"w": torch.ones(3)}),
        NotADirectoryError,
        ("Not a directory", "could not write the checkpoint"),
        "funcpipe/train/checkpoint.py: the OSError itself (was CheckpointException ranks:dict_keys([0]))",
    ),
    Case(
        "checkpoint-save-disk-full",
        "checkpoint I/O",
        "checkpoint.save when the disk is full (simulated: every write raises ENOSPC)",
        _disk_full,
        OSError,
        ("No space left on device", "rank 0 could not write the checkpoint"),
        "funcpipe/train/checkpoint.py: the OSError itself (was CheckpointException ranks:dict_keys([0]))",
    ),
    Case(
        "checkpoint-flipped-bit",
        "checkpoint I/O",
        "loading a checkpoint with one bit of a tensor's data flipped",
        _flipped_bit,
        fp.FuncpipeError,
        ("is corrupt: the data of key 'w'", "checksum"),
        "funcpipe/train/checkpoint_integrity.py: CRC-32 of every tensor recorded at save, verified at load "
        "(loaded silently)",
    ),
    Case(
        "demo-out-unwritable",
        "checkpoint I/O",
        "funcpipe demo --out a directory that cannot be created",
        lambda: _demo("--out", _under_a_file()),
        InvalidArgument,
        ("cannot be written", "NotADirectoryError", "choose a writable directory"),
        "funcpipe/cli/demo.py, before training (was found at the final save, losing the run)",
    ),
    Case(
        "demo-resume-without-checkpoint",
        "checkpoint I/O",
        "funcpipe demo --resume with no checkpoint in --out",
        lambda: _demo("--out", _tmp(), "--resume"),
        InvalidArgument,
        ("--resume: there is no complete checkpoint", "drop --resume"),
        "funcpipe/cli/demo.py, before training (silently started from step 0)",
    ),
    Case(
        "split-module-whole-batch-example",
        "stages and partitions",
        "split_module given the whole batch (8 rows) as example=, stepped in 4 microbatches of 2",
        _split_whole_batch_example,
        InvalidArgument,
        (
            "traced on input 'ids' = i64[8, 16] and is given i64[2, 16]",
            "it looks like the whole batch was given as example=",
            "batch[:batch_size // microbatches]",
        ),
        "funcpipe/stages/split_inputs.py (said the example is one microbatch, without naming "
        "the whole batch as the likely mistake)",
    ),
    Case(
        "split-module-batchnorm-training",
        "stages and partitions",
        "split_module of a model with BatchNorm still in training mode",
        _split_batchnorm_training,
        InvalidArgument,
        ("call module.eval() before split_module", "writes 12 buffers", "and 9 more"),
        "funcpipe/stages/split_errors.py: the fix first and three buffers (listed every buffer: "
        "2,094 characters for a ResNet-18)",
    ),
    Case(
        "split-module-data-dependent",
        "stages and partitions",
        "split_module of a forward that branches on a tensor's value (`if x.sum() > 0`)",
        lambda: fp.split_module(_Branchy(), ["b"], example=torch.randn(3, 2)),
        fp.FuncpipeError,
        ("takes a branch from tensor values (data-dependent", "torch._check(", "from_module"),
        "funcpipe/stages/split_errors.py: names the line and the alternatives; torch.export's "
        "partial graph is kept off stderr (39 KB for an eager-experts Mixtral)",
    ),
    Case(
        "loss-pair-and-scalar-mixed",
        "batches and microbatches",
        "a loss_fn that returns (sum, count) for one microbatch and a mean for the next",
        lambda: _two_stages(loss_fn=_pair_then_mean()).step(_params((4, 4), (4, 4)), *_xy()),
        InvalidArgument,
        ("(sum, count) pair for some microbatches and a scalar for others", "one kind"),
        "funcpipe/runtime/rank_io.py RankResult.add_loss (and pipeline/result.py across ranks): the "
        "loss would weight the two kinds of microbatch differently (issue 43)",
    ),
    Case(
        "loss-pair-counts-nothing",
        "batches and microbatches",
        "a (sum, count) loss over a batch whose every label is ignore_index",
        lambda: _two_stages(loss_fn=_masked_pair).step(
            _params((4, 4), (4, 4)), _xy()[0], torch.zeros(8, 4)
        ),
        InvalidArgument,
        ("counted 0 items over the whole batch", "ignore_index"),
        "funcpipe/runtime/loss_terms.py count_factor: a mean over nothing (was a NaN loss)",
    ),
    Case(
        "loss-pair-count-not-a-number",
        "batches and microbatches",
        "a (sum, count) loss whose count is a tensor per row",
        lambda: _two_stages(
            loss_fn=lambda o, y: (((o - y) ** 2).sum(), torch.ones(o.shape[0]))
        ).step(_params((4, 4), (4, 4)), *_xy()),
        InvalidArgument,
        ("count of shape (4,)", "one number"),
        "funcpipe/runtime/loss_terms.py loss_and_count",
    ),
    Case(
        "step-seed-not-int",
        "batches and microbatches",
        "step(seed=1.5): a float seed for the stages' random keys",
        lambda: _two_stages().step(_params((4, 4), (4, 4)), *_xy(), seed=1.5),
        InvalidArgument,
        ("seed=1.5", "an int", "or None"),
        "funcpipe/pipeline/checks.py step_seed (issue 43: random keys)",
    ),
    Case(
        "split-module-cut-name-typo",
        "stages and partitions",
        "points=['body.mpl'], a typo of the submodule 'body.mlp'",
        _split_cut_name_typo,
        InvalidArgument,
        ("points names 'body.mpl', which is not a submodule", "did you mean ['body.mlp']"),
        "funcpipe/stages/split_errors.py near_names: whole-path suggestions, a dotted suffix "
        "or a close name (matched the last part only: no suggestion here)",
    ),
    Case(
        "loss-pair-negative-count",
        "batches and microbatches",
        "a (sum, count) loss whose count tensor is negative (or inf, NaN) on one microbatch",
        lambda: _two_stages(loss_fn=lambda o, y: (((o - y) ** 2).sum(), torch.tensor(-3.0))).step(
            _params((4, 4), (4, 4)), *_xy()
        ),
        InvalidArgument,
        ("negative, infinite or NaN", "The step's loss and gradients are refused"),
        "funcpipe/runtime/rank_io.py add_loss counts them on the device, pipeline/result.py "
        "refuses them with the step's loss (issue 51: returned a loss)",
    ),
    Case(
        "demo-resume-another-batch",
        "checkpoint I/O",
        "funcpipe demo --resume at another --batch than the run in --out was trained with",
        _resume_at_another_batch,
        InvalidArgument,
        ("was trained with --batch 8 (now 4)", "another --out"),
        "funcpipe/cli/demo.py _check_run, out/run.json (issue 51: ran on, other losses)",
    ),
    Case(
        "demo-microbatches-too-many",
        "command line",
        "funcpipe demo --microbatches 500000 --batch 500000: a program of a million pairs",
        lambda: _demo("--out", _tmp(), "--microbatches", "500000", "--batch", "500000"),
        InvalidArgument,
        ("(stage, microbatch) pairs a step", "use fewer microbatches"),
        "funcpipe/cli/demo_options.py _check_model, before the program is built (issue 51: ran to "
        "the deadline)",
    ),
    Case(
        "demo-keep-zero",
        "command line",
        "funcpipe demo --keep 0: keep no checkpoint",
        lambda: _demo("--out", _tmp(), "--keep", "0"),
        InvalidArgument,
        ("--keep=0", "an int >= 1"),
        "funcpipe/cli/demo_options.py (issue 51)",
    ),
    Case(
        "save-async-modified-in-place",
        "checkpoint I/O",
        "a tensor handed to save_model_async modified in place before the save wrote it",
        _modified_while_saved,
        FuncpipeError,
        ("modified in place while the background save", "until its wait() returns"),
        "funcpipe/train/checkpoint_async.py: the version counters, checked after the write "
        "(issue 51)",
    ),
    Case(
        "zero-shards-swapped",
        "batches and microbatches",
        "Pipeline(data=2, zero=1) in one process stepped on the copies' shards out of order "
        "(every piece the same size)",
        _zero_swapped,
        InvalidArgument,
        ("shards[0] are copy 1's shards and it is copy 0 of 2", "in copy order"),
        "funcpipe/pipeline/zero.py Shards: shards carry their copy (issue 51: a permuted model, "
        "silently; over processes the same check names this process's copy)",
    ),
    Case(
        "zero-update-mixes-copies",
        "optimizers and checkpoints",
        "an optimizer update of copy 1's shards with copy 0's gradient shards",
        _zero_mixed_copies,
        InvalidArgument,
        ("grads are copy 0's shards (of 2) and params copy 1's", "its own gradient shards"),
        "funcpipe/pipeline/zero.py Shards: the copy is part of the pytree structure (issue 51)",
    ),
    Case(
        "export-by-paths-checkpoint",
        "checkpoint I/O",
        "checkpoint.export of a checkpoint written by checkpoint.save (keyed by pytree paths)",
        _export_by_paths,
        InvalidArgument,
        ("written by checkpoint.save", "only the latter exports", "checkpoint.save_model"),
        "funcpipe/train/checkpoint_export.py _table (issue 52)",
    ),
    Case(
        "load-safetensors-another-model",
        "checkpoint I/O",
        "checkpoint.load_safetensors into params of other names and shapes than the file's",
        _safetensors_of_another_model,
        InvalidArgument,
        ("'w' is (4, 3) in the file", "'b' (params[0] 'b') is not in the file"),
        "funcpipe/train/checkpoint_export.py load_safetensors: every leaf checked before any is "
        "read (issue 52)",
    ),
    Case(
        "dispatch-dest-outside-the-axis",
        "tensor-parallel shapes",
        "routing.dispatch with a destination past the axis's coordinates (an expert index "
        "given where the expert rank is wanted)",
        lambda: dispatch(torch.ones(3, 2), torch.tensor([0, 5, 0]), Axis("expert", 1, 0, None)),
        InvalidArgument,
        ("1 destination(s) outside the coordinates of axis 'expert', 0..0",),
        "funcpipe/parallel/routing.py dispatch: read from the counts it needs anyway (issue 53)",
    ),
    Case(
        "moe-top-k-above-the-experts",
        "stages and partitions",
        "MoEConfig(experts=4, top_k=6): more experts per token than there are",
        lambda: moe.MoEConfig(d_model=4, experts=4, ffn=3, top_k=6),
        InvalidArgument,
        ("top_k=6", "from 1 to min(8, experts=4)"),
        "funcpipe/models/moe.py MoEConfig (issue 53)",
    ),
    Case(
        "moe-capacity-not-positive",
        "stages and partitions",
        "MoEConfig(capacity=0): a capacity factor that keeps no token",
        lambda: moe.MoEConfig(d_model=4, experts=4, ffn=3, capacity=0),
        InvalidArgument,
        ("capacity=0", "a capacity factor > 0", "None (dropless)"),
        "funcpipe/models/moe.py MoEConfig (issue 53)",
    ),
    Case(
        "moe-experts-not-divisible-by-the-axis",
        "meshes and parallel configs",
        "6 experts split over an expert axis of 4 ranks",
        _moe_experts_not_divisible,
        InvalidArgument,
        ("experts=6 do not divide over axis 'expert' of 4 ranks", "a multiple of 4"),
        "funcpipe/models/moe.py moe(axis=) (issue 53)",
    ),
    Case(
        "moe-bias-of-another-layer",
        "tensor arguments",
        "a routing bias of 6 values for a layer of 8 experts",
        _moe_bias_of_another_layer,
        InvalidArgument,
        ("one value per expert (8,); got (6,)",),
        "funcpipe/models/moe.py moe (issue 53)",
    ),
    Case(
        "expert-axis-does-not-divide-the-copies",
        "meshes and parallel configs",
        "ParallelConfig(pipeline=2, expert=3) on 8 processes: 4 data-parallel copies, which an "
        "expert axis of 3 cannot span",
        lambda: ParallelConfig.from_dict({"pipeline": 2, "expert": 3}, world_size=8),
        InvalidArgument,
        ("expert=3 does not divide the data-parallel copies (4", "use expert in [1, 2, 4]"),
        "funcpipe/parallel/mesh.py ParallelConfig.from_dict (issue 53)",
    ),
    Case(
        "pipeline-experts-not-named",
        "pipeline construction",
        "a Pipeline over a mesh with expert=2 but no experts=: the data REDUCE would average "
        "different experts' weights together",
        _experts_not_named,
        InvalidArgument,
        ("experts= names no parameter leaves", "gpt.expert_paths"),
        "funcpipe/pipeline/experts.py check_experts (issue 53)",
    ),
    Case(
        "pipeline-experts-as-paths-alone",
        "pipeline construction",
        "experts=['w']: a path without its stage",
        _experts_as_paths_alone,
        InvalidArgument,
        ("experts[0]='w'", "(stage, path) pair"),
        "funcpipe/pipeline/experts.py check_experts (issue 53)",
    ),
    Case(
        "gpt-expert-width-over-tensor-ranks",
        "stages and partitions",
        "GPTConfig(experts=4, expert_ffn=6) over 4 tensor ranks: each expert's width is split "
        "over them",
        _gpt_expert_width_over_tensor_ranks,
        InvalidArgument,
        ("GPTConfig(expert_ffn=6) must be divisible by the tensor-parallel size 4",),
        "funcpipe/models/gpt.py GPTConfig.check_tensor (issue 53)",
    ),
    Case(
        "gpt-moe-tensor-unknown",
        "stages and partitions",
        "GPTConfig(experts=4, moe_tensor='rows'): neither of the two ways",
        lambda: GPTConfig(experts=4, moe_tensor="rows"),
        InvalidArgument,
        ("moe_tensor='rows'", "('width', 'tokens')"),
        "funcpipe/models/gpt.py GPTConfig (issue 53)",
    ),
    Case(
        "gpt-moe-tokens-without-the-expert-tensor-axis",
        "stages and partitions",
        "GPTConfig(moe_tensor='tokens') over 2 tensor ranks with no expert x tensor axis",
        _gpt_moe_tokens_without_the_expert_tensor_axis,
        InvalidArgument,
        ("moe_tensor='tokens'", "expert=mesh['expert_tensor']"),
        "funcpipe/models/gpt.py stages (issue 53)",
    ),
    Case(
        "moe-tokens-that-do-not-divide-over-tensor",
        "stages and partitions",
        "moe(split='tokens') on 3 tokens over 2 tensor ranks",
        _moe_tokens_that_do_not_divide_over_tensor,
        InvalidArgument,
        ("3 tokens do not divide over tensor axis 'tensor' of 2", "split='width'"),
        "funcpipe/models/moe.py moe (issue 53)",
    ),
    Case(
        "moe-params-of-another-tensor-split",
        "stages and partitions",
        "moe(..., tensor=<axis of 2>) given every expert's whole width",
        _moe_params_of_another_tensor_split,
        InvalidArgument,
        ("params['w_out'] holds 4 rows", "each holds 2", "moe.shardings"),
        "funcpipe/models/moe.py moe (issue 53)",
    ),
    Case(
        "gpt-moe-every-past-the-layers",
        "stages and partitions",
        "GPTConfig(layers=4, experts=4, moe_every=9): no block would be an MoE block",
        lambda: GPTConfig(layers=4, experts=4, moe_every=9),
        InvalidArgument,
        ("no block of the 4 is an MoE block", "moe_every <= layers"),
        "funcpipe/models/gpt.py GPTConfig (issue 53)",
    ),
    Case(
        "moe-load-of-another-layer",
        "tensor arguments",
        "a batch load of 4 fractions for a layer of 8 experts",
        _moe_load_of_another_layer,
        InvalidArgument,
        ("load must be each expert's fraction", "(8,); got (4,)"),
        "funcpipe/models/moe.py moe (issue 53)",
    ),
    Case(
        "tally-changes-shape",
        "stages and partitions",
        "a stage tallies a value whose shape follows the microbatch (2 rows, then 1)",
        _tally_changes_shape,
        InvalidArgument,
        ("tally('rows')", "a tally keeps one shape and dtype"),
        "funcpipe/stages/tally.py (issue 53)",
    ),
    Case(
        "moe-counts-of-another-layout",
        "tensor arguments",
        "a batch load from the tallies of a model with 8 experts, for one with 4",
        _counts_of_another_layout,
        InvalidArgument,
        ("blocks.1.moe.counts has shape (8,), the model 4 experts", "another model or layout"),
        "funcpipe/models/gpt_balance.py batch_load (issue 53)",
    ),
    Case(
        "split-every-leaf-whole",
        "batches and microbatches",
        "split a batch whose every leaf has dim 'whole' (nothing carries the batch)",
        lambda: fp.split({"bias": torch.zeros(3)}, 2, dim={"bias": "whole"}),
        InvalidArgument,
        ("every leaf of batch has dim 'whole'", "at least one leaf must carry the batch"),
        "funcpipe/pipeline/microbatch.py (issue 53)",
    ),
    Case(
        "demo-expert-without-experts",
        "command line",
        "funcpipe demo --expert 2 on a model without experts",
        lambda: _demo("--out", _tmp(), "--expert", "2"),
        InvalidArgument,
        ("--expert 2 splits the experts over 2 data copies", "add --experts E"),
        "funcpipe/cli/demo_options.py (issue 53)",
    ),
]


# ------------------------------------------------------------------------------------ checking
def seen_text(e: BaseException) -> str:
    """What the user reads: the message, then any notes funcpipe added to the exception."""
    return "\n".join([str(e), *(str(n) for n in getattr(e, "__notes__", ()) or ())])


def commit(case: Case) -> BaseException:
    """Make the case's mistake and return the exception it raised."""
    try:
        case.make()
    except BaseException as e:  # the catalogue records whatever comes out
        return e
    raise AssertionError(f"{case.id}: no error was raised")


# what each case raised in this session (its class and text), so the page is rendered from the
# rows' own runs rather than every mistake made twice (30 s of the suite)
_SEEN: dict[str, tuple[type[BaseException], str]] = {}


def outcome(case: Case) -> tuple[type[BaseException], str]:
    """The class and the text of what ``case`` raises (made now unless a test made it)."""
    if case.id not in _SEEN:
        e = commit(case)
        _SEEN[case.id] = (type(e), seen_text(e))
    return _SEEN[case.id]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_catalogue(case: Case) -> None:
    e = commit(case)
    text = seen_text(e)
    _SEEN[case.id] = (type(e), text)
    assert type(e) is case.error, f"{case.id}: {type(e).__name__}: {text}"
    for keyword in case.keywords:
        assert keyword in text, f"{case.id}: {keyword!r} not in {text!r}"


def test_rows_are_distinct_and_many() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30
    assert all(c.keywords for c in CASES)


# ------------------------------------------------------------------------------------ the page
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_TEMP = re.compile(re.escape(tempfile.gettempdir()) + r"/fp-catalogue-[^/'\"]+")
_NONCE = re.compile(r"\.tmp-[0-9a-f]{16}")  # a checkpoint save's temporary directory


def _normalise(text: str) -> str:
    return _NONCE.sub(".tmp-<nonce>", _TEMP.sub("<tmp>", _ADDRESS.sub("", text))).rstrip()


def _qualname(cls: type[BaseException]) -> str:
    if cls.__module__ == "funcpipe.errors":
        return f"funcpipe.{cls.__name__}"
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"


def render() -> str:
    """docs/errors.md from :data:`CASES`, with the message each mistake produces today."""
    test = "tests/test_errors_catalogue.py::test_catalogue"
    out = [
        "# Errors: a catalogue of user mistakes",
        "",
        "<!-- generated by `python tests/test_errors_catalogue.py --write-docs`; do not edit -->",
        "",
        f"{len(CASES)} mistakes across the API, what each one raises and the exact message. "
        "Every row is a test (`" + test + "[<id>]`) that makes the mistake and checks the "
        "error class and the key words of the message; this page is rendered from the same "
        "rows, and a test fails when it is out of date.",
        "",
        "The rules the messages follow: a mistake is caught before any work or communication "
        "starts wherever it can be (arguments when a function is called, programs by the "
        "checker before they run, shapes by inference without data before a step); the "
        "message names the argument and the value given, the rule, and the fix. Errors are "
        "`funcpipe.InvalidArgument` (also a `ValueError`) for arguments, "
        "`funcpipe.ScheduleError` for programs (with `.rank`, `.step`, `.instruction`, "
        "`.rule`), `funcpipe.ShapeInferenceError` when a stage cannot run on its inputs' "
        "shapes. Two mistakes can only show when a stage runs for real (inference without data does "
        "not check matmul dtypes, and `loss_fn` is user code): they keep torch's own error, "
        "and funcpipe adds a note saying which stage or loss, which microbatch and rank, and "
        "the shapes it was given. Failures of other ranks, dead processes and NaNs are in "
        "[faults](#faults).",
        "",
        "| id | area | mistake | error |",
        "|---|---|---|---|",
    ]
    outcomes = {}
    for case in CASES:
        outcomes[case.id] = outcome(case)
        out.append(
            f"| [{case.id}](#{case.id}) | {case.area} | {case.mistake} | "
            f"`{_qualname(outcomes[case.id][0])}` |"
        )
    area = None
    for case in CASES:
        if case.area != area:
            area = case.area
            out += ["", f"## {area[0].upper()}{area[1:]}"]
        cls, text = outcomes[case.id]
        out += [
            "",
            f"### {case.id}",
            "",
            f"{case.mistake[0].upper()}{case.mistake[1:]}. Raises `{_qualname(cls)}`:",
            "",
            "```text",
            _normalise(text),
            "```",
            "",
            f"Test: `{test}[{case.id}]`.",
        ]
        if case.fixed:
            out.append(f"Made clear by: {case.fixed}.")
    out += [
        "",
        "## Faults",
        "",
        "Failures while a step runs are tested in `tests/test_faults.py` (each with a timeout):",
        "",
        "- a rank raises in its forward, its backward, or a REDUCE (a tie or a data-parallel "
        "reduction): every other rank raises `funcpipe.RankFailed` naming it, and so does the "
        "launcher, with the failed rank's error and traceback;",
        "- a rank process is killed (SIGKILL) mid-step: the launcher and every other rank raise "
        "`funcpipe.RankFailed` saying that rank died, killed by SIGKILL (exit code -9); no "
        "process is left behind;",
        "- a NaN or an infinity in a loss or a gradient (`Pipeline(check_finite=True)`, or "
        "`FUNCPIPE_DEBUG=1`): the rank that sees it raises `funcpipe.NonFiniteError` naming the "
        "stage, microbatch and tensor; the others raise `RankFailed` naming that rank;",
        "- the processes build different pipelines (rank 0 1F1B, rank 1 GPipe; or one rank "
        "with recompute): `Pipeline` compares a hash of the lowered program and its options "
        "over the world when it is built (one all-gather) and every process raises "
        "`funcpipe.InvalidArgument` naming the processes that differ and the first line where "
        "their programs do, instead of waiting forever in the first step;",
        "- the process is killed while saving a checkpoint: the previous checkpoint loads and "
        "training resumes from it with exactly the losses of an uninterrupted run.",
        "",
        "## Load: the soak",
        "",
        "`tests/soak.py` trains the demo's GPT (tiny, float64, tied embedding, 1F1B over 2 gloo "
        "processes) with a new batch size and sequence length almost every step, checks the "
        "loss and every gradient against `funcpipe.reference_step` every few steps, and reports "
        "each rank's resident memory after a warm-up and at the end (`tests/test_soak.py` runs "
        "100 steps). Measured on 2026-11-22, rank 0:",
        "",
        "| steps | batch shapes | loss / gradient drift | RSS after warm-up -> end (MB) |",
        "|---:|---:|:--|:--|",
        "| 300 | 123 | 0.0 / 0.0 | 313.0 -> 315.7 |",
        "| 1,500 | 135 | 0.0 / 0.0 | 313.0 -> 316.7 |",
        "| 5,000 | 135 | 0.0 / 0.0 | 313.3 -> 317.2 |",
        "",
        "Memory grows while new batch shapes appear (each gets a cached shape inference, at most "
        "256 kept) and then stays flat: +0.5 MB from step 1,500 to 5,000. Before this was fixed, "
        "it crept by 1.3 KB per step for as long as training ran (308.8 -> 319.5 MB over 4,800 "
        "steps): with tied parameters, each step's interpreter state (its inputs and a copy of "
        "the gradients) was kept alive by a reference cycle through the tie reduction's callback "
        "until a full garbage collection, which with torch imported almost never runs. "
        "`tests/runtime/test_no_cycles.py` now checks that a step leaves nothing for the "
        "garbage collector.",
        "",
        "```sh",
        ".venv/bin/python -m tests.soak --steps 5000 --check-every 500",
        "```",
        "",
        "See also [security.md](security.md).",
        "",
    ]
    return "\n".join(out)


def test_docs_are_up_to_date() -> None:
    assert DOCS.read_text() == render(), (
        "docs/errors.md is stale: run .venv/bin/python tests/test_errors_catalogue.py --write-docs"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-docs"]:
        sys.exit("usage: python tests/test_errors_catalogue.py --write-docs")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    DOCS.write_text(render())
    print(f"wrote {DOCS.relative_to(ROOT)} ({len(CASES)} mistakes)")
