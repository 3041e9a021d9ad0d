"""The OpenAI-compatible routes' request bodies and their checks (:mod:`openai_routes`).

Bodies are parsed here, not by FastAPI, so that every refusal is an OpenAI-shaped error
(:class:`OpenAIError`: ``{"error": {"message", "type", "param", "code"}}``) with the field that is
wrong in ``param`` (``messages[2].role``, ``tools[0].function.parameters``) and a 400, which is
what OpenAI answers for a bad parameter (never FastAPI's 422). Unknown fields are ignored, as the
Tinker routes do, since clients send options this server does not read (``user``, ``metadata``).

Limits: ``n`` at most :data:`MAX_N` (128, OpenAI's own bound; and at most the server's
``max_num_samples``), ``top_logprobs`` at most 20 (OpenAI's), ``logprobs`` of ``/v1/completions``
at most 5 (OpenAI's), at most 4 ``stop`` strings (OpenAI's), at most 64 prompts in one completions
request; ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] and ``logit_bias`` values in
[-100, 100] (OpenAI's). A parameter this server does not serve (:data:`UNSERVED`), sent with a
value other than its default, is a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP = 4
MAX_PROMPTS = 64
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_BIAS = 100.0
# what OpenAI's routes take that this server does not serve (each with the value that means "off")
UNSERVED: dict[str, dict[str, Any]] = {
    "chat": {
        "audio": None,
        "prediction": None,
        "web_search_options": None,
        "functions": None,
        "function_call": None,
        "reasoning_effort": None,
    },
    "completions": {"best_of": None},
}


class OpenAIError(Exception):
    """A refusal in OpenAI's shape; ``status`` is the HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """What both routes share: the model and the sampling parameters."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions, which eval harnesses send: never stop at EOS (only without ``stop``);
    # report each logprob's token as ``token_id:<id>`` (exact, whatever the tokenizer's text)
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys are token ids; got {key!r}")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100]; got {bias!r} for {key!r}")
        return v

    def bias(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token, bias) pairs (a 400 for a token outside the vocabulary)."""
        out = tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())
        bad = next((t for t, _ in out if t >= vocab), None)
        if bad is not None:
            raise OpenAIError(
                f"logit_bias names token {bad}, outside the vocabulary (0..{vocab - 1})", param="logit_bias"
            )
        return out

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > MAX_STOP or any(not s for s in stops)):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings")
        return stops or None

    def stops(self) -> list[str] | None:
        return self.stop if isinstance(self.stop, list) else None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Sampling):
    messages: list[Any] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template
    response_format: Any = None
    modalities: list[str] | None = None

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise ValueError("only the text modality is served")
        return v

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for /v1/completions; 0 only with ``echo`` (score the prompt, sample nothing)
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


def parse(model: type[_Sampling], raw: Any) -> Any:
    """``raw`` (the decoded JSON body) as ``model``, or a 400 naming the first bad field."""
    if not isinstance(raw, dict):
        raise OpenAIError("the request body must be a JSON object")
    for name, off in UNSERVED.get("chat" if model is ChatRequest else "completions", {}).items():
        if raw.get(name, off) != off and not (name == "best_of" and raw[name] in (1, raw.get("n", 1))):
            raise OpenAIError(f"{name} is not served by this server", param=name)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(err["loc"])
        raise OpenAIError(f"{param or 'body'}: {err['msg']}", param=param) from None


def _param(loc: tuple[Any, ...]) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif part in ("str", "int", "float", "bool") or any(c in part for c in "[(,"):
            continue  # pydantic's names of union branches and validators
        else:
            out += f".{part}"
    return out or None


def check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The chat messages as the chat template takes them (a 400 naming the bad one): roles
    system / developer (as system) / user / assistant / tool; content a string or text parts."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise OpenAIError(f"{where} must be an object with a role and content", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise OpenAIError(
                f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role"
            )
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        msg["content"] = _content(m.get("content"), f"{where}.content", optional=role == "assistant")
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            if msg["content"] is None:  # templates concatenate content: null is no text
                msg["content"] = ""
        elif msg["content"] is None:
            raise OpenAIError(f"{where}.content is missing", param=f"{where}.content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise OpenAIError(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _content(content: Any, where: str, *, optional: bool) -> str | list[dict[str, Any]] | None:
    """A message's content: a string, or (with image parts, which ``openai_images.py`` reads on a
    VL model) its parts, each image part with its ``where``."""
    if content is None and optional:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                parts.append({**part, "where": f"{where}[{j}]"})
                continue
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise OpenAIError(
                    f"{where}[{j}] must be a text part ({{'type': 'text', 'text': ...}}) or an image_url "
                    "part; other parts (audio, files) are not served",
                    param=f"{where}[{j}]",
                )
            parts.append({"type": "text", "text": part["text"]})
        if any(p["type"] == "image_url" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise OpenAIError(f"{where} must be a string or a list of text and image_url parts", param=where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, their arguments as objects (what templates render)."""
    if not isinstance(calls, list):
        raise OpenAIError(f"{where} must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise OpenAIError(f"{where}[{j}] must have a function with a name", param=f"{where}[{j}]")
        args: Any = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise OpenAIError(
                    f"{where}[{j}].function.arguments is not JSON", param=f"{where}[{j}].function.arguments"
                ) from None
        out.append(
            {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Function tools, each with a name and (optionally) ``parameters`` that are a valid JSON
    Schema (checked with ``jsonschema``'s meta-schemas); a 400 naming the bad one."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise OpenAIError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise OpenAIError(
                f"{where}.function.name must be a non-empty string", param=f"{where}.function.name"
            )
        params = fn.get("parameters")
        if params is not None:
            problem = schema_problem(params)
            if problem is not None:
                raise OpenAIError(
                    f"{where}.function.parameters is not a valid JSON Schema: {problem}",
                    param=f"{where}.function.parameters",
                )
        out.append({"type": "function", "function": fn})
    return out


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON Schema (None if it is)."""
    if isinstance(schema, bool):
        return None  # true / false: every instance valid / none
    if not isinstance(schema, dict):
        return "a schema is an object"
    try:
        from jsonschema import exceptions, validators
    except ImportError:  # the checks that need no library: a type that names no JSON type
        kind = schema.get("type")
        types = {"object", "array", "string", "number", "integer", "boolean", "null"}
        if kind is not None and not (kind in types if isinstance(kind, str) else False):
            return f"type {kind!r} is not a JSON type"
        return None
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as e:
        at = "/".join(str(p) for p in e.path)
        return f"{e.message}" + (f" (at {at})" if at else "")
    return None


def check_echo(req: CompletionRequest) -> None:
    """``echo`` (whole answers only) and ``max_tokens`` 0 (only with ``echo``); no ``suffix``."""
    if req.suffix:
        raise OpenAIError("suffix is not supported", param="suffix")
    if req.echo and req.stream:
        raise OpenAIError("echo is not supported with stream", param="echo")
    if req.max_tokens == 0 and not req.echo:
        raise OpenAIError("max_tokens 0 needs echo (scoring the prompt)", param="max_tokens")


def prompt_text(tok: Any, prompt: Any, i: int, ids: list[int]) -> str:
    """The ``i``-th prompt as sent (a text prompt) or decoded (token ids), for ``echo``."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and i < len(prompt) and isinstance(prompt[i], str):
        return prompt[i]
    return tok.decode(ids)


def prompts_of(
    tok: Any, prompt: str | list[str] | list[int] | list[list[int]], vocab: int
) -> list[list[int]]:
    """A completions request's prompts as token ids (text with the tokenizer's special tokens)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items or len(items) > MAX_PROMPTS:
        raise OpenAIError(f"prompt must hold 1 to {MAX_PROMPTS} prompts", param="prompt")
    out = [list(tok.encode(p)) if isinstance(p, str) else list(p) for p in items]
    for i, ids in enumerate(out):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(
                f"prompt[{i}] holds token {bad}, outside the vocabulary (0..{vocab - 1})", param="prompt"
            )
    return out


def route_error(method: str, path: str, status: int) -> OpenAIError:
    """A 404 / 405 under ``/v1`` (no route, or not that method) in OpenAI's shape: its clients
    read no other."""
    if status == 405:
        return OpenAIError(f"{method} is not allowed on {path}", status=405)
    if status == 404:
        return OpenAIError(f"{method} {path} is not served here", status=404, type="not_found_error")
    return OpenAIError(f"the request failed with HTTP {status}", status=status)
