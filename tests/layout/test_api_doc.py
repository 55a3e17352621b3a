"""docs/api.md, the repository's copy of the public contract, agrees with
the package:

- every name in ``composable_shard.__all__`` is listed in the page's
  "Top-level names" table, and every name that table lists exists at the top
  level (and is in ``__all__``);
- every signature written in a ``python`` code block of the page names
  something that exists (an undotted name at the top level, a dotted one
  from ``composable_shard``: ``checkpoint.verify_checkpoint``,
  ``ShardingPlan.plot``), and ``inspect.signature`` of it has the same
  parameters: names, order, kinds (positional-only, positional-or-keyword,
  ``*args``, keyword-only, ``**kwargs``) and defaults (equal, of the same
  type). Annotations and return types are for the reader and not compared;
- every top-level function has a signature on the page.

``python`` blocks hold only signatures (examples go in ``py`` blocks); the
parsing is tests/support/api_signatures.py. A failure names the function (or
name) that drifted and what each side says."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import composable_shard
from tests.support.api_signatures import (
    Signature,
    actual_params,
    code_blocks,
    describe,
    parse_signature,
    resolve,
    signature_entries,
)

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
INDEX = "## Top-level names"
_ROW = re.compile(r"^\|([^|]*)\|")
_CODE = re.compile(r"`([^`]+)`")


def listed_top_level_names(markdown: str) -> list[str]:
    """The names in the first column of the table under "Top-level names"
    (each in backticks, several per cell allowed)."""
    assert INDEX in markdown, f"{API_DOC.name} has no section {INDEX!r}"
    section = markdown.split(INDEX, 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        row = _ROW.match(line)
        if row is None or set(row.group(1).strip()) <= {"-", ":"} or row.group(1).strip() == "name":
            continue
        names += _CODE.findall(row.group(1))
    return names


def documented_signatures(markdown: str) -> list[Signature]:
    return [parse_signature(entry) for block in code_blocks(markdown) for entry in signature_entries(block)]


def signature_drift(signature: Signature) -> str | None:
    """What differs between a documented signature and the real one, naming
    the function; ``None`` when they agree."""
    try:
        obj, is_method = resolve(signature.name)
    except LookupError as exc:
        return f"{signature.name}: documented in {API_DOC.name} but {exc}"
    actual = actual_params(obj, drop_first=is_method)
    documented = signature.params
    if len(actual) == len(documented) and all(a.same_as(d) for a, d in zip(actual, documented)):
        return None
    position = next(
        (i for i, (a, d) in enumerate(zip(actual, documented)) if not a.same_as(d)), min(len(actual), len(documented))
    )
    documented_one = str(documented[position]) if position < len(documented) else "nothing"
    actual_one = str(actual[position]) if position < len(actual) else "nothing"
    return (
        f"{signature.name}: parameter {position + 1} is {documented_one} in {API_DOC.name}, "
        f"{actual_one} in the code (documented {describe(documented)}, real {describe(actual)}); "
        "fix whichever is wrong"
    )


def test_every_exported_name_is_listed_in_the_api_doc() -> None:
    listed = set(listed_top_level_names(API_DOC.read_text()))
    missing = [name for name in composable_shard.__all__ if name not in listed]
    assert not missing, f"composable_shard.__all__ names {missing}, not in the {INDEX!r} table of {API_DOC}"


def test_every_listed_name_exists_at_the_top_level() -> None:
    listed = listed_top_level_names(API_DOC.read_text())
    assert listed, f"the {INDEX!r} table of {API_DOC} lists no name"
    absent = [name for name in listed if not hasattr(composable_shard, name) or name not in composable_shard.__all__]
    assert not absent, f"{API_DOC} lists {absent} as top-level names, but composable_shard does not export them"


def test_every_documented_signature_matches_the_code() -> None:
    signatures = documented_signatures(API_DOC.read_text())
    assert signatures, f"{API_DOC} has no signature in a python code block"
    undotted_absent = [s.name for s in signatures if "." not in s.name and s.name not in composable_shard.__all__]
    assert not undotted_absent, f"{API_DOC} documents {undotted_absent} as top-level, but they are not exported"
    drifts = [drift for signature in signatures if (drift := signature_drift(signature)) is not None]
    assert not drifts, "signatures in docs/api.md drifted from the code:\n" + "\n".join(drifts)


def test_every_top_level_function_has_a_documented_signature() -> None:
    documented = {signature.name for signature in documented_signatures(API_DOC.read_text())}
    functions = [name for name in composable_shard.__all__ if inspect.isfunction(getattr(composable_shard, name))]
    missing = [name for name in functions if name not in documented]
    assert not missing, f"top-level functions without a signature in a python block of {API_DOC}: {missing}"


# ----------------------------------------------------------------- the checker


def _sig(text: str) -> Signature:
    return parse_signature(signature_entries(text)[0])


def test_drift_is_named_for_a_renamed_reordered_rekinded_or_redefaulted_parameter() -> None:
    real = "clip_grad_norm_(module, max_norm, norm_type=2.0)"
    assert signature_drift(_sig(real)) is None
    for wrong in (
        "clip_grad_norm_(model, max_norm, norm_type=2.0)",  # renamed
        "clip_grad_norm_(max_norm, module, norm_type=2.0)",  # reordered
        "clip_grad_norm_(module, max_norm, *, norm_type=2.0)",  # keyword-only
        "clip_grad_norm_(module, max_norm, norm_type=2)",  # int, not float
        "clip_grad_norm_(module, max_norm, norm_type=1.0)",  # another value
        "clip_grad_norm_(module, max_norm)",  # a parameter left out
        "clip_grad_norm_(module, max_norm, norm_type=2.0, error_if_nonfinite=False)",  # one too many
    ):
        drift = signature_drift(_sig(wrong))
        assert drift is not None and drift.startswith("clip_grad_norm_: "), (wrong, drift)


def test_dotted_names_methods_enums_and_var_keywords_are_read() -> None:
    assert signature_drift(_sig("plan(module, *, world_size, policy=None, strategy=ShardingStrategy.FULL_SHARD,\n"
                                "     mixed_precision=None, cpu_offload=None, ignored_states=None,\n"
                                "     optimizer='adamw', memory_budget=None, **more) -> ShardingPlan")) is None
    assert signature_drift(_sig("plan(module, *, world_size, policy=None, strategy=ShardingStrategy.NO_SHARD,\n"
                                "     mixed_precision=None, cpu_offload=None, ignored_states=None,\n"
                                "     optimizer='adamw', **more)")) is not None
    assert signature_drift(_sig("ShardingPlan.plot(path, *, measured=None, title=None)")) is None
    assert signature_drift(_sig("comm_hooks.bf16_compress_hook(state, grad, output=None)")) is None
    gone = signature_drift(_sig("checkpoint.no_such_function(path)"))
    assert gone is not None and gone.startswith("checkpoint.no_such_function: ") and "does not exist" in gone


def test_examples_in_a_python_block_and_unparsable_signatures_are_refused() -> None:
    with pytest.raises(ValueError, match="put examples in a `py` block"):
        signature_entries("model = fully_shard(model)\n")
    with pytest.raises(ValueError, match="does not parse as a def"):
        _sig("fully_shard(module, *)")
    markdown = "## Top-level names\n\n| name | what |\n|---|---|\n| `a`, `b` | x |\n\n## Next\n| `c` | y |\n"
    assert listed_top_level_names(markdown) == ["a", "b"]
