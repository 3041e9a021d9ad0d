"""The JSON half of the wire protocol: request bodies as the SDK 0.38 sends them (pydantic).

These are *wire* types, kept apart from the embedded client's types and the storage rows. They
ignore unknown fields (a newer SDK may send more) and reuse the SDK's own models for the nested
values it defines precisely (``ModelInput``, ``SamplingParams``). FastAPI validates bodies against
them — a wrong type answers 422 naming the field — and publishes them at ``/docs``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field
from tinker import types

# ids the SDK numbers (seq ids, model and sampler seq ids) are int64 on its side; they end up in
# model and sampler ids, which become folder names, so an unbounded integer is refused (422)
MAX_SEQ = 2**63 - 1


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


AccessScope = Literal["owned", "accessible"]  # one tenant is one user: both name its own


class ClientConfigRequest(_Wire):
    sdk_version: str | None = None


class CreateSessionRequest(_Wire):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(_Wire):
    session_id: str


class FinishSessionRequest(_Wire):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class LoraConfig(_Wire):
    rank: int = Field(ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(_Wire):
    session_id: str
    model_seq_id: int = Field(ge=0, le=MAX_SEQ)
    base_model: str
    lora_config: LoraConfig | None = None
    optimizer_config: dict[str, Any] | None = None
    user_metadata: dict[str, Any] | None = None


class GetInfoRequest(_Wire):
    model_id: str


class AdamParams(types.AdamParams):
    """The SDK's ``AdamParams`` (its fields and defaults), unknown fields ignored as on every request."""

    model_config = ConfigDict(extra="ignore")


class OptimStepRequest(_Wire):
    model_id: str
    seq_id: int | None = Field(default=None, ge=1, le=MAX_SEQ)
    adam_params: AdamParams | None = Field(
        default=None, validation_alias=AliasChoices("adam_params", "optim_params")
    )
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(_Wire):
    model_id: str
    path: str | None = None
    seq_id: int | None = Field(default=None, ge=1, le=MAX_SEQ)
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerRequest(_Wire):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = Field(default=None, ge=0, le=MAX_SEQ)
    kind: Literal["snapshot", "inflight"] = "snapshot"  # the SDK's SamplingClientKind
    seq_id: int | None = Field(default=None, ge=1, le=MAX_SEQ)
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class SaveWeightsExternalRequest(_Wire):
    model_id: str
    path: str
    seq_id: int | None = Field(default=None, ge=1, le=MAX_SEQ)
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class CheckpointTtlRequest(_Wire):
    ttl_seconds: int | None = None


class LoadWeightsRequest(_Wire):
    path: str
    optimizer: bool = False
    # legacy form: load into an existing model, in its seq_id order
    model_id: str | None = None
    seq_id: int | None = Field(default=None, ge=1, le=MAX_SEQ)
    # create-from-state form: a new model ``<session_id>:train:<model_seq_id>``
    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0, le=MAX_SEQ)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None


class CreateSamplingSessionRequest(_Wire):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0, le=MAX_SEQ)
    base_model: str | None = None
    model_path: str | None = None


class SampleRequest(_Wire):
    prompt: types.ModelInput
    sampling_params: types.SamplingParams
    num_samples: int = 1
    sampling_session_id: str | None = None
    seq_id: int | None = Field(default=None, le=MAX_SEQ)
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0)
    topk_sample_logprobs: int = Field(default=0, ge=0)
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1)
    record_stability_info: bool | None = None


class FutureRetrieveRequest(_Wire):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfoRequest(_Wire):
    tinker_path: str
