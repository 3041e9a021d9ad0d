"""A skip for a missing extra fails under ``OPENTINKER_NO_SKIPS=1`` or ``CI=true`` (conftest.py).

The suite's own hooks run (``-p tests.conftest``) in a child ``pytest`` over a few made-up tests: a
test that needs a module that is not installed, with pytest's reason and with one of its own, a
module that needs one at import, and a skip that depends on the machine (which stays a skip). Without
either variable every one of them is a skip; with either, only the machine's is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDS = """
import pytest

def test_an_extra_by_its_import():
    pytest.importorskip("opentinker_no_such_extra")

def test_an_extra_by_a_reason_of_its_own():
    pytest.importorskip("opentinker_no_such_extra", reason="the frobnicator is not installed")

def test_a_cpu_without_bf16():
    pytest.skip("this CPU has no native bf16: the runtime fell back to float32")
"""
MODULE = """
import pytest

extra = pytest.importorskip("opentinker_no_such_extra", reason="the widget extra is missing")

def test_uses_it():
    assert extra
"""


def _outcomes(tmp_path: Path, **env: str) -> dict[str, str]:
    """Each made-up test's outcome ("passed", "failed", "skipped", "error" for its module)."""
    (tmp_path / "test_needs.py").write_text(NEEDS)
    (tmp_path / "test_module.py").write_text(MODULE)
    report = tmp_path / "report.xml"
    child = {
        k: v for k, v in os.environ.items() if k not in ("OPENTINKER_NO_SKIPS", "CI", "OPENTINKER_ROUTE_LOG")
    }
    child |= {"OPENTINKER_ROUTE_CHECK": "0", **env}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "tests.conftest",
        "-p",
        "no:cacheprovider",
        "-q",
        "--continue-on-collection-errors",
    ]
    cmd += ["--rootdir", str(tmp_path), f"--junitxml={report}", str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, env=child, capture_output=True, timeout=600)
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        out[case.get("name") or case.get("classname", "")] = kinds[0] if kinds else "passed"
    return out


def test_without_the_variables_a_missing_extra_is_a_skip(tmp_path: Path) -> None:
    assert _outcomes(tmp_path) == {
        "test_an_extra_by_its_import": "skipped",
        "test_an_extra_by_a_reason_of_its_own": "skipped",
        "test_a_cpu_without_bf16": "skipped",
        "test_module": "skipped",
    }


@pytest.mark.parametrize("env", [{"OPENTINKER_NO_SKIPS": "1"}, {"CI": "true"}], ids=["no-skips", "ci"])
def test_under_ci_a_missing_extra_fails_and_the_machines_skip_stays(
    tmp_path: Path, env: dict[str, str]
) -> None:
    assert _outcomes(tmp_path, **env) == {
        "test_an_extra_by_its_import": "failure",
        "test_an_extra_by_a_reason_of_its_own": "failure",
        "test_a_cpu_without_bf16": "skipped",
        "test_module": "error",
    }
