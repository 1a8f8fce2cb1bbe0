"""A run's checkpoint out to one safetensors file (checkpoint.export, `funcpipe checkpoint
export`) and pretrained weights in (checkpoint.load_safetensors), each checked against a model
that did not go through funcpipe's checkpoint code: a single-device reference, transformers'
own from_pretrained and safetensors' own reader."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import funcpipe as fp
from funcpipe.errors import InvalidArgument
from funcpipe.models import gpt
from funcpipe.schedule import generate
from funcpipe.train import checkpoint
from tests import jobs_export, jobs_reshard, models_zoo

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "transformers_recipe.py"


def _small(tmp: Path) -> tuple[str, tuple[Any, ...]]:
    params = (
        {"a.weight": torch.randn(4, 3), "n": torch.arange(5)},
        {"b.weight": torch.randn(3, dtype=torch.float64).to(torch.bfloat16)},
    )
    return checkpoint.save_model(str(tmp / "ck"), params, step=7), params


def test_export_writes_safetensors_that_its_own_reader_and_ours_read(tmp_path: Path) -> None:
    path, params = _small(tmp_path)
    st = models_zoo.load("safetensors.torch")
    for batch_bytes in (1, 1 << 30):  # a tensor at a time, and all at once: the same file
        done = checkpoint.export(tmp_path, tmp_path / f"m{batch_bytes}.safetensors",
                                 batch_bytes=batch_bytes)  # fmt: skip
        assert done["step"] == 7 and done["tensors"] == 3 and done["checkpoint"] == path
        got = st.load_file(str(tmp_path / f"m{batch_bytes}.safetensors"))
        assert {k: v.dtype for k, v in got.items()} == {
            "a.weight": torch.float32, "n": torch.int64, "b.weight": torch.bfloat16,
        }  # fmt: skip
        for p in params:
            for k, v in p.items():
                assert torch.equal(got[k], v), k
    one, every = ((tmp_path / f"m{b}.safetensors").read_bytes() for b in (1, 1 << 30))
    assert one == every
    (n,) = struct.unpack("<Q", one[:8])
    assert n % 8 == 0 and json.loads(one[8 : 8 + n])["__metadata__"]["format"] == "pt"
    wide = checkpoint.consolidate(path, dtype=torch.float64)
    assert wide["a.weight"].dtype == torch.float64 and wide["n"].dtype == torch.int64
    back = checkpoint.load_safetensors(tmp_path / "m1.safetensors", tuple(
        {k: torch.zeros_like(v) for k, v in p.items()} for p in params))  # fmt: skip
    fp.testing.assert_trees_close(list(back), list(params), atol=0, rtol=0)


def test_bad_exports_and_imports_are_clear_errors(tmp_path: Path) -> None:
    path, params = _small(tmp_path)
    with pytest.raises(InvalidArgument, match="neither a complete funcpipe checkpoint"):
        checkpoint.export(tmp_path / "nothing", tmp_path / "m.safetensors")
    with pytest.raises(InvalidArgument, match="ending in .safetensors"):
        checkpoint.export(path, tmp_path / "m.pt")
    with pytest.raises(InvalidArgument, match="dtype='bf16'"):
        checkpoint.export(path, tmp_path / "m.safetensors", dtype="bf16")  # type: ignore[arg-type]
    old = checkpoint.save(str(tmp_path / "by-paths"), {"params": params})
    with pytest.raises(InvalidArgument, match="written by checkpoint.save"):
        checkpoint.export(old, tmp_path / "m.safetensors")
    checkpoint.export(path, tmp_path / "m.safetensors")
    wrong = ({"a.weight": torch.zeros(3, 3), "x": torch.zeros(1)}, None)
    with pytest.raises(InvalidArgument, match="'a.weight' is \\(4, 3\\) in the file.*'x'"):
        checkpoint.load_safetensors(tmp_path / "m.safetensors", wrong)
    header = b'{"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}'
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(InvalidArgument, match="entry for 'x' is not .*damaged"):
        checkpoint.load_safetensors(tmp_path / "odd.safetensors", ({"x": torch.zeros(1)},))
    (tmp_path / "bad.safetensors").write_bytes(b"\x05")
    with pytest.raises(InvalidArgument, match="not a readable safetensors file"):
        checkpoint.load_safetensors(tmp_path / "bad.safetensors", wrong)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["pipeline2-tensor2", "pipeline2-data2-zero1"])
def test_a_run_at_any_layout_exports_the_model_a_single_device_runs(
    pool: Any, tmp_path: Path, layout: str
) -> None:
    """The GPT trained 2 AdamW steps over 4 processes and saved at step 2; the export, loaded
    into the one-stage model, gives step 3's loss on one device (which depends on the saved
    params only), to float64 rounding."""
    path = str(tmp_path / "ck")
    if layout == "pipeline2-tensor2":
        runs = pool(4).run(jobs_reshard.run, 2, 2, "1f1b", path, True)
        rows = 8
    else:
        runs = pool(4).run(jobs_reshard.run_zero, 2, 1, path, True)
        rows = 16
    done = checkpoint.export(path, tmp_path / "gpt.safetensors")
    cfg = jobs_reshard.CFG
    template = gpt.split(gpt.init(cfg, seed=5, dtype=torch.float64), cfg, 1)
    params = checkpoint.load_safetensors(tmp_path / "gpt.safetensors", template)
    x, y = jobs_reshard.batch(2, rows)
    axis = gpt.single_axis()
    loss, _ = fp.reference_step(gpt.stages(cfg, 1, axis=axis), params, x, gpt.loss_fn(axis=axis),
                                targets=y, microbatches=4)  # fmt: skip
    assert done["tensors"] == len(fp.tree.tree_leaves(template))
    assert abs(float(loss) - runs[0]["losses"][2]) < 1e-12, (float(loss), runs[0]["losses"])


@pytest.mark.timeout(300)
def test_pretrained_weights_load_into_a_pipeline_and_a_zero_run(pool: Any, tmp_path: Path) -> None:
    """from_pretrained's file into a split of another model's weights: the step at pipeline 2
    over 2 processes, and ZeRO-1 over 2 copies in one process, equal the pretrained model's
    loss and gradients (float32)."""
    transformers = models_zoo.load("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(jobs_export.llama_config())
    model.save_pretrained(tmp_path / "hf")
    file = str(tmp_path / "hf" / "model.safetensors")
    fields, labels = jobs_export.padded_batch()
    logits = model(**fields).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref.backward()
    ref = ref.detach()
    want = {k: p.grad for k, p in model.named_parameters()}
    tol = {"atol": 2e-6, "rtol": 1e-4}
    runs = pool(2).run(jobs_export.pretrained_step, file)
    for run in runs:
        assert abs(run["loss"] - float(ref)) < 1e-5
        for g in run["grads"]:
            for k, v in g.items():
                torch.testing.assert_close(v, want[k], **tol)
    parts, params = jobs_export.fresh_split_loaded(file)
    pipe = fp.Pipeline(parts.stages, generate("1f1b", ranks=2, microbatches=2),
                       loss_fn=jobs_export.token_loss, side_inputs=parts.side_inputs,
                       ties=parts.ties, data=2, zero=1)  # fmt: skip
    shards = pipe.shard(params)
    loss, grads = pipe.step(shards, parts.batch(fields), labels)
    assert abs(float(loss) - float(ref)) < 1e-5
    whole = [torch.cat([g[s][k] for g in grads]) for s in range(2) for k in sorted(grads[0][s])]
    expected = [want[k].flatten() for s in range(2) for k in sorted(grads[0][s])]
    for got, exp in zip(whole, expected, strict=True):
        torch.testing.assert_close(got, exp, **tol)


def _shim_env(tmp: Path) -> dict[str, str]:
    """Where torchvision is a build for another torch, transformers cannot import it: the
    tests' shim (tests/models_zoo.py) in every process, through sitecustomize."""
    (tmp / "shim").mkdir()
    (tmp / "shim" / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.models_zoo import _torchvision_ops_shim\n_torchvision_ops_shim()\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp / "shim"), str(ROOT)])
    return env


