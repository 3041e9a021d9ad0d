"""The organization-admin reads under ``/api/v1`` (the SDK's ``AdminClient``): the audit log,
billing usage events and the storage checkpoints take now, each scoped to the caller's tenant.
The records and counters behind them are :mod:`~opentinker.server.usage`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from opentinker.server.deps import Tenant
from opentinker.server.state import Server


def add_admin_routes(app: FastAPI, server: Server) -> None:
    """The organization-admin reads (``AdminClient``); see :mod:`usage`."""
    api, usage = "/api/v1", server.usage

    @app.get(f"{api}/audit", tags=["admin"])
    async def audit_log(t: Tenant, event_type: str = "all", day: str | None = None) -> dict[str, Any]:
        return usage.audit_log(t, event_type, day)

    @app.get(f"{api}/billing/usage/events", tags=["admin"])
    async def billing_usage(t: Tenant, starting_on: str, ending_before: str) -> dict[str, Any]:
        return usage.billing_usage(t, starting_on, ending_before)

    @app.get(f"{api}/billing/usage/checkpoints/current", tags=["admin"])
    async def storage_usage(t: Tenant, project_id: str | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(usage.storage_now, t, project_id)  # it walks the folders
