"""``GET /metrics``: the server's state and counters in Prometheus' text format, for an operator.

Only a key (or token) of a tenant named by ``--operator`` may scrape it: 401 without a valid
credential, 403 for any other tenant's. The series are labelled by tenant, which no tenant may
learn of another. Prometheus sends the key as ``Authorization: Bearer <key>`` (its scrape config's
``authorization: {credentials_file: …}``); ``X-API-Key`` works too, as on every other route. The
route is :mod:`~opentinker.server.metrics_route`'s.

Each server has its own ``CollectorRegistry`` (several servers in one process never collide).
Events are counters incremented where they happen: tokens, through the usage ledger's observers
(every count the ledger bills, with the prompt tokens a sample took from the prefix cache as an
unbilled observation). Everything else is read when scraped, by :class:`StateCollector`, from the
objects that already hold it: request states (the reorder buffer, admission, the futures), each
base model's scheduler (ticks, their run time and fused rows), sampling loop (running batch,
waiting requests), prefix cache and workers, live models, snapshots and samplers per tenant, and
checkpoint bytes from the index. No label value shows a filesystem path of this server (they go
through the same redactor as every error message).

Metric names (``<base>`` = ``base_model`` label):

- ``opentinker_tokens_total{tenant,base_model,kind}``: ``training`` (forward and forward-backward
  input tokens), ``sampling_prefill`` (prompt tokens), ``sampling_sample`` (sampled tokens)
- ``opentinker_prompt_cache_hit_tokens_total{tenant,base_model}``: prompt tokens reused
- ``opentinker_requests{state}``: unfinished requests ``held_for_order`` (a lower ``seq_id``
  missing), ``held_rate_limit`` (``--max-running``), ``running`` (handed to an engine), and
  ``done`` (finished, kept for polls)
- per base model: ``opentinker_scheduler_queued_operations``, ``opentinker_ticks_total``,
  ``opentinker_tick_seconds`` and ``opentinker_tick_rows`` (summaries: sum and count),
  ``opentinker_last_tick_seconds``, ``opentinker_optim_steps_total``,
  ``opentinker_rollout_running_rows``, ``opentinker_rollout_waiting_requests``,
  ``opentinker_rollout_decode_steps_total``, ``opentinker_prefix_cache_bytes``
- ``opentinker_live_models{tenant,base_model}``, ``opentinker_live_snapshots{tenant,base_model}``,
  ``opentinker_live_samplers{tenant}``, ``opentinker_checkpoints{tenant,kind}``,
  ``opentinker_checkpoint_bytes{tenant,kind}``
- paging (``engine/paging.py``): ``opentinker_memory_budget_bytes``; per base model
  ``opentinker_resident_models``, ``opentinker_resident_model_bytes``,
  ``opentinker_paged_out_models``, ``opentinker_paged_out_model_bytes`` (models and snapshots),
  ``opentinker_page_ins_total``, ``opentinker_page_outs_total``, ``opentinker_page_in_bytes_total``,
  ``opentinker_page_out_bytes_total``, ``opentinker_page_in_waits_total``,
  ``opentinker_page_in_wait_seconds_total``, ``opentinker_page_out_failures_total``,
  ``opentinker_ticks_waited_for_page_in_total``
- workers: ``opentinker_rollout_workers{base_model,transport,state}``,
  ``opentinker_rollout_worker_restarts_total``, ``opentinker_rollout_requests_rerun_total``,
  ``opentinker_trainer_workers{base_model,state}`` (``alive``, ``lost``)
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

PREFIX = "opentinker"


class ServerMetrics:
    """One server's registry: its event counters and the collector of its state."""

    def __init__(self, server: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.tokens = Counter(
            f"{PREFIX}_tokens",
            "Tokens counted as operations finish: training (forward and forward-backward inputs), "
            "sampling_prefill (prompts), sampling_sample (sampled)",
            ["tenant", "base_model", "kind"],
            registry=self.registry,
        )
        self.cache_hits = Counter(
            f"{PREFIX}_prompt_cache_hit_tokens",
            "Prompt tokens whose keys and values came from the sampler's prefix cache",
            ["tenant", "base_model"],
            registry=self.registry,
        )
        self.redact = server.redact
        self.registry.register(StateCollector(server))
        server.usage.observers.append(self.observe)

    def observe(self, tenant: str, kind: str, tokens: int, base_model: str) -> None:
        """The usage ledger's observer: every token count, billed or not."""
        base = self.redact(base_model)
        if kind == "prompt_cache_hit":
            self.cache_hits.labels(tenant, base).inc(tokens)
        else:
            self.tokens.labels(tenant, base, kind).inc(tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)


def snapshot_owner(snapshot_id: str) -> str:
    """The model a snapshot id belongs to: ``<model>@v<n>``, a loaded checkpoint
    ``tinker://<model>/<kind>/<name>@<content>``, or ``checkpoint-weights:tinker://<model>/…#n``."""
    sid = snapshot_id.removeprefix("checkpoint-weights:").removeprefix("tinker://")
    return sid.split("/", 1)[0].split("@", 1)[0]


class StateCollector(Collector):
    """What the server holds now, read at each scrape."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        yield self._requests()
        yield from self._engines()
        yield from self._paging()
        yield from self._tenants()
        yield from self._workers()
        yield from self._checkpoints()

    def _label(self, value: str) -> str:
        return self.server.redact(value)

    def _requests(self) -> Metric:
        s = self.server
        unfinished, done = s.futures.counts()
        _, rate_held = s.ops.admit.counts()
        order_held = s.sequencer.held_count()
        g = _gauge("requests", "Requests the server holds, by state (unfinished ones, then done)", ["state"])
        g.add_metric(["held_for_order"], order_held)
        g.add_metric(["held_rate_limit"], rate_held)
        g.add_metric(["running"], max(0, unfinished - order_held - rate_held))
        g.add_metric(["done"], done)
        return g

    def _engines(self) -> Iterator[Metric]:
        runtime, lb = self.server.runtime, ["base_model"]
        queued = _gauge("scheduler_queued_operations", "Operations queued on the scheduler", lb)
        ticks = _counter("ticks", "Scheduler ticks run", lb)
        secs = SummaryMetricFamily(f"{PREFIX}_tick_seconds", "Run time of the scheduler's ticks", labels=lb)
        rows = SummaryMetricFamily(f"{PREFIX}_tick_rows", "Datums in each tick's fused pass", labels=lb)
        last = _gauge("last_tick_seconds", "Run time of the last tick", lb)
        optim = _counter("optim_steps", "Optimizer steps run", lb)
        running = _gauge(
            "rollout_running_rows", "Sequences decoding in the rollout batch (rollout workers': summed)", lb
        )
        waiting = _gauge("rollout_waiting_requests", "Sample requests waiting to join the batch", lb)
        steps = _counter("rollout_decode_steps", "Decode steps the sampling loop ran", lb)
        cache = _gauge("prefix_cache_bytes", "Bytes of keys and values in the prefix cache", lb)
        for e in runtime.engine_stats(trainers=False):  # no call to any worker
            base, st = [self._label(e["base_model"])], e["ticks"]
            queued.add_metric(base, sum(e["queue_depths"].values()))
            ticks.add_metric(base, st["ticks"])
            secs.add_metric(base, st["ticks"], st["tick_seconds"])
            rows.add_metric(base, st["ticks"], st["fused_rows"])
            last.add_metric(base, st["last_tick_seconds"])
            optim.add_metric(base, st["optim_steps"])
            rs = e["rollout"] or {}  # the in-process loop's, or the worker pool's (its workers' summed)
            if "live_rows" in rs:
                running.add_metric(base, rs["live_rows"])
                waiting.add_metric(base, rs["waiting"])
                steps.add_metric(base, rs["steps"])
            if e["prefix_cache"] is not None:  # vLLM keeps its own
                cache.add_metric(base, e["prefix_cache"]["bytes"])
        yield from (queued, ticks, secs, rows, last, optim, running, waiting, steps, cache)

    def _paging(self) -> Iterator[Metric]:
        lb = ["base_model"]
        budget = _gauge(
            "memory_budget_bytes", "Bytes of models' state that may be resident (0: no limit)", []
        )
        budget.add_metric([], float(self.server.runtime.budget.limit or 0))
        gauges = {
            "resident": _gauge("resident_models", "Models and snapshots whose state is in memory", lb),
            "resident_bytes": _gauge("resident_model_bytes", "Bytes of that state", lb),
            "paged_out": _gauge("paged_out_models", "Models and snapshots paged out to page files", lb),
            "paged_out_bytes": _gauge("paged_out_model_bytes", "Bytes of their state in page files", lb),
        }
        counters = {
            "page_ins": _counter("page_ins", "State paged in from page files", lb),
            "page_outs": _counter("page_outs", "State paged out to page files", lb),
            "bytes_in": _counter("page_in_bytes", "Bytes paged in", lb),
            "bytes_out": _counter("page_out_bytes", "Bytes written to page files", lb),
            "waited": _counter("page_in_waits", "Uses that waited for a page-in", lb),
            "wait_s": _counter("page_in_wait_seconds", "Seconds requests waited for page-ins", lb),
            "failed_outs": _counter("page_out_failures", "Page-outs that could not be written", lb),
        }
        waited = _counter("ticks_waited_for_page_in", "Ticks that waited for a model's page-in", lb)
        for e in self.server.runtime.engine_stats(trainers=False):
            base, p = [self._label(e["base_model"])], e["paging"]
            for k, m in [*gauges.items(), *counters.items()]:
                m.add_metric(base, p[k])
            waited.add_metric(base, e["ticks"]["waited_ticks"])
        yield from (budget, *gauges.values(), *counters.values(), waited)

    def _tenants(self) -> Iterator[Metric]:
        runtime, store = self.server.runtime, self.server.store
        records = [r for r in list(runtime.models.values()) if not r.deleted]
        owners = {r.model_id: r.tenant for r in list(runtime.models.values())}
        models = Tally((r.tenant, r.base_model) for r in records)
        snapshots: Tally[tuple[str, str]] = Tally()
        for name in runtime.loaded_base_models():
            for sid in runtime.snapshot_ids(name):
                model = snapshot_owner(sid)
                if model not in owners:
                    row = store.model(model)
                    owners[model] = row.tenant if row is not None else "unknown"
                snapshots[(owners[model], name)] += 1
        samplers = Tally(s.tenant for s in list(self.server.registry.samplers.values()))
        lt = ["tenant", "base_model"]
        g = _gauge("live_models", "Models (LoRA adapters) in memory", lt)
        for (tenant, base), n in sorted(models.items()):
            g.add_metric([tenant, self._label(base)], n)
        yield g
        g = _gauge("live_snapshots", "Snapshots (sampleable weight versions) in memory", lt)
        for (tenant, base), n in sorted(snapshots.items()):
            g.add_metric([tenant, self._label(base)], n)
        yield g
        g = _gauge("live_samplers", "Sampler sessions the server holds", ["tenant"])
        for tenant, n in sorted(samplers.items()):
            g.add_metric([tenant], n)
        yield g

    def _workers(self) -> Iterator[Metric]:
        lb = ["base_model", "transport"]
        workers = _gauge(
            "rollout_workers", "Rollout workers (processes or Ray actors) by state", [*lb, "state"]
        )
        restarts = _counter("rollout_worker_restarts", "Rollout workers restarted after a loss", lb)
        rerun = _counter("rollout_requests_rerun", "Requests re-run after their worker was lost", lb)
        trainers = _gauge("trainer_workers", "Ray trainer workers: alive, lost", ["base_model", "state"])
        for name, info in sorted(self.server.runtime.scaleout.worker_counts().items()):
            base = self._label(name)
            if "rollout" in info:
                r = info["rollout"]
                for state, n in sorted(Tally(r["states"]).items()):
                    workers.add_metric([base, r["transport"], state], n)
                restarts.add_metric([base, r["transport"]], r["restarts"])
                rerun.add_metric([base, r["transport"]], r["rerun"])
            if "trainers" in info:
                for state in ("alive", "lost"):
                    trainers.add_metric([base, state], info["trainers"][state])
        yield from (workers, restarts, rerun, trainers)

    def _checkpoints(self) -> Iterator[Metric]:
        count = _gauge("checkpoints", "Checkpoints in the index, by tenant and kind", ["tenant", "kind"])
        size = _gauge("checkpoint_bytes", "Recorded bytes of those checkpoints", ["tenant", "kind"])
        for tenant, kind, n, nbytes in self.server.store.checkpoint_totals():
            count.add_metric([tenant, kind], n)
            size.add_metric([tenant, kind], nbytes)
        yield from (count, size)