@pytest.mark.timeout(300)
def test_the_recipe_trains_saves_exports_and_from_pretrained_equals_it(tmp_path: Path) -> None:
    """docs/models.md's recipe, as written, under torchrun over 2 processes; then the command
    line export of the same checkpoint gives the same file."""
    models_zoo.load("transformers")
    env = _shim_env(tmp_path)
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "llama"
    run = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(RECIPE), str(out)],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "logits equal the split model's" in run.stdout, run.stdout
    assert "step 20: loss" in run.stdout
    cli = subprocess.run(
        [sys.executable, "-m", "funcpipe", "checkpoint", "export", str(out),
         "--out", str(tmp_path / "cli.safetensors")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "exported" in cli.stdout and "step 20" in cli.stdout
    assert (tmp_path / "cli.safetensors").read_bytes() == (
        out / "hf/model.safetensors"
    ).read_bytes()


def test_the_recipe_in_the_docs_is_the_example() -> None:
    text = (ROOT / "docs" / "models.md").read_text()
    assert "```python\n" + RECIPE.read_text() + "```" in text


def test_pretrained_weights_load_cut_to_each_ranks_tensor_shard(tmp_path: Path) -> None:
    """load_safetensors with a Naming of tensor shardings: each tensor rank gets its block of
    the file's full tensor (rows of a column-parallel weight), the replicated ones whole."""
    from funcpipe.parallel import Place
    from funcpipe.parallel.sharding import Sharding

    full = ({"w": torch.arange(12.0).reshape(4, 3), "b": torch.arange(3.0)},)
    path = checkpoint.save_model(str(tmp_path / "ck"), full)
    checkpoint.export(path, tmp_path / "m.safetensors")
    shardings = ({"w": Sharding.of("tensor", None), "b": Sharding.of(None)},)
    for coord in range(2):
        naming = checkpoint.Naming(
            shardings=shardings, place=Place(coord, {"tensor": coord}, {"tensor": 2})
        )
        template = ({"w": torch.zeros(2, 3), "b": torch.zeros(3)},)
        got = checkpoint.load_safetensors(tmp_path / "m.safetensors", template, naming=naming)
        assert torch.equal(got[0]["w"], full[0]["w"][2 * coord : 2 * coord + 2])
        assert torch.equal(got[0]["b"], full[0]["b"])
