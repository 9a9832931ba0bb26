"""The documentation keeps up with the code: every refusal and warning accumopt can raise has an
entry in the error reference (``docs/errors.md``), every entry still matches a message, and the
README stays a short front page whose Quick start block is what ``.ci/run`` reads.

The Python code blocks of ``README.md`` and ``docs/`` run as tests themselves (Sybil, configured
in the root ``conftest.py``)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from refusals import (
    ERRORS_PAGE,
    ROOT,
    Template,
    code_templates,
    covers,
    entries,
    literal_length,
)

README = ROOT / "README.md"
README_LINES = 250
SPECIFIC = 20  # characters of the code's own words a documented message begins with, at least


@pytest.fixture(scope="module")
def templates() -> list[Template]:
    return code_templates()


def uncovered(templates: list[Template], page: str) -> list[Template]:
    messages = [m for entry in entries(page) for m in entry.messages]
    return [t for t in templates if not any(covers(m, t) for m in messages)]


def test_the_source_scan_finds_the_refusals_it_should(templates: list[Template]) -> None:
    """The scan reads messages built in every way the package builds them: a plain raise, a
    module constant, a helper's return value, a local variable with several texts, a
    ``.format`` template, a warning."""
    texts = [t.text for t in templates]
    for beginning in [
        "Accumulate: every=\x00 is not a positive int",  # raise with an f-string
        "Accumulate.load_state_dict: the checkpoint's open window was saved by rank",  # _LOAD
        "Accumulate: the window closed after \x00 micro-step(s)",  # returned by _state.Rules
        "Accumulate.\x00: a micro-step waits for opt.commit()",  # the local `why`, one text
        "Accumulate: the inner \x00 was stepped directly",  # STEPPED_DIRECTLY.format(...)
        "Accumulate: a wrapper ended with \x00 micro-step(s)",  # warnings.warn
        "\x00 is a CUDA device but CUDA is not available",  # a helper's `where`, filled in
    ]:
        assert any(t.startswith(beginning) for t in texts), beginning
    assert len(templates) > 150
    assert not any("%d" in t or t.startswith("AccumulateTrainer.train: dropped") for t in texts), (
        "log lines of the logger's own formatting are not messages"
    )


def test_every_refusal_has_an_entry_in_the_error_reference(templates: list[Template]) -> None:
    missing = uncovered(templates, ERRORS_PAGE.read_text())
    assert not missing, (
        f"{len(missing)} message(s) of accumopt/ have no entry in docs/errors.md (add one, "
        "with the message's beginning in its **Message:** line):\n"
        + "\n".join(f"  {t.where[0]}: {t.shown()}" for t in missing)
    )


def test_the_coverage_check_notices_a_missing_entry(templates: list[Template]) -> None:
    """The check above can fail: without one entry, its messages are reported missing; and a
    refusal added to the code without an entry is reported too."""
    page = ERRORS_PAGE.read_text()
    assert "### A second thread\n" in page
    without = re.sub(r"### A second thread\n.*?(?=\n### )", "", page, flags=re.S)
    missing = uncovered(templates, without)
    assert [t.text[:37] for t in missing] == ["Accumulate.step: called from a second"]

    package = ROOT / "accumopt"
    added = Template("Accumulate.step: a refusal added tomorrow; expected an entry.")
    assert uncovered([*code_templates(package), added], page) == [added]


def test_a_refusal_written_in_a_new_module_is_found(tmp_path: Path) -> None:
    (tmp_path / "new.py").write_text(
        textwrap.dedent(
            '''
            """A module."""
            WHY = "a reason that is long enough"
            def check(value):
                """Docstring: not a message."""
                if value < 0:
                    raise ValueError(f"Accumulate.check: value={value!r} is negative; {WHY}.")
                note = "Accumulate.check: a note built first, then raised elsewhere."
                return note
            '''
        )
    )
    texts = sorted(t.shown() for t in code_templates(tmp_path))
    assert texts == [
        "Accumulate.check: a note built first, then raised elsewhere.",
        "Accumulate.check: value=<...> is negative; a reason that is long enough.",
    ]


def test_every_entry_matches_a_message_and_says_cause_and_fix(templates: list[Template]) -> None:
    for entry in entries(ERRORS_PAGE.read_text()):
        assert entry.messages, f"entry {entry.title!r} has no **Message:** code span"
        assert entry.has_cause and entry.has_fix, f"entry {entry.title!r} lacks Cause or Fix"
        for message in entry.messages:
            assert literal_length(message) >= SPECIFIC, (
                f"entry {entry.title!r}: {message!r} is too general to name one refusal"
            )
            assert any(covers(message, t) for t in templates), (
                f"entry {entry.title!r}: no message of accumopt/ begins with {message!r} "
                "(the code's wording changed, or the refusal is gone)"
            )


def test_readme_is_a_short_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines (at most {README_LINES})"


def quick_start_commands(text: str) -> list[str]:
    """The commands of the first code block under the Quick start heading, as .ci/run and
    shared/checks/readme_commands.sh read them."""
    after = re.split(r"^#+ .*quick ?start.*$", text, maxsplit=1, flags=re.M | re.I)[1]
    block = after.split("```", 2)[1].split("\n", 1)[1]
    lines = [line.strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_quick_start_is_two_commands_install_then_run() -> None:
    text = README.read_text()
    first, second = quick_start_commands(text)
    assert "examples/digits.py" in first and "pip install" in first
    assert "pytest" in second and "pip install" in second and '".[dev]"' in second
    install = text.split("## Quick start")[0]
    for step in ("git clone", "python3 -m venv", "download.pytorch.org/whl/cpu"):
        assert step in install, f"the Install section (before Quick start) lacks {step!r}"


def test_readme_links_to_files_that_exist() -> None:
    """The README links into docs/ and the repository by relative paths (mkdocs --strict checks
    the links of docs/ itself)."""
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
