"""This project's GRPO against Hugging Face TRL's GRPOTrainer on one machine (issue 49).

    python bench/peer_trl.py                          # writes bench/results/peer_trl.json
    python bench/peer_trl.py --only learn             # rerun one section, keep the other
    python bench/peer_trl.py --trl-python /tmp/trl_venv/bin/python

TRL is a bench-only dependency, not the project's: measured with trl==1.16.0 (transformers
5.19, torch 2.13 CPU). Install it for the interpreter given by --trl-python (default: this
one), e.g. in a venv that sees this environment's packages:

    python -m venv --system-site-packages /tmp/trl_venv && /tmp/trl_venv/bin/pip install trl==1.16.0

Both sides run one after the other in one run, on the same Hugging Face checkpoint, the
same prompts in the same order (the project with data.shuffle=false, TRL with
shuffle_dataset=false), the same group size (8), max new tokens (16), temperature 1, the
same reward (the project's verifier, hpc_rl.envs.registry.score, called by TRL's reward
function), the same optimizer (AdamW, betas, eps, weight decay, grad clip 1.0, constant lr,
no warmup), the same loss (PPO clip 0.2 both sides; token-mean over the whole batch: TRL's
loss_type="dapo", which divides by the active tokens of the whole accumulated batch; beta=0,
no KL) and one optimizer step per batch (the project: trainer.global_batch_size = the batch,
micro-batches of 16; TRL: num_iterations=1, per_device_train_batch_size=16,
gradient_accumulation_steps = batch / 16, so steps_per_generation = one batch), fp32, no
gradient checkpointing (TRL's default is on; the project does not checkpoint). The
project runs through its real launcher (`python -m hpc_rl.launch +recipe=tiny_grpo`, local
launcher, every role a process), lock-step and with asynchronous rollouts
(algo.async_rollout.enabled=true: one step of look-ahead, TIS; TRL has no such mode
without vLLM). TRL generates with transformers' generate (its default without vLLM).
Differences left: the project keeps tiny_grpo's TIS weights (fp32 vLLM and fp32 trainer
agree, so they are ~1); TRL's group std is computed over the group like the project's.

Sections:
  speed  a random Llama of SmolLM2-135M's body (bench/real_size_refit.py's; the project's
         small tokenizer), --speed-steps steps per side: seconds per step after the first,
         samples/s, the time split (ours: metrics timing; TRL: its rollout / generate /
         reward vs the rest of the step, timed around its methods).
  learn  the project's tiny trained student (tiny:student), --learn-steps steps per side:
         reward over the steps, and greedy accuracy before and after on a fixed held-out set
         (never trained on), computed the same way for both: the final weights loaded with
         transformers, greedy, scored by the project's verifier. Timing is recorded too.
Each side runs once per --seeds seed; ranges are over the seeds. Each of our runs also
records each role's cores in use (CPU seconds from /proc per wall second) in the trainer's
train phase and over the steps, and the share of samples with zero advantage (a group of
equal rewards: zero loss and gradient, yet trained).

Run time: the whole default bench took 21.4 min here (1286 s), most of it the two async runs
on the 135M body (about 8 min each, 91-93 s/step); `--modes sync trl` saves them.

Measured here (bench/results/peer_trl.json, 2 cores, trl 1.16.0): 135M body, steps 2-4:
TRL 16.5-16.9 s/step (generate 4.9-5.1 s, train 11.6-11.7 s), 3.79-3.87 samples/s; ours
lock-step 21.4 s/step on the clean seed (generate 8.1, train 12.7, refit 0.42 s), 0.43-0.79x
TRL's samples/s; ours async 91-93 s/step (0.18x): trainer and engine share the 2 cores.
Tiny student, 30 steps, lr 5e-4: greedy accuracy 0.547 before; after: ours lock-step
0.19-0.30, async 0.25-0.28, TRL 0.09-0.25 (every side lost accuracy at this lr with 64
samples a step); samples/s ours lock-step 477-552, TRL 731-1020. The 1.3x goal is not met.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results" / "peer_trl.json"
TRL_VERSION = "1.16.0"
TASKS = ("addition_1digit", "multiplication_1digit")
from peer_eval import MAX_NEW, greedy_accuracy  # noqa: E402 (bench/ beside this file)

GROUP, MICRO = 8, 16
# variants of our side: a tp=1 CPU engine keeps vLLM's default OpenMP binding, which on this
# one-NUMA-node, 2-core machine leaves one core to the rest ("Reducing Torch threads from 2 to
# 1"); here the engine's OpenMP threads get both cores (vLLM's own environment variable)
MODE_ENV = {"sync_vllm2": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, "async_vllm2": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}}
# ablations of our side: every row trained (no zero-advantage skip, hpc_rl/roles/zero_advantage.py)
MODE_OVERRIDES = {"sync_noskip": ["trainer.skip_zero_advantage=false"]}
BETAS, EPS, WD, CLIP = [0.9, 0.999], 1e-8, 0.0, 1.0


class CpuSampler:
    """Every `period` s, the CPU seconds (user + system, all threads) of each rank process of
    the run in `run_dir` (the local launcher's `hpc_rl.runtime.worker` children, found by their
    HPC_RL_ROLE / run directory environment) or of the given pid: a time series, so a role's CPU
    inside another role's phase can be read (does an idle role burn cores?)."""

    def __init__(self, run_dir: Optional[Path] = None, pid: Optional[int] = None, period: float = 0.25):
        self.run_dir, self.pid, self.period = str(run_dir) if run_dir else None, pid, period
        self.samples: List[tuple] = []  # (wall time, {role: cpu seconds})
        self._roles: Dict[int, str] = {}
        self._seen: set = set()  # pids looked at (a rank's environment is set at its start)
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _cpu(self, pid: int) -> Optional[float]:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / self._tick  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            return None

    def _find(self) -> None:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) in self._seen or int(d.name) in self._roles:
                continue
            try:
                cmd = (d / "cmdline").read_bytes()
                if b"hpc_rl.runtime.worker" not in cmd and b"hpc_rl.launch" not in cmd:
                    self._seen.add(int(d.name))  # not a rank, nor the launcher's child before its exec
                    continue
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            kv = dict(x.split(b"=", 1) for x in env if b"=" in x)
            rd = kv.get(b"HPC_RL_RUN_DIR", b"").decode()
            if rd and b"HPC_RL_ROLE" in kv and os.path.realpath(rd) == os.path.realpath(self.run_dir):
                self._roles[int(d.name)] = kv[b"HPC_RL_ROLE"].decode()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.pid is not None:
                self._roles = {self.pid: "trl"}
            else:
                self._find()
            now, per = time.time(), {}
            for pid, role in self._roles.items():
                c = self._cpu(pid)
                if c is not None:
                    per[role] = per.get(role, 0.0) + c
            self.samples.append((now, per))
            self._stop.wait(self.period)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()

    def cpu_in(self, windows: List[tuple]) -> Dict[str, float]:
        """Each role's CPU seconds inside the (start, end) wall windows (interpolated between samples)."""
        out: Dict[str, float] = {}
        for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:]):
            overlap = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in windows)
            if overlap <= 0 or t1 <= t0:
                continue
            for role, v in c1.items():
                if role in c0:
                    out[role] = out.get(role, 0.0) + (v - c0[role]) * overlap / (t1 - t0)
        return out


