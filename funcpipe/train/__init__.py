"""Training around the step: what turns ``(loss, grads)`` into a run.

- ``optim``: the namespace users call (``funcpipe.optim``) over the three that follow
- ``optimizers``: pure optimizers (``init`` / ``update``): SGD and AdamW, master weights
- ``clip``: gradient clipping by the global norm, across ranks
- ``lr_schedules``: learning-rate schedules, pure functions of the step
- ``common``: what those share with ``loss_scale`` (low-precision dtypes, a sum over ranks)
- ``loss_scale``: dynamic loss scaling for float16, as pure functions of a small state
- ``checkpoint``: sharded, atomic checkpoints of pytrees (DCP)
- ``checkpoint_integrity``: a checkpoint read safely (restricted unpickling) and verified (CRC-32)
- ``checkpoint_regions``: which region of which named model tensor each leaf holds (``Naming``)
- ``checkpoint_named``: a model's state as named pieces, put back together at another layout
- ``data``: a byte-level corpus that needs no download, and a deterministic batch loader
- ``losses``: losses as ``(sum, count)``, weighted by what they count (``token_cross_entropy``)
- ``throughput``: tokens per second and model FLOPs utilisation
"""
