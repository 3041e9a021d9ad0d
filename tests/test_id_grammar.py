"""The id grammar has one home: ``service/sessions.py`` builds and parses ``<session>:train:<n>``
and ``<session>:sample:<n>`` (``model_id_in``, ``sampler_id_in``, ``session_of``,
``is_sampler_id``); the HTTP front-end (``src/opentinker/server``) writes neither form itself.

The check reads every module of ``server/`` with ``ast``: a string constant holding ``:train:`` or
``:sample:`` outside a docstring (an f-string's text, a ``.format`` template, a ``split``
separator) is an id built or parsed by hand. ``test_the_check_catches_ids_built_by_hand`` shows
it finds each way of writing one and passes the grammar's own calls."""

from __future__ import annotations

import ast
from pathlib import Path

from opentinker.service.sessions import is_sampler_id, model_id_in, sampler_id_in, session_of

SERVER = Path(__file__).resolve().parents[1] / "src" / "opentinker" / "server"
GRAMMAR = (":train:", ":sample:")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the constant nodes that are docstrings (of the module, classes, functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def ids_by_hand(source: str, name: str = "<src>") -> list[str]:
    """``name:line`` of every string constant in ``source`` (docstrings aside) that holds a
    model or sampler id's separator."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    return [
        f"{name}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skip
        and any(sep in node.value for sep in GRAMMAR)
    ]


def test_the_server_builds_and_parses_no_model_or_sampler_id_itself() -> None:
    found = [
        hit
        for path in sorted(SERVER.rglob("*.py"))
        for hit in ids_by_hand(path.read_text(), str(path.relative_to(SERVER.parent)))
    ]
    assert not found, f"ids written by hand (use service/sessions.py's grammar): {found}"


def test_the_check_catches_ids_built_by_hand() -> None:
    bad = '''
"""A module docstring may name <session>:sample:<n>."""
def f(sess, n, sid):
    """So may a function's: <session>:train:<n>."""
    a = f"{sess}:sample:{n}"
    b = "{}:train:{}".format(sess, n)
    c = sid.split(":sample:", 1)[0]
    d = sess + ":train:" + str(n)
    return a, b, c, d
'''
    assert ids_by_hand(bad) == ["<src>:5", "<src>:6", "<src>:7", "<src>:8"]
    good = (
        "from x import sampler_id_in, session_of\ndef f(s, n):\n    return session_of(sampler_id_in(s, n))\n"
    )
    assert ids_by_hand(good) == []


def test_the_grammar_round_trips() -> None:
    model, sampler = model_id_in("sess-1a", 3), sampler_id_in("sess-1a", 7)
    assert (model, sampler) == ("sess-1a:train:3", "sess-1a:sample:7")
    assert session_of(model) == session_of(sampler) == "sess-1a"
    assert is_sampler_id(sampler) and not is_sampler_id(model) and not is_sampler_id("tiny")
