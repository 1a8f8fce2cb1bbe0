"""``python -m funcpipe`` runs the ``funcpipe`` command."""

from funcpipe.cli import main

raise SystemExit(main())