def check_trl(python: str) -> str:
    proc = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"TRL is missing for {python}: the bench needs it (a bench-only dependency, not the project's).\n"
                         f"  pip install trl=={TRL_VERSION}\n(or give --trl-python an interpreter that has it)")
    return proc.stdout.strip().splitlines()[-1]


def make_prompts(work: Path, heldout_per_task: int) -> Dict:
    """Training rows (the tiny tasks, held-out prompts removed) and the held-out set."""
    from hpc_rl.data import tasks

    seen, heldout = set(), []
    for name in TASKS:  # the first distinct prompts of each task (seed 99), never trained on
        rows = [r for r in tasks.GENERATORS[name](400, 99)]
        picked = []
        for r in rows:
            if r["prompt"] not in seen and len(picked) < heldout_per_task:
                seen.add(r["prompt"])
                picked.append(dict(r, id=f"heldout-{name}-{len(picked)}"))
        heldout += picked
    train = [r for r in tasks.mixed(512, seed=0, tasks=TASKS) if r["prompt"] not in seen]
    work.mkdir(parents=True, exist_ok=True)
    tp, hp = work / "train.jsonl", work / "heldout.jsonl"
    tp.write_text("".join(json.dumps(r) + "\n" for r in train))
    hp.write_text("".join(json.dumps(r) + "\n" for r in heldout))
    return {"train": tp, "heldout": hp, "train_rows": len(train), "heldout_rows": len(heldout)}


