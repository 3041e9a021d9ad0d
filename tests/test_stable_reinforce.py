"""``stable_reinforce`` end to end with the UNMODIFIED ``tinker`` SDK against ``opentinker serve``:
sampling with ``record_stability_info=True`` records each returned sequence; datums naming those
sequences through provenance spans (as tinker-cookbook's ``rl_loop`` builds them) train with the
loss of ``engine/losses.py``, whose value is checked here against a hand computation from the
recorded sampler logprobs and the learner's logprobs, off-policy (one optimizer step after
sampling). Unknown sequences, another session's or another tenant's, tokens that differ from the
record, missing spans and server-only inputs sent by the client are user errors that leave the
model as it was; records expire after their lifetime and each use restarts it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from opentinker.server.local import LocalServer
from opentinker.service import EngineError
from opentinker.service.stability import StabilityRecords
from tests.conftest import TEST_MODEL, local_server
from tests.tolerances import assert_scalar_close

DEV_KEY = "tml-stable-reinforce-dev-key-1"
OTHER_KEY = "tml-stable-reinforce-dev-key-2"
PROMPT = [5, 17, 42, 99, 7, 300]
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "stable-data", "--poll-timeout", "5") as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=DEV_KEY)
    yield sc
    sc.close("success").result()


def _datum(
    seq: types.SampledSequence, advantage: float, *, spans: bool = True, zero_prompt_targets: bool = False
) -> types.Datum:
    """As tinker-cookbook's rl_loop builds it: prompt + all but the last sampled token in,
    targets shifted by one; the provenance names the sampled sequence behind every position.
    ``zero_prompt_targets``: the prompt's targets are placeholder zeros, exactly as ``rl_loop``
    sends them (its prompt advantages are 0)."""
    toks, n = list(seq.tokens), len(seq.tokens)
    ob = len(PROMPT) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + toks[:-1]),
        loss_fn_inputs={
            "target_tokens": ([0] * ob if zero_prompt_targets else PROMPT[1:]) + toks,
            "logprobs": [0.0] * ob + list(seq.logprobs or []),
            "advantages": [0.0] * ob + [advantage] * n,
        },  # type: ignore[dict-item]  # lists: the SDK converts
    )
    if not spans:
        return datum
    sid = seq.sequence_id
    assert sid is not None
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sid, length=n - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(PROMPT) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=n),
        ],
    )


def _sample(tc: tinker.TrainingClient) -> list[types.SampledSequence]:
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    res = sc.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result()
    assert all(s.sequence_id for s in res.sequences)
    return list(res.sequences)


def _logprobs(tc: tinker.TrainingClient, data: list[types.Datum]) -> list[list[float]]:
    plain = [
        types.Datum(
            model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]}
        )
        for d in data
    ]
    return [o["logprobs"].tolist() for o in tc.forward(plain, "cross_entropy").result().loss_fn_outputs]


def test_stable_reinforce_trains_on_recorded_sequences_as_computed_by_hand(
    service: tinker.ServiceClient,
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=1).result()
    seqs = _sample(tc)
    data = [_datum(s, a) for s, a in zip(seqs, (1.0, -0.5), strict=True)]
    # off-policy: the learner moves on before it trains on these samples
    tc.forward_backward([_datum(seqs[0], 1.0, spans=False)], "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    lps = _logprobs(tc, data)
    ob, cap, expected, weights = len(PROMPT) - 1, 2.0, 0.0, []
    for seq, adv, lp in zip(seqs, (1.0, -0.5), lps, strict=True):
        sampled = lp[ob:]  # the sampled targets; prompt targets have mask 0
        q = list(seq.logprobs or [])
        w = min(math.exp(sum(a - b for a, b in zip(sampled, q, strict=True)) / len(q)), cap)
        weights.append(w)
        expected += -w * adv * sum(sampled)
    assert any(abs(w - 1.0) > 1e-3 for w in weights)  # really off-policy
    out = tc.forward_backward(data, "stable_reinforce").result()
    assert_scalar_close(out.metrics["loss:sum"], expected)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_placeholder_prompt_targets_train_like_the_real_prompt_tokens(service: tinker.ServiceClient) -> None:
    """tinker-cookbook's rl_loop fills the prompt part of target_tokens with zeros under a prompt
    provenance span; those targets have mask 0, so the loss (and so the update) is the one of the
    real prompt tokens. Sampled targets are still checked against the record."""
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=3).result()
    seqs = _sample(tc)
    real = [_datum(s, a) for s, a in zip(seqs, (1.0, -0.5), strict=True)]
    zeros = [_datum(s, a, zero_prompt_targets=True) for s, a in zip(seqs, (1.0, -0.5), strict=True)]
    assert [d.loss_fn_inputs["target_tokens"].tolist() for d in zeros] != [
        d.loss_fn_inputs["target_tokens"].tolist() for d in real
    ]
    want = tc.forward(real, "stable_reinforce").result().metrics["loss:sum"]
    got = tc.forward(zeros, "stable_reinforce").result().metrics["loss:sum"]
    assert want != 0.0
    assert_scalar_close(got, want)


def _refused(tc: tinker.TrainingClient, data: list[types.Datum], message: str) -> None:
    before = _logprobs(tc, data)
    with pytest.raises(tinker.RequestFailedError, match=message):
        tc.forward_backward(data, "stable_reinforce").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # would apply any gradient kept
    assert _logprobs(tc, data) == before


def test_bad_provenance_is_a_user_error_and_changes_nothing(
    service: tinker.ServiceClient, server: LocalServer
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=2).result()
    [seq, _] = _sample(tc)
    good = _datum(seq, 1.0)
    unknown = _datum(dataclasses.replace(seq, sequence_id="f" * 32), 1.0)
    _refused(tc, [unknown], "which this server has no record of")
    _refused(tc, [_datum(seq, 1.0, spans=False)], "needs provenance spans")
    tampered = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={**good.loss_fn_inputs, "target_tokens": [*PROMPT[1:], *[t + 1 for t in seq.tokens]]},  # type: ignore[dict-item]
        model_input_spans=good.model_input_spans,
        loss_fn_input_spans=good.loss_fn_input_spans,
    )
    _refused(tc, [tampered], "target_tokens differ from the tokens the sequence recorded")
    sneaky = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={
            **good.loss_fn_inputs,
            "stability_logprobs": types.TensorData.from_numpy(
                np.zeros(len(seq.tokens) + len(PROMPT) - 1, np.float32)
            ),
        },  # type: ignore[dict-item]
        model_input_spans=good.model_input_spans,
        loss_fn_input_spans=good.loss_fn_input_spans,
    )
    _refused(tc, [sneaky], "is set by the server")
    for key in (DEV_KEY, OTHER_KEY):  # another session of this tenant, and another tenant
        other = tinker.ServiceClient(base_url=server.base_url, api_key=key)
        try:
            theirs = other.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
            [their_seq, _] = _sample(theirs)
        finally:
            other.close("success").result()
        _refused(tc, [_datum(their_seq, 1.0)], "was not sampled in this model's session")
    out = tc.forward_backward([good], "stable_reinforce").result()  # and the good one trains
    assert math.isfinite(out.metrics["loss:sum"])


def test_records_expire_after_their_lifetime_and_each_use_restarts_it() -> None:
    records = StabilityRecords(ttl_s=0.5)
    res = types.SampleResponse(
        sequences=[
            types.SampledSequence(
                stop_reason="length",
                sequence_id="",
                tokens_np=np.array([9, 8]),
                logprobs_np=np.array([-0.5, -1.5]),
            )
        ],
    )
    records.record("t", "s", ["id"], [1, 2, 3], res, "sampler")
    assert records.get("t", "s", "id") is not None
    assert records.get("other-tenant", "s", "id") is None
    assert records.get("t", "other-session", "id") is None
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 9]),
        loss_fn_inputs={"target_tokens": [2, 3, 9, 8], "advantages": [0.0, 0.0, 1.0, 1.0]},  # type: ignore[dict-item]
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="id", length=3),
            types.SampledProvenanceSpan(sequence_id="id", length=1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="id", offset=1, length=2),
            types.SampledProvenanceSpan(sequence_id="id", length=2),
        ],
    )
    [resolved] = records.resolve("t", "s", [datum])
    inputs: dict[str, Any] = {k: v.tolist() for k, v in resolved.loss_fn_inputs.items()}
    assert inputs["stability_logprobs"] == [0.0, 0.0, -0.5, -1.5]
    assert inputs["stability_mask"] == [0.0, 0.0, 1.0, 1.0]
    assert inputs["stability_sequence"] == [-1.0, -1.0, 0.0, 0.0]
    time.sleep(0.3)
    records.resolve("t", "s", [datum])  # a use restarts the lifetime
    time.sleep(0.3)
    assert records.get("t", "s", "id") is not None  # 0.6 s after sampling, 0.3 s after use
    time.sleep(0.6)
    with pytest.raises(EngineError, match="no record of"):
        records.resolve("t", "s", [datum])
