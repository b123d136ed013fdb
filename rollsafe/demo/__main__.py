"""``python -m rollsafe.demo``: the same as ``rollsafe demo``."""

from rollsafe.demo.run import main

raise SystemExit(main())
