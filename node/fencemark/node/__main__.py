"""``python -m fencemark.node`` is the ``fencemark`` command."""

from fencemark.node.tools.cli import main

raise SystemExit(main())
