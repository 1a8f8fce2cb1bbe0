"""split_module's errors say what the user did: a whole-batch example, a module in training mode,
a forward torch.export cannot follow, a cut name that is not a submodule (issue 43)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

import funcpipe as fp
from funcpipe.schedule import generate
from tests.models_zoo import gpt2, load
from tests.test_split_module import _length_lm, xent


def test_whole_batch_example_is_named_with_both_sizes_and_the_fix() -> None:
    model, ids = _length_lm()  # 8 rows
    sp = fp.split_module(model, 2, example=ids[:, :16])  # the whole batch, not one microbatch
    pipe = fp.Pipeline(sp.stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=xent)
    said = (
        "was traced on input 'ids' = i64[8, 16] and is given i64[2, 16]: dim 0 (the microbatch "
        "size) is 2, the example's 8 (4 x 2): it looks like the whole batch was given as example="
    )
    for step in (
        lambda: pipe.step(sp.params, ids[:, :16], ids[:, 1:17]),
        lambda: fp.reference_step(
            sp.stages, sp.params, ids[:, :16], xent, targets=ids[:, 1:17], microbatches=4
        ),
    ):
        with pytest.raises(fp.InvalidArgument) as e:
            step()
        text = str(e.value)
        assert said in text, text
        assert "batch[:batch_size // microbatches] (here [:2])" in text
        assert "dynamic_shapes={'ids': {0: torch.export.Dim('batch')}}" in text
        assert len(text) < 500


def test_batchnorm_in_training_mode_leads_with_eval_and_lists_a_few_buffers() -> None:
    blocks = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(8)]
    model = nn.Sequential(*blocks)  # 8 BatchNorms: 24 buffers written in the forward
    with pytest.raises(fp.InvalidArgument) as e:
        fp.split_module(model, ["4"], example=torch.randn(6, 4))
    text = str(e.value)
    assert text.startswith("call module.eval() before split_module"), text
    assert "writes 24 buffers ('0.1.num_batches_tracked', '0.1.running_mean', '0.1.running_var' and 21 more)" in text  # fmt: skip
    assert "a stage must be a pure function" in text and len(text) < 400, len(text)
    assert len(fp.split_module(model.eval(), ["4"], example=torch.randn(6, 4)).stages) == 2


def test_an_input_written_in_place_is_refused_saying_so() -> None:
    class Inplace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.add_(1)
            return self.b(self.a(x))

    with pytest.raises(fp.InvalidArgument, match=r"writes its inputs 'x' in place.*out of place"):
        fp.split_module(Inplace(), ["b"], example=torch.randn(3, 2))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a value
            return self.b(self.a(x))
        return self.a(x)


def test_data_dependent_branch_is_named_without_torchs_dump(capfd: pytest.CaptureFixture) -> None:
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    with pytest.raises(fp.FuncpipeError) as e:
        fp.split_module(_Branchy(), ["b"], example=torch.randn(3, 2))
    assert log.level == level  # torch's loggers are silenced during the trace only
    text = str(e.value)
    assert "it makes a shape or takes a branch from tensor values (data-dependent, at " in text
    assert re.search(r"at test_split_errors.py:\d+ in forward: if x.sum\(\) > 0:", text), text
    assert "torch._check(" in text and "funcpipe.from_module" in text
    assert "funcpipe.partition(nn.Sequential" in text and len(text) < 700, len(text)
    assert len(capfd.readouterr().err) < 2000
    assert hasattr(e.value.__cause__, "partial_fx_graph")  # torch's dump stays on the cause


def test_eager_moe_experts_name_the_implementation_to_use(capfd: pytest.CaptureFixture) -> None:
    transformers = load("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False, max_position_embeddings=16,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval()
    model.set_experts_implementation("eager")  # a loop over the experts hit: data-dependent
    example = {"input_ids": torch.randint(0, 64, (2, 8))}
    capfd.readouterr()
    with pytest.raises(fp.FuncpipeError) as e:
        fp.split_module(model, ["model.layers.1"], example=example)
    text = str(e.value)
    assert "data-dependent, at modeling_mixtral.py" in text
    assert "experts_implementation='eager'" in text
    assert "model.set_experts_implementation('batched_mm')" in text and len(text) < 800
    assert len(capfd.readouterr().err) < 2000  # torch.export printed ~39 KB here
    model.set_experts_implementation("batched_mm")  # the fix the message gives
    assert len(fp.split_module(model, ["model.layers.1"], example=example).stages) == 2


def test_cut_names_are_suggested_by_the_whole_path() -> None:
    model = gpt2()
    example = torch.randint(0, 64, (2, 8))
    for given, meant in [
        ("h.2", "transformer.h.2"),  # a suffix of the name
        ("transformer.hh.2", "transformer.h.2"),  # a typo
        ("transformer.h.2.attn.c_atn", "transformer.h.2.attn.c_attn"),  # a typo in the last part
    ]:
        with pytest.raises(fp.InvalidArgument, match="not a submodule") as e:
            fp.split_module(model, [given], example=example)
        assert f"did you mean ['{meant}'" in str(e.value), str(e.value)
    with pytest.raises(fp.InvalidArgument) as e:  # only the last part is shared: no suggestion
        fp.split_module(model, ["layers.2"], example=example)
    assert "did you mean" not in str(e.value), str(e.value)


def test_a_stage_failing_in_shape_inference_names_its_input_shapes() -> None:
    def picky(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 3:
            raise ValueError("this stage only takes 3 features")
        return x @ params["w"]

    stages = [fp.Stage(picky, name="picky"), fp.Stage(picky, name="next")]
    pipe = fp.Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=xent)
    params = [{"w": torch.ones(3, 3)}, {"w": torch.ones(3, 3)}]
    with pytest.raises(fp.ShapeInferenceError, match=r"fails on its inputs \(f32\[2, 4\]\), without data"):  # fmt: skip
        pipe.step(params, torch.randn(4, 4), torch.zeros(4, dtype=torch.long))
