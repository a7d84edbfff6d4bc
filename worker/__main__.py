"""``python -m worker`` runs the CLI."""

from worker.cli import main

raise SystemExit(main())
