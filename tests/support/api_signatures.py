"""Owns: reading the function signatures written in Markdown code blocks
(docs/api.md, the contract's copy in tests/layout/test_api_signatures.py) and
comparing them with the package's real ones.

A signature is written as a call at the start of a line of a ``python`` code
block — ``name(params) -> result  # comment`` — possibly over several lines;
it is parsed as the ``def`` it would be, so parameter kinds (``/``, ``*``,
``*args``, ``**kwargs``) and defaults read exactly as Python reads them. The
name may be dotted (``comm_hooks.bf16_compress_hook``,
``ShardingPlan.plot``): it is looked up from ``composable_shard``, importing
subpackages as needed; a method read from its class loses ``self``.
Annotations and return types are not compared.

Knows nothing of: which document or test uses it.
"""

from __future__ import annotations

import ast
import datetime
import importlib
import inspect
import io
import re
import tokenize
import types
from dataclasses import dataclass
from typing import Any

import torch

import composable_shard

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
_START = re.compile(r"^([A-Za-z_][\w.]*)\(")

# The kinds of inspect.Parameter, by the names ast gives them.
POSITIONAL_ONLY = inspect.Parameter.POSITIONAL_ONLY
POSITIONAL_OR_KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD
VAR_POSITIONAL = inspect.Parameter.VAR_POSITIONAL
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD

_NO_DEFAULT = inspect.Parameter.empty


@dataclass(frozen=True)
class Param:
    """One parameter as a signature states it: its name, kind and default
    (``inspect.Parameter.empty`` when it has none)."""

    name: str
    kind: inspect._ParameterKind
    default: Any = _NO_DEFAULT

    def same_as(self, other: Param) -> bool:
        """Same name, kind and default; defaults equal with the same type
        (``2`` is not ``2.0``), ``None`` and enum members by identity."""
        if (self.name, self.kind) != (other.name, other.kind):
            return False
        if self.default is _NO_DEFAULT or other.default is _NO_DEFAULT:
            return self.default is other.default
        if type(self.default) is not type(other.default):
            return False
        try:
            return bool(self.default == other.default)
        except Exception:  # noqa: BLE001 - a default without a usable ==: compare identity
            return self.default is other.default

    def __str__(self) -> str:
        prefix = {VAR_POSITIONAL: "*", VAR_KEYWORD: "**"}.get(self.kind, "")
        default = "" if self.default is _NO_DEFAULT else f"={self.default!r}"
        return f"{prefix}{self.name}{default} ({self.kind.description})"


@dataclass(frozen=True)
class Signature:
    """A signature read from a document: the (possibly dotted) name and its
    parameters in order."""

    name: str
    params: tuple[Param, ...]


def code_blocks(markdown: str, language: str = "python") -> list[str]:
    """The bodies of the fenced code blocks whose info string is exactly
    ``language``."""
    return [body for info, body in _FENCE.findall(markdown) if info.strip() == language]


def strip_comments(source: str) -> str:
    """``source`` without its ``#`` comments (a ``#`` inside a string stays)."""
    lines = source.splitlines()
    cuts: dict[int, int] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source + "\n").readline):
            if token.type == tokenize.COMMENT:
                cuts[token.start[0] - 1] = token.start[1]
    except (tokenize.TokenError, IndentationError):
        pass  # unbalanced text: leave it as it is, the parse below says what is wrong
    return "\n".join(line[: cuts[i]] if i in cuts else line for i, line in enumerate(lines)).strip()


def _depth(text: str) -> int:
    """How many brackets ``text`` leaves open (strings are not looked into:
    signatures do not need brackets in string defaults)."""
    return sum(text.count(c) for c in "([{") - sum(text.count(c) for c in ")]}")


