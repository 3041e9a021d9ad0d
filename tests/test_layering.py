"""Import layering of ``src/opentinker``: lower layers never import upper ones, and no import cycles.

The layers (docs/DESIGN.md, "Layers"), bottom-up: ``models`` → ``lora`` → ``engine`` → ``sampling`` →
``workers`` (rollout worker processes and the pool serving from them: the sampler as a service,
beside the backends it runs) → ``scheduler`` (the core: pure compute and state) → ``cluster`` (the Ray
transport and Ray's set-up: the only layer that imports ``ray``, and only when Ray is asked for) → ``service`` (the
``Runtime`` that owns model lifecycle, tenancy, checkpoints and scale-out, and the per-model and
per-policy operations) → the two front-ends, ``client`` (the embedded, SDK-shaped entry point) and
``server`` (the Tinker HTTP protocol), each over the service alone. The library (``data``,
``renderers``, ``tracking`` → ``rl``, ``sft`` → ``tasks``) uses only the client API; ``cli`` sits
on top of everything. ``console`` (the web console's static page and the readers of its data:
local run folders, downsampling) imports nothing of the package and no web framework; the server
serves it, at ``/`` of ``opentinker serve`` and for ``opentinker console --runs DIR``. :data:`ALLOWED` is that table. Every ``import`` is read from the source with
``ast`` — module-level, function-level and ``TYPE_CHECKING`` ones alike — so a lazy import that
breaks the layering is caught too.

Beyond the table:
- the front-ends (``server/`` and the embedded ``client/``) import only ``service/`` (and the server
  the ``console``'s page and readers, which import nothing of the package): no engine, cluster,
  sampling, rollout or scheduler module, not even a leaf type: the service exports the types of its
  interface (its errors, ``LoRAConfig``, ``SnapshotInfo``, ``canonical_name``), so
  :data:`FRONT_END_LEAVES` (core names a front-end may still import) is empty;
- the front-ends, the library and the CLI never reach through attributes into the runtime's
  engines (``.engine``, ``.scheduler``, ``.base_stack(...)``);
- the core imports none of ``tinker``, ``fastapi``, ``uvicorn`` (a GPU machine may have none of
  them), and the core packages import with those blocked;
- the module import graph has no cycles (its strongly connected components are single modules).

``test_the_checker_catches_violations`` builds a small package with one violation of each kind
and asserts each is reported, so these checks cannot pass by checking nothing.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "opentinker"

CORE = ("models", "lora", "engine", "sampling", "workers", "scheduler", "cluster")
LIBRARY_BASE = ("data", "renderers", "tracking")
CLIENT_API = ("opentinker", "client")  # the package root re-exports the client names (lazily)

# layer -> the other layers its modules may import. A layer is a subpackage of opentinker
# ("opentinker" itself is the package root).
ALLOWED: dict[str, frozenset[str]] = {
    "models": frozenset(),
    "lora": frozenset({"models"}),
    "engine": frozenset({"models", "lora"}),
    "sampling": frozenset({"models", "lora", "engine"}),
    "workers": frozenset({"models", "lora", "engine", "sampling"}),
    "scheduler": frozenset({"models", "lora", "engine", "sampling"}),
    "cluster": frozenset({"models", "lora", "engine", "sampling", "workers", "scheduler"}),
    "service": frozenset(CORE),
    "client": frozenset({"service"}),
    "opentinker": frozenset({"client"}),
    "console": frozenset(),  # the console's page and the readers of its data; the server serves them
    "server": frozenset({"service", "console"}),
    "data": frozenset(CLIENT_API),
    "renderers": frozenset(CLIENT_API),
    "tracking": frozenset(CLIENT_API),
    "rl": frozenset({*CLIENT_API, *LIBRARY_BASE}),
    "sft": frozenset({*CLIENT_API, *LIBRARY_BASE}),
    "tasks": frozenset({*CLIENT_API, *LIBRARY_BASE, "rl", "sft"}),
    "cli": frozenset(
        {*CLIENT_API, "service", *CORE, "console", "server", *LIBRARY_BASE, "rl", "sft", "tasks"}
    ),
}

FRONT_ENDS = ("client", "server")
# Core modules and names a front-end may import although they sit below the service. Empty: the
# service re-exports the types of its interface (opentinker.service); add an entry only for a
# plain value or error type no service method can hand over, and say why here.
FRONT_END_LEAVES: dict[str, frozenset[str]] = {}

# Attributes that reach into the Runtime's per-base-model engines and queues.
INTERNAL_ATTRS = frozenset({"engine", "scheduler", "base_stack", "_stacks"})
NO_INTERNAL_ATTRS = frozenset({*FRONT_ENDS, "cli", *LIBRARY_BASE, "rl", "sft", "tasks"})

CORE_NEVER_IMPORTS = ("tinker", "fastapi", "uvicorn")
ONLY_SERVER_AND_CLI_IMPORT = ("fastapi", "uvicorn")
ONLY_CLUSTER_IMPORTS = ("ray",)  # plain serve and the embedded mode never need Ray
BLOCKED_WHEN_PROBING = ("tinker", "fastapi", "uvicorn", "gguf")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. "opentinker.client.service"
    target: str  # the imported module (a module of the package, or a third-party one)
    names: tuple[str, ...]  # for "from X import a, b": ("a", "b"); for "import X": ()
    file: str
    line: int


@dataclass
class Package:
    modules: dict[str, Path]  # dotted name -> file
    imports: list[Import]
    attrs: list[tuple[str, str, str, int]]  # (module, attribute, file, line)


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def scan(src: Path, root: str = ROOT) -> Package:
    """Every module under ``src/root`` with every import it makes (at any depth) and every
    attribute name it reads."""
    files = sorted((src / root).rglob("*.py"))
    modules = {module_name(p, src): p for p in files}
    imports: list[Import] = []
    attrs: list[tuple[str, str, str, int]] = []
    for name, path in modules.items():
        rel = str(path.relative_to(src))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    imports.append(Import(name, alias.name, (), rel, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                names = tuple(a.name for a in node.names)
                imports.append(Import(name, target, names, rel, node.lineno))
            elif isinstance(node, ast.Attribute):
                attrs.append((name, node.attr, rel, node.lineno))
    return Package(modules, imports, attrs)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def internal_targets(imp: Import, modules: dict[str, Path]) -> list[str]:
    """The package's modules an import loads: ``from X import m`` of a submodule ``m`` is X.m."""
    if imp.target not in modules:
        return []
    subs = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in modules]
    if len(subs) == len(imp.names) and subs:
        return subs
    return [imp.target, *subs]


