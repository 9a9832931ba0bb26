"""The refusals accumopt's code can raise, read from its source, and the entries of the error
reference (``docs/errors.md``) that cover them. Used by ``tests/test_docs.py``.

A *message template* is the text of a message with every part the code fills in at run time
(an f-string field, a variable) replaced by :data:`FILLED`. Templates come from two places:

- the first argument of every ``raise SomeError(...)`` in ``accumopt/`` (a relay such as
  ``raise RuntimeError(problem)`` or ``raise E(f"{problem} Nothing changed.")`` contributes
  nothing itself: the text of ``problem`` is written elsewhere, and found there);
- every other string in ``accumopt/`` that reads as a message: it starts with the name of the
  API that speaks (``Accumulate.step:``, ``MicroBatchRunner:``, ``{api}:``) and holds a whole
  sentence (the refusals built by helpers, ``warnings.warn`` texts). Log lines and docstrings
  are not messages.

Module-level string constants and a function's local string variables are filled in where a
template uses them (``{_LOAD}``, ``{why}``: one template per text the variable can hold).

An error-reference entry is a ``###`` section of ``docs/errors.md`` whose ``**Message:**``
paragraph holds one or more code spans, each the beginning of a message, ``<name>`` standing for
a part the code fills in. An entry covers a template when one of its spans matches the
template's beginning."""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "accumopt"
ERRORS_PAGE = ROOT / "docs" / "errors.md"

FILLED = "\x00"
"""Stands in a template for a part filled in at run time (no message holds this character)."""

_SPEAKER = re.compile(
    r"^(?:\x00|[A-Za-z_][\w.]*(?: \((?:[^()]|\x00)*\))?): "  # `Accumulate.step: `, `{api}: `
)
_ENVELOPE = re.compile(r"^\x00(?:$| [A-Z(])")
"""A relay: ``raise E(f"{problem} Nothing changed.")`` (``problem``'s text is found elsewhere)."""
_SENTENCE = re.compile(r"[.;?]( |$)")
_LOGGING = {"debug", "info", "warning", "error", "exception", "critical", "log"}
_MAX_ALTERNATIVES = 16


@dataclass
class Template:
    text: str
    where: list[str] = field(default_factory=list)

    def shown(self) -> str:
        return self.text.replace(FILLED, "<...>")


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


class _Module:
    """Renders the string expressions of one module into templates."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text())
        self.constants: dict[str, list[str]] = {}
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and _stringish(node.value):
                    self.constants[target.id] = self.render(node.value, {})

    def render(self, node: ast.expr, local: dict[str, list[str]]) -> list[str]:
        """Every text ``node`` can evaluate to, filled-in parts as :data:`FILLED`."""
        if isinstance(node, ast.Constant):
            return [node.value] if isinstance(node.value, str) else [FILLED]
        if isinstance(node, ast.JoinedStr):
            parts: list[list[str]] = []
            for value in node.values:
                if isinstance(value, ast.FormattedValue) and value.format_spec is None:
                    parts.append(self.render(value.value, local))
                elif isinstance(value, ast.FormattedValue):
                    parts.append([FILLED])
                else:
                    parts.append(self.render(value, local))
            return _product(parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return _product([self.render(node.left, local), self.render(node.right, local)])
        if isinstance(node, ast.IfExp):
            return self.render(node.body, local) + self.render(node.orelse, local)
        if isinstance(node, ast.Name):
            return local.get(node.id) or self.constants.get(node.id) or [FILLED]
        if (  # CONSTANT.format(name=...): its {fields} are filled in
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"
        ):
            return [
                re.sub(r"\{[^{}]*\}", FILLED, text) for text in self.render(node.func.value, local)
            ]
        return [FILLED]

    def locals_of(self, function: ast.AST) -> dict[str, list[str]]:
        """The string variables assigned in ``function`` (each with all the texts it takes)."""
        found: dict[str, list[str]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.NamedExpr):
                target, value = node.target, node.value
            else:
                continue
            if isinstance(target, ast.Name) and _stringish(value):
                texts = self.render(value, {**found})
                found[target.id] = [*found.get(target.id, []), *texts]
        return found

    def templates(self) -> Iterator[tuple[str, int]]:
        """(template, line) for every message of the module."""
        scopes: list[ast.AST] = [self.tree]
        scopes += [n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef)]
        for scope in scopes:
            local = {} if scope is self.tree else self.locals_of(scope)
            for node in _own_nodes(scope):
                exc = node.exc if isinstance(node, ast.Raise) else None
                if isinstance(exc, ast.Call) and exc.args:
                    for text in self.render(exc.args[0], local):
                        if not _ENVELOPE.match(text):
                            yield text, node.lineno
                for string in _maximal_strings(node):
                    for text in self.render(string, local):
                        if _reads_as_message(text):
                            yield text, string.lineno


def _stringish(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _stringish(node.left) or _stringish(node.right)
    if isinstance(node, ast.IfExp):
        return _stringish(node.body) and _stringish(node.orelse)
    return False


def _product(parts: list[list[str]]) -> list[str]:
    texts = ["".join(p) for p in itertools.islice(itertools.product(*parts), _MAX_ALTERNATIVES)]
    return [re.sub(FILLED + "+", FILLED, t) for t in texts]


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The statements of ``scope``, not those of the functions defined inside it."""
    body = list(ast.iter_child_nodes(scope))
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.stmt):
            yield node
        body.extend(ast.iter_child_nodes(node))


