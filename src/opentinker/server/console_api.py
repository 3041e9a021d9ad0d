"""The console's JSON routes (``/console/api/…``) and its page at ``/``, on a server or over local
run folders (:func:`create_runs_app`, ``opentinker console --runs DIR``).

On a server every JSON route takes the ``X-API-Key`` header (or a token) the API takes: without a
valid one it answers 401, and another tenant's session, run or checkpoint is unknown (404), as in
the API. A key of a tenant named by ``--operator`` sees every tenant's. The console only reads:
training, sampling, publishing and deleting stay with the API's own routes and their checks.
Lists are paginated (at most :data:`MAX_PAGE` a page) and curves downsampled.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import APIKeyHeader
from fastapi.staticfiles import StaticFiles

from opentinker.console import STATIC_DIR, RunsDir, RunsError, downsample
from opentinker.server.checkpoints import checkpoint_json
from opentinker.server.deps import ServerDep
from opentinker.server.errors import ApiError, NotFound

if TYPE_CHECKING:
    from opentinker.server.store import CheckpointRow, ModelRow

API = "/console/api"
MAX_PAGE = 500
MAX_CURVE_POINTS = 2000
LINEAGE_DEPTH = 32
_key = APIKeyHeader(name="X-API-Key", auto_error=False)
Offset = Annotated[int, Query(ge=0)]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]


def mount_static(app: FastAPI, mode: str) -> None:
    """The page at ``/`` and its assets; ``/console/api/mode`` says which console this is."""
    app.mount("/console/static", StaticFiles(directory=STATIC_DIR), name="console-static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get(f"{API}/mode", include_in_schema=False)
    async def console_mode() -> dict[str, str]:
        return {"mode": mode}


class Viewer:
    def __init__(self, tenant: str, operator: bool) -> None:
        self.tenant = tenant
        self.operator = operator

    @property
    def scope(self) -> str | None:
        """The tenant whose rows a listing shows (None: every tenant's)."""
        return None if self.operator else self.tenant

    def sees(self, owner: str) -> bool:
        return self.operator or owner == self.tenant


async def _viewer(request: Request, key: Annotated[str | None, Depends(_key)]) -> Viewer:
    server = request.app.state.server
    tenant = server.auth.tenant(key)  # 401 without a valid key or token
    return Viewer(tenant, tenant in server.config.operator_tenants)


Who = Annotated[Viewer, Depends(_viewer)]


class _Console:
    """What the console's routes share: the server's store and loss history, and the row lookups
    and JSON shapes scoped to a viewer."""

    def __init__(self, server: Any) -> None:
        self.server, self.store, self.history = server, server.store, server.ops.history

    def model_row(self, who: Viewer, model_id: str) -> ModelRow:
        row = self.store.model(model_id)
        if row is None or not who.sees(row.tenant):
            raise NotFound(f"unknown training run {model_id!r}")
        return row

    def checkpoint_row(self, who: Viewer, model_id: str, kind: str, name: str) -> CheckpointRow:
        row = self.store.checkpoint(f"tinker://{model_id}/{kind}/{name}")
        if row is None or not who.sees(row.tenant) or row.expired():
            raise NotFound(f"unknown checkpoint tinker://{model_id}/{kind}/{name}")
        return row

    def owned(self, who: Viewer, model_id: str | None) -> bool:
        """Whether ``model_id`` is the viewer's (an operator's: every model)."""
        if who.operator:
            return True
        row = self.store.model(model_id) if model_id is not None else None
        return row is not None and row.tenant == who.tenant

    def run_json(self, row: ModelRow) -> dict[str, Any]:
        lora = row.lora
        targets = [t for t in ("attn", "mlp", "unembed") if lora.get(f"train_{t}", True)]
        return {
            "model_id": row.id,
            "tenant": row.tenant,
            "session_id": row.session_id,
            "base_model": row.base_model,
            "rank": lora.get("rank"),
            "targets": targets,
            "parent": row.parent,
            "steps": self.history.steps(row.id),
            "created": row.created,
            "last_request": row.last_request,
        }

    def ckpt_json(self, row: CheckpointRow) -> dict[str, Any]:
        return {
            **checkpoint_json(row),
            "model_id": row.model_id,
            "tenant": row.tenant,
            "kind": row.kind,
            "name": row.name,
            "ttl_expires_at": row.expires_at,
            "parent": row.meta.get("parent"),
            "sampler_versions": list(row.meta.get("sampler_versions") or []),
        }


async def _console(server: ServerDep) -> _Console:
    return _Console(server)


Con = Annotated[_Console, Depends(_console)]
router = APIRouter()
"""The server's console JSON routes, read-only and scoped to the caller's tenant (the page at ``/``
is :func:`mount_static`'s)."""


@router.get(f"{API}/whoami", tags=["console"])
async def whoami(who: Who) -> dict[str, Any]:
    return {"tenant": who.tenant, "operator": who.operator}


@router.get(f"{API}/engine", tags=["console"])
async def engine(con: Con, who: Who) -> dict[str, Any]:
    stats = con.server.runtime.engine_stats()
    for s in stats:  # only the caller's own models (an operator: all)
        depths = {m: d for m, d in s["queue_depths"].items() if con.owned(who, m)}
        s["queue_depths"] = dict(sorted(depths.items(), key=lambda kv: -kv[1])[:MAX_PAGE])
        if "restored" in s:  # models brought back after a trainer worker's loss
            s["restored"] = {m: e for m, e in s["restored"].items() if con.owned(who, m)}
        if "served_by" in s:  # which backend samples each snapshot
            s["served_by"] = [e for e in s["served_by"] if con.owned(who, e.get("model_id"))][:MAX_PAGE]
    return {"engines": stats}


@router.get(f"{API}/sessions", tags=["console"])
async def sessions(con: Con, who: Who, offset: Offset = 0, limit: Limit = 50) -> dict[str, Any]:
    rows = con.store.sessions(who.scope, limit=limit + 1, offset=offset)
    out = []
    for r in rows[:limit]:
        models, samplers, n_ckpt, size = con.store.session_contents(r.id)
        out.append(
            {
                "session_id": r.id,
                "tenant": r.tenant,
                "created": r.created,
                "last_seen": r.last_seen,
                "finished": r.finished,
                "models": models[:MAX_PAGE],
                "samplers": samplers[:MAX_PAGE],
                "checkpoints": n_ckpt,
                "checkpoint_bytes": size,
            }
        )
    return {"sessions": out, "offset": offset, "limit": limit, "more": len(rows) > limit}


@router.get(f"{API}/sessions/{{session_id}}/trace", tags=["console"])
async def session_trace(
    con: Con, session_id: str, who: Who, offset: Offset = 0, limit: Limit = 500
) -> dict[str, Any]:
    """The session's requests (training, sampling, checkpoints, ...) with their queue wait, run
    time and tick: the spans ``export_session_trace`` exports."""
    row = con.store.session(session_id)
    if row is None or not who.sees(row.tenant):
        raise NotFound(f"unknown session {session_id!r}")
    requests, total = con.server.traces.requests(session_id, offset, limit)
    return {
        "session_id": session_id,
        "requests": requests,
        "offset": offset,
        "limit": limit,
        "total_count": total,
    }


@router.get(f"{API}/models", tags=["console"])
async def models(con: Con, who: Who, offset: Offset = 0, limit: Limit = 50) -> dict[str, Any]:
    rows, total = con.store.models(who.scope, limit, offset)
    return {
        "models": [con.run_json(r) for r in rows],
        "offset": offset,
        "limit": limit,
        "total_count": total,
    }


@router.get(f"{API}/models/{{model_id}}", tags=["console"])
async def model(
    con: Con, model_id: str, who: Who, max_points: Annotated[int, Query(ge=2, le=MAX_CURVE_POINTS)] = 500
) -> dict[str, Any]:
    row = con.model_row(who, model_id)
    hist = con.history.run(row.id)
    curves: dict[str, list[list[float]]] = {}
    if hist is not None:
        for name, series in (
            ("loss", hist.loss),
            ("grad_norm", hist.grad_norm),
            ("learning_rate", hist.learning_rate),
        ):
            curves[name] = downsample([(float(x), y) for x, y in series], max_points)
    ckpts, total = con.store.checkpoints(row.tenant, row.id, limit=MAX_PAGE)
    return {
        **con.run_json(row),
        "curves": curves,
        "checkpoints": [con.ckpt_json(c) for c in ckpts],
        "checkpoint_count": total,
    }


@router.get(f"{API}/models/{{model_id}}/lineage", tags=["console"])
async def lineage(con: Con, model_id: str, who: Who) -> dict[str, Any]:
    """Where the run came from (the checkpoints it was created from, oldest first) and what it
    saved: each checkpoint with its parent and the sampler versions its data came from."""
    row = con.model_row(who, model_id)
    ancestors: list[dict[str, Any]] = []
    parent, seen = row.parent, {row.id}
    while parent and len(ancestors) < LINEAGE_DEPTH:
        c = con.store.checkpoint(parent)
        if c is None or not (who.sees(c.tenant) or c.public):
            ancestors.append({"tinker_path": parent, "visible": False})
            break
        ancestors.append({**con.ckpt_json(c), "visible": True})
        if c.model_id in seen:
            break
        seen.add(c.model_id)
        up = con.store.model(c.model_id)
        parent = up.parent if up is not None and who.sees(up.tenant) else None
    ckpts, _ = con.store.checkpoints(row.tenant, row.id, limit=MAX_PAGE)
    return {
        "model_id": row.id,
        "ancestors": ancestors[::-1],
        "checkpoints": [con.ckpt_json(c) for c in ckpts],
    }


@router.get(f"{API}/checkpoints", tags=["console"])
async def checkpoints(con: Con, who: Who, offset: Offset = 0, limit: Limit = 50) -> dict[str, Any]:
    rows, total = con.store.checkpoints(who.scope, limit=limit, offset=offset)
    return {
        "checkpoints": [con.ckpt_json(c) for c in rows],
        "offset": offset,
        "limit": limit,
        "total_count": total,
    }


@router.get(f"{API}/checkpoints/{{model_id}}/{{kind}}/{{name}}", tags=["console"])
async def checkpoint(con: Con, model_id: str, kind: str, name: str, who: Who) -> dict[str, Any]:
    return con.ckpt_json(con.checkpoint_row(who, model_id, kind, name))


@router.get(f"{API}/checkpoints/{{model_id}}/{{kind}}/{{name}}/peft.zip", tags=["console"])
async def download_peft(con: Con, model_id: str, kind: str, name: str, who: Who) -> Response:
    """The checkpoint as a PEFT adapter folder (``adapter_model.safetensors``,
    ``adapter_config.json``), zipped."""
    row = con.checkpoint_row(who, model_id, kind, name)
    if row.kind not in ("weights", "sampler_weights"):
        raise NotFound(f"tinker://{model_id}/{kind}/{name} is not a training checkpoint")
    tmp = Path(tempfile.mkdtemp(prefix="opentinker-peft-"))
    try:
        fut = con.server.runtime.export_checkpoint_peft(row.tinker_path, row.tenant, tmp / "peft")
        folder = await asyncio.wrap_future(fut)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for f in sorted(Path(folder).iterdir()):
                z.write(f, f"{name}/{f.name}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    headers = {"Content-Disposition": f'attachment; filename="{name}-peft.zip"'}
    return Response(buf.getvalue(), media_type="application/zip", headers=headers)


def create_runs_app(runs_dir: str | Path) -> FastAPI:
    """The console over local run folders: curves, checkpoints and rollouts, read as they grow."""
    runs = RunsDir(runs_dir)
    app = FastAPI(title="OpenTinker console", docs_url=None, redoc_url=None)
    mount_static(app, "runs")

    @app.exception_handler(RunsError)
    async def _bad(_: Request, exc: RunsError) -> JSONResponse:
        status = 404 if str(exc).startswith("unknown run") else 400
        return JSONResponse({"detail": str(exc)}, status_code=status)

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=exc.status)

    @app.get(f"{API}/runs")
    async def list_runs(offset: Offset = 0, limit: Limit = 100) -> dict[str, Any]:
        return await asyncio.to_thread(runs.runs, offset, limit)

    @app.get(f"{API}/runs/curves")
    async def curves(
        run: str,
        keys: Annotated[list[str], Query()],
        max_points: Annotated[int, Query(ge=2, le=MAX_CURVE_POINTS)] = 1000,
        series: Annotated[list[str] | None, Query()] = None,
    ) -> dict[str, Any]:
        return await asyncio.to_thread(runs.curves, run, keys, max_points=max_points, series=series)

    @app.get(f"{API}/runs/rollouts")
    async def rollouts(
        run: str,
        step: int | None = None,
        series: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        offset: Offset = 0,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
    ) -> dict[str, Any]:
        return await asyncio.to_thread(
            runs.rollouts, run, step=step, series=series, min_reward=min_reward, max_reward=max_reward,
            offset=offset, limit=limit,
        )  # fmt: skip

    return app


def console_main(argv: list[str] | None = None) -> int:
    """``opentinker console --runs DIR [--host H] [--port P]``."""
    import uvicorn

    p = argparse.ArgumentParser(prog="opentinker console", description="the console over local run folders")
    p.add_argument("--runs", required=True, help="a folder of runs (each with a metrics.jsonl), e.g. runs/")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args(argv)
    print(f"opentinker console: runs in {args.runs} on http://{args.host}:{args.port}/", flush=True)
    uvicorn.run(
        create_runs_app(args.runs), host=args.host, port=args.port, log_level="warning", access_log=False
    )
    return 0
