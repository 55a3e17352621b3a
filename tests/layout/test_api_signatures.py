"""The per-unit runtime controls exist at the top level with the signatures
the original contract lists (its "Per-unit runtime controls" section, kept
outside the repository as ``../shared/API.md``; the repository's own copy of
the contract is docs/api.md, checked exactly by test_api_doc.py): parameter
names, their order and kinds (positional / keyword-only) and defaults.
Annotations are not compared (the contract writes ``float`` where we also
take ``None``, ``list`` where we take any sequence). A parameter we add
beyond the contract's must be keyword-only with a default, so every call the
contract allows still works.

The section is copied below (a clean clone has no ``../shared/API.md``);
where that file exists, the copy must equal its code block, so the two
cannot drift apart unnoticed. Parsing: tests/support/api_signatures.py."""

from __future__ import annotations

import inspect
from pathlib import Path

import composable_shard
from tests.support.api_signatures import (
    KEYWORD_ONLY,
    actual_params,
    code_blocks,
    describe,
    parse_signature,
    signature_entries,
)

API_MD = Path(__file__).resolve().parents[2].parent / "shared" / "API.md"
SECTION = "## Per-unit runtime controls"

# The contract's code block of that section, as of issue 33.
CONTROLS = """
set_requires_gradient_sync(module, requires: bool, *, recurse=True)
set_requires_all_reduce(module, requires: bool, *, recurse=True)     # HYBRID: skip the replica all-reduce
set_is_last_backward(module, is_last: bool)
set_reshard_after_forward(module, reshard: bool, *, recurse=True)
set_reshard_after_backward(module, reshard: bool, *, recurse=True)
set_gradient_divide_factor(module, factor: float)
set_modules_to_forward_prefetch(module, modules: list[nn.Module])
set_modules_to_backward_prefetch(module, modules: list[nn.Module])
unshard(module, *, async_op: bool = False) -> UnshardHandle | None
reshard(module)
register_forward_method(module, method_name: str)
register_comm_hook(module, state, hook)     # reduction of the unit's flat gradient
set_all_reduce_hook(module, hook)           # HYBRID replica all-reduce
"""


def test_every_per_unit_control_has_the_contract_signature() -> None:
    for entry in signature_entries(CONTROLS):
        listed = parse_signature(entry)
        name = listed.name
        assert name in composable_shard.__all__, f"{name} is not exported by composable_shard"
        actual = actual_params(getattr(composable_shard, name))
        prefix = actual[: len(listed.params)]
        assert len(prefix) == len(listed.params) and all(
            a.same_as(b) for a, b in zip(prefix, listed.params)
        ), f"{name}: the contract lists {describe(listed.params)}, the code has {describe(actual)}"
        for extra in actual[len(listed.params) :]:
            assert extra.kind is KEYWORD_ONLY and extra.default is not inspect.Parameter.empty, (
                f"{name}: {extra.name} is not in the contract and not an optional keyword"
            )


def test_the_copied_section_equals_the_contract_where_it_is_present() -> None:
    # A clean clone has no ../shared/API.md: then only the copy is checked.
    if not API_MD.is_file():
        return
    text = API_MD.read_text()
    assert SECTION in text, f"{API_MD} has no section {SECTION!r}"
    blocks = code_blocks(text.split(SECTION, 1)[1])
    assert blocks, f"{API_MD}: no code block in {SECTION!r}"
    assert signature_entries(blocks[0]) == signature_entries(CONTROLS)
