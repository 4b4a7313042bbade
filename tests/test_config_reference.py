"""The config reference (docs/reference/config.md) is generated from the schema and the rules
that check it (hpc_rl/config/reference.py); these tests fail when it is stale."""

from __future__ import annotations

import difflib

from hpc_rl.config.keys import leaf_keys
from hpc_rl.config.reference import PAGE, REGENERATE, field_docs, generate, schema_keys
from hpc_rl.config.schema import RunConfig


def test_config_reference_page_is_current():
    page, _ = generate()
    assert PAGE.exists(), f"{PAGE} is missing: run `{REGENERATE}` (or `make docs` after it)"
    diff = list(difflib.unified_diff(PAGE.read_text().splitlines(), page.splitlines(), "committed", "generated", n=0, lineterm=""))
    assert not diff, (f"{PAGE.relative_to(PAGE.parents[2])} is stale: the schema's fields or comments, or a rule's "
                      f"text, changed since it was written. Regenerate it with `{REGENERATE}` and commit it.\n"
                      + "\n".join(diff[:20]))


def test_every_rule_names_a_schema_key():
    _, lost = generate()
    assert not lost, "rules whose key names nothing in the schema: " + "; ".join(f"{c.where}: {c.pattern}" for c in lost)


def test_every_schema_key_has_an_entry():
    page, _ = generate()
    for key in leaf_keys(RunConfig):
        assert f"### `{key.replace('*', '<alias>')}`" in page, key


def test_comments_above_and_beside_a_field_are_its_meaning():
    src = '''
from typing import Literal
Kind = Literal["a", "b"]

class Section:
    """What the section is."""

    # Spread over
    # two lines,
    plain: int = 1  # and trailing.
    kind: Kind = "a"

    bare: str = ""  # only trailing
'''
    docs, fields = field_docs(src)
    assert docs["Section"] == "What the section is."
    assert fields[("Section", "plain")] == ("int", "Spread over two lines, and trailing.")
    assert fields[("Section", "kind")] == ("Literal['a', 'b']", "")
    assert fields[("Section", "bare")] == ("str", "only trailing")


def test_refusals_and_checks_land_on_their_keys():
    keys = {k.path: k for k in schema_keys()}
    page, _ = generate()
    assert keys["refit.timeout_s"].type == "float" and keys["refit.timeout_s"].default == 120.0
    assert "peer that did not arrive" in keys["refit.timeout_s"].doc
    # a refusal of support.py, with its example, and validation's rule on the same key
    block = page.split("### `model.architecture`")[1].split("\n### ")[0]
    assert "**refused**" in block and "nemotron_h" in block
    ep = page.split("### `trainer.parallel.ep`")[1].split("\n### ")[0]
    assert "**checked**" in ep and "**refused**" in ep and "set trainer.parallel.ep to a divisor" in ep
