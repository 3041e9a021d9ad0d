"""``python -m opentinker.cli …`` = ``opentinker …`` (e.g. ``python -m opentinker.cli prepare``)."""

from opentinker.cli.main import main

raise SystemExit(main())
