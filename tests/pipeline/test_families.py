"""pipeline.families: one table of the model families, which the source loader, the lean forward, the draft builders,
the messages, the tests' tiny models and docs/families.md all follow."""
from __future__ import annotations

import re
from pathlib import Path

from pipeline.families import FAMILIES, FAMILY_NAMES, architecture_problem, supported_families
from tests.families import FAMILIES as TINY_FAMILIES
from tests.families import tiny_family

PAGE = Path(__file__).resolve().parents[2] / "docs" / "families.md"


def families_table(page: str) -> list[list[str]]:
    """The cells of the rows of the page's "Which families" table."""
    section = page.split("## Which families", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and its rule
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_docs_families_table_lists_exactly_the_tables_families():
    rows = families_table(PAGE.read_text())
    assert [row[:2] for row in rows] == [[f"{family.name} (`{family.model_type}`)", family.checkpoints]
                                         for family in FAMILIES.values()]


def test_the_messages_name_every_family_of_the_table():
    assert FAMILY_NAMES == "Llama, Qwen2/2.5, Qwen3, Mistral, Gemma 2, Gemma 3 or Phi-3"
    assert all(re.search(rf"\b{re.escape(family.name)} \({family.model_type}\b", supported_families())
               for family in FAMILIES.values())


def test_every_family_has_a_tiny_model_in_the_tests():
    assert {tiny_family(family).config.model_type for family in TINY_FAMILIES} == set(FAMILIES)


def test_a_checkpoint_of_another_architecture_is_refused_saying_which_families_are_supported():
    assert all(architecture_problem({"model_type": model_type}) is None for model_type in FAMILIES)
    assert architecture_problem({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}) == (
        "architecture GPTNeoXForCausalLM (model_type 'gpt_neox') is not supported: draftops distills and decodes "
        "Llama (llama: Llama 2/3, SmolLM2), Qwen2/2.5 (qwen2), Qwen3 (qwen3), Mistral (mistral), Gemma 2 (gemma2), "
        "Gemma 3 (gemma3_text: text-only), Phi-3 (phi3)")
    custom = architecture_problem({"model_type": "tiny_custom", "auto_map": {"AutoModelForCausalLM": "m.Tiny"}})
    assert custom.startswith("its config asks for custom code (auto_map, model_type 'tiny_custom')")
    assert architecture_problem({"model_type": "phi3", "auto_map": {"AutoModelForCausalLM": "m.Phi3"}}) is None
