"""Synthetic tasks small enough for tiny models to learn: addition, multiplication, reversal.

Every generator is a pure function of its seed (its own `random.Random`, never the global
one), so a test, a smoke run and a resumed run all see the same prompts. Each sample is a
dict in the dataset's row format: {"prompt", "answer", "agent", "task"}.
"""

from __future__ import annotations

import json
import operator
import random
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Sequence, Tuple, Union

ADD_TEMPLATES = (
    "What is {a} plus {b}?",
    "Add {a} and {b}.",
    "Compute {a} + {b}.",
    "Tom has {a} apples and finds {b} more. How many apples does he have?",
)
MUL_TEMPLATES = (
    "What is {a} times {b}?",
    "Multiply {a} by {b}.",
    "Compute {a} * {b}.",
    "A box holds {a} pens. How many pens are in {b} boxes?",
)
REVERSE_TEMPLATES = (
    "Reverse the word '{w}'.",
    "Write '{w}' backwards.",
    "Spell the word '{w}' in reverse order.",
)
# Short, common words whose reversals are not themselves words the model might recall.
WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "lemon", "chair", "bread", "plant", "mouse",
    "green", "light", "sugar", "water", "paper", "horse", "music", "table", "clock", "dream",
    "cat", "dog", "sun", "tree", "fish", "bird", "book", "milk", "rain", "snow",
)


def _arithmetic(name: str, n: int, seed: int, a_range: Tuple[int, int], b_range: Tuple[int, int],
                templates: Sequence[str], op: Callable[[int, int], int], agent: str, task: str) -> List[dict]:
    """n rows of `op(a, b)` with a and b drawn from their ranges; one template is used as is
    (no draw), so each generator's prompts stay what they were."""
    rng = random.Random(f"{name}:{seed}")
    out = []
    for _ in range(n):
        a, b = rng.randint(*a_range), rng.randint(*b_range)
        template = rng.choice(templates) if len(templates) > 1 else templates[0]
        out.append({"prompt": template.format(a=a, b=b), "answer": str(op(a, b)), "agent": agent, "task": task})
    return out


def addition(n: int, seed: int = 0) -> List[dict]:
    """Two 2-digit operands (10..99): sums stay below 200."""
    return _arithmetic("addition", n, seed, (10, 99), (10, 99), ADD_TEMPLATES, operator.add, "add_agent", "addition")


def multiplication(n: int, seed: int = 0) -> List[dict]:
    """A 2-digit operand times a 1-digit one (2..9): products stay below 900."""
    return _arithmetic("multiplication", n, seed, (10, 99), (2, 9), MUL_TEMPLATES, operator.mul, "mul_agent",
                       "multiplication")


def reverse(n: int, seed: int = 0) -> List[dict]:
    rng = random.Random(f"reverse:{seed}")
    out = []
    for _ in range(n):
        w = rng.choice(WORDS)
        prompt = rng.choice(REVERSE_TEMPLATES).format(w=w)
        out.append({"prompt": prompt, "answer": w[::-1], "agent": "reverse_agent", "task": "reverse"})
    return out


def addition_1digit(n: int, seed: int = 0) -> List[dict]:
    """Single-digit sums with one short template: a 2-layer character-level model learns
    them in a few hundred steps on a CPU (2-digit sums take thousands), which is what the
    tiny teachers need. Scored as `addition`."""
    return _arithmetic("addition_1digit", n, seed, (0, 9), (0, 9), ADD_TEMPLATES[:1], operator.add, "add_agent",
                       "addition")


def multiplication_1digit(n: int, seed: int = 0) -> List[dict]:
    """Single-digit products (2..9 x 2..9) with one short template. Scored as `multiplication`."""
    return _arithmetic("multiplication_1digit", n, seed, (2, 9), (2, 9), MUL_TEMPLATES[:1], operator.mul,
                       "mul_agent", "multiplication")


def calculator(n: int, seed: int = 0) -> List[dict]:
    """Two 2-digit operands (10..99) multiplied, one template: the agentic task
    (hpc_rl/agentic/calculator.py), beyond the tiny models' own arithmetic; a tool user
    copies the operands into a calculator call and the tool's answer back."""
    return _arithmetic("calculator", n, seed, (10, 99), (10, 99), MUL_TEMPLATES[:1], operator.mul, "calc_agent",
                       "calculator")


GENERATORS: Dict[str, Callable[[int, int], List[dict]]] = {
    "addition": addition,
    "multiplication": multiplication,
    "reverse": reverse,
    "addition_1digit": addition_1digit,
    "multiplication_1digit": multiplication_1digit,
    "calculator": calculator,
}


# The task families; the *_1digit generators are easier variants of two of them.
DEFAULT_TASKS = ("addition", "multiplication", "reverse")


def mixed(n_per_task: int, seed: int = 0, tasks: Iterable[str] = DEFAULT_TASKS) -> List[dict]:
    """n_per_task samples of each task, interleaved, each with a stable id ("<task>-<i>")."""
    per_task = []
    for name in tasks:
        if name not in GENERATORS:
            raise ValueError(f"unknown task {name!r}; known tasks: {sorted(GENERATORS)}")
        rows = GENERATORS[name](n_per_task, seed)
        per_task.append([dict(row, id=f"{name}-{i}") for i, row in enumerate(rows)])
    return [row for group in zip(*per_task) for row in group]


def write_jsonl(path: Union[str, Path], samples: Iterable[dict]) -> Path:
    """One JSON object per line; parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    return path