def signature_entries(block: str) -> list[str]:
    """Split a code block into its signatures, comments removed: a line that
    starts at column 0 with ``name(`` begins one; indented lines, and any line
    while brackets are open, continue it. Raises ``ValueError`` for any other
    line (an example belongs in a code block of another language)."""
    entries: list[list[str]] = []
    depth = 0
    for line in block.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if depth > 0 or line[0].isspace():
            if not entries:
                raise ValueError(f"an indented line before any signature: {line!r}")
            entries[-1].append(line)
        elif _START.match(line):
            entries.append([line])
            depth = 0
        else:
            raise ValueError(
                f"{line!r} is not a signature: a `python` block of the document holds only signatures "
                "(`name(params)`); put examples in a `py` block"
            )
        depth += _depth(strip_comments(line))
    return [strip_comments("\n".join(entry)) for entry in entries]


def parse_signature(entry: str, namespace: dict[str, Any] | None = None) -> Signature:
    """One signature entry, read as the ``def`` it would be; defaults are
    evaluated in ``namespace`` (by default ``default_namespace()``). Raises ``ValueError`` naming the entry if it does not
    parse."""
    match = _START.match(entry)
    if match is None:
        raise ValueError(f"not a signature: {entry!r}")
    dotted = match.group(1)
    source = f"def _{entry[len(dotted):]}:\n    pass\n"
    try:
        function = ast.parse(source).body[0]
    except SyntaxError as exc:
        raise ValueError(f"{dotted}: the signature does not parse as a def ({exc.msg}): {entry!r}") from exc
    if not isinstance(function, ast.FunctionDef):
        raise ValueError(f"{dotted}: not a signature: {entry!r}")
    scope = default_namespace() if namespace is None else namespace

    def value(node: ast.expr | None) -> Any:
        if node is None:
            return _NO_DEFAULT
        try:
            return eval(compile(ast.Expression(node), dotted, "eval"), dict(scope))  # noqa: S307 - our own doc
        except Exception as exc:  # noqa: BLE001 - say which default
            raise ValueError(f"{dotted}: cannot evaluate the default {ast.unparse(node)!r} ({exc})") from exc

    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(arguments.defaults))
    defaults += list(arguments.defaults)
    params: list[Param] = []
    for index, (argument, default) in enumerate(zip(positional, defaults)):
        kind = POSITIONAL_ONLY if index < len(arguments.posonlyargs) else POSITIONAL_OR_KEYWORD
        params.append(Param(argument.arg, kind, value(default)))
    if arguments.vararg is not None:
        params.append(Param(arguments.vararg.arg, VAR_POSITIONAL))
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        params.append(Param(argument.arg, KEYWORD_ONLY, value(default)))
    if arguments.kwarg is not None:
        params.append(Param(arguments.kwarg.arg, VAR_KEYWORD))
    return Signature(dotted, tuple(params))


def default_namespace() -> dict[str, Any]:
    """What a default written in a signature may name: the package's
    top-level names, ``torch``, ``nn`` and ``timedelta``."""
    names = {name: getattr(composable_shard, name) for name in composable_shard.__all__}
    return {**names, "torch": torch, "nn": torch.nn, "timedelta": datetime.timedelta}


def resolve(dotted: str) -> tuple[Any, bool]:
    """The object ``composable_shard.<dotted>`` names, importing subpackages
    on the way, and whether it is a function read from its class (whose
    first parameter, ``self``, a signature does not write). Raises
    ``LookupError`` naming what is missing."""
    current: Any = composable_shard
    path = composable_shard.__name__
    method = False
    for part in dotted.split("."):
        path = f"{path}.{part}"
        if hasattr(current, part):
            method = inspect.isclass(current) and isinstance(inspect.getattr_static(current, part), types.FunctionType)
            current = getattr(current, part)
        elif isinstance(current, types.ModuleType):
            try:
                current = importlib.import_module(path)
            except ImportError as exc:
                raise LookupError(f"{path} does not exist ({exc})") from exc
            method = False
        else:
            raise LookupError(f"{path} does not exist")
    return current, method


def actual_params(obj: Any, *, drop_first: bool = False) -> tuple[Param, ...]:
    """The parameters of a callable as ``inspect.signature`` gives them."""
    params = [
        Param(parameter.name, parameter.kind, parameter.default)
        for parameter in inspect.signature(obj).parameters.values()
    ]
    return tuple(params[1:] if drop_first else params)


def describe(params: tuple[Param, ...] | list[Param]) -> str:
    return "(" + ", ".join(str(param) for param in params) + ")"
