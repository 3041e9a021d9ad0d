"""The organization-admin reads under ``/api/v1`` (the SDK's ``AdminClient``): the audit log,
billing usage events and the storage checkpoints take now, each scoped to the caller's tenant.
The records and counters behind them are :mod:`~opentinker.server.usage`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from opentinker.server.deps import ServerDep, Tenant

API = "/api/v1"
router = APIRouter()
"""The organization-admin reads (``AdminClient``); see :mod:`usage`."""


@router.get(f"{API}/audit", tags=["admin"])
async def audit_log(
    server: ServerDep, t: Tenant, event_type: str = "all", day: str | None = None
) -> dict[str, Any]:
    return server.usage.audit_log(t, event_type, day)


@router.get(f"{API}/billing/usage/events", tags=["admin"])
async def billing_usage(server: ServerDep, t: Tenant, starting_on: str, ending_before: str) -> dict[str, Any]:
    return server.usage.billing_usage(t, starting_on, ending_before)


@router.get(f"{API}/billing/usage/checkpoints/current", tags=["admin"])
async def storage_usage(server: ServerDep, t: Tenant, project_id: str | None = None) -> dict[str, Any]:
    return await asyncio.to_thread(server.usage.storage_now, t, project_id)  # it walks the folders
