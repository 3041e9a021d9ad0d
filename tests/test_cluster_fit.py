"""What the Ray cluster can place, without Ray: the arithmetic of :func:`fit_error` (one owner for
start-up and scaling), the short wait of :func:`check_start` for resources being given back, and
the bound :func:`wait_placed` puts on an actor that is never placed.

The Ray-backed halves (``serve`` refusing a start the cluster cannot place, a pending placement
failing its pool) are in ``tests/test_ray_start.py``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from opentinker.cluster import ray_env
from opentinker.cluster.ray_env import Ask, ClusterError, check_start, fit_error, wait_placed


def _have(total: float, free: float | None = None, largest: float | None = None, gpus: float = 0.0) -> Any:
    """A one-kind-of-node cluster as :func:`ray_env.resources` reports it."""
    return {
        "total": {"CPU": total, "GPU": gpus},
        "free": {"CPU": total if free is None else free, "GPU": gpus},
        "largest_node": {"CPU": total if largest is None else largest, "GPU": gpus},
    }


ROLLOUT = Ask(2, 1.0, 0.0, "rollout worker", "--worker")
TRAINER = Ask(2, 1.0, 0.0, "trainer worker", "--trainer")


def test_a_start_that_needs_more_cpus_than_the_cluster_has_names_each_kind_and_the_sum() -> None:
    assert fit_error([ROLLOUT, TRAINER], _have(2), more=False) == (
        "2 rollout workers × 1 CPU + 2 trainer workers × 1 CPU = 4 CPUs asked, but the cluster "
        "has 2 CPUs free (2 in all; each kind alone would fit); lower --worker-cpus / "
        "--trainer-cpus or the worker counts"
    )


def test_what_fits_is_no_error_exactly_full_included() -> None:
    half = [Ask(2, 0.5, 0.0, "rollout worker", "--worker"), Ask(2, 0.5, 0.0, "trainer worker", "--trainer")]
    assert fit_error(half, _have(2), more=False) is None
    assert fit_error([TRAINER], _have(2), more=False) is None
    assert fit_error([Ask(0, 64.0, 9.0, "rollout worker")], _have(2), more=False) is None  # none asked
    assert fit_error([Ask(3, 1 / 3, 0.0, "rollout worker")], _have(1), more=False) is None  # rounding


def test_one_kind_alone_beyond_the_cluster_is_not_called_fitting_alone() -> None:
    why = fit_error([Ask(3, 1.0, 0.0, "trainer worker", "--trainer")], _have(2), more=False)
    assert why == (
        "3 trainer workers × 1 CPU = 3 CPUs asked, but the cluster has 2 CPUs free (2 in all); "
        "lower --trainer-cpus or the worker counts"
    )


def test_what_is_free_counts_not_what_the_cluster_has_in_all() -> None:
    why = fit_error([Ask(1, 1.0, 0.0, "trainer worker")], _have(2, free=0.0), more=True)
    assert why == (
        "1 more trainer worker × 1 CPU = 1 CPU asked, but the cluster has 0 CPUs free (2 in all); "
        "scale to fewer workers or free some of the cluster's CPUs"
    )


def test_a_worker_larger_than_any_node_is_named_whatever_the_total() -> None:
    why = fit_error([Ask(1, 3.0, 0.0, "rollout worker")], _have(4, largest=2.0), more=False)
    assert (
        why
        == "a rollout worker asks for 3 CPUs but the largest Ray node has 2 (the cluster has 4 CPUs in all)"
    )
    why = fit_error([Ask(1, 0.0, 1.0, "trainer worker")], _have(2), more=False)
    assert (
        why
        == "a trainer worker asks for 1 GPUs but the largest Ray node has 0 (the cluster has 0 GPUs in all)"
    )


def test_gpus_are_summed_over_the_kinds_as_cpus_are() -> None:
    asks = [Ask(1, 0.0, 1.0, "rollout worker", "--worker"), Ask(2, 0.0, 1.0, "trainer worker", "--trainer")]
    assert fit_error(asks, _have(8, gpus=2.0), more=False) == (
        "1 rollout worker × 1 GPU + 2 trainer workers × 1 GPU = 3 GPUs asked, but the cluster has "
        "2 GPUs free (2 in all; each kind alone would fit); lower --worker-gpus / --trainer-gpus "
        "or the worker counts"
    )


class _Cluster:
    """What :func:`ray_env.resources` answers, changed by the test as Ray's would be."""

    def __init__(self, have: Any) -> None:
        self.have, self.asked = have, 0

    def __call__(self) -> Any:
        self.asked += 1
        return self.have


