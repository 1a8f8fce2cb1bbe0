"""The pipeline: the user-facing step, stages + schedule + loss -> (loss, grads).

- ``pipeline``: :class:`Pipeline` (builds the program, runs it per rank) and :class:`StepResult`
- ``checks``: the checks a Pipeline makes of its arguments, off the hot path
- ``agreement``: what the processes must agree on (program, tied values, each step's shapes)
- ``lowering``: the schedule lowered into the program a Pipeline runs, and checked
- ``rank_inputs``: a rank's share of a step (its parameter leaves, its part of the batch)
- ``result``: :class:`StepResult`, put together from the ranks' results
- ``microbatch``: split a batch pytree into microbatches and merge them back
- ``reference``: :func:`reference_step`, the single-device step every schedule must reproduce
- ``zero``: sharded params (``Pipeline(zero=1)``): shard, step on shards, gather
"""

from funcpipe.pipeline.pipeline import Pipeline, StepResult

__all__ = ["Pipeline", "StepResult"]
