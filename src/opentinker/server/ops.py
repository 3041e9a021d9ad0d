"""The operations behind the routes: each maps one decoded request onto the embedded clients.

An operation that takes time returns a request id at once; its result — encoded for the wire —
lands in the :class:`~opentinker.server.futures.FutureStore` under that id. Training requests are
submitted in their model's ``seq_id`` order through the :class:`~opentinker.server.ordering.Sequencer`;
requests with ids the SDK may retry (``(session, model_seq_id)``, ``(sampler, seq_id)``, …) are
idempotent. Everything here runs on the event loop and never blocks on the engine: the embedded
clients queue work on the scheduler and hand back futures.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from tinker import types
from tinker.types._pydantic_types.tensor_data import TensorData as TensorDataModel
from tinker.types.optimizer import OptimParamsBase

from opentinker.server import schemas as S
from opentinker.server.admission import Admission
from opentinker.server.completions import CLONE_BLOCK, CompletionQueues
from opentinker.server.config import ServerConfig
from opentinker.server.custom_losses import CreateCustomLossRequest, CustomLosses
from opentinker.server.errors import BadRequest, UserError
from opentinker.server.futures import FutureStore, QueueState, chain, fail
from opentinker.server.history import History
from opentinker.server.ordering import Idempotency, Sequencer
from opentinker.server.registry import Registry, SamplerNotLoaded, Session
from opentinker.server.traces import SessionTraces
from opentinker.server.usage import Ledger
from opentinker.server.wire import (
    decode_forward_backward,
    digest_json,
    encode_forward_output,
    encode_sample_response,
)
from opentinker.service import EngineError, LoRAConfig, SampleHandle, SamplingClient, Submitted
from opentinker.service.checkpoints import check_ttl
from opentinker.service.convert import check_prompt_extras, checked_length, keyed_tokens, optimizer_type
from opentinker.service.metering import meter_sample, meter_training
from opentinker.service.sampling import sampling_client
from opentinker.service.sessions import sampler_id_in, session_of
from opentinker.service.stability import StabilityRecords

Submit = Callable[[], Future]
Encode = Callable[[Any], Any]
# what a request's trace span records: (session id, operation, track, base model, seq_id)
Trace = tuple[str, str, str, str | None, int | None]


@dataclass
class Operation:
    """One request as the pipeline (:meth:`Operations.execute`) runs it."""

    tenant: str
    submit: Submit  # queues the work (called when admission lets it in)
    encode: Encode  # the result, for the wire
    trace: Trace | None = None  # its span in its session's trace
    key: tuple[Any, ...] | None = None  # an idempotent request's id: its retries get the same answer
    what: str = ""  # how that id reads in a conflict ("model_seq_id 3")
    digest: str = ""  # the request body's digest: a retry with another body is a conflict
    model_id: str | None = None  # a training operation: run in this model's ``seq_id`` order
    seq_id: int | None = None
    answer: Callable[[str, Future], Any] = lambda request_id, _: request_id  # what the caller gets


class Operations:
    def __init__(
        self,
        config: ServerConfig,
        registry: Registry,
        futures: FutureStore,
        sequencer: Sequencer,
        ledger: Ledger | None = None,
        traces: SessionTraces | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger  # counts the tokens each tenant trained and sampled
        self.reg = registry
        self.futures = futures
        self.seq = sequencer
        self.once = Idempotency()
        self.completions = CompletionQueues(ttl_s=config.result_ttl_s)
        self.admit = Admission(config.max_running_per_tenant)
        self.custom_losses = CustomLosses()
        self.stability = StabilityRecords()
        self.history = History()  # loss / grad norm / learning rate per run, from their results
        self.traces = traces  # each session's requests on a timeline (export_session_trace)

    # ------------------------------------------------------------------ the pipeline
    def run(self, tenant: str, submit: Submit, encode: Encode) -> str:
        """An unordered operation: submit now; a request id for its encoded result."""
        return self.execute(Operation(tenant, submit, encode))

    def execute(self, op: Operation) -> Any:
        """Run ``op`` through the one pipeline: an idempotent retry (``op.key``) or an ordered one
        (``op.model_id``'s ``seq_id``) gets its first answer again; else a request id is made, its
        span traced, and ``op.submit`` goes to the tenant's admission — at once, or for an ordered
        operation when its model's turn comes. Returns ``op.answer`` of the request id."""
        if op.key is not None:
            hit = self.once.check(op.key, op.digest, op.what)
            if hit is not None:
                return hit
        turn = (op.model_id, op.seq_id) if op.model_id is not None and op.seq_id is not None else None
        if turn is not None:
            hit = self.seq.lookup(*turn, op.digest)
            if hit is not None:
                return hit
        # the one its model's held requests wait for must get in, or they would hold the
        # tenant's pending slots while it is refused for want of one
        exempt = turn is not None and self.seq.awaited(*turn)
        request_id, out = self.futures.create(op.tenant, exempt=exempt)
        submit, encode = self._traced(request_id, out, op)
        start = partial(self._admit, op.tenant, request_id, out, submit, encode)
        if turn is None:
            start()
        else:
            try:
                self.seq.submit(*turn, op.digest, request_id, out, start)
            except BaseException as e:
                fail(out, e)
                raise
        answer = op.answer(request_id, out)
        if op.key is not None:
            self.once.remember(op.key, op.digest, answer)
        return answer

    def _traced(self, request_id: str, out: Future, op: Operation) -> tuple[Submit, Encode]:
        """``op``'s submit and encode, recording the request's span in its session's trace."""
        if self.traces is None or op.trace is None:
            return op.submit, op.encode
        session, name, track, base, seq_id = op.trace
        span = self.traces.begin(session, request_id, name, track, base, seq_id)
        self.traces.finish_with(session, span, out)
        return self.traces.submit(span, op.submit), self.traces.encode(span, op.encode)

    def _admit(self, tenant: str, request_id: str, out: Future, submit: Submit, encode: Encode) -> None:
        self.futures.hooks(
            request_id,
            state=lambda: self.admit.state(tenant, out),
            cancel=lambda: self.admit.cancel(tenant, out),
        )
        self.admit.submit(tenant, out, lambda: chain(submit(), out, encode))

    def _training(
        self,
        tenant: str,
        model_id: str,
        seq_id: int | None,
        digest: str,
        submit: Submit,
        encode: Encode,
        name: str,
    ) -> str:
        """A training operation on ``model_id``: in its ``seq_id`` order, traced on its track."""
        try:
            base: str | None = self.reg.runtime.model(model_id).base_model
        except Exception:  # not (or no longer) in memory: traced without its ticks
            base = None
        trace = (session_of(model_id), name, model_id, base, seq_id)
        return self.execute(
            Operation(tenant, submit, encode, trace, model_id=model_id, seq_id=seq_id, digest=digest)
        )

    # ------------------------------------------------------------------ models
    def create_model(self, tenant: str, req: S.CreateModelRequest) -> str:
        sess = self.reg.session(tenant, req.session_id)
        digest = digest_json("create_model", req.model_dump(mode="json"))
        self._data_parallel(req.user_metadata)  # a degree it cannot serve: 400 at once, nothing made
        lora = req.lora_config or S.LoraConfig(rank=32)
        config = LoRAConfig(
            rank=lora.rank,
            seed=lora.seed,
            train_attn=lora.train_attn,
            train_mlp=lora.train_mlp,
            train_unembed=lora.train_unembed,
        )
        self.reg.life.check_room(req.base_model, config)  # over the budget: 400; no room: 507

        def submit() -> Future:
            base = self.reg.base_model(req.base_model)
            return self.reg.new_model(
                sess,
                req.model_seq_id,
                base,
                config=config,
                optimizer_type=optimizer_type(req.optimizer_config),
                user_metadata=req.user_metadata,
            )

        return self.execute(
            Operation(
                tenant,
                submit,
                lambda rec: {"model_id": rec.model_id, "type": "create_model"},
                (sess.id, "create_model", sess.id, req.base_model, req.model_seq_id),
                ("model", sess.id, req.model_seq_id),
                f"model_seq_id {req.model_seq_id}",
                digest,
            )
        )

    def _data_parallel(self, user_metadata: dict[str, Any] | None) -> int | None:
        """The data-parallel degree a new model's ``user_metadata`` asks for (``"data_parallel"``;
        None: the server's ``--data-parallel``), or 400 naming the value and the trainer workers."""
        try:
            return self.reg.runtime.asked_data_parallel(user_metadata)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    def get_info(self, tenant: str, model_id: str) -> dict[str, Any]:
        tc = self.reg.model(tenant, model_id)
        info = tc.get_info().model_dump(mode="json", exclude_none=True)
        # a local folder, so the SDK's get_tokenizer() works offline on this machine
        info["model_data"]["tokenizer_id"] = self.reg.base_info(info["model_data"]["model_name"]).path
        return info

    def load_weights(self, tenant: str, req: S.LoadWeightsRequest) -> str:
        digest = digest_json("load_weights", req.model_dump(mode="json"))
        if req.session_id is not None and req.model_seq_id is not None:  # create-from-state
            sess = self.reg.session(tenant, req.session_id)
            ref, meta = self.reg.checkpoint(tenant, req.path)
            self._data_parallel(req.user_metadata)  # a degree it cannot serve: 400 at once

            def submit() -> Future:
                optimizer_type(req.optimizer_config)  # refuse what this engine does not run
                base = self.reg.base_model(meta.get("base_model", ""))
                if req.base_model is not None and self.reg.base_model(req.base_model) != base:
                    raise UserError(f"checkpoint {req.path} was trained on {base!r}, not {req.base_model!r}")
                return self.reg.new_model(
                    sess,
                    req.model_seq_id or 0,
                    base,
                    checkpoint=ref.tinker_path,
                    optimizer=req.optimizer,
                    user_metadata=req.user_metadata,
                )

            def done(rec: Any) -> dict[str, Any]:  # the degree it came at, and why if not its checkpoint's
                out = {"path": req.path, "model_id": rec.model_id, "type": "load_weights"}
                return {**out, "data_parallel": rec.data_parallel, **({"note": rec.note} if rec.note else {})}

            return self.execute(
                Operation(
                    tenant,
                    submit,
                    done,
                    (sess.id, "create_model_from_state", sess.id, req.base_model, req.model_seq_id),
                    ("model", sess.id, req.model_seq_id),
                    f"model_seq_id {req.model_seq_id}",
                    digest,
                )
            )
        if req.model_id is None:
            raise BadRequest("load_weights needs model_id (+ seq_id), or session_id + model_seq_id")
        tc = self.reg.model(tenant, req.model_id)
        load = tc.load_state_with_optimizer if req.optimizer else tc.load_state

        def submit() -> Future:
            ref, _ = self.reg.checkpoint(tenant, req.path)  # another tenant's checkpoint is unknown
            return load(ref.tinker_path).future()

        return self._training(
            tenant,
            req.model_id,
            req.seq_id,
            digest,
            submit,
            lambda r: r.model_dump(mode="json", exclude_none=True),
            "load_weights",
        )

    # ------------------------------------------------------------------ training
    def create_custom_loss(self, tenant: str, req: CreateCustomLossRequest) -> str:
        sess = self.reg.session(tenant, req.session_id)
        digest = digest_json("create_custom_loss", req.model_dump(mode="json"))

        def submit() -> Future:
            done: Future = Future()
            done.set_result(self.custom_losses.create(tenant, sess.id, req))
            return done

        return self.execute(
            Operation(
                tenant,
                submit,
                lambda loss_id: {"loss_id": loss_id, "type": "create_custom_loss"},
                key=("custom_loss", sess.id, req.custom_loss_seq_id),
                what=f"custom_loss_seq_id {req.custom_loss_seq_id}",
                digest=digest,
            )
        )

    def forward_backward(self, tenant: str, body: bytes) -> str:
        call = decode_forward_backward(body)
        tc = self.reg.model(tenant, call.model_id)
        op = tc.forward if call.forward_only else tc.forward_backward

        def submit() -> Future:
            if call.error is not None:
                raise call.error
            custom, data = None, call.data
            session = self._session_of(tenant, call.model_id).id
            if call.loss_fn == "custom":  # checked in its turn: a refusal leaves no seq_id gap
                custom = self.custom_losses.get(tenant, session, call.loss_id)
            elif call.loss_fn == "stable_reinforce":  # provenance -> what the sampler recorded
                data = self.stability.resolve(tenant, session, data, self.reg.runtime.vision(base))
            return op(data, call.loss_fn, call.loss_fn_config, custom_loss=custom).future()

        base = self.reg.runtime.model(call.model_id).base_model
        # a bad image is refused now, its seq_id spent (refusals.py): later requests do not wait
        lengths = self._checked_lengths(
            base, [(d.model_input, f"datum {i}") for i, d in enumerate(call.data)]
        )
        ledger, tokens = self.ledger, sum(lengths)
        session = session_of(call.model_id)
        name = "forward" if call.forward_only else "forward_backward"

        def encode(out: Any) -> Any:
            if ledger is not None:
                meter_training(ledger, tenant, tokens, session_id=session, base_model=base)
            if not call.forward_only:
                self.history.forward(call.model_id, out.metrics)
            return encode_forward_output(out)

        return self._training(tenant, call.model_id, call.seq_id, call.digest, submit, encode, name)

    def optim_step(self, tenant: str, req: S.OptimStepRequest) -> str:
        tc = self.reg.model(tenant, req.model_id)
        digest = digest_json("optim_step", req.model_dump(mode="json"))

        def submit() -> Future:
            if req.optimizer_params is not None and req.optimizer_params.get("type") != "adamw":
                # the SDK sends another optimizer's params (DimuonParams, ...) under this key;
                # the training client refuses those its model's optimizer does not take
                return tc.optim_step(OptimParamsBase.model_validate(req.optimizer_params)).future()
            params = req.adam_params or S.AdamParams()
            return tc.optim_step(types.AdamParams(**params.model_dump())).future()

        def encode(r: Any) -> Any:
            metrics = r.metrics or {}
            self.history.optim(str(req.model_id), metrics)
            return r.model_dump(mode="json", exclude_none=True)

        return self._training(tenant, req.model_id, req.seq_id, digest, submit, encode, "optim_step")

    def save_weights(self, tenant: str, req: S.SaveWeightsRequest) -> str:
        tc = self.reg.model(tenant, req.model_id)
        digest = digest_json("save_weights", req.model_dump(mode="json"))
        name = req.path if req.path is not None else f"seq-{req.seq_id or uuid.uuid4().hex[:8]}"

        def saved(res: types.SaveWeightsResponse) -> dict[str, Any]:
            self.reg.record_checkpoint(tenant, res.path, req.ttl_seconds, req.user_metadata)
            return {"path": res.path, "type": "save_weights"}

        def submit() -> Future:
            check_ttl(req.ttl_seconds)  # refused in the model's order: nothing is saved
            return tc.save_state(name, overwrite=req.overwrite).future()

        return self._training(tenant, req.model_id, req.seq_id, digest, submit, saved, "save_weights")

    def save_weights_for_sampler(self, tenant: str, req: S.SaveWeightsForSamplerRequest) -> str:
        tc = self.reg.model(tenant, req.model_id)
        digest = digest_json("save_weights_for_sampler", req.model_dump(mode="json"))
        if req.path is not None:  # named, durable sampler weights

            def saved(res: types.SaveWeightsForSamplerResponse) -> dict[str, Any]:
                self.reg.record_checkpoint(tenant, res.path, req.ttl_seconds, req.user_metadata)
                return {"path": res.path, "type": "save_weights_for_sampler"}

            def submit() -> Future:
                check_ttl(req.ttl_seconds)
                return tc.save_weights_for_sampler(req.path or "").future()

            name = "save_weights_for_sampler"
            return self._training(tenant, req.model_id, req.seq_id, digest, submit, saved, name)
        # ephemeral: an in-memory snapshot served by a new sampler session; kind "inflight" makes
        # it the model's inflight target, which all its inflight samplers follow (registry)
        if req.sampling_session_seq_id is None:
            raise BadRequest("save_weights_for_sampler needs a path, or a sampling_session_seq_id")
        sess = self._session_of(tenant, req.model_id)
        sampler_id = sampler_id_in(sess.id, req.sampling_session_seq_id)
        base = self.reg.runtime.model(req.model_id).base_model

        def snapshot() -> Future:
            return self.reg.runtime.snapshot(tc.model_id)

        def served(snap: Any) -> dict[str, Any]:
            serve = self.reg.inflight_sampler if req.kind == "inflight" else self.reg.snapshot_sampler
            serve(sess, sampler_id, snap, base)
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        name = "save_weights_for_sampler"
        return self._training(tenant, req.model_id, req.seq_id, digest, snapshot, served, name)

    def save_weights_external(self, tenant: str, req: S.SaveWeightsExternalRequest) -> str:
        """The adapter in PEFT format at ``tinker://<model_id>/external_weights/<name>``."""
        tc = self.reg.model(tenant, req.model_id)
        digest = digest_json("save_weights_external", req.model_dump(mode="json"))

        def saved(res: types.SaveWeightsExternalResponse) -> dict[str, Any]:
            size = self.reg.record_external(res.path, ttl_seconds=req.ttl_seconds)
            return {"path": res.path, "size_bytes": size, "type": "save_weights_external"}

        def submit() -> Future:
            check_ttl(req.ttl_seconds)
            return tc.save_weights_external(
                req.path, age_encryption_recipients=req.age_encryption_recipients
            ).future()

        name = "save_weights_external"
        return self._training(tenant, req.model_id, req.seq_id, digest, submit, saved, name)

    def _checked_lengths(self, base_model: str, inputs: list[tuple[types.ModelInput, str]]) -> list[int]:
        """Each input's length in the model (an image as its processor's tokens); an image the base
        model cannot take: 400 (413: over the pixel limit) at once, naming it."""
        vision = self.reg.runtime.vision(base_model)
        try:
            return [checked_length(model_input, vision, where) for model_input, where in inputs]
        except EngineError as e:
            raise BadRequest(str(e), getattr(e, "status", 400)) from None

    def _session_of(self, tenant: str, model_id: str) -> Session:
        return self.reg.session(tenant, session_of(model_id), live=False)

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, tenant: str, req: S.CreateSamplingSessionRequest) -> Callable[[], str]:
        """Checks now; returns the (blocking: it may load weights) part to run in a worker thread."""
        sess = self.reg.session(tenant, req.session_id)
        sampler_id = sampler_id_in(sess.id, req.sampling_session_seq_id)
        digest = digest_json("create_sampling_session", req.model_dump(mode="json"))
        if self.once.check(
            ("sampler", sampler_id), digest, f"sampling_session_seq_id {req.sampling_session_seq_id}"
        ):
            return lambda: sampler_id
        base = None
        if req.model_path is not None:
            _, meta = self.reg.checkpoint(tenant, req.model_path)
            self.reg.base_model(str(meta.get("base_model", "")))  # never load an unserved base model
        elif req.base_model is None:
            raise BadRequest("create_sampling_session needs model_path or base_model")
        else:
            base = self.reg.base_model(req.base_model)

        def make() -> str:
            client = sampling_client(
                self.reg.runtime, sess.tenant, model_path=req.model_path, base_model=base
            )
            self.reg.add_sampler(sess, sampler_id, client)
            self.once.remember(("sampler", sampler_id), digest, sampler_id)
            return sampler_id

        return make

    def get_sampler(self, tenant: str, sampler_id: str) -> dict[str, Any]:
        try:
            s = self.reg.sampler(tenant, sampler_id)
        except SamplerNotLoaded as e:  # known, just not loaded yet: the record says it all
            return {"sampler_id": e.row.id, "base_model": e.row.base_model, "model_path": e.row.model_path}
        return {"sampler_id": s.id, "base_model": s.client.base_model, "model_path": s.model_path}

    def asample(self, tenant: str, req: S.SampleRequest) -> dict[str, Any]:
        if req.sampling_session_id is not None:
            client = self.reg.sampler(tenant, req.sampling_session_id).client
        elif req.base_model is not None and req.model_path is None:  # the session-less legacy form
            client = SamplingClient(self.reg.runtime, self.reg.base_model(req.base_model), None)
        else:
            raise BadRequest("asample needs a sampling_session_id (or a base_model)")
        digest = digest_json("asample", req.model_dump(mode="json"))
        [prompt_len] = self._checked_lengths(str(client.base_model), [(req.prompt, "the prompt")])
        self.check_sample(req, prompt_len)

        ids = [uuid.uuid4().hex for _ in range(req.num_samples)]
        handle: SampleHandle | None = None  # once queued with the sampler

        def submit() -> Future:
            nonlocal handle
            submitted = self._sample(client, req)
            handle = submitted.handle
            return submitted.response.future()

        def answer(rid: str, out: Future) -> dict[str, Any]:
            # held by admission first, then (once queued) by the sampler
            def state() -> tuple[QueueState, str | None]:
                held = self.admit.state(tenant, out)
                return held if held[0] != "active" or not handle else _capacity_state(client, handle)

            def cancel() -> bool:
                return self.admit.cancel(tenant, out) or (handle is not None and client.cancel(handle))

            self.futures.hooks(rid, state=state, cancel=cancel)
            if sampler_id is not None:
                self.completions.track((sampler_id, max(req.seq_id or 0, 0) // CLONE_BLOCK), rid, out)
            return {"request_id": rid, "sample_sequence_ids": ids}

        sampler_id = req.sampling_session_id
        encode = self._metered(tenant, client, req, prompt_len)
        op = Operation(tenant, submit, encode, answer=answer, digest=digest)
        if sampler_id is not None:
            if req.record_stability_info:
                op.encode = self._recording(tenant, sampler_id, ids, req, client, encode)
            op.trace = (session_of(sampler_id), "sample", sampler_id, str(client.base_model), req.seq_id)
            if req.seq_id is not None:
                op.key, op.what = (
                    ("sample", sampler_id, req.seq_id),
                    f"seq_id {req.seq_id} of sampler {sampler_id}",
                )
        return self.execute(op)

    def _sample(self, client: SamplingClient, req: S.SampleRequest) -> Submitted:
        if not 1 <= req.num_samples <= self.config.max_num_samples:
            raise UserError(
                f"num_samples must be in [1, {self.config.max_num_samples}], got {req.num_samples}"
            )
        return client.submit(
            req.prompt,
            req.num_samples,
            req.sampling_params,
            include_prompt_logprobs=bool(req.prompt_logprobs),
            topk_prompt_logprobs=req.topk_prompt_logprobs,
            topk_sample_logprobs=req.topk_sample_logprobs,
            target_prompt_logprobs=_target_tensor(req),
            prompt_alt_tokens_k=req.prompt_alt_tokens_k,
            prompt_logprobs_last_n=req.prompt_logprobs_last_n,
        )

    @staticmethod
    def check_sample(req: S.SampleRequest, prompt_len: int) -> None:
        """The prompt-scoring options, checked when the request arrives (400 naming the field)."""
        try:
            check_prompt_extras(
                prompt_len,
                bool(req.prompt_logprobs),
                _target_tensor(req),
                req.prompt_alt_tokens_k,
                req.prompt_logprobs_last_n,
            )
        except EngineError as e:
            raise BadRequest(str(e)) from None

    def _recording(
        self, tenant: str, sampler_id: str, ids: list[str], req: S.SampleRequest, client: Any, encode: Encode
    ) -> Encode:
        """``encode``, recording each returned sequence first (``service/stability.py``)."""
        session = session_of(sampler_id)
        weights = getattr(client, "model_path", None) or getattr(client, "policy", None) or "base"
        policy = f"{sampler_id} ({weights})"
        prompt = keyed_tokens(req.prompt, self.reg.runtime.vision(str(client.base_model)), "the prompt")

        def record(res: types.SampleResponse) -> Any:
            self.stability.record(tenant, session, ids, prompt, res, policy)
            return encode(res)

        return record

    @staticmethod
    def _encode_sample(req: S.SampleRequest) -> Encode:
        return lambda res: encode_sample_response(res, prompt_logprobs_last_n=req.prompt_logprobs_last_n)

    def _metered(self, tenant: str, client: Any, req: S.SampleRequest, prompt_len: int) -> Encode:
        """The sample's encoder, counting its prompt and generated tokens once it is done."""
        encode, ledger = self._encode_sample(req), self.ledger
        if ledger is None:
            return encode
        session = session_of(req.sampling_session_id or "")

        def metered(res: Any) -> Any:
            meter_sample(
                ledger, tenant, res, prompt_len, session_id=session, base_model=str(client.base_model)
            )
            return encode(res)

        return metered


def _target_tensor(req: S.SampleRequest) -> types.TensorData | None:
    """``target_prompt_logprobs`` as the SDK's ``TensorData`` (400 if it is not one)."""
    if req.target_prompt_logprobs is None:
        return None
    try:
        return types.TensorData(**TensorDataModel.model_validate(req.target_prompt_logprobs).model_dump())
    except (ValueError, TypeError) as e:
        raise BadRequest(f"target_prompt_logprobs is not a tensor: {e}") from None


def _capacity_state(client: SamplingClient, handle: SampleHandle) -> tuple[QueueState, str | None]:
    if client.held_back(handle):
        return "paused_capacity", (
            f"the sampler is at capacity: it decodes at most {client.max_rows} sequences at a time, "
            "and requests queued earlier are decoding first"
        )
    return "active", None
