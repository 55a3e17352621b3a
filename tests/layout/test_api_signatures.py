"""The per-unit runtime controls exist at the top level with the signatures
API.md's "Per-unit runtime controls" section lists: parameter names, their
order and kinds (positional / keyword-only) and defaults. Annotations are
not compared (API.md writes ``float`` where we also take ``None``, ``list``
where we take any sequence). A parameter we add beyond API.md's must be
keyword-only with a default, so every call API.md allows still works.

The section is copied below (a clean clone has no ``../shared/API.md``);
where that file exists, the copy must equal its code block, so the two
cannot drift apart unnoticed."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import composable_shard

API_MD = Path(__file__).resolve().parents[2].parent / "shared" / "API.md"
SECTION = "## Per-unit runtime controls"

# API.md's code block of that section, as of issue 33 (comments dropped).
CONTROLS = """
set_requires_gradient_sync(module, requires: bool, *, recurse=True)
set_requires_all_reduce(module, requires: bool, *, recurse=True)
set_is_last_backward(module, is_last: bool)
set_reshard_after_forward(module, reshard: bool, *, recurse=True)
set_reshard_after_backward(module, reshard: bool, *, recurse=True)
set_gradient_divide_factor(module, factor: float)
set_modules_to_forward_prefetch(module, modules: list[nn.Module])
set_modules_to_backward_prefetch(module, modules: list[nn.Module])
unshard(module, *, async_op: bool = False) -> UnshardHandle | None
reshard(module)
register_forward_method(module, method_name: str)
register_comm_hook(module, state, hook)
set_all_reduce_hook(module, hook)
"""

# (name, kind, has a default, default) per parameter.
Parameter = tuple[str, str, bool, object]


def _code_lines(block: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in block.splitlines())
    return [line for line in lines if line]


def _listed(line: str) -> tuple[str, list[Parameter]]:
    """A signature line of API.md, parsed as a ``def``."""
    function = ast.parse(f"def {line}: pass").body[0]
    assert isinstance(function, ast.FunctionDef), line
    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    parameters: list[Parameter] = []
    for argument, default in zip(positional, defaults):
        parameters.append(
            (argument.arg, "positional", default is not None, None if default is None else ast.literal_eval(default))
        )
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        parameters.append(
            (argument.arg, "keyword", default is not None, None if default is None else ast.literal_eval(default))
        )
    return function.name, parameters


def _actual(name: str) -> list[Parameter]:
    parameters: list[Parameter] = []
    for parameter in inspect.signature(getattr(composable_shard, name)).parameters.values():
        kind = "keyword" if parameter.kind is inspect.Parameter.KEYWORD_ONLY else "positional"
        assert parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD), (name, parameter)
        has_default = parameter.default is not inspect.Parameter.empty
        parameters.append((parameter.name, kind, has_default, parameter.default if has_default else None))
    return parameters


def test_every_per_unit_control_has_api_md_signature() -> None:
    for line in _code_lines(CONTROLS):
        name, listed = _listed(line)
        assert name in composable_shard.__all__, f"{name} is not exported by composable_shard"
        actual = _actual(name)
        assert actual[: len(listed)] == listed, f"{name}: API.md lists {listed}, the code has {actual}"
        for extra in actual[len(listed) :]:
            assert extra[1] == "keyword" and extra[2], f"{name}: {extra[0]} is not in API.md and not an optional keyword"


def test_the_copied_section_equals_api_md_where_it_is_present() -> None:
    # A clean clone has no ../shared/API.md: then only the copy is checked.
    if not API_MD.is_file():
        return
    text = API_MD.read_text()
    assert SECTION in text, f"{API_MD} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, f"{API_MD}: no code block in {SECTION!r}"
    assert _code_lines(block.group(1)) == _code_lines(CONTROLS)
