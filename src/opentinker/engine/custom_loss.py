"""Server-side custom losses: a traced torch.fx graph, sent as plain JSON, run by an interpreter
that knows only an explicit allow-list of tensor operations.

The SDK (``ServiceClient.create_custom_loss``) traces a per-datum loss
``fn(logprobs, *inputs) -> (scalar loss, {"custom/<name>:sum|mean": scalar})`` with
``torch.fx`` and uploads its nodes as data (``tinker.types.CustomLossGraph``: no pickles, no
code). :func:`compile_loss` checks every node before anything runs and builds a
:class:`CustomLoss`; nothing in the upload is ever ``exec``'d, ``eval``'d or unpickled, and no
name in it is looked up on a module: a ``call_function`` target must be a key of
:data:`FUNCTIONS` (a table of callables built here, keyed by the qualified name torch.fx gives
them), a ``call_method`` a name in :data:`METHODS` called only on a tensor, ``getattr`` only a
name in :data:`TENSOR_ATTRS` read only off a tensor. ``get_attr`` (captured tensors),
``call_module`` and every other op are refused, each with a message naming the node.

Ops that allocate by a size argument (``torch.zeros(n)``, ``expand``, ``repeat``) are not in the
table, and every run is first made on ``meta`` tensors (shapes only, no memory) so a graph whose
intermediates grow past :data:`MAX_ELEMENTS` (broadcasting ``[T, 1] * [1, T]`` and so on) is
refused before it allocates anything. Device arguments are mapped to the device of the run.

Semantics match the SDK's client-side ``run_loss_handle``: the loss runs once per datum, the
per-datum losses are summed, and metrics are summed (``:sum``) or averaged over datums
(``:mean``). The engine differentiates the summed loss straight through the logprobs, which is
the gradient the client-side path sends back as ``cross_entropy`` weights.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.node import _get_qualified_name

from opentinker.engine.types import EngineError

MAX_NODES = 4096
MAX_INPUTS = 16
MAX_ELEMENTS = 1 << 24  # any intermediate tensor: 16 M elements (64 MB in fp32)
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")

_FUNCTIONS: list[Callable[..., Any]] = [
    # Python arithmetic, comparison and indexing, as torch.fx records them
    *(operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod),
    *(operator.pow, operator.neg, operator.pos, operator.abs, operator.invert, operator.matmul),
    *(operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne),
    *(operator.and_, operator.or_, operator.xor, operator.getitem),
    # elementwise
    *(torch.exp, torch.log, torch.log1p, torch.expm1, torch.exp2, torch.log2, torch.log10),
    *(torch.sqrt, torch.rsqrt, torch.square, torch.pow, torch.abs, torch.neg, torch.sign),
    *(torch.sigmoid, torch.tanh, torch.relu, torch.clamp, torch.clip, torch.minimum, torch.maximum),
    *(torch.where, torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.reciprocal),
    *(torch.logical_and, torch.logical_or, torch.logical_not, torch.isfinite, torch.nan_to_num),
    *(torch.lt, torch.le, torch.gt, torch.ge, torch.eq, torch.ne, torch.floor, torch.ceil),
    *(torch.round, torch.lerp, torch.logaddexp, torch.xlogy, torch.special.xlogy),
    *(F.softplus, F.logsigmoid, F.relu, F.sigmoid, F.tanh, F.silu),
    # reductions and shape
    *(torch.sum, torch.mean, torch.amax, torch.amin, torch.max, torch.min, torch.logsumexp),
    *(torch.prod, torch.cumsum, torch.std, torch.var, torch.norm, torch.all, torch.any),
    *(torch.softmax, torch.log_softmax, F.softmax, F.log_softmax, torch.gather, torch.stack),
    *(torch.cat, torch.squeeze, torch.unsqueeze, torch.flatten, torch.reshape, torch.transpose),
    *(torch.numel, torch.detach, torch.masked_fill, torch.dot, torch.matmul),
    # new tensors shaped like an existing one, or a scalar
    *(torch.zeros_like, torch.ones_like, torch.full_like, torch.scalar_tensor),
    # plain math on Python numbers (shapes, constants)
    *(math.log, math.exp, math.sqrt, math.log1p, math.expm1, math.floor, math.ceil, math.fabs),
]


def _wire_name(fn: Callable[..., Any]) -> str:
    name = _get_qualified_name(fn)
    return "operator." + name.removeprefix("_operator.") if name.startswith("_operator.") else name


FUNCTIONS: dict[str, Callable[..., Any]] = {_wire_name(fn): fn for fn in _FUNCTIONS}
"""The call_function targets a graph may name (wire name -> the callable it runs)."""

_METHOD_NAMES = """
sum mean exp log log1p expm1 sqrt rsqrt square pow abs neg sign sigmoid tanh relu clamp clip
minimum maximum where add sub mul div true_divide reciprocal lt le gt ge eq ne logical_and
logical_or logical_not isfinite nan_to_num floor ceil round lerp amax amin max min logsumexp
prod cumsum std var norm all any softmax log_softmax gather squeeze unsqueeze flatten reshape
view view_as transpose t permute contiguous size dim numel detach float double to type_as
masked_fill dot matmul __getitem__ __add__ __sub__ __mul__ __truediv__ __neg__ __pow__ __radd__
__rsub__ __rmul__ __rtruediv__ __rpow__
"""
METHODS = frozenset(_METHOD_NAMES.split())
"""Tensor methods a graph may call (never in place, never one that leaves torch or allocates
by a size argument)."""

TENSOR_ATTRS = frozenset({"shape", "ndim", "dtype", "T", "mT", "device", "requires_grad"})
"""Tensor attributes ``getattr`` may read."""

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "bool", "float", "long")
}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format}


class CustomLossError(EngineError):
    """A custom-loss graph the server refuses, or one that failed on this data."""


@dataclass(frozen=True)
class _Node:
    op: str
    name: str
    target: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Device:
    pass  # "the device of the run"


class CustomLoss:
    """A checked graph: ``loss(logprobs, inputs)`` -> (scalar loss, metrics) for one datum."""

    def __init__(self, name: str, inputs: list[tuple[str, int]], nodes: list[_Node], output: Any) -> None:
        self.name = name
        self.inputs = inputs  # (name, rank), logprobs first
        self._nodes = nodes
        self._output = output

    @property
    def input_names(self) -> tuple[str, ...]:
        """The ``loss_fn_inputs`` keys the loss reads, in the order it takes them."""
        return tuple(n for n, _ in self.inputs[1:])

    def check_datum(
        self, where: str, logprobs_shape: Sequence[int], inputs: Mapping[str, torch.Tensor]
    ) -> None:
        """Raise unless ``inputs`` has every input at its declared rank."""
        lp_rank = self.inputs[0][1]
        if len(logprobs_shape) != lp_rank:
            raise CustomLossError(
                f"{where}: target_tokens has rank {len(logprobs_shape)}, but loss {self.name!r} "
                f"declared logprobs with rank {lp_rank}"
            )
        for key, rank in self.inputs[1:]:
            t = inputs.get(key)
            if t is None:
                raise CustomLossError(
                    f"{where}: loss_fn_inputs has no {key!r}, which loss {self.name!r} takes"
                )
            got = 0 if (rank == 0 and t.numel() == 1 and t.dim() <= 1) else t.dim()
            if got != rank:
                raise CustomLossError(
                    f"{where}: loss_fn_inputs[{key!r}] has rank {t.dim()}, but loss {self.name!r} "
                    f"declared it with rank {rank}"
                )

    def __call__(
        self, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        args = [logprobs]
        for key, rank in self.inputs[1:]:
            t = inputs[key]
            args.append(t.reshape(()) if rank == 0 else t)
        meta = [a.detach().to("meta") for a in args]
        try:  # shapes only: an oversize graph is refused before it allocates anything
            self._run(meta, torch.device("meta"))
        except CustomLossError as e:
            if "over the limit" in str(e):
                raise
            # an op without a meta kernel, or data-dependent (a boolean mask): the real run
            # below still checks every intermediate, and such ops only shrink tensors
        loss, metrics = self._run(args, logprobs.device)
        return loss, metrics

    def _run(
        self, args: list[torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        env: dict[str, Any] = {}
        placeholders = iter(args)
        for node in self._nodes:
            try:
                if node.op == "placeholder":
                    value: Any = next(placeholders)
                else:
                    a = _resolve(node.args, env, device)
                    kw = _resolve(node.kwargs, env, device)
                    value = _call(node, a, kw)
            except CustomLossError:
                raise
            except Exception as e:  # torch's own refusal of these values (shapes, dtypes)
                raise CustomLossError(
                    f"custom loss {self.name!r} failed at node {node.name!r} ({node.target}): {e}"
                ) from e
            if isinstance(value, torch.Tensor) and value.numel() > MAX_ELEMENTS:
                raise CustomLossError(
                    f"custom loss {self.name!r}: node {node.name!r} ({node.target}) makes a tensor of "
                    f"{value.numel()} elements, over the limit of {MAX_ELEMENTS}"
                )
            env[node.name] = value
        loss, metrics = _resolve(self._output, env, device)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise CustomLossError(f"custom loss {self.name!r} must return a scalar loss, got {shape}")
        for key, m in metrics.items():
            if not isinstance(m, torch.Tensor) or m.numel() != 1:
                raise CustomLossError(f"custom loss {self.name!r}: metric {key!r} must be a scalar tensor")
        return loss, metrics


def _call(node: _Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if node.op == "call_function":
        if node.target == "getattr":
            obj, attr = args  # attr is one of TENSOR_ATTRS (checked at compile time)
            if not isinstance(obj, torch.Tensor):
                raise CustomLossError(
                    f"node {node.name!r}: getattr on a {type(obj).__name__} is refused; "
                    "custom losses may read attributes only of tensors"
                )
            return getattr(obj, attr)
        return FUNCTIONS[node.target](*args, **kwargs)
    self, *rest = args
    if not isinstance(self, torch.Tensor):
        raise CustomLossError(
            f"node {node.name!r} calls method {node.target!r} on a {type(self).__name__}; "
            "custom losses may call methods only on tensors"
        )
    return getattr(self, node.target)(*rest, **kwargs)


def _resolve(arg: Any, env: dict[str, Any], device: torch.device) -> Any:
    if isinstance(arg, _Ref):
        return env[arg.name]
    if isinstance(arg, _Device):
        return device
    if isinstance(arg, tuple):
        return tuple(_resolve(a, env, device) for a in arg)
    if isinstance(arg, list):
        return [_resolve(a, env, device) for a in arg]
    if isinstance(arg, dict):
        return {k: _resolve(v, env, device) for k, v in arg.items()}
    if isinstance(arg, slice):
        return slice(*(_resolve(a, env, device) for a in (arg.start, arg.stop, arg.step)))
    return arg


# ---------------------------------------------------------------------------- compile
def compile_loss(name: str, inputs: Sequence[Mapping[str, Any]], graph: Mapping[str, Any]) -> CustomLoss:
    """Check an uploaded loss (the fields of ``CreateCustomLossRequest``) completely; raises
    :class:`CustomLossError` naming the first node (or field) at fault."""
    if not isinstance(name, str) or not 0 < len(name) <= 128:
        raise CustomLossError("a custom loss needs a name of 1-128 characters")
    declared = _check_inputs(name, inputs)
    if graph.get("format") != 1:
        raise CustomLossError(
            f"custom loss {name!r}: graph format {graph.get('format')!r} is not supported (1 is)"
        )
    raw = graph.get("nodes")
    if not isinstance(raw, list) or not raw:
        raise CustomLossError(f"custom loss {name!r}: the graph has no nodes")
    if len(raw) > MAX_NODES:
        raise CustomLossError(
            f"custom loss {name!r}: the graph has {len(raw)} nodes, over the limit of {MAX_NODES}"
        )
    nodes: list[_Node] = []
    known: dict[str, str] = {}  # node name -> "tensor" | "value" (what getattr/methods may act on)
    output: Any = None
    placeholders: list[str] = []
    for i, r in enumerate(raw):
        if output is not None:
            raise CustomLossError(f"custom loss {name!r}: node {i} comes after the output node")
        node = _node(name, i, r, known)
        if node.op == "placeholder":
            placeholders.append(node.target)
            known[node.name] = "tensor"
        elif node.op == "output":
            if len(node.args) != 1:
                raise CustomLossError(f"custom loss {name!r}: the output node must have one argument")
            output = _check_output(name, node.args[0])
            continue
        else:
            _check_call(name, node, known)
            known[node.name] = "value"
        nodes.append(node)
    if output is None:
        raise CustomLossError(f"custom loss {name!r}: the graph has no output node")
    want = [n for n, _ in declared]
    if placeholders != want:
        raise CustomLossError(
            f"custom loss {name!r}: the graph's parameters {placeholders} do not match its declared inputs {want}"
        )
    return CustomLoss(name, declared, nodes, output)


def _check_inputs(name: str, inputs: Sequence[Mapping[str, Any]]) -> list[tuple[str, int]]:
    if not isinstance(inputs, list | tuple) or not inputs or len(inputs) > MAX_INPUTS:
        raise CustomLossError(f"custom loss {name!r}: it takes 1 to {MAX_INPUTS} inputs, logprobs first")
    out: list[tuple[str, int]] = []
    for x in inputs:
        n, rank = x.get("name"), x.get("rank")
        if not isinstance(n, str) or not _INPUT_NAME.fullmatch(n) or rank not in (0, 1, 2):
            raise CustomLossError(
                f"custom loss {name!r}: input {x!r} must be a lowercase name with rank 0, 1 or 2"
            )
        out.append((n, int(rank)))
    if out[0][0] != "logprobs" or out[0][1] == 0:
        raise CustomLossError(f"custom loss {name!r}: its first input must be logprobs, of rank 1 or 2")
    if len({n for n, _ in out}) != len(out) or "target_tokens" in {n for n, _ in out}:
        raise CustomLossError(f"custom loss {name!r}: input names must be distinct and not target_tokens")
    return out


def _node(loss: str, i: int, r: Any, known: dict[str, str]) -> _Node:
    if not isinstance(r, Mapping):
        raise CustomLossError(f"custom loss {loss!r}: node {i} is not an object")
    op, name, target = r.get("op"), r.get("name"), r.get("target")
    if not all(isinstance(x, str) for x in (op, name, target)):
        raise CustomLossError(f"custom loss {loss!r}: node {i} needs string op, name and target")
    assert isinstance(op, str) and isinstance(name, str) and isinstance(target, str)
    if name in known:
        raise CustomLossError(f"custom loss {loss!r}: node name {name!r} is used twice")
    where = f"custom loss {loss!r} node {name!r}"
    args, kwargs = r.get("args", []), r.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, Mapping):
        raise CustomLossError(f"{where}: args must be a list and kwargs an object")
    decoded = tuple(_decode(where, a, known) for a in args)
    decoded_kw = {str(k): _decode(where, v, known) for k, v in kwargs.items()}
    return _Node(op, name, target, decoded, decoded_kw)


def _decode(where: str, a: Any, known: dict[str, str]) -> Any:
    """One encoded argument (see ``tinker.types.CustomLossNode.args``) as a value or a reference."""
    if a is None or isinstance(a, bool | int | float | str):
        return a
    if isinstance(a, list):
        return [_decode(where, x, known) for x in a]
    if not isinstance(a, Mapping) or len(a) != 1:
        raise CustomLossError(f"{where}: argument {a!r} is not an encoded value")
    [(kind, v)] = a.items()
    if kind == "ref":
        if v not in known:
            raise CustomLossError(f"{where}: refers to {v!r}, which no earlier node defines")
        return _Ref(v)
    if kind == "tuple" and isinstance(v, list):
        return tuple(_decode(where, x, known) for x in v)
    if kind == "dict" and isinstance(v, Mapping):
        return {str(k): _decode(where, x, known) for k, x in v.items()}
    if kind == "slice" and isinstance(v, list) and len(v) == 3:
        return slice(*(_decode(where, x, known) for x in v))
    if kind == "ellipsis" and v is True:
        return Ellipsis
    if kind == "float" and v in ("inf", "-inf", "nan"):
        return float(v)
    if kind == "dtype" and v in _DTYPES:
        return _DTYPES[v]
    if kind == "device" and isinstance(v, str):
        return _Device()
    if kind == "layout" and v == "strided":
        return torch.strided
    if kind == "memory_format" and v in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[v]
    raise CustomLossError(f"{where}: argument {{{kind!r}: {v!r}}} is not allowed")


def _check_call(loss: str, node: _Node, known: dict[str, str]) -> None:
    where = f"custom loss {loss!r} node {node.name!r}"
    if node.op == "call_function":
        if node.target == "getattr":
            if len(node.args) != 2 or node.kwargs:
                raise CustomLossError(f"{where}: getattr takes an object and an attribute name")
            obj, attr = node.args
            if not isinstance(obj, _Ref) or known.get(obj.name) is None:
                raise CustomLossError(
                    f"{where}: getattr on {obj!r} is refused; custom losses may read attributes only of tensors"
                )
            if attr not in TENSOR_ATTRS:
                raise CustomLossError(
                    f"{where}: getattr of {attr!r} is refused; allowed tensor attributes: "
                    f"{', '.join(sorted(TENSOR_ATTRS))}"
                )
            return
        if node.target not in FUNCTIONS:
            raise CustomLossError(
                f"{where} calls {node.target!r}, which is not an allowed operation of a custom loss "
                "(allowed: elementwise, reduction and shape ops of torch, operator and math)"
            )
        return
    if node.op == "call_method":
        if node.target not in METHODS:
            raise CustomLossError(
                f"{where} calls method {node.target!r}, which is not an allowed tensor method of a custom loss"
            )
        if not node.args:
            raise CustomLossError(f"{where}: a method call needs the tensor it is called on")
        return
    if node.op == "get_attr":
        raise CustomLossError(
            f"{where} reads attribute {node.target!r} (a captured tensor); a custom loss may read only "
            "logprobs and the loss_fn_inputs it names"
        )
    if node.op == "call_module":
        raise CustomLossError(f"{where} calls module {node.target!r}; custom losses cannot use modules")
    raise CustomLossError(f"{where} has op {node.op!r}, which a custom loss graph cannot contain")


def _check_output(loss: str, out: Any) -> tuple[Any, dict[str, Any]]:
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise CustomLossError(f"custom loss {loss!r} must return (loss, metrics)")
    value, metrics = out
    if not isinstance(value, _Ref):
        raise CustomLossError(f"custom loss {loss!r} must return its loss as a tensor")
    if not isinstance(metrics, dict):
        raise CustomLossError(f"custom loss {loss!r} must return its metrics as a dict")
    for key, m in metrics.items():
        if not _METRIC_KEY.fullmatch(key) or not isinstance(m, _Ref):
            raise CustomLossError(
                f"custom loss {loss!r}: metric {key!r} must be a tensor named custom/<name>:sum or :mean"
            )
    return value, metrics


def reduce_metrics(per_datum: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Sum each metric over datums; ``:mean`` ones are then divided by the number of datums."""
    sums: dict[str, float] = {}
    for metrics in per_datum:
        for key, m in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(m.detach().reshape(()))
    n = max(len(per_datum), 1)
    return {k: v / n if k.endswith(":mean") else v for k, v in sums.items()}
