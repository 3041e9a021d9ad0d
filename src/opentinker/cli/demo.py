"""The main job, embedded: several LoRA policies trained with RL at once over one base model.

Each adapter gets questions from the same pool but its own objective: reply in about 2, 5, 10 or
20 words, on the question's topic (the ``reply_length`` task: a dense reward on the ratio of words
to target, 0 for a reply off topic), with a per-token KL penalty to the base model
(:data:`KL_COEF`) that keeps the replies in the base model's language. All of them
sample in one mixed batch and train in one fused forward/backward per scheduler tick, through
the same client API a remote Tinker server offers. At the end every adapter and the bare base
answer ten held-out questions (four sampled replies each, in one mixed sampling batch); the demo
prints each adapter's typical reply length, share on topic and reward there and whether the
adapters *separated*:

    every adapter's held-out typical word count is nearer (as a ratio) to its own target than to
    any other adapter's target, its held-out reward is above the base model's for that target, and
    at least 75% of its held-out replies are on the question's topic.

"Typical" is the geometric mean of the replies' word counts: the reward and "nearer" both judge
ratios (twice the target costs as much as half of it), so lengths are averaged on that scale too,
and one 60-word ramble does not move a 2-word adapter's figure as far as an arithmetic mean would.

``<log-dir>/held_out.json`` keeps every held-out reply; ``<log-dir>/curves.png`` shows each
adapter's mean words per step against its target (dashed) and its mean reward.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker import types

# With the topic check and the KL penalty, 1 / 3 / 9 / 27 separated one seed of three at 24 steps:
# an on-topic 1-word reply is the topic word alone, slow to learn (3.5 and 4.8 held-out words on
# seeds 1 and 2), and the 3-word adapter broke at lr 1.5e-3. 2 / 5 / 12 / 30 with 64 tokens and 30
# steps separated 5 runs of 6 in ~9 minutes here: a decode step costs about the same for 8 rows as
# for 32 (it streams every weight), so the longest replies set the pace. 2 / 5 / 10 / 20 with 40
# tokens and 24 steps separated 6 runs of 7 in 5.4 minutes. Its bands are a factor 2 wide (they
# meet at 3.2, 7.1 and 14.1 words), and the held-out lengths spread about ±30% around the targets.
TARGETS = (2, 5, 10, 20)
# SmolLM2 writes ~1.3 tokens a word: 20 words fit in ~26 tokens, and a reply cut at 40 tokens
# (~30 words, reward 0) is 1.5 times the largest target. The base model starts at ~26 words, so
# from the first step the cut pays every adapter to be shorter, which all of them must learn.
MAX_TOKENS = 40
# checkpoints of three seeds separated at 18, 24 and 30 steps but for one 2-word adapter at 30 (72%
# on topic); the first ten steps, on the base model's long replies, take half the time
STEPS = 24
RANK = 8
LR = 1e-3
# per token, on the sampler's log-ratio to the base: the replies stayed in the base model's English
# (measured); at 0.1 the 1-word adapter was still at ~9 words after 18 steps
KL_COEF = 0.02
GROUPS_PER_STEP = 2  # questions per adapter per step
GROUP_SIZE = 4  # replies per question
HELD_OUT_SAMPLES = 4  # replies per held-out question and policy
HELD_OUT_SEED = 1234
# the frozen base in fp32 (``auto`` on a CPU) with the unclipped importance-sampling loss. On the
# earlier 2 / 5 / 12 / 30 workload a bf16 base ran 1.5x faster (353-379 s against 532 s on an idle
# 2-core AVX512-BF16 machine), but RL's importance ratios then see a sampler-trainer gap of ~0.06
# nats a token (models/dtype.py): with this loss one adapter of three seeds lost the language
# ('wys.ends.wys...'); with ``ppo``'s clip three seeds separated at one thread, yet seed 0 at two
# threads did not (its 2-word adapter learned to echo the question: 'Why do cats purr?)').
# ``--dtype bfloat16 --loss-fn ppo`` runs it so.
DTYPE = "auto"
LOSS_FN = "importance_sampling"
# an adapter whose held-out replies leave the topic more often than this has lost the task
MIN_ON_TOPIC = 0.75


@dataclass
class HeldOut:
    """One adapter's held-out replies, scored for its target (and the base's, for the same one)."""

    target: int
    words: float  # typical words per reply: the geometric mean (see typical_words)
    reward: float  # mean reply_length reward for `target`
    on_topic: float  # share of the replies on the question's topic
    base_reward: float  # the base model's mean reward for the same target
    texts: list[str]


def typical_words(counts: list[int]) -> float:
    """Geometric mean of word counts, an empty reply counted as half a word (log 0 is undefined)."""
    if not counts:
        raise ValueError("no replies to average")
    return math.exp(sum(math.log(max(n, 0.5)) for n in counts) / len(counts))


def reply_questions() -> list[str]:
    """The held-out question of each held-out reply, in their order (each question's replies together)."""
    from opentinker.tasks import reply_length

    return [q for q in reply_length.EVAL for _ in range(HELD_OUT_SAMPLES)]


def nearest_target(words: float, targets: list[int]) -> int:
    """The target nearest to ``words`` as a ratio (``|log(words / t)|``), the reward's own scale."""
    return min(targets, key=lambda t: abs(math.log(max(words, 0.5) / t)))


def separated(held: list[HeldOut]) -> bool:
    """Each adapter nearest its own target, above the base model's reward for it, and on topic in
    at least :data:`MIN_ON_TOPIC` of its replies."""
    targets = [h.target for h in held]
    return all(
        nearest_target(h.words, targets) == h.target
        and h.reward > h.base_reward
        and h.on_topic >= MIN_ON_TOPIC
        for h in held
    )


def check_settings(targets: list[int], **counts: float) -> None:
    """Raise ValueError naming the first bad setting: ``targets`` distinct and >= 1, each count >= 1."""
    if len(set(targets)) != len(targets) or not targets or min(targets) < 1:
        raise ValueError(f"targets must be distinct word counts >= 1, got {targets}")
    for name, v in counts.items():
        if not v >= 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def run_demo(
    *,
    base_model: str,
    targets: list[int] | None = None,
    steps: int = STEPS,
    rank: int = RANK,
    lr: float = LR,
    kl_coef: float = KL_COEF,
    seed: int = 0,
    max_tokens: int = MAX_TOKENS,
    groups_per_step: int = GROUPS_PER_STEP,
    group_size: int = GROUP_SIZE,
    log_dir: str = "runs/demo",
    dtype: str = DTYPE,
    loss_fn: str = LOSS_FN,
) -> int:
    """Train one adapter per target at once, print progress and the held-out result. Returns 0."""
    import opentinker
    from opentinker.renderers import get_renderer
    from opentinker.rl.loop import RLConfig, run_rl_many
    from opentinker.service.runtime import Runtime
    from opentinker.tasks import reply_length

    targets = list(targets or TARGETS)
    check_settings(
        targets, steps=steps, rank=rank, max_tokens=max_tokens, groups_per_step=groups_per_step,
        group_size=group_size,
    )  # fmt: skip
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a positive number, got {lr}")
    t0 = time.perf_counter()
    runtime = Runtime(dtype=dtype)
    service = opentinker.ServiceClient(runtime=runtime)
    base = service.create_sampling_client(base_model=base_model)
    renderer = get_renderer("auto", base.get_tokenizer())
    names = [f"words-{t}" for t in targets]
    jobs = []
    for i, (name, target) in enumerate(zip(names, targets, strict=True)):
        cfg = RLConfig(
            base_model=base_model, log_dir=str(Path(log_dir) / name), steps=steps,
            groups_per_step=groups_per_step, group_size=group_size, lora_rank=rank, learning_rate=lr,
            max_tokens=max_tokens, normalize_std=True, kl_coef=kl_coef, loss_fn=loss_fn, eval_every=0, seed=seed * 1000 + i,
            progress=False, name=name, plot_keys=("reward/mean", "env/words"),
            extra={"target_words": target},
        )  # fmt: skip
        dataset, _ = reply_length.build(renderer, cfg)
        jobs.append((cfg, dataset, None))
    print(
        f"{len(targets)} adapters (rank {rank}) on {base_model} ({runtime.dtype}), RL towards {targets} "
        f"words, {steps} steps, seed {seed}"
    )
    print("step  " + "  ".join(f"{n:>16}" for n in names) + "   (mean reward / mean words)")
    results = asyncio.run(run_rl_many(jobs, service, on_step=StepPrinter(names, t0)))
    plot = plot_curves(log_dir, names, targets, base_model)

    # held-out: every adapter and the base answer the same questions in one mixed batch
    policies = [r.training_client.save_weights_and_get_sampling_client().result() for r in results] + [base]
    held, base_texts = held_out(policies, renderer, targets, max_tokens)
    report_held_out(log_dir, names, held, base_texts)
    print(f"\nmetrics: {log_dir}/*/metrics.jsonl   plot: {plot}   ({time.perf_counter() - t0:.0f}s in all)")
    print(f"console: opentinker console --runs {log_dir}   (curves per adapter, episodes per step)")
    return 0


class StepPrinter:
    """The demo's ``on_step``: one line per step, each adapter's mean reward / mean words.

    Adapters run at their own pace (short replies sample faster): a step's line is printed once
    every adapter has finished that step, with each adapter's own row for it."""

    def __init__(self, names: list[str], t0: float) -> None:
        self.names, self.t0 = names, t0
        self.rows: dict[str, dict[int, dict[str, Any]]] = {n: {} for n in names}
        self.printed = -1

    def __call__(self, name: str, row: dict[str, Any]) -> None:
        self.rows[name][row["step"]] = row
        while all(self.printed + 1 in r for r in self.rows.values()):
            self.printed += 1
            cells = [
                f"{self.rows[n][self.printed]['reward/mean']:6.2f} / {self.rows[n][self.printed]['env/words']:5.1f}"
                for n in self.names
            ]
            elapsed = time.perf_counter() - self.t0
            print(f"{self.printed:4d}  " + "  ".join(f"{c:>16}" for c in cells) + f"   ({elapsed:.0f}s)")


def plot_curves(log_dir: str, names: list[str], targets: list[int], base_model: str) -> Path:
    """``<log_dir>/curves.png``: each adapter's words per reply against its target, and its reward."""
    from opentinker.tracking import plot_metrics

    return plot_metrics(
        {n: Path(log_dir) / n for n in names}, ["env/words", "reward/mean"], Path(log_dir) / "curves.png",
        title=f"{len(targets)} LoRA adapters, one base ({base_model.split('/')[-1]}), one batch per step",
        guides={"env/words": dict(zip(names, map(float, targets), strict=True))},
        log_y=("env/words",), smooth=3,
        labels={"env/words": "words per reply (3-step mean; dashed: target)", "reward/mean": "mean reward (1 = on target)"},
    )  # fmt: skip


def report_held_out(log_dir: str, names: list[str], held: list[HeldOut], base_texts: list[str]) -> None:
    """Print the held-out table, the verdict and one question's replies; write ``held_out.json``."""
    from opentinker.tasks import reply_length

    targets = [h.target for h in held]
    print(f"\nheld-out: {len(reply_length.EVAL)} questions, {HELD_OUT_SAMPLES} replies each at temperature 1")
    print(f"  {'adapter':>10}  target  typical words  on topic  reward  base model's reward")
    for name, h in zip(names, held, strict=True):
        near = nearest_target(h.words, targets)
        ok = "ok" if near == h.target else f"nearest {near}"
        cells = f"{h.target:6d}  {h.words:13.1f}  {h.on_topic:8.0%}  {h.reward:6.2f}  {h.base_reward:19.2f}"
        print(f"  {name:>10}  {cells}   {ok}")
    base_topic = sum(map(reply_length.on_topic, base_texts, reply_questions())) / len(base_texts)
    base_words = typical_words([len(t.split()) for t in base_texts])
    print(f"  {'base model':>10}  {'':6}  {base_words:13.1f}  {base_topic:8.0%}")
    record = {
        "questions": reply_length.EVAL,
        "samples_per_question": HELD_OUT_SAMPLES,
        "adapters": {n: {"target": h.target, "typical_words": h.words, "on_topic": h.on_topic, "reward": h.reward,
                         "base_reward": h.base_reward, "replies": h.texts} for n, h in zip(names, held, strict=True)},
        "base_model": {"typical_words": base_words, "on_topic": base_topic, "replies": base_texts},
        "separated": separated(held),
    }  # fmt: skip
    (Path(log_dir) / "held_out.json").write_text(json.dumps(record, indent=1))
    verdict = "yes" if separated(held) else "NO"
    print(
        f"separated: {verdict} (each adapter nearest its own target, reward above the base model's, "
        f"{MIN_ON_TOPIC:.0%} or more of its replies on topic)"
    )
    question = reply_length.EVAL[0]
    print(f"\n{question!r}")
    examples = [(n, h.texts[0]) for n, h in zip(names, held, strict=True)] + [("base model", base_texts[0])]
    for name, text in examples:
        print(f"  {name:>10} ({len(text.split()):2d} words) -> {text!r}")


def held_out(
    policies: list[Any], renderer: Any, targets: list[int], max_tokens: int
) -> tuple[list[HeldOut], list[str]]:
    """Replies of ``policies`` (one per target, then the base) to the held-out questions, all
    sampled at once, scored with ``reply_length``'s reward. Returns (adapters, base's texts).

    Each question gets :data:`HELD_OUT_SAMPLES` seeded replies at temperature 1, the distribution
    RL trained: a greedy reply is one mode of it and, for an adapter 16 noisy steps in, often not
    a typical one (measured: greedy put a 5-word adapter at 15 words while its samples averaged 4).
    """
    from opentinker.tasks import reply_length

    params = types.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=HELD_OUT_SEED, stop=renderer.stop
    )
    prompts = [
        types.ModelInput.from_ints(renderer.build_generation_prompt(reply_length.prompt_messages(q)))
        for q in reply_length.EVAL
    ]
    # one mixed batch: every policy, every question, HELD_OUT_SAMPLES replies each
    futures = [[p.sample(prompt, HELD_OUT_SAMPLES, params) for prompt in prompts] for p in policies]
    replies = [
        [renderer.parse_response(list(seq.tokens)) for f in fs for seq in f.result().sequences]
        for fs in futures
    ]  # [policy][question * sample] -> (message, ended)

    questions = reply_questions()

    def score(rs: list[tuple[Any, bool]], target: int) -> float:
        rewards = [
            reply_length.reply_reward(m["content"], q, target) if e else 0.0
            for (m, e), q in zip(rs, questions, strict=True)
        ]
        return sum(rewards) / len(rs)

    def topical(rs: list[tuple[Any, bool]]) -> float:
        return sum(
            reply_length.on_topic(m["content"], q) for (m, _), q in zip(rs, questions, strict=True)
        ) / len(rs)

    base = replies[-1]
    out = [
        HeldOut(
            target=t,
            words=typical_words([len(m["content"].split()) for m, _ in rs]),
            reward=score(rs, t),
            on_topic=topical(rs),
            base_reward=score(base, t),
            texts=[m["content"] for m, _ in rs],
        )
        for rs, t in zip(replies[:-1], targets, strict=True)
    ]
    return out, [m["content"] for m, _ in base]
