"""Processes: starting them, the world a Pipeline runs on, and the process groups they share.

- ``launcher``: run a function on N local processes, or unchanged under ``torchrun``
  (:func:`launch`, :class:`Pool`); a rank's side of a job; fail fast and by name
- ``collect``: the launcher waiting for a job's results, naming the rank or limit that stopped it
- ``timeouts``: the process group's timeout, its default and bounds, and what its expiry says
- ``network``: where a launched job listens (the given host only, loopback by default)
- ``devices``: which backend a launched job uses and which device each rank computes on
- ``failures``: the failure (and return) record a rank leaves in the store, what is said about a
  death, a bare torch.distributed failure, and the step a rank was in
- ``world``: the processes a Pipeline runs on over ``torch.distributed`` (pair groups, timeouts)
- ``groups``: process groups shared per layout by the Pipelines and meshes of one process
"""
