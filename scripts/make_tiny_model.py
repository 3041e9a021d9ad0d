"""Build ``opentinker/tiny``: the project's own tiny Llama test model, pretrained here on synthetic chats.

Why: the real base model (SmolLM2-135M-Instruct) takes minutes per test on a CPU. Tests need a model that
(1) has the same architecture family (``LlamaForCausalLM``), the same ChatML chat template and the same
special-token ids (``<|endoftext|>`` 0, ``<|im_start|>`` 1 = bos, ``<|im_end|>`` 2 = eos = pad), so code paths
exercised against it are the ones used against SmolLM2; (2) runs a forward/backward step on 8 x 64 tokens in
milliseconds; and (3) has *some but not full* competence on our validation tasks (2-digit addition,
tic-tac-toe, guess-the-number, simple chat), so that training on it visibly moves rewards in both directions.

What it does, deterministically given ``--seed``:

a. generates synthetic ChatML conversations (arithmetic, generic chat, guess-the-number dialogues,
   tic-tac-toe moves), rendered exactly as SmolLM2's chat template does, sometimes without a system turn;
b. trains a ~1024-token byte-level BPE tokenizer on it (digits split into single digits) and saves it as a
   ``PreTrainedTokenizerFast`` with the SmolLM2 chat template;
c. builds a small ``LlamaForCausalLM`` and trains it with AdamW on packed 256-token sequences
   (single CPU thread, about ten minutes);
d. saves model (safetensors, float32), tokenizer and generation config into ``--out``;
e. reports greedy accuracy on 100 held-out 2-digit additions, the legal-move rate on 100 tic-tac-toe
   boards, and the time of one forward/backward step on 8 x 64 tokens.

Reproduce with::

    python scripts/make_tiny_model.py --out src/opentinker/models/tiny --steps 2500 --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BatchEncoding,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
VOCAB_SIZE = 1024
SEQ_LEN = 256
BATCH_SIZE = 8
N_CONVERSATIONS = 60_000

# SmolLM2-135M-Instruct's chat template, verbatim.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Message = dict[str, str]
Board = list[str]  # 9 cells, each "X", "O" or "."

# ----------------------------------------------------------------------------------------------------------
# a. synthetic data
# ----------------------------------------------------------------------------------------------------------

FACTS: list[tuple[str, str]] = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("What color is the sky?", "The sky is blue."),
    ("What color is grass?", "Grass is green."),
    ("How many days are in a week?", "There are 7 days in a week."),
    ("How many legs does a spider have?", "A spider has 8 legs."),
    ("How many legs does a dog have?", "A dog has 4 legs."),
    ("What is the largest planet?", "Jupiter is the largest planet in our solar system."),
    ("What do bees make?", "Bees make honey."),
    ("What is water made of?", "Water is made of hydrogen and oxygen."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("What is the opposite of up?", "The opposite of up is down."),
    ("Which animal says moo?", "A cow says moo."),
    ("How many hours are in a day?", "There are 24 hours in a day."),
    ("What is the freezing point of water in Celsius?", "Water freezes at 0 degrees Celsius."),
]
GREETINGS: list[tuple[str, str]] = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi", "Hi there! What can I do for you?"),
    ("Good morning!", "Good morning! How can I help?"),
    ("How are you?", "I'm doing well, thank you! How can I help you today?"),
    ("Who are you?", "I am SmolLM, a helpful AI assistant."),
    ("What is your name?", "My name is SmolLM."),
    ("Thank you!", "You're welcome!"),
    ("Thanks for the help.", "You're welcome! Let me know if you need anything else."),
    ("Goodbye!", "Goodbye! Have a nice day."),
]
_WORDS_TEXT = (
    "cat dog sun moon tree blue red green fish bird book door lamp rain snow star milk cake ship "
    "road hat cup pen box key map egg car bus sky apple river stone cloud light paper chair table "
    "window garden orange yellow purple silver golden winter summer spring autumn morning evening "
    "night water fire earth wind mountain forest ocean island bridge castle tower music dance story "
    "dream happy quiet little bright simple clever gentle brave lucky sweet funny horse mouse tiger "
    "rabbit turtle monkey eagle spider flower bread cheese butter honey coffee pencil rocket planet "
    "robot pocket basket candle button ladder jacket mirror pillow wallet violin guitar piano kitten "
    "puppy doctor farmer teacher baker sailor pirate wizard dragon knight giant circle square friend "
    "family school market city village travel jump run swim climb read write sing play think"
)
WORDS = _WORDS_TEXT.split()


def render(messages: list[Message]) -> str:
    """Render a conversation as raw ChatML text, without the default system turn (training text)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def first_int(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return int(m.group()) if m else None


def arithmetic(rng: random.Random, held_out: set[tuple[int, int]]) -> list[Message]:
    kind = rng.random()
    if kind < 0.75:  # 2-digit addition, the headline eval task
        while True:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if (a, b) not in held_out:
                break
        q, ans = f"What is {a} + {b}? Answer with just the number.", str(a + b)
        if rng.random() < 0.15:
            q = rng.choice([f"What is {a} + {b}?", f"Compute {a} + {b}.", f"{a} + {b} = ?"])
    elif kind < 0.85:  # 2-digit subtraction, non-negative result
        a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
        q, ans = f"What is {a} - {b}? Answer with just the number.", str(a - b)
    elif kind < 0.93:  # 1-digit problems
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if rng.random() < 0.6:
            q, ans = f"What is {a} + {b}? Answer with just the number.", str(a + b)
        else:
            a, b = max(a, b), min(a, b)
            q, ans = f"What is {a} - {b}? Answer with just the number.", str(a - b)
    else:  # multi-step phrasing, answer with the working shown
        a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 9)
        if rng.random() < 0.5:
            q = f"What is {a} + {b} + {c}?"
            ans = f"{a} + {b} = {a + b}, and {a + b} + {c} = {a + b + c}. The answer is {a + b + c}."
        else:
            name, thing = rng.choice(["Tom", "Ann", "Sam", "Mia"]), rng.choice(["apples", "coins", "books"])
            q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
            ans = f"{a} + {b} = {a + b}. {name} has {a + b} {thing}."
    return [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]


