"""The ``funcpipe`` command: one module per subcommand, each registering itself with the parser.

- ``app``: the parser, built from the subcommand modules, and :func:`main` (``funcpipe COMMAND
  ...``, ``python -m funcpipe``)
- ``args``: the argument types the subcommands share
- ``demo``: ``funcpipe demo``, the GPT trained with pipeline x tensor x data parallelism; its
  options in ``demo_options``, one rank's training loop in ``demo_loop``, the summary and its
  printout in ``demo_report``
- ``tour``: ``funcpipe tour``, a one-process walk through partition, shapes and the reference
- ``schedule``: ``funcpipe schedule`` and ``funcpipe check``
- ``plan``: ``funcpipe plan``, the cluster planner
"""

from funcpipe.cli.app import main

__all__ = ["main"]
