"""The held-out validation set (rl/heldout.py, data/validation.py): disjoint from training by
item on the datasets the demo builds, a planted overlap refused at launch, the config rules
of data.validation and checkpoint keep-best (config/validate_data.py)."""

from __future__ import annotations

import json
import random

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.data.dataset import PromptDataset, PromptIterator, PromptRecord
from hpc_rl.data.tasks import mixed, write_jsonl
from hpc_rl.data.validation import content_key, distinct_items, item_groups, split_by_item
from hpc_rl.launch import main
from hpc_rl.rl.inputs import check_inputs, eval_records, load_dataset, load_rows, load_validation, write_generated
from test_rl_inputs import _overrides, model_dir  # noqa: F401 (model_dir: a fixture)


@pytest.mark.parametrize("recipe", ["tiny_mopd", "tiny_grpo"])
def test_the_demo_validates_on_items_it_never_trains_on(recipe, tmp_path):
    """The datasets `make demo` builds, read back as the ranks read them (the generated file in
    the run directory): no validation item is a training item, by content or by id, and a
    training iterator over several epochs never draws one."""
    cfg = load_config([f"+recipe={recipe}", f"run.dir={tmp_path / 'run'}"])
    assert cfg.data.eval_prompts_per_task > 0 and cfg.data.validation.path is None
    run_dir = tmp_path / "run"
    write_generated(cfg, run_dir)
    rows, train, val = load_rows(cfg, run_dir), load_dataset(cfg, run_dir), load_validation(cfg, run_dir)
    # the synthetic tasks repeat prompts: a row-level split would leak
    assert len(distinct_items(rows.records)) < len(rows)
    assert len(train) + len(val) == len(rows) and len(val) > 0
    train_keys = {content_key(r) for r in train}
    assert not train_keys & {content_key(r) for r in val}
    assert not {r.id for r in train} & {r.id for r in val}
    # every agent is validated and trained on
    assert {r.agent for r in val} == {r.agent for r in train} == {r.agent for r in rows}
    evals = eval_records(val, cfg.data.eval_prompts_per_task, cfg.run.seed)
    assert evals and all(content_key(r) not in train_keys for r in evals)
    assert len({content_key(r) for r in evals}) == len(evals)  # each held-out item scored once
    it = PromptIterator(train, cfg.algo.prompts_per_step, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    drawn = {content_key(r) for _ in range(3 * len(train) // cfg.algo.prompts_per_step + 1) for r in next(it)}
    assert drawn == train_keys  # every training item, and nothing held out
    # the launcher's view (generated in memory) splits the same way as the ranks'
    assert [r.prompt for r in load_validation(cfg).records] == [r.prompt for r in val.records]


def test_the_split_is_by_item_seeded_and_independent_of_row_order():
    rows = [dict(r, id=f"row-{i}") for i, r in enumerate(mixed(200, tasks=("addition_1digit", "multiplication_1digit")))]
    ds = PromptDataset([PromptRecord(r["prompt"], r["agent"], r["answer"], r["task"], r["id"]) for r in rows])
    train, val = split_by_item(ds, 0.2, seed=3)
    for rows_of_item in item_groups(ds.records):  # every row of an item on one side
        sides = {ds.records[i] in val.records for i in rows_of_item}
        assert len(sides) == 1
    per_agent = {a: len({content_key(r) for r in distinct_items(ds.records) if r.agent == a}) for a in ("add_agent", "mul_agent")}
    held = {a: len({content_key(r) for r in val if r.agent == a}) for a in per_agent}
    assert held == {a: round(0.2 * n) for a, n in per_agent.items()}
    shuffled = list(ds.records)
    random.Random(0).shuffle(shuffled)
    _, val2 = split_by_item(PromptDataset(shuffled), 0.2, seed=3)
    assert {content_key(r) for r in val2} == {content_key(r) for r in val}
    _, val3 = split_by_item(ds, 0.2, seed=4)
    assert {content_key(r) for r in val3} != {content_key(r) for r in val}


def test_rows_sharing_an_id_are_one_item_and_whitespace_does_not_hide_a_repeat():
    recs = [PromptRecord("What is 1 plus 2?", "a", "3", "addition", "q1"),
            PromptRecord("Add 1 and 2.", "a", "3", "addition", "q1"),  # another phrasing, same id
            PromptRecord("What is  1 plus 2? ", "a", "3", "addition", "x9"),  # the first, re-spaced
            PromptRecord("What is 5 plus 5?", "a", "10", "addition", "q2")]
    assert item_groups(recs) == [[0, 1, 2], [3]]


def test_validation_off_holds_nothing_out_and_a_small_set_is_used_as_it_is(tmp_path):
    off = load_config(["+recipe=tiny_mopd", "data.eval_prompts_per_task=0"])
    assert len(load_dataset(off)) == len(load_rows(off)) and len(load_validation(off)) == 0
    cfg = load_config(["+recipe=tiny_mopd", "data.samples_per_task=16", "data.eval_prompts_per_task=50"])
    val = load_validation(cfg)
    evals = eval_records(val, 50, cfg.run.seed)
    assert 0 < len(evals) == len(distinct_items(val.records)) < 100  # fewer than asked: all there is




def test_a_planted_overlap_is_refused_naming_the_key_the_lines_and_the_fix(model_dir, tmp_path, capsys):  # noqa: F811
    tasks = ("addition_1digit", "multiplication_1digit")
    train = write_jsonl(tmp_path / "train.jsonl", mixed(20, seed=0, tasks=tasks))
    train_rows = [json.loads(x) for x in train.read_text().splitlines()]
    held = [r for r in mixed(40, seed=7, tasks=tasks)
            if content_key(PromptRecord(r["prompt"], r["agent"], r["answer"], r["task"])) not in
            {content_key(PromptRecord(t["prompt"], t["agent"], t["answer"], t["task"])) for t in train_rows}][:6]
    clean = write_jsonl(tmp_path / "val_clean.jsonl", held)
    cfg, _ = check_inputs(load_config(_overrides(model_dir, tmp_path, f"data.path={train}",
                                                 f"data.validation.path={clean}")))
    assert len(load_validation(cfg)) == 6 and len(load_dataset(cfg)) == len(train_rows)  # a file takes nothing away
    # lines 3 and 5 are training rows (other ids, same question): the leak
    leaky = held[:2] + [dict(train_rows[4], id="v-3")] + held[2:3] + [dict(train_rows[9], id="v-5")] + held[3:]
    bad = write_jsonl(tmp_path / "val_leaky.jsonl", leaky)
    with pytest.raises(ConfigError) as err:
        check_inputs(load_config(_overrides(model_dir, tmp_path, f"data.path={train}", f"data.validation.path={bad}")))
    (v,) = [v for v in err.value.violations if v.key == "data.validation.path"]
    assert "2 of its 8 rows are also training rows" in v.problem
    assert f"line 3 (= {train}:5)" in v.problem and f"line 5 (= {train}:10)" in v.problem
    assert "remove those rows" in v.fix
    # the launch (launcher=local: check_runnable before any rank) refuses it, exit 2, naming the key
    code = main(_overrides(model_dir, tmp_path, f"data.path={train}", f"data.validation.path={bad}"))
    text = capsys.readouterr()
    assert code == 2 and "data.validation.path" in text.out + text.err and "line 3" in text.out + text.err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, key", [
    ("data.validation.split=1.0", "data.validation.split"),
    ("data.validation.split=0", "data.validation.split"),
    ("data.validation.every_steps=-1", "data.validation.every_steps"),
    ("data.validation.k=0", "data.validation.k"),
    ("data.validation.temperature=0", "data.validation.temperature"),
    ("checkpoint.keep_best=2 data.validation.every_steps=0", "checkpoint.keep_best"),  # no validation between steps
    ("checkpoint.keep_best=2 data.eval_prompts_per_task=0", "checkpoint.keep_best"),
    ("checkpoint.keep_best=-1", "checkpoint.keep_best"),
])
def test_validation_settings_are_checked(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(["+recipe=tiny_mopd", *override.split()])
    assert key in {v.key for v in err.value.violations}, err.value


def test_keep_best_needs_a_metric_validation_emits_and_mid_run_validation_needs_lock_step():
    base = ["+recipe=tiny_mopd", "checkpoint.keep_best=1", "data.validation.every_steps=5", "data.validation.k=1"]
    load_config(base)  # val/accuracy_mean, the default
    load_config([*base, "data.validation.k=4", "checkpoint.best_metric=val/pass_at_k/add_agent"])
    load_config([*base, "checkpoint.best_metric=val/reverse_kl/mean", "checkpoint.best_mode=min"])
    for metric in ("val/pass_at_k_mean", "eval/accuracy_mean", "loss"):  # k=1: no pass@k
        with pytest.raises(ConfigError) as err:
            load_config([*base, f"checkpoint.best_metric={metric}"])
        assert [v.key for v in err.value.violations] == ["checkpoint.best_metric"]
    with pytest.raises(ConfigError) as err:
        load_config([*base, "checkpoint.keep_best=0", "algo.async_rollout.enabled=true"])  # every_steps=5
    assert "data.validation.every_steps" in {v.key for v in err.value.violations}
    load_config(["+recipe=tiny_mopd", "data.validation.split=0", "data.eval_prompts_per_task=0"])  # off: no held-out set needed
