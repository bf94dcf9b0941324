"""``python -m fencemark.node`` is the ``fencemark`` command."""

from fencemark.node.cli import main

raise SystemExit(main())
