"""Training around the step: what turns ``(loss, grads)`` into a run.

- ``optim``: pure optimizers (``init`` / ``update``), clipping, learning-rate schedules
- ``loss_scale``: dynamic loss scaling for float16, as pure functions of a small state
- ``checkpoint``: sharded, atomic checkpoints of pytrees (DCP)
- ``data``: a byte-level corpus that needs no download, and a deterministic batch loader
- ``throughput``: tokens per second and model FLOPs utilisation
"""