def _summary(step_s: List[float], samples: List[int], extra: Dict[str, List[float]]) -> Dict:
    """Steps after the first (warm-up excluded): seconds per step and samples/s."""
    s, n = step_s[1:], samples[1:]
    out = {"steps_measured": len(s), "step_s_mean": statistics.mean(s) if s else None,
           "step_s_range": [min(s), max(s)] if s else None,
           "samples_per_s": sum(n) / sum(s) if s else None, "first_step_s": step_s[0] if step_s else None}
    for k, v in extra.items():
        vv = [x for x in v[1:] if x is not None]
        out[f"{k}_mean"] = statistics.mean(vv) if vv else None
    return out


def _reward_summary(rewards: List[float]) -> Dict:
    k = min(5, len(rewards))
    return {"reward_mean_all_steps": statistics.mean(rewards) if rewards else None,
            "reward_first5": statistics.mean(rewards[:k]) if k else None,
            "reward_last5": statistics.mean(rewards[-k:]) if k else None, "reward_per_step": rewards}


def run_ours(work: Path, name: str, model: str, params_b: float, data: Path, steps: int, seed: int, lr: float,
             prompts: int, asynchronous: bool, env: Optional[Dict[str, str]] = None,
             extra: Optional[List[str]] = None) -> Dict:
    run = work / name
    batch = prompts * GROUP
    overrides = ["+recipe=tiny_grpo", f"model.path={model}", "model.name=peer-bench", f"model.params_b={params_b:.5f}",
                 f"run.max_steps={steps}", f"run.dir={run}", f"run.seed={seed}", f"algo.prompts_per_step={prompts}",
                 f"algo.generations_per_prompt={GROUP}", f"trainer.global_batch_size={batch}",
                 f"trainer.micro_batch_size={MICRO}", f"generator.sampling.max_tokens={MAX_NEW}",
                 f"trainer.optimizer.lr={lr}", f"trainer.optimizer.betas=[{BETAS[0]},{BETAS[1]}]",
                 f"trainer.optimizer.eps={EPS}", f"trainer.optimizer.weight_decay={WD}",
                 f"trainer.optimizer.grad_clip={CLIP}", "trainer.scheduler.warmup_steps=0", "trainer.scheduler.warmup_start_lr=0.0",
                 f"data.path={data}", "data.shuffle=false", "data.eval_prompts_per_task=0",
                 "checkpoint.every_steps=100000", "checkpoint.export_final=true", *(extra or [])]
    if asynchronous:
        overrides.append("algo.async_rollout.enabled=true")
    load0 = os.getloadavg()[0]
    t0 = time.time()
    with CpuSampler(run_dir=run) as cpu:
        proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *overrides], capture_output=True, text=True,
                              cwd=ROOT, timeout=3600, env=dict(os.environ, **(env or {})))
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps_rows = [r for r in rows if r.get("kind") == "step"]
    times = [r["time"] for r in steps_rows]
    # the run's last step saves a checkpoint (run.max_steps): TRL's save is outside its steps, so not counted here
    ckpt = [r["timing"].get("checkpoint_s") or 0.0 for r in steps_rows]
    step_s = [r["timing"]["step_s"] - c for r, c in zip(steps_rows, ckpt)]
    wall_between = [b - a - c for a, b, c in zip(times, times[1:], ckpt[1:])]  # step end to step end, from the 2nd
    samples = [r["samples"] for r in steps_rows]
    keys = ("generate_s", "train_s", "refit_s", "logprobs_s", "score_s", "wait_rows_s", "generate_busy_s", "checkpoint_s")
    extra = {k: [r["timing"].get(k) for r in steps_rows] for k in keys}
    # each role's cores in use inside the trainer's train phases and over the measured steps (after the first)
    tr = [json.loads(x) for x in (run / "timing" / "trainer.0.0.jsonl").read_text().splitlines() if x.strip()]
    train_w, step_w = [], []
    for row in tr[1:]:
        t = row["start"]
        for ph, d in row["phases"].items():
            if ph == "train":
                train_w.append((t, t + d))
            t += d
        step_w.append((row["start"], row["end"]))
    cores = {}
    for what, w in (("train_phase", train_w), ("steps", step_w)):
        span = sum(b - a for a, b in w)
        cores[what] = {k: v / span for k, v in cpu.cpu_in(w).items()} if span > 0 else {}
    # samples whose advantage is 0 (their group's rewards all equal): their loss and gradient are 0 under
    # GRPO without KL, yet they are trained (forward + backward) like the rest
    zero_adv = []
    try:
        import h5py

        with h5py.File(run / "rollouts.h5", "r") as f:
            for k in sorted(f):
                a, m = f[k]["advantages"][()], f[k]["response_mask"][()].astype(bool)
                zero_adv.append(float(sum(not abs(a[i][m[i]]).max(initial=0.0) > 0 for i in range(len(a))) / len(a)))
    except (ImportError, OSError, KeyError):
        pass
    step_prompts = []
    try:
        import h5py

        by_id = {r.get("id"): r["prompt"] for r in (json.loads(x) for x in data.read_text().splitlines() if x.strip())}
        with h5py.File(run / "rollouts.h5", "r") as f:
            for k in sorted(f):
                ids = [x.decode() if isinstance(x, bytes) else str(x) for x in f[k]["item_ids"][()]]
                step_prompts.append(sorted({by_id.get(i, i) for i in ids}))
    except (ImportError, OSError, KeyError):
        pass
    out = {"mode": "async" if asynchronous else "lock-step", "env": env or {}, "seed": seed, "cores_in_use": cores,
           "step_prompts": step_prompts,
           "zero_advantage_sample_frac_mean": statistics.mean(zero_adv) if zero_adv else None, "wall_s": wall, "load_before": load0,
           "load_after": os.getloadavg()[0], **_summary(step_s, samples, extra),
           "step_end_to_end_s_mean": statistics.mean(wall_between) if wall_between else None,
           "samples_per_s_end_to_end": (sum(samples[1:]) / sum(wall_between)) if wall_between else None,
           "old_logprobs_path": sorted({r.get("old_logprobs_path") for r in steps_rows} - {None}),
           # rows the train step trained (the rest had advantage 0: trainer.skip_zero_advantage), and the
           # engine-vs-trainer agreement over the trained rows
           "samples_trained_per_step": [r.get("samples_trained") for r in steps_rows],
           "token_mult_prob_error_max": max((r["token_mult_prob_error"] for r in steps_rows
                                             if r.get("token_mult_prob_error") is not None), default=None),
           "response_len_mean": statistics.mean(r["response_len_mean"] for r in steps_rows),
           "timing_per_step": [r["timing"] for r in steps_rows],
           **_reward_summary([r.get("reward_mean") for r in steps_rows]), "final_hf": str(run / "final_hf")}
    return out


