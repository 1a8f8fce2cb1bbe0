"""Stages: the pure functions a model is cut into, and what funcpipe learns about them.

- ``stage``: :class:`Stage`, ``from_module``, ``compose``, the input convention (``as_inputs``)
- ``partition``: cut a sequence of layers into contiguous stages (by count, parameters or time)
- ``split_module``: cut any ``nn.Module`` at named submodules (torch.export), keeping its names
- ``split_inputs``: a split stage's traced input specs, checked on every call
- ``split_errors``: what ``split_module`` says when it cannot trace or cut a module
- ``shapes``: infer a stage's output specs without data (``infer_specs``, ``TensorSpec``)
- ``boundaries``: the specs crossing every stage boundary for one microbatch signature
- ``ties``: tied parameters, declared (``ties=``) or found from shared storage
- ``precision``, ``compile``: stage transforms (autocast, ``torch.compile``)

The public names are re-exported by :mod:`funcpipe`.
"""
