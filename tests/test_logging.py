"""Log lines of the size search: one prefix (the logger's name), readable input shapes."""

from __future__ import annotations

import logging

import pytest

from accumopt.autosize import MicroBatchSizer, describe_key

KEY = (((1, 8, 8), "torch.float32"), ((), "torch.int64"))


def test_size_search_log_lines_do_not_repeat_the_logger_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sizer = MicroBatchSizer(64, grow_after=1)
    with caplog.at_level(logging.INFO, logger="accumopt"):
        sizer.propose(KEY, 64)
        sizer.failed(KEY, 64)
        sizer.propose(KEY, 64)
        sizer.succeeded(KEY, 32)
    messages = [r.getMessage() for r in caplog.records]
    assert [r.name for r in caplog.records] == ["accumopt"] * len(messages)
    assert messages[:3] == [
        "micro-batch size starts at 64 for inputs (1, 8, 8) float32, () int64",
        "out of memory at micro-batch size 64 for inputs (1, 8, 8) float32, () int64",
        "micro-batch size 64 -> 32 for inputs (1, 8, 8) float32, () int64",
    ]
    assert not any(m.startswith("accumopt") for m in messages)


@pytest.mark.parametrize(
    ("key", "text"),
    [
        (KEY, "(1, 8, 8) float32, () int64"),
        ((("batch['x']", (3, 32, 32), "torch.bfloat16"),), "batch['x']: (3, 32, 32) bfloat16"),
        ((((5,), "float16"),), "(5,) float16"),
        ((), "()"),
        ("a string", "a string"),
        ((1, 2), "(1, 2)"),
    ],
)
def test_describe_key(key: object, text: str) -> None:
    assert describe_key(key) == text  # type: ignore[arg-type]
