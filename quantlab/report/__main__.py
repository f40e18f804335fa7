"""``python -m quantlab.report``: the command line is :mod:`quantlab.report_cli`."""
from quantlab.report_cli import main

raise SystemExit(main())
