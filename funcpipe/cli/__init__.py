"""The ``funcpipe`` command: one module per subcommand, each registering itself with the parser.

- ``app``: the parser and :func:`main` (``funcpipe COMMAND ...``, ``python -m funcpipe``)
- ``demo``: ``funcpipe demo``, the GPT trained with pipeline x tensor x data parallelism
- ``tour``: ``funcpipe tour``, a one-process walk through partition, shapes and the reference
- ``schedule``: ``funcpipe schedule`` and ``funcpipe check``
- ``plan``: ``funcpipe plan``, the cluster planner
"""

from funcpipe.cli.app import main

__all__ = ["main"]
