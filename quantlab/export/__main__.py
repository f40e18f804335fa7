"""``python -m quantlab.export``: see :mod:`quantlab.export.cli`."""
from quantlab.export.cli import main

raise SystemExit(main())
