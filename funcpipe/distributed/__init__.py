"""Processes: starting them, the world a Pipeline runs on, and the process groups they share.

- ``launcher``: run a function on N local processes, or unchanged under ``torchrun``
  (:func:`launch`, :class:`Pool`); fail fast and by name
- ``world``: the processes a Pipeline runs on over ``torch.distributed`` (pair groups, timeouts)
- ``groups``: process groups shared per layout by the Pipelines and meshes of one process
"""