def run_trl(work: Path, name: str, python: str, model: str, data: Path, steps: int, seed: int, lr: float,
            prompts: int) -> Dict:
    out_dir = work / name
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {"model": model, "train_jsonl": str(data), "out_dir": str(out_dir), "steps": steps, "prompts": prompts,
            "group": GROUP, "micro_batch": MICRO, "max_new_tokens": MAX_NEW, "lr": lr, "betas": BETAS, "eps": EPS,
            "weight_decay": WD, "grad_clip": CLIP, "seed": seed}
    (out_dir / "spec.json").write_text(json.dumps(spec))
    load0 = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.Popen([python, str(ROOT / "bench" / "peer_trl_side.py"), str(out_dir / "spec.json"),
                             str(out_dir / "result.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    with CpuSampler(pid=proc.pid) as cpu:
        stdout, stderr = proc.communicate(timeout=3600)
    proc.stdout, proc.stderr = stdout, stderr
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads((out_dir / "result.json").read_text())
    st = res["steps"]
    extra = {k: [s[k] for s in st] for k in ("rollout_s", "generate_s", "reward_s", "train_s")}
    lengths = [x["completions/mean_length"] for x in res["logs"] if "completions/mean_length" in x]
    zero = [x["frac_reward_zero_std"] for x in res["logs"] if "frac_reward_zero_std" in x]
    ends = [e for e in res.get("step_end_wall", [])]
    cores = {}
    if len(ends) > 2:  # the steps after the first; TRL's rollout opens each step, training follows it
        w = list(zip(ends, ends[1:]))[1:]
        cores["steps"] = {k: v / (ends[-1] - ends[1]) for k, v in cpu.cpu_in(w).items()}
        tw = [(a + (s_.get("rollout_s") or 0.0), b) for (a, b), s_ in zip(w, st[1:])]
        span = sum(b - a for a, b in tw)
        cores["train_phase"] = {k: v / span for k, v in cpu.cpu_in(tw).items()} if span > 0 else {}
    return {"mode": "trl", "seed": seed, "wall_s": wall, "cores_in_use": cores, "load_before": load0, "load_after": os.getloadavg()[0],
            **_summary([s["step_s"] for s in st], [s["samples"] for s in st], extra),
            "response_len_mean": statistics.mean(lengths) if lengths else None,
            "zero_advantage_sample_frac_mean": statistics.mean(zero) if zero else None,
            "step_prompts": res.get("step_prompts"), "trl_version": res["trl_version"], "torch_threads": res["torch_threads"], "trl_config": res["config"],
            "timing_per_step": st, **_reward_summary([s["reward_mean"] for s in st]), "final_hf": res["final_hf"]}


def _range(runs: List[Dict], key: str) -> Optional[List[float]]:
    v = [r[key] for r in runs if r.get(key) is not None]
    return [min(v), max(v)] if v else None


def section(work: Path, args, kind: str, model: str, params_b: float, data: Dict, steps: int, lr: float,
            modes: List[str]) -> Dict:
    runs: Dict[str, List[Dict]] = {m: [] for m in modes}
    for seed in args.seeds:
        for m in modes:  # interleaved per seed: machine load drifts
            name = f"{kind}_{m}_s{seed}"
            print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
            if m == "trl":
                r = run_trl(work, name, args.trl_python, model, data["train"], steps, seed, lr, args.prompts)
            else:
                # the engine's KV cache sized for the model (the generator warns when a step does not fit:
                # engines/kv_capacity.py; the tiny recipes' 0.06 holds 3 sequences of the 120M model)
                extra = [f"generator.gpu_memory_utilization={args.gen_memory}", *MODE_OVERRIDES.get(m, [])]
                r = run_ours(work, name, model, params_b, data["train"], steps, seed, lr, args.prompts,
                             m.startswith("async"), MODE_ENV.get(m), extra)
                r["extra_overrides"] = extra
            if kind == "learn":
                r["greedy_after"] = greedy_accuracy(r["final_hf"], model, data["heldout"])
            print(f"    {m} seed {seed}: {r['step_s_mean']:.2f} s/step, {r['samples_per_s']:.2f} samples/s, "
                  f"reward {r['reward_mean_all_steps']:.3f}"
                  + (f", greedy after {r['greedy_after']['accuracy']:.3f}" if "greedy_after" in r else ""), flush=True)
            r.pop("final_hf", None)
            runs[m].append(r)
    for m, rs in runs.items():  # the same prompts at every step on every side?
        for r in rs:
            ref = runs[modes[0]][0].get("step_prompts")
            r["same_prompts_as_first_run"] = bool(ref) and r.get("step_prompts") == ref
    out: Dict = {"model": model, "params_b": params_b, "steps": steps, "lr": lr, "runs": runs, "ranges": {}}
    for m, rs in runs.items():
        out["ranges"][m] = {k: _range(rs, k) for k in
                            ("samples_per_s", "step_s_mean", "samples_per_s_end_to_end", "reward_mean_all_steps",
                             "reward_last5", "generate_s_mean", "train_s_mean", "rollout_s_mean", "refit_s_mean",
                             "wait_rows_s_mean", "zero_advantage_sample_frac_mean")}
        if kind == "learn":
            out["ranges"][m]["greedy_after"] = _range([r["greedy_after"] for r in rs], "accuracy")
            out["ranges"][m]["heldout_sampled_reward_after"] = _range([r["greedy_after"] for r in rs], "sampled_reward")
    if "trl" in runs:
        trl_sps = [r["samples_per_s"] for r in runs["trl"]]
        for m in modes:
            if m != "trl":  # per seed (same seed both sides) and worst case
                per_seed = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs[m], runs["trl"])]
                out[f"{m}_over_trl_samples_per_s"] = {"per_seed": per_seed, "range": [min(per_seed), max(per_seed)],
                                                     "worst_over_best": min(r["samples_per_s"] for r in runs[m]) / max(trl_sps)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("speed", "learn"), help="rerun one section, keeping the other from the file")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--speed-steps", type=int, default=3)
    p.add_argument("--learn-steps", type=int, default=30)
    p.add_argument("--speed-lr", type=float, default=1e-5)
    p.add_argument("--learn-lr", type=float, default=5e-4)
    p.add_argument("--modes", nargs="+", default=["sync", "sync_noskip", "trl"],
                   choices=("sync", "async", "trl", *MODE_ENV, *MODE_OVERRIDES))
    p.add_argument("--gen-memory", type=float, default=0.2, help="our generator.gpu_memory_utilization")
    p.add_argument("--key-suffix", default="", help="store the sections as speed<suffix> / learn<suffix>")
    p.add_argument("--heldout-per-task", type=int, default=32)
    p.add_argument("--trl-python", default=sys.executable, help="an interpreter with TRL installed")
    p.add_argument("--speed-hidden", type=int, default=576, help="(development) a smaller random model: hidden size")
    p.add_argument("--speed-layers", type=int, default=30, help="(development) layers")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    trl_version = check_trl(args.trl_python) if "trl" in args.modes else None
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if args.only and out_path.exists() else {}
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result.update({"bench": "peer_trl", "time": time.time(), "trl_version": trl_version,
                   "transformers": transformers.__version__, "torch": torch.__version__,
                   "machine": {"cpus": os.cpu_count()}, "args": vars(args),
                   f"commit_{args.only or 'all'}": commit,
                   "fixed": {"group": GROUP, "micro_batch": MICRO, "max_new_tokens": MAX_NEW, "betas": BETAS,
                             "eps": EPS, "weight_decay": WD, "grad_clip": CLIP, "temperature": 1.0, "clip": 0.2,
                             "loss": "PPO clip, token-mean over the batch (TRL dapo), beta 0",
                             "optimizer_steps_per_batch": 1}})
    work = Path(tempfile.mkdtemp(prefix="peer_trl-"))
    data = make_prompts(work / "data", args.heldout_per_task)
    result["data"] = {"tasks": TASKS, "train_rows": data["train_rows"], "heldout_rows": data["heldout_rows"]}
    t_all = time.time()
    if args.only in (None, "learn"):
        from hpc_rl.rl.inputs import resolve_model_ref

        student = resolve_model_ref("tiny:student")
        before = greedy_accuracy(student, student, data["heldout"])
        print(f"tiny:student greedy accuracy before: {before['accuracy']:.3f}", flush=True)
        learn = section(work, args, "learn", student, 0.00012, data, args.learn_steps, args.learn_lr, args.modes)
        learn["greedy_before"] = before
        result["learn" + args.key_suffix] = learn
        out_path.write_text(json.dumps(result, indent=1) + "\n")
    if args.only in (None, "speed"):
        import safetensors.torch

        from hpc_rl.models.assets import ModelSpec, save_untrained

        spec = ModelSpec(hidden=args.speed_hidden, intermediate=args.speed_hidden * 8 // 3 if args.speed_hidden != 576
                         else 1536, layers=args.speed_layers, heads=max(1, args.speed_hidden // 64), max_positions=256)
        ckpt = save_untrained(work / "smol_body", spec, seed=0)
        params = sum(t.numel() for f in ckpt.glob("*.safetensors") for t in safetensors.torch.load_file(f).values())
        speed = section(work, args, "speed", str(ckpt), params / 1e9, data, args.speed_steps, args.speed_lr, args.modes)
        speed["spec"] = dataclasses.asdict(spec)
        speed["params"] = params
        result["speed" + args.key_suffix] = speed
    result["bench_wall_s"] = time.time() - t_all
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    summary = {sec: {"ranges": result[sec]["ranges"],
                     **{k: v for k, v in result[sec].items() if k.endswith("_over_trl_samples_per_s")}}
               for sec in ("speed" + args.key_suffix, "learn" + args.key_suffix) if sec in result}
    print(json.dumps(summary, indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
