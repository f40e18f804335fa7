"""``python -m quantlab.export``: see :mod:`quantlab.export_cli`."""
from quantlab.export_cli import main

raise SystemExit(main())
