"""Teacher routing: agent -> alias -> the rank group that scores the sample."""

from __future__ import annotations

import pytest

from hpc_rl.algo.routing import RoutingError, TeacherRouter

AGENTS = {
    "general": ["chat_agent"],
    "code": ["swe_*", "swe_pivot_django"],
    "swe_pivot": ["swe_pivot_*"],
}
CKPTS = {"general": "/ckpt/general", "code": "/ckpt/code", "swe_pivot": "/ckpt/swe"}


def test_exact_beats_prefix_and_longest_prefix_wins():
    r = TeacherRouter(AGENTS, default="general", checkpoints=CKPTS)
    assert r.route("swe_pivot_django") == "code"  # exact, although swe_pivot_* is longer
    assert r.route("swe_pivot_flask") == "swe_pivot"  # swe_pivot_* is longer than swe_*
    assert r.route("swe_bench") == "code"
    assert r.route("chat_agent") == "general"
    assert r.route("swe") == "general"  # 'swe_*' needs the underscore: falls to the default


def test_unlisted_agents_use_the_default():
    r = TeacherRouter(AGENTS, default="swe_pivot", checkpoints=CKPTS)
    assert r.route("brand_new_agent") == "swe_pivot"


def test_strict_error_names_agent_and_aliases():
    r = TeacherRouter(AGENTS, default="general", strict=True, checkpoints=CKPTS)
    assert r.route("chat_agent") == "general"
    with pytest.raises(RoutingError) as err:
        r.route("mystery_agent")
    msg = str(err.value)
    assert "'mystery_agent'" in msg and "routing.strict" in msg
    assert "known aliases: ['general', 'code', 'swe_pivot']" in msg
    assert "code: ['swe_*', 'swe_pivot_django']" in msg


def test_no_default_and_not_strict_is_an_error_too():
    with pytest.raises(RoutingError, match="'x' matches no routing entry and routing.default is unset"):
        TeacherRouter({"a": ["y"]}, checkpoints={"a": "/a"}).route("x")


def test_aliases_sharing_a_checkpoint_share_one_group():
    ckpts = {"math": "/ckpt/big", "chat": "/ckpt/chat", "code": "/ckpt/big"}
    r = TeacherRouter({"math": ["add_agent", "mul_*"], "chat": ["chat_agent"], "code": ["code_*"]},
                      default="chat", checkpoints=ckpts)
    assert r.groups == ["math", "chat"]
    assert r.group_of("code") == "math" and r.group_of("math") == "math" and r.group_of("chat") == "chat"
    aliases, groups = r.route_batch(["add_agent", "code_gen", "chat_agent", "mul_agent", "other"])
    assert aliases == ["math", "code", "chat", "math", "chat"]
    assert groups == [0, 0, 1, 0, 1]
    # Each sample lands in exactly one group's list.
    assert r.split_by_group(["add_agent", "code_gen", "chat_agent", "other"]) == {"math": [0, 1], "chat": [2, 3]}
    with pytest.raises(RoutingError, match="'nope' is not a teacher alias"):
        r.group_of("nope")


def test_bad_tables_are_rejected():
    with pytest.raises(RoutingError, match="'a' is listed under both 'x' and 'y'"):
        TeacherRouter({"x": ["a"], "y": ["a"]}, checkpoints={"x": "1", "y": "2"})
    with pytest.raises(RoutingError, match="only a trailing"):
        TeacherRouter({"x": ["swe_*_django"]}, checkpoints={"x": "1"})
    with pytest.raises(RoutingError, match=r"aliases \['ghost'\] that are not defined teachers"):
        TeacherRouter({"x": ["a"]}, default="ghost", checkpoints={"x": "1"})


def test_ultra_mopd_recipe_routing():
    from hpc_rl.config import load_config
    from hpc_rl.config.resources import teacher_groups

    cfg = load_config(["+recipe=ultra_mopd"])
    r = TeacherRouter.from_config(cfg)
    assert r.route("swe_pivot_django") == "swe"
    assert r.route("droid_pivot_1") == "swe"
    assert r.route("genrm_simple_agent") == "rlhf"
    assert r.route("mcqa_simple_agent") == "reasoning"
    assert r.route("abstention_simple_agent") == "ifbench"
    assert r.route("some_new_agent") == "general"
    assert r.groups == [g.name for g in teacher_groups(cfg)] == ["general", "rlhf", "ifbench", "reasoning", "swe"]
    assert r.route_batch(["swe_pivot_django", "genrm_simple_agent", "some_new_agent"]) == (
        ["swe", "rlhf", "general"], [4, 1, 0])