def _maximal_strings(statement: ast.AST) -> Iterator[ast.expr]:
    """The string expressions of one statement (not its docstring, nor a log call's format)."""
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return  # a docstring
    todo = [
        n
        for n in ast.iter_child_nodes(statement)
        if not isinstance(n, (ast.stmt, ast.excepthandler))
    ]
    while todo:
        node = todo.pop()
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and func.attr in _LOGGING:
            continue
        if isinstance(node, ast.expr) and _stringish(node):
            yield node
            continue
        todo.extend(ast.iter_child_nodes(node))


def _reads_as_message(text: str) -> bool:
    """A string that names the API speaking and holds a whole sentence: a message."""
    if not (speaker := _SPEAKER.match(text)):
        return False
    rest = text[speaker.end() :]
    return len(rest.replace(FILLED, "")) >= 20 and bool(_SENTENCE.search(rest))


def code_templates(package: Path = PACKAGE) -> list[Template]:
    """Every message template of the package, once each, with where it is written."""
    found: dict[str, Template] = {}
    for path in sorted(package.rglob("*.py")):
        module = _Module(path)
        for text, line in module.templates():
            key = _norm(text)
            where = f"{path.relative_to(package.parent)}:{line}"
            template = found.setdefault(key, Template(key))
            if where not in template.where:
                template.where.append(where)
    return list(found.values())


@dataclass
class Entry:
    title: str
    messages: list[str]
    has_cause: bool
    has_fix: bool


_PLACEHOLDER = re.compile(r"<[^<>\s][^<>]*>")
_FILL = r"(?:(?!\. ).){0,60}?"
"""What a placeholder matches: a filled-in part, or a few words of one sentence."""


def entries(page: str) -> list[Entry]:
    """The entries of the error reference: its ``###`` sections with a **Message:** line."""
    found = []
    for section in re.split(r"^### ", page, flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        message = re.search(r"^\*\*Messages?:\*\*(.*?)(?:\n\n|\Z)", body, flags=re.M | re.S)
        spans = re.findall(r"`([^`]+)`", message.group(1)) if message else []
        found.append(
            Entry(
                title=title.strip(),
                messages=[_norm(s) for s in spans],
                has_cause=bool(re.search(r"^\*\*Cause:\*\*", body, flags=re.M)),
                has_fix=bool(re.search(r"^\*\*Fix:\*\*", body, flags=re.M)),
            )
        )
    return found


def pattern(message: str) -> re.Pattern[str]:
    """The regex of one documented message beginning: ``<name>`` matches any filled-in text."""
    pieces = _PLACEHOLDER.split(message)
    return re.compile(_FILL.join(re.escape(p) for p in pieces))


def literal_length(message: str) -> int:
    """How much of a documented message is the code's own words (not placeholders)."""
    return len(_PLACEHOLDER.sub("", message).strip())


def covers(message: str, template: Template) -> bool:
    return pattern(message).match(template.text) is not None