def layering_violations(pkg: Package, root: str = ROOT) -> list[str]:
    out = []
    for imp in pkg.imports:
        src_layer = layer(imp.source)
        where = f"{imp.file}:{imp.line}"
        if src_layer not in ALLOWED:
            out.append(f"{where}: layer {src_layer!r} is not in the layering table (add it to ALLOWED)")
            continue
        top = imp.target.split(".")[0]
        if top != root:
            if src_layer in CORE and top in CORE_NEVER_IMPORTS:
                out.append(f"{where}: the core layer {src_layer!r} imports {imp.target!r}")
            if top in ONLY_SERVER_AND_CLI_IMPORT and src_layer not in ("server", "cli"):
                out.append(f"{where}: {src_layer!r} imports {imp.target!r} (only server and cli may)")
            if top in ONLY_CLUSTER_IMPORTS and src_layer != "cluster":
                out.append(f"{where}: {src_layer!r} imports {imp.target!r} (only cluster may)")
            continue
        dst_layer = layer(imp.target)
        leaf = set(imp.names) <= FRONT_END_LEAVES.get(imp.target, frozenset()) and bool(imp.names)
        if dst_layer != src_layer and dst_layer not in ALLOWED[src_layer] and not leaf:
            allowed = ", ".join(sorted(ALLOWED[src_layer])) or "nothing"
            out.append(
                f"{where}: {src_layer!r} imports {imp.target!r} (layer {dst_layer!r}); "
                f"{src_layer!r} may import: {allowed}"
            )
    for module, attr, file, line in pkg.attrs:
        if attr in INTERNAL_ATTRS and layer(module) in NO_INTERNAL_ATTRS:
            out.append(
                f"{file}:{line}: {layer(module)!r} reaches into the runtime's internals (.{attr}); "
                "use a Runtime accessor"
            )
    return out