def test_a_start_beyond_the_cluster_is_refused_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _Cluster(_have(2))
    monkeypatch.setattr(ray_env, "resources", cluster)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"= 4 CPUs asked, but the cluster has 2 CPUs free \(2 in all"):
        check_start([ROLLOUT, TRAINER], grace_s=60.0)
    assert time.monotonic() - t0 < 30 and cluster.asked == 1  # never waits for what can't come


def test_a_start_waits_briefly_for_resources_being_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _Cluster(_have(2, free=1.0))  # a runtime just stopped: one CPU not yet given back
    monkeypatch.setattr(ray_env, "resources", cluster)
    monkeypatch.setattr(ray_env.time, "sleep", lambda s: setattr(cluster, "have", _have(2)))
    check_start([TRAINER], grace_s=60.0)
    assert cluster.asked == 2
    cluster.have = _have(2, free=1.0)  # never given back: refused once the grace is over
    monkeypatch.setattr(ray_env.time, "sleep", lambda s: None)
    with pytest.raises(ClusterError, match=r"= 2 CPUs asked, but the cluster has 1 CPUs free \(2 in all\)"):
        check_start([TRAINER], grace_s=0.05)


def test_an_actor_never_placed_fails_after_the_timeout_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    placed = {"a": True, "b": False}
    monkeypatch.setattr(ray_env, "_placed", lambda actor: placed[actor])
    monkeypatch.setattr(ray_env, "resources", lambda: _have(2, free=0.0))
    each = Ask(1, 1.0, 0.0, "trainer worker", "--trainer")
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as info:
        wait_placed({"trainer worker trainer-0": "a", "trainer worker trainer-1": "b"}, each, timeout=0.3)
    assert time.monotonic() - t0 < 30
    assert str(info.value) == (
        "trainer worker trainer-1 was not placed within 0.3 s: each asks for 1 CPU and 0 GPUs, the "
        "cluster has 0 CPUs and 0 GPUs free (2 and 0 in all); lower --trainer-cpus / --trainer-gpus "
        "or the worker counts, or raise --placement-timeout"
    )


def test_placed_actors_and_an_unreadable_actor_table_do_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"up": True, "unknown": None}
    monkeypatch.setattr(ray_env, "_placed", lambda actor: answers[actor])
    t0 = time.monotonic()
    wait_placed({"rollout worker 0": "up", "rollout worker 1": "unknown"}, ROLLOUT, timeout=600)
    assert time.monotonic() - t0 < 30


def test_the_placement_timeout_is_a_serve_option_and_must_be_positive(tmp_path: Any) -> None:
    from opentinker.server.main import build_parser, config_from_args
    from opentinker.service.runtime import Runtime

    args = ["--base-model", "opentinker/tiny", "--dev"]
    assert config_from_args(build_parser().parse_args(args)).runtime.placement_timeout == 60.0
    cfg = config_from_args(build_parser().parse_args([*args, "--placement-timeout", "5"]))
    assert cfg.runtime.placement_timeout == 5.0
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--placement-timeout", "0"])
    with pytest.raises(ValueError, match="placement_timeout must be > 0 seconds, got 0"):
        Runtime(tmp_path, placement_timeout=0)
