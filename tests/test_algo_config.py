"""The NeMo RL algorithm options' keys: each refused where the runtime cannot honour it
(naming the key, why and the fix), and the reference model placed as a teacher group
(its own, or a teacher's with the same checkpoint)."""

import subprocess
import sys

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.resources import REFERENCE, role_sections, teacher_groups

GRPO = ["+recipe=tiny_grpo", "launcher=dry_run"]
MOPD = ["+recipe=tiny_mopd", "launcher=dry_run"]
AGENTIC = ["+recipe=tiny_agentic_grpo", "launcher=dry_run"]

REFUSED = [
    (GRPO + ["algo.loss.ratio_level=sequence"], "algo.loss.aggregation", "seq-mean-token-mean"),
    (GRPO + ["algo.loss.ratio_level=sequence", "algo.loss.aggregation=seq-mean-token-mean"], "algo.mismatch.kind",
     "per sequence"),
    (GRPO + ["algo.loss.ratio_level=sequence", "algo.loss.kind=reinforce"], "algo.loss.ratio_level", "kind=ppo"),
    (GRPO + ["algo.loss.aggregation=mean"], "algo.loss.aggregation", "token-mean"),
    (GRPO + ["algo.ref_kl_coef=0.1", "algo.ref_kl.estimator=k4"], "algo.ref_kl.estimator", "k3"),
    (GRPO + ["algo.ref_kl_coef=0.1", "algo.ref_kl.output_clamp=0"], "algo.ref_kl.output_clamp", "> 0"),
    (MOPD + ["algo.ref_kl_coef=0.1", "algo.ref_kl.apply_to=reward"], "algo.ref_kl.apply_to", "apply_to=loss"),
    (GRPO + ["reference.checkpoint=tiny:student"], "reference.checkpoint", "algo.ref_kl_coef is 0"),
    (MOPD + ["+teachers.reference.checkpoint=tiny:teacher_add"], "teachers", "another alias"),
    (MOPD + ["algo.grpo.adv_clip_low=-1"], "algo.grpo.adv_clip_low", "algo.opd.adv_clip"),
    (GRPO + ["algo.grpo.adv_clip_low=2", "algo.grpo.adv_clip_high=1"], "algo.grpo.adv_clip_low", "below"),
    (GRPO + ["algo.overlong_shaping.enabled=true"], "algo.overlong_shaping.buffer_tokens", "[1, 6]"),
    (GRPO + ["algo.overlong_shaping.enabled=true", "algo.overlong_shaping.buffer_tokens=2",
             "algo.overlong_shaping.penalty=-1"], "algo.overlong_shaping.penalty", "rewards length"),
    (MOPD + ["algo.overlong_shaping.enabled=true", "algo.overlong_shaping.buffer_tokens=2"],
     "algo.overlong_shaping.enabled", "advantages do not use them"),
    (AGENTIC + ["algo.overlong_shaping.enabled=true", "algo.overlong_shaping.buffer_tokens=2"],
     "algo.overlong_shaping.enabled", "several turns"),
]


@pytest.mark.parametrize("overrides,key,fragment", REFUSED, ids=[" ".join(o[2:]) for o, _, _ in REFUSED])
def test_an_option_the_runtime_cannot_honour_is_refused_naming_key_and_fix(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    found = [v for v in info.value.violations if v.key == key and fragment in f"{v.problem} {v.fix}"]
    assert found, "\n".join(v.render() for v in info.value.violations)
    assert all(v.fix for v in found)


def test_the_options_each_recipe_shows_load():
    cfg = load_config(GRPO + ["algo.ref_kl_coef=0.01", "algo.loss.ratio_level=sequence", "algo.mismatch.kind=none",
                              "algo.loss.aggregation=seq-mean-token-mean", "algo.loss.overlong_filtering=true",
                              "algo.overlong_shaping.enabled=true", "algo.overlong_shaping.buffer_tokens=2",
                              "algo.grpo.adv_clip_low=-3", "algo.grpo.adv_clip_high=3"])
    assert cfg.algo.loss.ratio_level == "sequence" and cfg.algo.overlong_shaping.buffer_tokens == 2


def test_the_reference_is_its_own_group_or_shares_a_teachers():
    cfg = load_config(GRPO + ["algo.ref_kl_coef=0.01"])
    groups = teacher_groups(cfg)
    assert [(g.name, g.aliases, g.key) for g in groups] == [(REFERENCE, [REFERENCE], "reference")]
    assert ("teacher/reference", "reference") in [r[:2] for r in role_sections(cfg)]
    # a teacher with the student's checkpoint serves the reference too: one rank group, no extra role
    same = MOPD + ["teachers.add.checkpoint=tiny:student"]
    cfg = load_config(same + ["algo.ref_kl_coef=0.01"])
    assert [(g.name, g.aliases) for g in teacher_groups(cfg)] == [("add", ["add", REFERENCE]), ("mul", ["mul"])]
    assert [r[0] for r in role_sections(cfg)] == [r[0] for r in role_sections(load_config(same))]
    # its resources must agree with the teacher's it shares (the fix names the key)
    with pytest.raises(ConfigError) as info:
        load_config(same + ["algo.ref_kl_coef=0.01", "reference.nodes=2"])
    assert any(v.key == "reference.nodes" and "shares checkpoint" in v.problem for v in info.value.violations)
    # no coefficient, no reference role
    assert not any(g.serves_reference for g in teacher_groups(load_config(GRPO)))


def test_the_dry_run_shows_the_reference_role_and_what_it_scores(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpc_rl.launch", *GRPO, "algo.ref_kl_coef=0.01", f"run.dir={tmp_path / 'r'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "teacher/reference" in proc.stdout
    assert "every training sample (algo.ref_kl_coef=0.01, k3 in the loss)" in proc.stdout