def import_cycles(pkg: Package) -> list[list[str]]:
    """The strongly connected components of the module import graph with more than one module
    (or a module importing itself), by Tarjan's algorithm, iteratively."""
    graph: dict[str, set[str]] = {m: set() for m in pkg.modules}
    for imp in pkg.imports:
        graph[imp.source].update(internal_targets(imp, pkg.modules))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1 or node in graph[node]:
                    cycles.append(sorted(comp))
    return cycles


# ---------------------------------------------------------------------------- the real package
def test_every_package_has_a_layer() -> None:
    pkg = scan(SRC)
    layers = {layer(m) for m in pkg.modules}
    assert layers <= set(ALLOWED), f"not in the layering table: {sorted(layers - set(ALLOWED))}"
    assert {*CORE, "service", *FRONT_ENDS, *LIBRARY_BASE, "rl", "sft", "tasks", "cli"} <= layers


def test_lower_layers_never_import_upper_ones() -> None:
    violations = layering_violations(scan(SRC))
    assert not violations, "\n".join(violations)


def front_end_imports(pkg: Package) -> list[str]:
    """Every import of a package module by a front-end that is neither its own layer, the
    service, nor (for the server) the console, nor a :data:`FRONT_END_LEAVES` name."""
    out = []
    for imp in pkg.imports:
        src_layer = layer(imp.source)
        if src_layer not in FRONT_ENDS or imp.target.split(".")[0] != ROOT:
            continue
        ok = {src_layer, "service", *(("console",) if src_layer == "server" else ())}
        leaf = bool(imp.names) and set(imp.names) <= FRONT_END_LEAVES.get(imp.target, frozenset())
        if layer(imp.target) not in ok and not leaf:
            out.append(f"{imp.file}:{imp.line}: {imp.target} {list(imp.names)}")
    return out


def test_the_front_ends_import_only_the_service() -> None:
    """``server/`` and the embedded ``client/`` go through ``service/`` for everything: no engine,
    cluster, sampling, rollout, scheduler (nor models, lora) import, at any depth; the server
    never imports the embedded clients either."""
    pkg = scan(SRC)
    found = front_end_imports(pkg)
    assert not found, "front-ends importing below the service:\n" + "\n".join(found)
    assert not FRONT_END_LEAVES
    reached = {
        layer(i.target)
        for i in pkg.imports
        if layer(i.source) in FRONT_ENDS and i.target.startswith(f"{ROOT}.")
    }
    assert reached == {"service", "console", *FRONT_ENDS}, (
        reached
    )  # the server and the client use the service
    assert not any(layer(i.source) == "server" and layer(i.target) == "client" for i in pkg.imports)


