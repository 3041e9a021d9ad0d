"""``python -m opentinker.server …`` = ``opentinker serve …`` (see :mod:`opentinker.server.main`)."""

from opentinker.server.main import serve

raise SystemExit(serve())
