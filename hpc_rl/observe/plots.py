"""PNG plots of a run's metrics.jsonl, by the metric names of observe/metrics.py.

One PNG per panel in <run dir>/plots/ and `overview.png` with every panel on one page:

  reverse_kl          reverse KL to the routed teacher, per teacher (training batches as
                      lines, the validations as large markers)
  reward              mean reward of the training batches
  ref_kl              KL to the reference model (algo.ref_kl_coef > 0)
  accuracy            accuracy per task (training batches; validations as markers)
  validation          the held-out validation: greedy accuracy per task and its mean, and with
                      data.validation.k > 1 pass@k (dashed) and mean@k (dotted) per task
  mult_prob_error     token_mult_prob_error: vLLM's vs the trainer's token probabilities (same
                      weights), and policy_change_mult_prob_error (older weights, async)
  phase_time          seconds per phase of a step (generate, score, train, refit,
                      checkpoint when recorded) and the whole step
  refit               seconds per refit

A panel with nothing to draw (no teachers in GRPO) is left out. matplotlib's Figure is used
without pyplot, so no display, backend choice or global state is involved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hpc_rl.rundir import RunDir

from .metrics import VAL_PREFIX, series

Series = Dict[str, List[Tuple[int, float]]]
PHASES = ("generate_s", "score_s", "train_s", "refit_s", "checkpoint_s")  # drawn in this order, then any other


def read_records(run_dir: Path) -> List[dict]:
    path = RunDir(run_dir).metrics
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _children(s: Series, prefix: str) -> List[str]:
    """The names directly under prefix/ (reverse_kl/add, ...), `mean` last."""
    kids = sorted({n[len(prefix) + 1:] for n in s if n.startswith(prefix + "/") and "/" not in n[len(prefix) + 1:]})
    return sorted(kids, key=lambda k: k == "mean")


def _line(ax, pts: Sequence[Tuple[int, float]], **kw):
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, **kw)[0]


def _from_zero(ax, values: Sequence[float]) -> None:
    """Durations from 0 (a wobble of milliseconds should not fill the panel), with headroom
    for the legend."""
    ax.set_ylim(0, max(values, default=0.0) * 1.3 or 1.0)


def _with_evals(ax, s: Series, name: str, ylabel: str) -> bool:
    """Training lines of name/<k> and validation markers of val/name/<k>, one colour per k."""
    keys = list(dict.fromkeys(_children(s, name) + _children(s, f"{VAL_PREFIX}/{name}")))
    for k in keys:
        color = None
        if f"{name}/{k}" in s:
            color = _line(ax, s[f"{name}/{k}"], label=k, linestyle="--" if k == "mean" else "-").get_color()
        ev = s.get(f"{VAL_PREFIX}/{name}/{k}")
        if ev:
            ax.plot([p[0] for p in ev], [p[1] for p in ev], linestyle="none", marker="D", markersize=8,
                    color=color, label=f"{k} (val)" if color is None else None, markeredgecolor="black")
    ax.set_ylabel(ylabel)
    return bool(keys)


def draw_reverse_kl(ax, s: Series) -> bool:
    ax.set_title("reverse KL to the routed teacher (diamonds: validation)")
    return _with_evals(ax, s, "reverse_kl", "nats / token")


def draw_reward(ax, s: Series) -> bool:
    ax.set_title("mean reward")
    if "reward_mean" not in s:
        return False
    _line(ax, s["reward_mean"], label="reward_mean")
    ax.set_ylabel("reward")
    return True


def draw_ref_kl(ax, s: Series) -> bool:
    """algo.ref_kl_coef: the training batches' KL to the reference model (the configured
    estimator, and k1 beside it), at the weights that sampled them."""
    ax.set_title("KL to the reference model")
    if "ref_kl" not in s:
        return False
    _line(ax, s["ref_kl"], label="ref_kl")
    if "ref_kl_k1" in s:
        _line(ax, s["ref_kl_k1"], label="ref_kl_k1", linestyle="--")
    ax.set_ylabel("nats / token")
    return True


def draw_accuracy(ax, s: Series) -> bool:
    ax.set_title("accuracy per task (diamonds: greedy validation)")
    return _with_evals(ax, s, "accuracy", "accuracy")


def draw_validation(ax, s: Series) -> bool:
    """The validation series over steps: greedy accuracy (solid), pass@k (dashed) and mean@k
    (dotted), one colour per task; the means over tasks in black."""
    k = int(s[f"{VAL_PREFIX}/k"][-1][1]) if s.get(f"{VAL_PREFIX}/k") else None
    ax.set_title("held-out validation" + (f" (dashed: pass@{k}, dotted: mean@{k})" if k else ""))
    tasks = _children(s, f"{VAL_PREFIX}/accuracy")
    for t in tasks:
        color = _line(ax, s[f"{VAL_PREFIX}/accuracy/{t}"], label=t).get_color()
        for kind, style in (("pass_at_k", "--"), ("mean_at_k", ":")):
            if f"{VAL_PREFIX}/{kind}/{t}" in s:
                _line(ax, s[f"{VAL_PREFIX}/{kind}/{t}"], color=color, linestyle=style)
    if f"{VAL_PREFIX}/accuracy_mean" in s and len(tasks) > 1:
        _line(ax, s[f"{VAL_PREFIX}/accuracy_mean"], label="mean", color="black")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("accuracy")
    return bool(tasks)


def draw_mult_prob_error(ax, s: Series) -> bool:
    ax.set_title("token_mult_prob_error (vLLM vs trainer)")
    if "token_mult_prob_error" not in s and "policy_change_mult_prob_error" not in s:
        return False
    pts = s.get("token_mult_prob_error", [])
    if pts:  # same weights on both sides: the mismatch
        _line(ax, pts, label="token_mult_prob_error (same weights)")
    drift = s.get("policy_change_mult_prob_error", [])
    if drift:  # older weights than the trainer's (async): the policy's change, drawn apart
        _line(ax, drift, label="policy_change_mult_prob_error (older weights)", linestyle="--")
        ax.legend(fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    # 1.0 is identical; float noise of 1e-7 must not look like spikes: show at least up to
    # 1.01 (a bf16 engine's usual level) and plain numbers, not an offset
    top = max(max(v for _, v in pts + drift), 1.0)
    ax.set_ylim(0.998, max(1.01, top + 0.2 * (top - 1.0)))
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_ylabel("mean exp(|log p_vllm - log p_trainer|)")
    return True


def draw_phase_time(ax, s: Series) -> bool:
    ax.set_title("time per phase")
    found = _children(s, "timing")
    phases = [p for p in PHASES if p in found] + [p for p in found if p not in PHASES and p != "step_s"]
    for p in phases:
        _line(ax, s[f"timing/{p}"], label=p[:-2] if p.endswith("_s") else p)
    if "step_s" in found:
        _line(ax, s["timing/step_s"], label="step", color="black", linestyle="--")
    ax.set_ylabel("seconds")
    _from_zero(ax, [v for p in found for _, v in s[f"timing/{p}"]])
    return bool(phases)


def draw_refit(ax, s: Series) -> bool:
    ax.set_title("refit (trainer -> vLLM engines)")
    if "timing/refit_s" not in s:
        return False
    _line(ax, s["timing/refit_s"], label="refit_s")
    ax.set_ylabel("seconds")
    _from_zero(ax, [v for _, v in s["timing/refit_s"]])
    return True


PANELS: List[Tuple[str, Callable]] = [
    ("reverse_kl", draw_reverse_kl),
    ("reward", draw_reward),
    ("ref_kl", draw_ref_kl),
    ("accuracy", draw_accuracy),
    ("validation", draw_validation),
    ("mult_prob_error", draw_mult_prob_error),
    ("phase_time", draw_phase_time),
    ("refit", draw_refit),
]


def _finish(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(True, alpha=0.3)
    handles = ax.get_legend_handles_labels()[0]
    if handles:
        ax.legend(fontsize="small", ncol=2 if len(handles) > 4 else 1)


def write_plots(run_dir: Path, out_dir: Optional[Path] = None) -> List[Path]:
    """Draw every panel with data; returns the PNGs written (overview.png last). Raises
    ImportError without matplotlib."""
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    records = read_records(run_dir)
    s = series(records)
    out_dir = Path(out_dir) if out_dir else RunDir(run_dir).plots
    out_dir.mkdir(parents=True, exist_ok=True)
    written, drawn = [], []
    for stem, draw in PANELS:
        fig = Figure(figsize=(6.4, 4.0), layout="constrained")
        ax = fig.add_subplot()
        if draw(ax, s):
            _finish(ax)
            fig.savefig(out_dir / f"{stem}.png", dpi=100)
            written.append(out_dir / f"{stem}.png")
            drawn.append(draw)
    if drawn:
        cols = 3 if len(drawn) > 4 else 2
        rows = -(-len(drawn) // cols)
        fig = Figure(figsize=(5.2 * cols, 3.6 * rows), layout="constrained")
        fig.suptitle(f"{run_dir.name}: {sum(1 for r in records if r.get('kind') == 'step')} steps")
        for i, draw in enumerate(drawn):
            ax = fig.add_subplot(rows, cols, i + 1)
            draw(ax, s)
            _finish(ax)
        fig.savefig(out_dir / "overview.png", dpi=100)
        written.append(out_dir / "overview.png")
    return written