def test_no_import_cycles() -> None:
    cycles = import_cycles(scan(SRC))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_core_imports_without_the_sdk_or_the_web_stack() -> None:
    """What a bare GPU machine has: torch and transformers, no tinker, fastapi, uvicorn, gguf."""
    probe = (
        "import json, sys\n"
        f"for n in {BLOCKED_WHEN_PROBING!r}:\n"
        "    sys.modules[n] = None  # 'import n' now raises ImportError\n"
        "out = {}\n"
        f"for layer in {CORE!r}:\n"
        "    try:\n"
        "        __import__('opentinker.' + layer)\n"
        "        out[layer] = 'ok'\n"
        "    except ImportError as e:\n"
        "        out[layer] = repr(e)\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == dict.fromkeys(CORE, "ok"), result


# ---------------------------------------------------------------------------- the checker itself
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


CLEAN = {
    "opentinker/__init__.py": "",
    "opentinker/engine/__init__.py": "from opentinker.engine.types import EngineError\n",
    "opentinker/engine/types.py": "class EngineError(ValueError): ...\n",
    "opentinker/service/__init__.py": "from .runtime import Runtime\nfrom opentinker.engine import EngineError\n",
    "opentinker/service/runtime.py": "from opentinker.engine import EngineError\nclass Runtime: ...\n",
    "opentinker/client/__init__.py": "from opentinker.service import Runtime\n",
    "opentinker/server/__init__.py": "",
    "opentinker/server/app.py": (
        "from opentinker.service import EngineError, Runtime\ndef tok(rt):\n    return rt.tokenizer('m')\n"
    ),
    "opentinker/rl/__init__.py": "import opentinker\n",
}


def test_the_checker_passes_a_clean_package(tmp_path: Path) -> None:
    _write(tmp_path, CLEAN)
    pkg = scan(tmp_path)
    assert layering_violations(pkg) == []
    assert import_cycles(pkg) == []


def test_the_checker_catches_violations(tmp_path: Path) -> None:
    bad = {
        **CLEAN,
        # a lower layer importing an upper one, lazily inside a function
        "opentinker/engine/lazy.py": "def f():\n    from opentinker.client import Runtime\n    return Runtime\n",
        # a cycle through a relative import
        "opentinker/client/a.py": "from opentinker.client import b\n",
        "opentinker/client/b.py": "from . import a\n",
        # a front-end importing below the service: a core error type; the server, the embedded client
        "opentinker/client/leak.py": "from opentinker.engine.types import EngineError\n",
        "opentinker/server/embedded.py": "from opentinker.client import Runtime\n",
        # the server taking an engine internal, and reaching through the runtime
        "opentinker/server/ops.py": (
            "from opentinker.engine.engine import Engine\n"
            "def tok(rt):\n    return rt.base_stack('m').engine.base.tokenizer\n"
        ),
        # the core importing the SDK; the library importing the core
        "opentinker/engine/wire.py": "import tinker\n",
        # Ray outside the cluster layer, even lazily
        "opentinker/client/scale.py": "def f():\n    import ray\n    return ray\n",
        "opentinker/rl/loop.py": "from opentinker.engine import EngineError\n",
        # a package the table does not know
        "opentinker/dashboard/__init__.py": "",
        "opentinker/dashboard/page.py": "import opentinker.client\n",
    }
    _write(tmp_path, bad)
    pkg = scan(tmp_path)
    found = "\n".join(layering_violations(pkg))
    assert "opentinker/engine/lazy.py:2: 'engine' imports 'opentinker.client'" in found
    assert "opentinker/server/ops.py:1: 'server' imports 'opentinker.engine.engine' (layer 'engine')" in found
    assert "opentinker/client/leak.py:1: 'client' imports 'opentinker.engine.types'" in found
    assert "opentinker/server/embedded.py:1: 'server' imports 'opentinker.client'" in found
    assert front_end_imports(pkg) == [
        "opentinker/client/leak.py:1: opentinker.engine.types ['EngineError']",
        "opentinker/server/embedded.py:1: opentinker.client ['Runtime']",
        "opentinker/server/ops.py:1: opentinker.engine.engine ['Engine']",
    ]
    assert "opentinker/server/ops.py:3: 'server' reaches into the runtime's internals (.base_stack)" in found
    assert "opentinker/server/ops.py:3: 'server' reaches into the runtime's internals (.engine)" in found
    assert "opentinker/engine/wire.py:1: the core layer 'engine' imports 'tinker'" in found
    assert "opentinker/client/scale.py:2: 'client' imports 'ray' (only cluster may)" in found
    assert "opentinker/rl/loop.py:1: 'rl' imports 'opentinker.engine'" in found
    assert "layer 'dashboard' is not in the layering table" in found
    assert "opentinker/server/app.py" not in found  # the clean modules stay clean
    assert import_cycles(pkg) == [["opentinker.client.a", "opentinker.client.b"]]


def test_the_checker_catches_a_cycle_through_a_package_init(tmp_path: Path) -> None:
    """``models/registry`` ↔ ``models/smollm2`` was such a cycle: one lazy import is enough."""
    _write(
        tmp_path,
        {
            "opentinker/__init__.py": "",
            "opentinker/models/__init__.py": "from opentinker.models.registry import resolve\n",
            "opentinker/models/registry.py": (
                "def resolve():\n    from opentinker.models.smollm2 import ensure\n    return ensure()\n"
            ),
            "opentinker/models/smollm2.py": "from opentinker.models import registry\ndef ensure(): ...\n",
        },
    )
    cycles = import_cycles(scan(tmp_path))
    assert cycles == [["opentinker.models.registry", "opentinker.models.smollm2"]]


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted((SRC / ROOT).rglob("*.py"))


def test_no_module_in_src_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {long}"


def _long_functions(paths: list[Path], root: Path) -> list[str]:
    long = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return long


def test_no_function_in_src_is_over_80_lines() -> None:
    long = _long_functions(_sources(), SRC)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split into named steps): {long}"


