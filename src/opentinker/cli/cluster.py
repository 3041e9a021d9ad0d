"""``opentinker cluster``: an operator's view and control of a running server's rollout and trainer workers.

    opentinker cluster status --url http://HOST:PORT --api-key tml-…
    opentinker cluster scale --rollout-workers K --url http://HOST:PORT --api-key tml-…
    opentinker cluster scale --trainer-workers T --url http://HOST:PORT --api-key tml-…

The key must be an operator's (a tenant the server names with ``--operator``). ``scale`` (either
count or both) returns once new workers serve, removed rollout workers have drained and removed
trainer workers have handed their models over; it prints the workers as JSON. A refused
request prints the server's reason and exits 1. ``--url`` and ``--api-key`` default to
``$TINKER_BASE_URL`` and ``$TINKER_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="opentinker cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, what in (("status", "the workers now"), ("scale", "add or remove rollout or trainer workers")):
        c = sub.add_parser(name, help=what)
        c.add_argument("--url", default=os.environ.get("TINKER_BASE_URL"), help="the server's base URL")
        c.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY"), help="an operator's key")
        c.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the answer")
        if name == "scale":
            c.add_argument("--rollout-workers", type=int, help="rollout workers per base model")
            c.add_argument("--trainer-workers", type=int, help="trainer workers per base model")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.url or not args.api_key:
        print(
            "opentinker cluster: error: give --url and --api-key (or TINKER_BASE_URL, TINKER_API_KEY)",
            file=sys.stderr,
        )
        return 2
    if args.command == "scale":
        body: dict[str, Any] | None = {
            k: v
            for k, v in (("rollout_workers", args.rollout_workers), ("trainer_workers", args.trainer_workers))
            if v is not None
        }
        if not body:
            print(
                "opentinker cluster: error: give --rollout-workers and/or --trainer-workers", file=sys.stderr
            )
            return 2
        route = "/api/v1/cluster/scale"
    else:
        body, route = None, "/api/v1/cluster"
    try:
        out = request(args.url, route, args.api_key, body, timeout=args.timeout)
    except RuntimeError as e:
        print(f"opentinker cluster: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0


def request(url: str, route: str, api_key: str, body: dict[str, Any] | None, *, timeout: float) -> Any:
    """One call to the server (POST with ``body``, else GET); raises ``RuntimeError`` with the
    server's reason (or why it could not be reached)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url.rstrip("/") + route,
        data=data,
        method="GET" if body is None else "POST",
        headers={"X-API-Key": api_key, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read()).get("detail", e.reason)
        except (ValueError, AttributeError):
            detail = e.reason
        raise RuntimeError(f"{e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None
