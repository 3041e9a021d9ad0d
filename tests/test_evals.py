"""Eval harnesses against a trained checkpoint through the OpenAI-compatible routes (slow tier):
**lm-eval** (``local-completions``: a loglikelihood multiple-choice task, which needs ``echo`` +
``logprobs``, and a ``generate_until`` task; ``local-chat-completions``: the generation task
through the chat template) and **Inspect** (its ``openai-api`` provider, a Python task with an
in-memory dataset). Each runs its own CLI, the command docs/SERVER.md ("Evals") shows, on a task
written here (no dataset download), against a LoRA trained a few SFT steps on the tiny model and
saved as sampler weights, named by its ``tinker://`` path; each must report its metric.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types

from opentinker.models.registry import tiny_model_dir
from tests.conftest import TEST_MODEL, local_server

pytestmark = pytest.mark.slow
KEY = "tml-evals"
QUESTIONS = [
    ("What is 12 + 34?", "46", ["46", "12", "99"]),
    ("What is 2 + 2?", "4", ["5", "4", "22"]),
    ("What is 10 - 3?", "7", ["7", "13", "3"]),
]

MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""

INSPECT_TASK = """from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate

QUESTIONS = {questions!r}


@task
def tiny_arith() -> Task:
    samples = [Sample(input=q, target=a) for q, a, _ in QUESTIONS]
    return Task(dataset=MemoryDataset(samples), solver=generate(), scorer=includes())
"""


class Trained:
    def __init__(self, base_url: str, path: str, folder: Path) -> None:
        self.base_url, self.path, self.folder = base_url, path, folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    with local_server(tmp_path_factory, "evals") as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=0).result()
        tok = tc.get_tokenizer()
        data = []
        for q, a, _ in QUESTIONS:
            ids = tok.encode(f"{q} {a}")
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
                )
            )
        for _ in range(4):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler("evals").result().path
        yield Trained(srv.base_url, path, tmp_path_factory.mktemp("eval-tasks"))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TINKER_"))}
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return {**env, **offline, **extra}


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout[-4000:], out.stderr[-4000:])
    return out.stdout + out.stderr


def _lm_eval(t: Trained, model: str, route: str, tasks: str, chat: bool) -> dict[str, Any]:
    folder = t.folder
    (folder / "qa.jsonl").write_text(
        "".join(
            json.dumps({"question": q, "answer": a, "choices": c, "label": c.index(a)}) + "\n"
            for q, a, c in QUESTIONS
        )
    )
    (folder / "tiny_mc.yaml").write_text(MC_YAML.format(data=folder / "qa.jsonl"))
    (folder / "tiny_gen.yaml").write_text(GEN_YAML.format(data=folder / "qa.jsonl"))
    args = {
        "model": t.path,
        "base_url": f"{t.base_url}/v1/{route}",
        "tokenizer": str(tiny_model_dir()),
        "tokenizer_backend": "huggingface",
        "header": {"Authorization": f"Bearer {KEY}"},
        "max_length": 1024,
    }
    out_dir = folder / f"out-{model}"
    argv = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", json.dumps(args)]
    argv += ["--tasks", *tasks.split(), "--include_path", str(folder), "--output_path", str(out_dir)]
    argv += ["--apply_chat_template"] if chat else []
    _run(argv, _env(), folder)
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    return results["results"]


def test_lm_eval_local_completions_on_a_checkpoint(trained: Trained) -> None:
    res = _lm_eval(trained, "local-completions", "completions", "tiny_mc tiny_gen", chat=False)
    assert 0.0 <= res["tiny_mc"]["acc,none"] <= 1.0
    assert 0.0 <= res["tiny_gen"]["exact_match,none"] <= 1.0


def test_lm_eval_local_chat_completions_on_a_checkpoint(trained: Trained) -> None:
    res = _lm_eval(trained, "local-chat-completions", "chat/completions", "tiny_gen", chat=True)
    assert 0.0 <= res["tiny_gen"]["exact_match,none"] <= 1.0


def test_inspect_openai_api_provider_on_a_checkpoint(trained: Trained) -> None:
    task = trained.folder / "tiny_arith.py"
    task.write_text(INSPECT_TASK.format(questions=QUESTIONS))
    logs = trained.folder / "inspect-logs"
    env = _env(OPENTINKER_API_KEY=KEY, OPENTINKER_BASE_URL=f"{trained.base_url}/v1")
    argv = [sys.executable, "-m", "inspect_ai", "eval", task.name, "--model"]
    argv += [f"openai-api/opentinker/{trained.path}", "--max-tokens", "8", "--temperature", "0"]
    argv += ["--log-dir", str(logs), "--log-format", "json", "--display", "plain"]
    _run(argv, env, trained.folder)
    log = json.loads(next(logs.glob("*.json")).read_text())
    assert log["status"] == "success", log.get("error")
    scores = log["results"]["scores"]
    metric = scores[0]["metrics"]["accuracy"]["value"]
    assert 0.0 <= metric <= 1.0 and log["results"]["completed_samples"] == len(QUESTIONS)