def test_the_length_check_catches_a_long_method_and_passes_a_short_one(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "ok.py").write_text(f"class C:\n    def f(self):\n{body}\n")
    (tmp_path / "long.py").write_text(f"class C:\n    async def g(self):\n{body}\n        y = 1\n")
    assert _long_functions([tmp_path / "ok.py"], tmp_path) == []
    assert _long_functions([tmp_path / "long.py"], tmp_path) == [
        f"long.py:2 g ({MAX_FUNCTION_LINES + 1} lines)"
    ]


# Where the sampling and training core holds a decoder, a sampling backend or a trainer, it calls
# their protocols (sampling/decoder.py's Decoder, sampling/backend.py's SamplingBackend,
# engine/trainer.py's Trainer): no getattr/hasattr probing what one of them has. These are the
# names such an object goes by there; the last name of getattr's first argument is checked.
PROTOCOL_HOLDERS = frozenset(
    {"decoder", "backend", "sampler", "native", "vllm", "trainer", "engine", "eng", "router", "_local"}
)
DUCK_FOLDERS = ("sampling", "scheduler", "workers", "cluster")
# the Ray trainer path still calls the trainer by method name: file -> how many such calls
CALLS_BY_NAME = {"opentinker/cluster/trainer_worker.py": 2, "opentinker/cluster/routed_trainer.py": 1}


def _holder(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def duck_typing(paths: list[Path], root: Path) -> list[str]:
    """Each ``getattr``/``hasattr`` on a protocol holder, and each ``threading.local``."""
    out = []
    for p in paths:
        rel = p.relative_to(root)
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
                if node.func.id in ("getattr", "hasattr") and _holder(node.args[0]) in PROTOCOL_HOLDERS:
                    out.append(f"{rel}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, ...)")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr == "local"
                and _holder(node.value) == "threading"
            ):
                out.append(f"{rel}:{node.lineno} threading.local")
            elif isinstance(node, ast.ImportFrom) and node.module == "threading":
                out += [f"{rel}:{node.lineno} threading.local" for a in node.names if a.name == "local"]
    return out


def test_the_core_calls_protocols_and_keeps_no_thread_local_state() -> None:
    """No probing a decoder, backend or trainer for what it has, and no thread-local side
    channels (a sample's request id travels in its handle), in sampling/, scheduler/, workers/
    and cluster/."""
    paths = [p for folder in DUCK_FOLDERS for p in sorted((SRC / ROOT / folder).rglob("*.py"))]
    found = duck_typing(paths, SRC)
    by_name = {f: sum(1 for x in found if x.startswith(f"{f}:") and "getattr(" in x) for f in CALLS_BY_NAME}
    assert by_name == CALLS_BY_NAME, found
    rest = [x for x in found if not any(x.startswith(f"{f}:") and "getattr(" in x for f in CALLS_BY_NAME)]
    assert not rest, f"duck typing or thread-local state in the core: {rest}"


def test_the_duck_typing_check_catches_each_kind(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(
        "import threading\nfrom threading import local\n"
        "def f(self, eng):\n"
        "    a = getattr(self.decoder, 'drop', None)\n"
        "    b = hasattr(self.backend, 'close')\n"
        "    c = getattr(eng, 'save_state')\n"
        "    d = threading.local()\n"
    )
    (tmp_path / "ok.py").write_text(
        "def f(self, config, engine):\n"
        "    return getattr(config, 'head_dim', None), getattr(engine.base.model, 'config'), getattr(self, 'x', 0)\n"
    )
    assert duck_typing([tmp_path / "ok.py"], tmp_path) == []
    assert duck_typing([tmp_path / "bad.py"], tmp_path) == [
        "bad.py:2 threading.local",
        "bad.py:4 getattr(self.decoder, ...)",
        "bad.py:5 hasattr(self.backend, ...)",
        "bad.py:6 getattr(eng, ...)",
        "bad.py:7 threading.local",
    ]
