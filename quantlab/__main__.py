from quantlab.cli import main

raise SystemExit(main())
