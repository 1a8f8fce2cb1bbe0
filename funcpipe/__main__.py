"""``python -m funcpipe`` runs the ``funcpipe`` command."""

from funcpipe.cli.app import main

raise SystemExit(main())
