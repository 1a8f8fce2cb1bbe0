"""Processes: starting them, the world a Pipeline runs on, and the process groups they share.

- ``launcher``: run a function on N local processes, or unchanged under ``torchrun``
  (:func:`launch`, :class:`Pool`); fail fast and by name
- ``devices``: which backend a launched job uses and which device each rank computes on
- ``failures``: the failure record a rank leaves in the store, and what is said about a death
- ``world``: the processes a Pipeline runs on over ``torch.distributed`` (pair groups, timeouts)
- ``groups``: process groups shared per layout by the Pipelines and meshes of one process
"""