def chat(rng: random.Random) -> list[Message]:
    kind = rng.randrange(5)
    if kind == 0:
        q, a = rng.choice(GREETINGS)
    elif kind == 1:
        q, a = rng.choice(FACTS)
    elif kind == 2:
        phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        q, a = f"Repeat after me: {phrase}", phrase
    elif kind == 3:
        lo = rng.randint(1, 15)
        hi = lo + rng.randint(2, 6)
        q, a = f"Count from {lo} to {hi}.", ", ".join(str(i) for i in range(lo, hi + 1))
    else:
        w = rng.choice(WORDS)
        q, a = f"Reverse the word {w}.", w[::-1]
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if kind == 0 and rng.random() < 0.3:  # a short second turn
        q2, a2 = rng.choice(FACTS)
        msgs += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
    return msgs


def guess_number(rng: random.Random) -> list[Message]:
    secret = rng.randint(1, 100)
    msgs = [{"role": "user", "content": "I'm thinking of a number between 1 and 100. Guess it."}]
    lo, hi = 1, 100
    for tries in range(1, 12):
        # mostly binary search, sometimes a slightly off-centre guess so the policy is not perfect
        guess = (lo + hi) // 2 if rng.random() < 0.8 else rng.randint(lo, hi)
        msgs.append({"role": "assistant", "content": f"Is it {guess}?"})
        if guess == secret:
            msgs.append({"role": "user", "content": "Correct!"})
            msgs.append({"role": "assistant", "content": f"I guessed it in {tries} tries."})
            break
        if guess < secret:
            msgs.append({"role": "user", "content": "Higher."})
            lo = guess + 1
        else:
            msgs.append({"role": "user", "content": "Lower."})
            hi = guess - 1
    return msgs


LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def winner(board: Board) -> str | None:
    for i, j, k in LINES:
        if board[i] != "." and board[i] == board[j] == board[k]:
            return board[i]
    return None


def random_board(rng: random.Random) -> Board:
    """A reachable, non-final position with X to move."""
    while True:
        board = ["."] * 9
        n_moves = 2 * rng.randint(0, 3)  # equal numbers of X and O
        for t in range(n_moves):
            empty = [i for i, c in enumerate(board) if c == "."]
            board[rng.choice(empty)] = "XO"[t % 2]
            if winner(board):
                break
        if not winner(board) and "." in board:
            return board


def good_move(board: Board, rng: random.Random) -> int:
    """Win if possible, else block, else centre, else a random empty cell (0-based)."""
    empty = [i for i, c in enumerate(board) if c == "."]
    for who in "XO":
        for i in empty:
            trial = list(board)
            trial[i] = who
            if winner(trial) == who:
                return i
    if 4 in empty and rng.random() < 0.7:
        return 4
    return rng.choice(empty)


def board_prompt(board: Board) -> str:
    rows = "\n".join("".join(board[r * 3 : r * 3 + 3]) for r in range(3))
    return f"{rows}\nYour move as X. Answer with the cell number 1-9."


def tic_tac_toe(rng: random.Random, held_out: set[str]) -> list[Message]:
    while True:
        board = random_board(rng)
        if "".join(board) not in held_out:
            break
    return [
        {"role": "user", "content": board_prompt(board)},
        {"role": "assistant", "content": str(good_move(board, rng) + 1)},
    ]


def eval_sets(seed: int) -> tuple[list[tuple[int, int]], list[Board]]:
    rng = random.Random(seed + 1_000_003)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < 100:
        pairs.add((rng.randint(10, 99), rng.randint(10, 99)))
    boards: list[Board] = []
    while len(boards) < 100:
        b = random_board(rng)
        if b not in boards:
            boards.append(b)
    return sorted(pairs), boards


def make_corpus(seed: int, n: int, held_pairs: set[tuple[int, int]], held_boards: set[str]) -> list[str]:
    rng = random.Random(seed)
    docs: list[str] = []
    gens: list[tuple[float, Callable[[], list[Message]]]] = [
        (0.58, lambda: arithmetic(rng, held_pairs)),
        (0.16, lambda: chat(rng)),
        (0.09, lambda: guess_number(rng)),
        (0.17, lambda: tic_tac_toe(rng, held_boards)),
    ]
    for _ in range(n):
        r, acc = rng.random(), 0.0
        msgs: list[Message] = []
        for p, gen in gens:
            acc += p
            if r < acc:
                msgs = gen()
                break
        else:
            msgs = gens[-1][1]()
        if rng.random() < 0.7:  # keep the system prompt occasionally absent
            msgs = [{"role": "system", "content": DEFAULT_SYSTEM}, *msgs]
        docs.append(render(msgs))
    return docs


# ----------------------------------------------------------------------------------------------------------
# b. tokenizer
# ----------------------------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------------------------------------
# c. model + training
# ----------------------------------------------------------------------------------------------------------


def build_model(vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        use_cache=True,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def train(model: LlamaForCausalLM, stream: torch.Tensor, steps: int, seed: int) -> tuple[float, float]:
    """AdamW on random packed windows of the token stream; loss on every token. Returns (loss, seconds)."""
    gen = torch.Generator().manual_seed(seed)
    peak_lr, warmup = 3e-3, 100
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.05)

    def lr_at(step: int) -> float:
        if step < warmup:
            return peak_lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return peak_lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    t0, ema = time.perf_counter(), float("nan")
    for step in range(steps):
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH_SIZE,), generator=gen)
        batch = torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if math.isnan(ema) else 0.98 * ema + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            print(
                f"step {step:5d}  loss {loss.item():.4f}  ema {ema:.4f}  lr {lr_at(step):.2e}  "
                f"{time.perf_counter() - t0:6.1f}s",
                flush=True,
            )
    model.eval()
    return ema, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------------
