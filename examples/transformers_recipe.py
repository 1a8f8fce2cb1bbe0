"""A transformers model end to end: split in training mode, a padded batch with -100 labels and
the token-weighted loss, AdamW over 2 processes, save, export to safetensors, from_pretrained.

python examples/transformers_recipe.py [OUT]                       # 2 local processes
torchrun --nproc-per-node 2 examples/transformers_recipe.py [OUT]  # the same, under torchrun
"""

import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import funcpipe as fp
from funcpipe.schedule import generate, to_eval
from funcpipe.train import checkpoint, optim

CONFIG = LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, vocab_size=64,
                     num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1,
                     use_cache=False)  # fmt: skip


def batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """8 rows of 16 tokens, 3 of them left-padded: their labels are -100 (not counted)."""
    ids = torch.randint(1, 64, (8, 17), generator=torch.Generator().manual_seed(step))
    mask = torch.ones(8, 16, dtype=torch.long)
    mask[:3, :5] = 0
    labels = ids[:, 1:].masked_fill(mask == 0, -100)
    return {"input_ids": ids[:, :-1], "attention_mask": mask}, labels


def loss_fn(
    out: dict[str, torch.Tensor], labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return fp.token_cross_entropy(out["logits"], labels)  # (sum, count): the mean over tokens


def train(rank: int, out: str) -> torch.Tensor | None:
    torch.manual_seed(0)  # every process builds the same model
    model = LlamaForCausalLM(CONFIG)  # in training mode: dropout on
    schedule = generate("1f1b", ranks=2, microbatches=4)
    fields, _ = batch(0)
    example = {k: v[:2] for k, v in fields.items()}  # one microbatch: 8 rows / 4
    parts = fp.split_module(model, schedule.n_stages, example=example)
    kw = {"ties": parts.ties, "side_inputs": parts.side_inputs}
    pipe = fp.Pipeline(parts.stages, schedule, loss_fn=loss_fn, **kw)
    opt = optim.adamw(1e-3, weight_decay=0.01)
    params = pipe.held(parts.params)  # meta tensors for the stage the other process holds
    state = opt.init(params)
    for step in range(20):
        fields, labels = batch(step)
        loss, grads = pipe.step(params, parts.batch(fields), labels, seed=step)  # keyed dropout
        params, state = opt.update(grads, state, params)
        if pipe.held(grads)[-1] is not None and step % 5 == 4:
            print(f"step {step + 1}: loss {float(loss):.4f}", flush=True)
    checkpoint.save_model(f"{out}/checkpoint", params, opt_state=state, step=20)
    evaluate = fp.Pipeline(parts.stages, to_eval(schedule), **kw)  # no key: no dropout
    got = evaluate.step(params, parts.batch(batch(99)[0]), return_outputs=True).outputs
    return None if got is None else got["logits"]  # on the process with the last stage


def main(out: str) -> None:
    for logits in fp.launch(train, 2, out, backend="gloo"):
        if logits is None:
            continue
        checkpoint.export(f"{out}/checkpoint", f"{out}/hf/model.safetensors")
        CONFIG.save_pretrained(f"{out}/hf")
        model = LlamaForCausalLM.from_pretrained(f"{out}/hf").eval()
        with torch.no_grad():
            theirs = model(**batch(99)[0]).logits
        torch.testing.assert_close(theirs, logits, atol=1e-5, rtol=1e-4)
        worst = float((theirs - logits).abs().max())
        print(f"from_pretrained({out}/hf): logits equal the split model's (max diff {worst:.1e})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("out", "llama"))
