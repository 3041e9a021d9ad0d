"""The console over local run folders (``opentinker console --runs DIR``), through its JSON routes.

Bad input: a runs directory that does not exist, malformed ``metrics.jsonl`` lines (each named by
file and line while the other lines and runs still show). Huge runs: 100k steps come back
downsampled (and the extremes of each bucket kept), 1,000 runs come back a page at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from opentinker.console import downsample
from opentinker.server.console_api import create_runs_app


def _write_run(folder: Path, rows: list[dict], *, raw_lines: list[str] = ()) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "config.json").write_text(json.dumps({"lr": 1e-3}))


def test_a_missing_runs_dir_is_named(tmp_path: Path) -> None:
    client = TestClient(create_runs_app(tmp_path / "nope"))
    page = client.get("/console/api/runs").json()
    assert page["runs"] == []
    assert page["problems"] == [
        {"file": str(tmp_path / "nope"), "line": 0, "message": "the runs directory does not exist"}
    ]
    assert "OpenTinker console" in client.get("/").text  # the page itself still loads


def test_malformed_lines_are_named_and_the_rest_still_show(tmp_path: Path) -> None:
    good = [{"step": i, "reward/mean": i / 10} for i in range(5)]
    _write_run(tmp_path / "bad", good[:2], raw_lines=["{not json", "[1, 2]", *map(json.dumps, good[2:])])
    _write_run(tmp_path / "fine", good)
    client = TestClient(create_runs_app(tmp_path))
    page = client.get("/console/api/runs").json()
    assert [r["name"] for r in page["runs"]] == ["bad", "fine"]
    assert [r["steps"] for r in page["runs"]] == [5, 5]
    probs = {(p["file"], p["line"]): p["message"] for p in page["problems"]}
    assert set(probs) == {("bad/metrics.jsonl", 3), ("bad/metrics.jsonl", 4)}
    assert probs["bad/metrics.jsonl", 3].startswith("not JSON")
    assert "not an object" in probs["bad/metrics.jsonl", 4]
    curves = client.get("/console/api/runs/curves", params={"run": "bad", "keys": ["reward/mean"]}).json()
    assert curves["curves"]["reward/mean"][""] == [[float(i), i / 10] for i in range(5)]
    assert len(curves["problems"]) == 2


def test_a_half_written_last_line_is_not_a_problem(tmp_path: Path) -> None:
    (tmp_path / "live").mkdir()
    (tmp_path / "live" / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    page = TestClient(create_runs_app(tmp_path)).get("/console/api/runs").json()
    assert page["problems"] == [] and page["runs"][0]["steps"] == 1


def test_unknown_runs_and_path_escapes_are_refused(tmp_path: Path) -> None:
    _write_run(tmp_path / "a", [{"step": 0, "loss": 1.0}])
    (tmp_path.parent / "metrics.jsonl").write_text('{"step": 0}\n')  # outside the runs dir
    client = TestClient(create_runs_app(tmp_path / "a"))
    for run in ("..", "../a", "/etc", "b"):
        r = client.get("/console/api/runs/curves", params={"run": run, "keys": ["loss"]})
        assert r.status_code == 404, run
        assert str(tmp_path) not in r.text
    bad = client.get("/console/api/runs", params={"limit": 100_000})
    assert bad.status_code == 422


def test_huge_runs_are_downsampled_and_paginated(tmp_path: Path) -> None:
    n = 100_000
    rows = [{"step": i, "loss": 1.0 + (5.0 if i == 77_777 else 0.0) + (i % 7) / 100} for i in range(n)]
    _write_run(tmp_path / "long", rows)
    for k in range(1000):
        _write_run(tmp_path / "adapters" / f"a{k:04d}", [{"step": 0, "loss": float(k)}])
    client = TestClient(create_runs_app(tmp_path))
    r = client.get("/console/api/runs/curves", params={"run": "long", "keys": ["loss"], "max_points": 1000})
    pts = r.json()["curves"]["loss"][""]
    assert len(pts) <= 1000
    assert len(r.content) < 64_000  # 100k points would be ~2 MB
    assert max(y for _, y in pts) == 6.0 + 77_777 % 7 / 100  # the spike survives
    assert pts[0][0] == 0 and pts[-1][0] >= n - n // 500
    page = client.get("/console/api/runs", params={"limit": 50}).json()
    assert len(page["runs"]) == 50 and page["cursor"]["total_count"] == 1001
    last = client.get("/console/api/runs", params={"limit": 50, "offset": 1000}).json()
    assert [r["name"] for r in last["runs"]] == ["long"]


def test_downsample_keeps_small_series_and_each_buckets_extremes() -> None:
    pts = [(float(i), float((i * 37) % 101)) for i in range(10_000)]
    assert downsample(pts[:10], 20) == [[x, y] for x, y in pts[:10]]
    out = downsample(pts, 200)
    assert len(out) <= 200
    assert [p[0] for p in out] == sorted(p[0] for p in out)
    assert max(p[1] for p in out) == 100.0 and min(p[1] for p in out) == 0.0


def test_rollouts_filter_by_step_series_and_reward(tmp_path: Path) -> None:
    _write_run(tmp_path / "r", [{"step": 0, "loss": 1.0}])
    eps = [
        {"step": s, "series": a, "group": 0, "reward": float(s + i), "advantage": 0.0,
         "turns": [{"kind": "prompt", "text": f"q{s}{a}{i}"}]}
        for s in range(3) for a in ("x", "y") for i in range(2)
    ]  # fmt: skip
    (tmp_path / "r" / "rollouts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps) + "oops\n{}\n")
    client = TestClient(create_runs_app(tmp_path))
    page = client.get("/console/api/runs/rollouts", params={"run": "r", "limit": 100}).json()
    assert page["steps"] == [0, 1, 2] and page["series"] == ["x", "y"]
    assert page["problems"] == [
        {"file": "r/rollouts.jsonl", "line": 13, "message": page["problems"][0]["message"]}
    ]
    sel = client.get(
        "/console/api/runs/rollouts", params={"run": "r", "step": 2, "series": "y", "min_reward": 3}
    ).json()
    assert [e["turns"][0]["text"] for e in sel["episodes"]] == ["q2y1"]
    assert client.get("/console/api/runs/rollouts", params={"run": "r", "limit": 5}).json()["cursor"] == {
        "offset": 0, "limit": 5, "total_count": 13,
    }  # fmt: skip


def test_a_run_of_1000_adapters_overlays_a_bounded_number_of_curves(tmp_path: Path) -> None:
    """One metrics.jsonl with 1,000 adapters' rows (100 steps each, 100k rows): the listing names a
    bounded number of them and says how many there are; a curve answer overlays at most
    MAX_SERIES of them unless the caller names which, and stays small."""
    from opentinker.console.runs import MAX_SERIES

    n_adapters, n_steps = 1000, 100
    rows = [
        {"step": s, "adapter": f"a{k:04d}", "loss": k + s / 1000}
        for s in range(n_steps)
        for k in range(n_adapters)
    ]
    _write_run(tmp_path / "many", rows)
    client = TestClient(create_runs_app(tmp_path))
    (run,) = client.get("/console/api/runs").json()["runs"]
    assert run["series_count"] == n_adapters and len(run["series"]) == MAX_SERIES
    assert run["steps"] == n_adapters * n_steps
    r = client.get("/console/api/runs/curves", params={"run": "many", "keys": ["loss"]})
    body = r.json()
    assert body["series_total"] == n_adapters and body["series_by"] == "adapter"
    assert sorted(body["curves"]["loss"]) == [f"a{k:04d}" for k in range(MAX_SERIES)]
    assert all(len(pts) == n_steps for pts in body["curves"]["loss"].values())
    assert len(r.content) < 200_000  # all 1,000 would be ~2.5 MB
    picked = client.get(
        "/console/api/runs/curves", params={"run": "many", "keys": ["loss"], "series": ["a0999", "a0500"]}
    ).json()["curves"]["loss"]
    assert sorted(picked) == ["a0500", "a0999"]
    assert picked["a0999"][:2] == [[0.0, 999.0], [1.0, 999.001]]
    too_many = client.get(
        "/console/api/runs/curves",
        params={"run": "many", "keys": ["loss"], "series": [f"a{k:04d}" for k in range(MAX_SERIES + 1)]},
    )
    assert too_many.status_code == 400 and f"at most {MAX_SERIES} series" in too_many.text
