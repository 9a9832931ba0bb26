"""The house rules of the package layout, checked on the source: small modules, no import
circle, torch.distributed used by one core module only, and no framework in the core."""

from __future__ import annotations

import ast
from pathlib import Path

import accumopt

PACKAGE = Path(accumopt.__file__).parent
MODULES = {f"accumopt.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
INTEGRATIONS = {
    f"accumopt.integrations.{p.stem}": p
    for p in (PACKAGE / "integrations").glob("*.py")
    if p.stem != "__init__"
}
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def _imports(path: Path) -> set[str]:
    """Modules imported by ``path`` at module level or inside functions, except under
    ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_module_is_over_400_lines() -> None:
    every = {**MODULES, **INTEGRATIONS}
    sizes = {name: len(path.read_text().splitlines()) for name, path in every.items()}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_no_import_circle_between_accumopt_modules() -> None:
    graph = {name: {m for m in _imports(path) if m in MODULES} for name, path in MODULES.items()}
    done: set[str] = set()

    def walk(name: str, trail: list[str]) -> None:
        assert name not in trail, " -> ".join([*trail, name])
        if name in done:
            return
        for dep in graph[name]:
            walk(dep, [*trail, name])
        done.add(name)

    for name in graph:
        walk(name, [])


def test_only_the_distributed_module_uses_torch_distributed() -> None:
    users = {
        name
        for name, path in MODULES.items()
        if any(
            m == "torch.distributed" or m.startswith("torch.distributed.") for m in _imports(path)
        )
    }
    assert users <= {"accumopt.distributed", "accumopt.testing"}, users


def test_no_framework_is_imported_by_the_core() -> None:
    """Lightning, transformers and Accelerate are optional: only accumopt.integrations uses
    them (an extra installs each)."""
    users = {
        name
        for name, path in MODULES.items()
        if any(m.split(".")[0] in FRAMEWORKS for m in _imports(path))
    }
    assert users == set(), users
