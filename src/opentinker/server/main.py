"""``opentinker serve``: run the HTTP service (uvicorn) over one shared embedded runtime.

    opentinker serve --base-model opentinker/tiny --data-dir ./data --port 8000 [--dev] [--dtype bfloat16]

    opentinker serve --base-model opentinker/tiny --ray [ADDRESS] --rollout-workers 2 --worker-cpus 1

With ``--ray``, the rollout workers are Ray actors: on a Ray instance started here (no ADDRESS) or
on a cluster joined (``auto``, ``ray://HOST:PORT``, ``HOST:PORT``); ``opentinker cluster scale``
changes their number while serving.

Every ``--base-model`` is loaded before the port opens (and only those are served). Clients use
the official SDK: ``tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-…")``.
Without ``--dev``, keys come from ``opentinker keys create --tenant NAME --data-dir ./data``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from opentinker.server.config import ServerConfig
from opentinker.service.config import add_runtime_args, positive_int, runtime_config_from_args


def _seconds(minimum: float, strict: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if value < minimum or (strict and value == minimum) or value != value:
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}, got {text}")
        return value

    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="opentinker serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-model", action="append", required=True, help="a base model to serve (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="checkpoints and the server database (default $OPENTINKER_HOME)",
    )
    p.add_argument(
        "--dev",
        action="store_true",
        help="accept any key the SDK accepts (tml- + anything, e.g. tml-dummy); each key is its own tenant",
    )
    _add_limit_args(p)
    # the runtime's flags, one per RuntimeConfig field: --device, --dtype, --rollout-workers, --ray,
    # --trainer-workers, --data-parallel, --trainer-cpus, --placement-timeout, ...
    add_runtime_args(p.add_argument_group("runtime"))
    p.add_argument(
        "--operator",
        action="append",
        default=[],
        metavar="TENANT",
        help="a tenant whose keys see every tenant's sessions, runs and checkpoints in the console "
        "(read-only; repeatable)",
    )
    p.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Jinja chat template for /v1/chat/completions (default: each base model's tokenizer's)",
    )
    p.add_argument("--log-level", default="warning")
    return p


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """Request limits, timeouts, sweeps and caches."""
    p.add_argument("--max-body-bytes", type=int, default=64 << 20)
    p.add_argument("--max-pending", type=int, default=2048, help="unfinished requests per tenant before 429")
    p.add_argument(
        "--max-running",
        type=positive_int,
        default=512,
        help="requests per tenant queued on the engines at once; more wait in the server, their "
        "polls answering try_again with queue_state paused_rate_limit",
    )
    p.add_argument(
        "--poll-timeout", type=float, default=25.0, help="seconds a /retrieve_future long-poll waits"
    )
    p.add_argument(
        "--gap-timeout",
        type=_positive_float,
        default=10.0,
        help="seconds a model's requests wait for a lower seq_id that never arrives before they fail "
        "(naming it) and the model goes on; a refused send's seq_id is skipped at once",
    )
    p.add_argument(
        "--token-ttl",
        type=_seconds(0, strict=False),
        default=900.0,
        help="seconds a signed token from /auth/token lasts (0 = tokens off; keys only)",
    )
    p.add_argument(
        "--session-inactive-after",
        type=_seconds(0, strict=True),
        default=600.0,
        help="seconds without heartbeat or request after which a session is inactive: its "
        "models page out first (under --memory-budget; with 'off', they are saved and evicted)",
    )
    p.add_argument(
        "--checkpoint-sweep",
        type=float,
        default=60.0,
        help="seconds between deletions of expired checkpoints (also run at start-up)",
    )
    p.add_argument(
        "--batch-polling",
        action="store_true",
        help="have the SDK poll sampling results per sampling session (/retrieve_futures) rather "
        "than per request; a sample in flight at a server crash then waits for the SDK's "
        "stuck-detection instead of failing at once",
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    from opentinker.service.runtime import default_data_dir

    return ServerConfig(
        data_dir=args.data_dir or default_data_dir(),
        base_models=tuple(args.base_model),
        dev=args.dev,
        runtime=runtime_config_from_args(args),
        max_body_bytes=args.max_body_bytes,
        max_pending_per_tenant=args.max_pending,
        max_running_per_tenant=args.max_running,
        poll_timeout_s=args.poll_timeout,
        gap_timeout_s=args.gap_timeout,
        batch_polling=args.batch_polling,
        token_ttl_s=args.token_ttl,
        session_inactive_s=args.session_inactive_after,
        checkpoint_sweep_s=args.checkpoint_sweep,
        operator_tenants=tuple(args.operator),
        chat_template=args.chat_template.read_text() if args.chat_template is not None else None,
    )


def serve(argv: list[str] | None = None) -> int:
    import uvicorn

    from opentinker.server.app import create_app
    from opentinker.server.route_log import with_route_log

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = create_app(config_from_args(args))
    except (
        ValueError,
        RuntimeError,
        OSError,
    ) as e:  # e.g. an unreadable --chat-template, a Ray address that does not answer, workers
        # the cluster cannot place, a rollout worker that cannot start: named, before the port opens
        print(f"opentinker serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    dtype = app.state.server.runtime.dtype  # what --dtype resolved to on this device
    print(
        f"opentinker: serving {', '.join(args.base_model)} (base weights {dtype}) on http://{args.host}:{args.port}",
        flush=True,
    )
    uvicorn.run(
        with_route_log(app),  # OPENTINKER_ROUTE_LOG: the tests' request log (route_log.py)
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(serve())