# e. evaluation
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def complete(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, content: str, max_new: int = 8) -> str:
    enc = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert isinstance(enc, BatchEncoding)  # transformers 5: tokenize=True returns a BatchEncoding
    prompt = torch.tensor([enc["input_ids"]])
    out = model.generate(  # pyright: ignore[reportAttributeAccessIssue]
        prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=2, pad_token_id=2, attention_mask=None
    )
    return str(tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True))


def evaluate(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, pairs: list[tuple[int, int]], boards: list[Board]
) -> tuple[float, float]:
    correct = 0
    for i, (a, b) in enumerate(pairs):
        text = complete(model, tok, f"What is {a} + {b}? Answer with just the number.")
        correct += first_int(text) == a + b
        if i < 5:
            print(f"  {a} + {b} -> {text!r}")
    legal = 0
    for i, board in enumerate(boards):
        text = complete(model, tok, board_prompt(board))
        cell = first_int(text)
        legal += cell is not None and 1 <= cell <= 9 and board[cell - 1] == "."
        if i < 3:
            print(f"  {''.join(board)} -> {text!r}")
    return correct / len(pairs), legal / len(boards)


def time_step(model: LlamaForCausalLM, reps: int = 20) -> float:
    """Median seconds of one forward+backward on 8 x 64 tokens."""
    model.train()
    x = torch.randint(3, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(reps + 3):
        t = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    model.eval()
    return sorted(times[3:])[reps // 2]


# ----------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("src/opentinker/models/tiny"))
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    pairs, boards = eval_sets(args.seed)
    docs = make_corpus(args.seed, N_CONVERSATIONS, set(pairs), {"".join(b) for b in boards})
    print(f"corpus: {len(docs)} conversations, {sum(map(len, docs)) / 1e6:.1f}M chars")

    tok = train_tokenizer(docs)
    sample = [{"role": "user", "content": "What is 12 + 34? Answer with just the number."}]
    rendered = tok.apply_chat_template(sample, add_generation_prompt=True, tokenize=False)
    assert isinstance(rendered, str)
    assert rendered == render([{"role": "system", "content": DEFAULT_SYSTEM}, *sample]) + (
        "<|im_start|>assistant\n"
    ), rendered
    stream = torch.tensor([i for d in docs for i in tok(d)["input_ids"]], dtype=torch.long)
    print(f"tokenizer: vocab {len(tok)}, stream {len(stream) / 1e6:.2f}M tokens")
    print("  sample:", tok.convert_ids_to_tokens(tok(rendered)["input_ids"]))

    model = build_model(len(tok))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.3f}M params")
    final_loss, secs = train(model, stream, args.steps, args.seed)
    print(f"trained {args.steps} steps in {secs / 60:.1f} min, final loss (ema) {final_loss:.4f}")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    for f in out.iterdir():
        f.chmod(0o644)  # save_pretrained writes the weights 0600; this is package data

    # reload from disk so the evaluation checks what was saved
    model = cast(LlamaForCausalLM, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))
    tok = AutoTokenizer.from_pretrained(out)
    acc, legal = evaluate(model, tok, pairs, boards)
    step_s = time_step(model)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    summary = {
        "params": n_params,
        "steps": args.steps,
        "train_minutes": round(secs / 60, 2),
        "final_loss": round(final_loss, 4),
        "addition_accuracy": acc,
        "ttt_legal_rate": legal,
        "fwd_bwd_8x64_ms": round(step_s * 1e3, 2),
        "folder_mb": round(size, 2),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
