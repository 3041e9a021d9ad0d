"""The console in a real browser: Debian's ``chromium``, headless, driven by Playwright with the
system browser (no browser download), against a live server and a live local run.

Server: a tenant signs in with its key and sees its runs and not another tenant's; a click from
a checkpoint leads to its lineage (the checkpoint its run was created from); the engine page shows
the live counters; a session's trace lists its requests (sampling too) with their waits and
ticks. Local runs: a curve has the run's points, and grows while the run writes more; an
episode's text from ``rollouts.jsonl`` is shown; a multi-agent run's episodes filter by agent. Screenshots of the main pages go to
``docs/screenshots/``. Marked slow: it starts a server and trains a real local run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from opentinker.server.local import LocalServer, free_port
from tests.conftest import TEST_MODEL
from tests.console_world import start_world

CHROMIUM = os.environ.get("OPENTINKER_CHROMIUM", "/usr/bin/chromium")
# every wait in the browser is for a condition, returning once it holds; this bounds it generously so
# that a loaded machine (CI beside other jobs) still meets it
WAIT_MS = 120_000
SHOTS = Path(__file__).resolve().parents[1] / "docs" / "screenshots"
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright")
if not Path(CHROMIUM).exists():
    pytest.skip(f"the browser tests need Debian's chromium at {CHROMIUM}", allow_module_level=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_PROJECT_ID"):
            mp.delenv(var, raising=False)
        srv, w = start_world(tmp_path_factory.mktemp("console-browser-srv"))
        try:
            yield srv, w
        finally:
            srv.stop()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Two adapters trained by ``opentinker train rl --runs 2`` (embedded), and the console on them."""
    runs = tmp_path_factory.mktemp("console-runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENTINKER_HOME": str(runs / "data")}
    train = [sys.executable, "-m", "opentinker.cli.main", "train", "rl", "--task", "addition", "--runs", "2"]
    train += ["--base-model", TEST_MODEL, "--steps", "3", "--log-dir", str(runs / "multi")]
    subprocess.run(train, check=True, env=env, capture_output=True, timeout=600)
    game = [sys.executable, "-m", "opentinker.cli.main", "train", "rl", "--task", "tictactoe"]
    game += ["--base-model", TEST_MODEL, "--steps", "2", "--group-size", "2", "--groups-per-step", "2"]
    game += ["--max-tokens", "4", "--extra", "eval_games=2", "--log-dir", str(runs / "game")]
    subprocess.run(game, check=True, env=env, capture_output=True, timeout=600)
    (runs / "broken").mkdir()
    (runs / "broken" / "metrics.jsonl").write_text(
        '{"step": 0, "loss": 1}\nnot json\n{"step": 1, "loss": 2}\n'
    )
    port = free_port()
    cmd = [sys.executable, "-m", "opentinker.cli.main", "console", "--runs", str(runs), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT_MS / 1000
        while True:  # up as soon as it answers; a loaded machine gets time
            try:
                urllib.request.urlopen(url + "/console/api/mode", timeout=10)
                break
            except OSError:
                assert proc.poll() is None, f"opentinker console exited with {proc.returncode}"
                assert time.monotonic() < deadline, (
                    f"opentinker console did not answer within {WAIT_MS / 1000} s"
                )
                time.sleep(0.2)
        yield url, runs
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _page(browser: Any, **options: Any) -> Any:
    """A new page whose every wait (an action's, a navigation's, ``wait_for_*``'s) is bounded by
    :data:`WAIT_MS` rather than Playwright's 30 s default: each returns as soon as its condition holds."""
    page = browser.new_page(**options)
    page.set_default_timeout(WAIT_MS)
    page.set_default_navigation_timeout(WAIT_MS)
    return page


def _shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _sign_in(browser: Any, srv: LocalServer, key: str) -> Any:
    page = _page(browser, viewport={"width": 1280, "height": 900})
    page.goto(srv.base_url + "/")
    page.fill("#api-key", key)
    page.click("form.signin button")
    page.wait_for_selector("#models")
    return page


def test_a_tenant_sees_its_runs_and_not_anothers(
    browser: Any, world: tuple[LocalServer, dict[str, Any]]
) -> None:
    srv, w = world
    page = _sign_in(browser, srv, w["keys"]["alice"])
    shown = set(page.eval_on_selector_all("tr.model", "rows => rows.map(r => r.dataset.model)"))
    assert shown == {w["alice"]["model_id"], w["alice_child"]["model_id"]}
    assert w["bob"]["model_id"] not in page.content()
    assert "tenant alice" in page.inner_text("#who")
    _shot(page, "server-runs")
    page.click(f"tr.model[data-model='{w['alice']['model_id']}'] a")
    page.wait_for_selector("#model-charts .chart")
    titles = page.eval_on_selector_all(
        "#model-charts .chart", "cs => cs.map(c => [c.dataset.title, c.dataset.points])"
    )
    assert ["grad_norm", "3"] in titles and ["loss", "3"] in titles
    _shot(page, "server-run")
    page.close()
    bob = _sign_in(browser, srv, w["keys"]["bob"])
    assert bob.eval_on_selector_all("tr.model", "rows => rows.map(r => r.dataset.model)") == [
        w["bob"]["model_id"]
    ]
    bob.close()


def test_a_wrong_key_is_refused_in_the_page(browser: Any, world: tuple[LocalServer, dict[str, Any]]) -> None:
    srv, _ = world
    page = _page(browser)
    page.goto(srv.base_url + "/")
    page.fill("#api-key", "tml-wrong-key")
    page.click("form.signin button")
    page.wait_for_selector("form.signin .error")
    assert "#models" not in page.content() and page.query_selector("#models") is None
    page.close()


def test_click_from_a_checkpoint_to_its_lineage(
    browser: Any, world: tuple[LocalServer, dict[str, Any]]
) -> None:
    srv, w = world
    page = _sign_in(browser, srv, w["keys"]["alice"])
    page.click("#tab-checkpoints")
    page.wait_for_selector("#checkpoints tr.checkpoint")
    _shot(page, "server-checkpoints")
    page.click(f"tr.checkpoint[data-checkpoint='{w['alice_child']['path']}'] a.to-lineage")
    page.wait_for_selector("#lineage")
    assert page.inner_text("#model-id") == w["alice_child"]["model_id"]
    graph = page.inner_text("#lineage")
    assert w["alice"]["path"] in graph and w["alice_child"]["model_id"] in graph
    row = page.inner_text(f"#lineage-checkpoints tr[data-checkpoint='{w['alice_child']['path']}']")
    assert w["alice"]["path"] in row  # the saved checkpoint's parent
    _shot(page, "server-lineage")
    page.close()


def test_the_engine_page_updates_live(browser: Any, world: tuple[LocalServer, dict[str, Any]]) -> None:
    srv, w = world
    page = _sign_in(browser, srv, w["keys"]["ops"])
    page.click("#tab-engine")
    page.wait_for_selector("section.engine")
    ticks = page.locator("section.engine [data-stat='ticks'] b")
    before = int(ticks.inner_text())
    tc = w["alice"]["service"].create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
    from tests.console_world import datum

    tc.forward_backward([datum(list(range(3, 12)))], "cross_entropy").result()
    page.wait_for_function(
        f"() => Number(document.querySelector(\"section.engine [data-stat='ticks'] b\").textContent) > {before}",
        timeout=WAIT_MS,
    )  # no reload: the page polls
    assert page.inner_text("section.engine [data-stat='ticks/s'] b") != ""
    # the memory budget (auto) and what is resident and paged out, read from the engine
    assert int(page.inner_text("section.engine [data-stat='memory budget MiB'] b")) > 0
    assert int(page.inner_text("section.engine [data-stat='resident models'] b")) >= 1
    assert page.inner_text("section.engine [data-stat='paged-out models'] b") == "0"
    _shot(page, "server-engine")
    page.close()


def test_local_runs_curves_live_and_problems(browser: Any, local_run: tuple[str, Path]) -> None:
    url, runs = local_run
    page = _page(browser, viewport={"width": 1280, "height": 1000})
    page.goto(url + "/")
    page.wait_for_selector("#charts .chart")
    names = page.eval_on_selector_all("tr.run", "rows => rows.map(r => r.dataset.run)")
    assert {"multi/seed0", "multi/seed1", "broken"} <= set(names)
    assert "broken/metrics.jsonl:2" in page.inner_text("#problems")  # named; the other runs still show
    rows = [json.loads(x) for x in (runs / "multi" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    reward = page.locator("#charts .chart[data-title='reward/mean']")
    assert reward.count() == 1
    selected = page.eval_on_selector_all("tr.run input:checked", "xs => xs.length")
    expected = 0
    for name in names[:selected]:
        metrics = [
            json.loads(x)
            for x in (runs / name / "metrics.jsonl").read_text().splitlines()
            if x.startswith("{")
        ]
        config = (
            json.loads((runs / name / "config.json").read_text())
            if (runs / name / "config.json").exists()
            else {}
        )
        keys = [f"{a}/reward/mean" for a in config.get("agents", [])] or ["reward/mean"]  # a curve per agent
        expected += sum(1 for row in metrics for k in keys if k in row)
    assert int(reward.get_attribute("data-points") or 0) == expected >= len(rows)
    _shot(page, "runs-curves")
    with (runs / "multi" / "seed0" / "metrics.jsonl").open("a") as f:  # the run goes on
        f.write(json.dumps({"step": len(rows), "reward/mean": 0.5}) + "\n")
    page.wait_for_function(
        f"() => Number(document.querySelector(\"#charts .chart[data-title='reward/mean']\").dataset.points) > {expected}",
        timeout=WAIT_MS,
    )
    page.close()


def test_local_runs_rollouts_are_shown(browser: Any, local_run: tuple[str, Path]) -> None:
    url, runs = local_run
    first = json.loads((runs / "multi" / "seed0" / "rollouts.jsonl").read_text().splitlines()[0])
    page = _page(browser, viewport={"width": 1280, "height": 1000})
    page.goto(url + "/")
    page.wait_for_selector("tr.run[data-run='multi/seed0'] a.open-rollouts")
    page.click("tr.run[data-run='multi/seed0'] a.open-rollouts")
    page.wait_for_selector(".episode")
    page.select_option("select[name=step]", str(first["step"]))
    page.wait_for_function(
        "() => { const ms = [...document.querySelectorAll('.episode .meta')]; "
        f"return ms.length > 0 && ms.every(m => m.textContent.startsWith('step {first['step']} ')); }}"
    )
    prompt = first["turns"][0]["text"]
    texts = page.eval_on_selector_all(".turn.prompt", "ts => ts.map(t => t.textContent)")
    assert prompt in texts
    action = "".join(first["turns"][1]["tokens"])
    assert action in page.eval_on_selector_all(".turn.action", "ts => ts.map(t => t.textContent)")
    page.fill("input[name=min_reward]", "0.5")
    page.press("input[name=min_reward]", "Enter")
    page.wait_for_function(  # the filtered list, however long the reload takes
        "() => [...document.querySelectorAll('.episode .meta')].every("
        "m => parseFloat(m.textContent.split('reward ')[1]) >= 0.5)",
        timeout=WAIT_MS,
    )
    metas = page.eval_on_selector_all(".episode .meta", "ms => ms.map(m => m.textContent)")
    assert all(float(m.split("reward ")[1].split(" ")[0]) >= 0.5 for m in metas)
    _shot(page, "runs-rollouts")
    page.close()


def test_a_multi_agent_runs_episodes_filter_by_agent(browser: Any, local_run: tuple[str, Path]) -> None:
    url, runs = local_run
    logged = [json.loads(x) for x in (runs / "game" / "rollouts.jsonl").read_text().splitlines()]
    assert {e["series"] for e in logged} == {"X", "O"}
    page = _page(browser, viewport={"width": 1280, "height": 1000})
    page.goto(url + "/")
    page.click("tr.run[data-run='game'] a.open-rollouts")
    page.wait_for_selector(".episode")
    assert page.eval_on_selector_all("select[name=series] option", "os => os.map(o => o.value)") == [
        "",
        "O",
        "X",
    ]
    for agent in ("O", "X"):
        page.select_option("select[name=series]", agent)
        page.wait_for_function(
            "() => { const ms = [...document.querySelectorAll('.episode .meta')]; "
            f"return ms.length > 0 && ms.every(m => m.textContent.includes(' · {agent} · ')); }}"
        )
        shown = page.eval_on_selector_all(".turn.prompt", "ts => ts.map(t => t.textContent)")
        mine = [e["turns"][0]["text"] for e in logged if e["series"] == agent]
        assert shown and all(t in mine for t in shown)
        assert len(shown) == min(20, len(mine))
    page.close()


def test_the_session_trace_page_shows_waits_ticks_and_samples(
    browser: Any, world: tuple[LocalServer, dict[str, Any]]
) -> None:
    srv, w = world
    page = _sign_in(browser, srv, w["keys"]["alice"])
    page.click("#tab-sessions")
    session = w["alice_child"]["model_id"].split(":train:")[0]
    page.wait_for_selector(f"tr[data-session='{session}'] a")
    page.click(f"tr[data-session='{session}'] a")
    page.wait_for_selector("#trace tr.request")
    kinds = page.eval_on_selector_all("#trace tr.request", "rs => rs.map(r => r.dataset.kind)")
    assert {"sample", "forward_backward", "optim_step"} <= set(kinds)
    sample = page.locator("#trace tr.request[data-kind='sample']").first
    assert ":sample:" in (sample.get_attribute("data-track") or "")
    cells = sample.locator("td").all_inner_texts()
    assert float(cells[3]) >= 0 and float(cells[5]) >= float(cells[3])  # waited, then ran
    fb = page.locator("#trace tr.request[data-kind='forward_backward']").first.locator("td").all_inner_texts()
    assert int(fb[6]) >= 1  # the tick that ran it
    bars = page.eval_on_selector_all("#timeline .bar", "bs => bs.map(b => b.dataset.kind)")
    assert sorted(bars) == sorted(kinds)
    _shot(page, "server-trace")
    page.close()


def test_no_browser_was_downloaded() -> None:
    cache = Path.home() / ".cache" / "ms-playwright"
    assert not cache.exists() or not any(cache.glob("chromium*")), "a browser was downloaded"
    assert shutil.which("chromium") or Path(CHROMIUM).exists()
