"""funcpipe quickstart: a model as pure stages, checked against plain autograd, trained purely.

Run with:  .venv/bin/python examples/quickstart.py
"""

import torch
from torch import nn

import funcpipe as fp

torch.manual_seed(0)

# 1. Any nn.Sequential (or list of layers) is cut into stages: pure functions over params.
model = nn.Sequential(
    nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
).double()
part = fp.partition(model, 2, by="parameters")
for stage, bounds in zip(part.stages, part.bounds):
    print(stage, "runs layers", bounds)
# Stage params keep the full model's names: the union is exactly model.named_parameters().
print([list(p) for p in part.params])

# 2. Shapes are inferred on the meta device from one microbatch (no compute, no memory).
x = torch.randn(32, 16, dtype=torch.float64)
y = torch.randn(32, 4, dtype=torch.float64)
microbatches = fp.split(x, 4)  # 4 views of 8 samples each
for spec in fp.infer_specs(part.stages, part.params, microbatches[0]):
    print(spec.inputs, "->", spec.outputs)


# 3. The single-device reference step: loss = mean over microbatches of loss_fn.
def mse(outputs, targets):
    return ((outputs - targets) ** 2).mean()


loss, grads = fp.reference_step(part.stages, part.params, x, mse, targets=y, microbatches=4)

# Same thing with plain autograd on the unpartitioned module.
plain = torch.stack([mse(model(xb), yb) for xb, yb in zip(fp.split(x, 4), fp.split(y, 4))]).mean()
plain_grads = dict(
    zip(
        [n for n, _ in model.named_parameters()],
        torch.autograd.grad(plain, list(model.parameters())),
    )
)
max_diff = max((g - plain_grads[name]).abs().max().item() for gs in grads for name, g in gs.items())
print(f"loss {loss.item():.8f} (plain autograd {plain.item():.8f}), max grad diff {max_diff:.1e}")

# 4. Training is a pure function of params: new params come out, nothing is mutated.
params = part.params
for step in range(10):
    loss, grads = fp.reference_step(part.stages, params, x, mse, targets=y, microbatches=4)
    params = tuple(
        {name: p - 0.1 * g[name] for name, p in stage_params.items()}
        for stage_params, g in zip(params, grads)
    )
    print(f"step {step}: loss {loss.item():.5f}")
