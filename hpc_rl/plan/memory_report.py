"""The dry run's memory table: plan.json's "memory" (plan/memory_plan.py) in GiB per GPU."""

from __future__ import annotations

from typing import Dict, List

from hpc_rl.memory.model import GiB

_COLUMNS = ["role", "params", "grads", "optim", "activ", "logits", "kv", "other", "peak", "budget", "phase", ""]
_PARTS = ["params", "grads", "optimizer", "activations", "logits", "kv_cache", "other"]


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.1f}"


def memory_table(doc: dict, cluster: str) -> str:
    roles: Dict[str, dict] = doc.get("roles", {})
    gpu = doc.get("gpu_memory_gib")
    if gpu:
        head = (f"memory per GPU in GiB ({cluster}: {gpu:g} GiB; trainer and teachers may plan "
                f"{_gib(doc['usable'])} after cluster.gpu_memory_headroom={doc['headroom']:g}; "
                "the generator its gpu_memory_utilization):")
    else:
        head = f"memory per rank in GiB ({cluster}: cluster.gpu_memory_gib unset, so no fit check):"
    rows: List[List[str]] = []
    for name, r in roles.items():
        parts = r["parts"]
        verdict = "" if r["fits"] is None else ("fits" if r["fits"] else "DOES NOT FIT")
        rows.append([name, *(_gib(parts.get(k, 0)) for k in _PARTS), _gib(r["peak"]), _gib(r["budget"]), r["phase"], verdict])
    lines = [head]
    if rows:
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_COLUMNS)]

        def fmt(cells: List[str]) -> str:
            out = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:-2], widths[1:-2])]
            return "  ".join(out + [cells[-2].ljust(widths[-2]), cells[-1]]).rstrip()

        lines += [fmt(_COLUMNS), "-" * len(fmt(_COLUMNS)), *(fmt(r) for r in rows)]
    for name, r in roles.items():
        if "activations_full" in r:
            state = "on" if r["recompute"] else "off"
            lines.append(f"{name} activations: {_gib(r['activations_full'])} without activation checkpointing, "
                         f"{_gib(r['activations_recompute'])} with (it is {state})")
        if "kv_tokens" in r:
            seqs = r["parts"].get("kv_cache", 0) / r["kv_minimum"] if r["kv_minimum"] else 0
            lines.append(f"{name}: needs {_gib(r['required'])} to start with room for one max_model_len sequence's "
                         f"KV cache ({_gib(r['kv_minimum'])}); its KV cache ({_gib(r['parts'].get('kv_cache'))}) "
                         f"holds {r['kv_tokens']:,} tokens, {seqs:.1f} such sequences")
        for note in r.get("notes", []):
            lines.append(f"{name}: {note}")
    by_source: Dict[str, List[str]] = {}
    for name, r in roles.items():
        by_source.setdefault(r["shape"], []).append(name)
    for source, names in by_source.items():
        lines.append(f"shape of {', '.join(names)}: {source}")
    for name, why in doc.get("unknown", {}).items():
        lines.append(f"{name}: no figures ({why})")
    return "\n".join(lines)
