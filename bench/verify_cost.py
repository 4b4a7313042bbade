"""What a math verify call costs (issue 27: math answers through math-verify).

An env rank scores every sampled row of its generators each step (hundreds). Timed here,
one call after another in this process, on answers that differ call to call (math-verify
caches its last 20 parses):

1. the tiny tasks' answers (addition, multiplication; 400 references, right and wrong,
   written "105", "The answer is 105." and "#### 105"): whole numbers, the fast path;
   beside them the number rules alone (extract + exact fraction, what the verifier did
   before math-verify);
2. non-integer plain numbers ("0.75" against "3/4"): math-verify, main thread;
3. LaTeX answers (\\boxed{\\frac{2k}{2k+2}} against \\frac{k}{k+1}, \\boxed{2\\sqrt{k}}
   against \\sqrt{4k}): math-verify, main thread;
4. the LaTeX answers from another thread: the helper process (math_worker.py);
plus the one-off costs: importing math-verify (first call) and starting the helper.

    python bench/verify_cost.py          # writes bench/results/verify_cost.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc_rl.data import addition, multiplication  # noqa: E402
from hpc_rl.envs import math_worker  # noqa: E402
from hpc_rl.envs.math_verifier import _clean_latex, extract_answer, parse_number, verify_math  # noqa: E402


def number_rules_only(response: str, answer: str) -> bool:
    got, ref = extract_answer(response), parse_number(_clean_latex(answer))
    return got is not None and parse_number(got) == ref


def per_call(fn, cases):
    start = time.perf_counter()
    right = sum(bool(getattr(r, "correct", r)) for r in (fn(resp, ans) for resp, ans in cases))
    secs = time.perf_counter() - start
    return {"calls": len(cases), "correct": right, "us_per_call": round(secs / len(cases) * 1e6, 1),
            "calls_per_s": round(len(cases) / secs)}


def main() -> None:
    rows = addition(200, seed=1) + multiplication(200, seed=1)
    tiny = [(fmt.format(a), r["answer"]) for r in rows for a in (r["answer"], str(int(r["answer"]) + 1))
            for fmt in ("{}", "The answer is {}.", "#### {}")]
    decimals = [(f"{k / (k + 1):.6f}"[:8], f"{k}/{k + 1}") for k in (4, 8, 16, 20, 25, 40, 50, 80, 100, 125)] * 3
    latex = ([(rf"\boxed{{\frac{{{2 * k}}}{{{2 * k + 2}}}}}", rf"\frac{{{k}}}{{{k + 1}}}") for k in range(1, 101)]
             + [(rf"\boxed{{2\sqrt{{{k}}}}}", rf"\sqrt{{{4 * k}}}") for k in range(2, 102)])
    out = {}
    start = time.perf_counter()
    verify_math(r"\boxed{\frac{1}{2}}", "0.5")  # imports math-verify
    out["first_latex_call_s"] = round(time.perf_counter() - start, 2)
    out["tiny_tasks_fast_path"] = per_call(verify_math, tiny)
    out["tiny_tasks_number_rules_only"] = per_call(number_rules_only, tiny)
    out["decimals_math_verify"] = per_call(verify_math, decimals)
    out["latex_math_verify_main_thread"] = per_call(verify_math, latex)
    box = {}

    def from_thread():
        start = time.perf_counter()
        verify_math(r"\boxed{\frac{1}{2}}", "0.5")  # starts the helper
        box["helper_start_and_first_call_s"] = round(time.perf_counter() - start, 2)
        box["latex_helper_process"] = per_call(verify_math, latex)

    t = threading.Thread(target=from_thread)
    t.start()
    t.join()
    out.update(box)
    math_worker.WORKER.close()
    out["load_average"] = Path("/proc/loadavg").read_text().split()[:3]
    out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    path = ROOT / "bench" / "results" / "verify_cost.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
