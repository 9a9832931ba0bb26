"""What a batch may hold: per-sample Python lists, containers torch's pytree does not know, and
every tensor kind with a batch dimension, wherever batches are cut (micro_split, RowSlicer for
MicroBatchRunner and apply, concat of outputs, row counting)."""

from __future__ import annotations

import dataclasses
import warnings
from collections import UserDict
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_split import assert_same, expected_rows
from torch import Tensor
from torch.utils import _pytree

import accumopt
from accumopt import Accumulate, MicroBatchRunner, micro_split, parallel_backward
from accumopt._tree import RowSlicer, batch_size, concat
from accumopt.split import Broadcast, PerSample

CPU2 = ["cpu", "cpu"]


class Encoding(UserDict[str, Any]):
    """Like Hugging Face's ``BatchEncoding``: a ``UserDict`` subclass with extra methods."""

    def tokens(self) -> Any:
        return self["input_ids"]


class FrozenMapping(Mapping[str, Any]):
    """A read-only Mapping that is not a UserDict."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


@dataclasses.dataclass(frozen=True)
class Sample:
    image: Tensor
    caption: list[str]
    source: str = "web"
    rows: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", len(self.image))


# ---- 2. per-sample Python sequences -----------------------------------------------------------


def test_per_sample_python_sequences_are_cut_with_the_rows() -> None:
    captions = ["a", "b", "c", "d"]
    pieces = micro_split({"img": torch.zeros(4, 3), "txt": captions}, CPU2)
    assert [p.batch["txt"] for p in pieces] == [["a", "b"], ["c", "d"]]
    # tuples stay tuples; lists of token lists are per-sample too (no tensor inside)
    batch = {"x": torch.arange(3), "ids": (7, 8, 9), "words": [["hi", "there"], ["yo"], []]}
    pieces = micro_split(batch, CPU2)
    assert [p.batch["ids"] for p in pieces] == [(7, 8), (9,)]
    assert [p.batch["words"] for p in pieces] == [[["hi", "there"], ["yo"]], [[]]]


def test_per_sample_rule_leaves_scalars_and_other_lengths_whole() -> None:
    shape, tags = (3, 224), ["x", "y", "z"]
    batch = {"img": torch.zeros(4, 3), "shape": shape, "tags": tags, "k": 5, "name": "abcd"}
    for piece in micro_split(batch, CPU2):
        assert piece.batch["shape"] is shape and piece.batch["tags"] is tags
        assert piece.batch["k"] == 5 and piece.batch["name"] == "abcd"
    # a list of tensors is a nesting level: each tensor is cut, the list is not
    nested = micro_split({"xs": [torch.arange(4), torch.arange(4) * 2]}, CPU2)
    assert [len(p.batch["xs"]) for p in nested] == [2, 2]
    assert nested[1].batch["xs"][1].tolist() == [4, 6]


def test_per_sample_sequences_do_not_confuse_row_counting() -> None:
    # before: the 3 captions were 3 leaves and the batch was refused or miscounted
    assert batch_size({"x": torch.zeros(2, 1), "txt": ["a", "b", "c"]}, "t") == 2
    with pytest.raises(TypeError, match=r"t: batch has no tensor leaf \(leaves: list\)"):
        batch_size({"txt": ["a", "b"]}, "t")
    assert batch_size({"txt": PerSample(["a", "b", "c"])}, "t") == 3
    with pytest.raises(ValueError, match=r"batch\['t'\] has 2 rows \(a PerSample of 2 items\)"):
        batch_size({"x": torch.zeros(3), "t": PerSample(["a", "b"])}, "t")


def test_per_sample_sequences_in_row_slicer_and_concat() -> None:
    batch = {"x": torch.arange(5), "txt": list("abcde"), "tag": ("u", "v")}
    slicer = RowSlicer(batch, None)
    parts = [slicer(0, 2), slicer(2, 5)]
    assert parts[0]["txt"] == ["a", "b"] and parts[1]["tag"] is batch["tag"]
    joined = concat(parts)
    assert joined["txt"] == batch["txt"] and torch.equal(joined["x"], batch["x"])
    assert joined["tag"] is batch["tag"]  # length 2 is not a piece's rows (2, 3)
    # without a tensor, a piece's rows come from sizes=
    assert concat([["a", "b"], ["c"]], sizes=[2, 1]) == ["a", "b", "c"]
    assert concat([["a", "b"], ["c"]]) == ["a", "b"]  # rows unknown: taken whole


def test_broadcast_and_per_sample_markers_override_the_rule() -> None:
    weights = torch.ones(5)
    batch = {
        "x": torch.zeros(3, 2),
        "size": Broadcast((3, 224, 224)),
        "class_weights": Broadcast(weights),  # neither cut, moved nor counted as rows
        "boxes": PerSample([torch.zeros(1, 4), torch.zeros(3, 4), torch.zeros(0, 4)]),
        "scores": PerSample(torch.arange(3)),  # a PerSample of a tensor is the tensor
    }
    a, b = (p.batch for p in micro_split(batch, CPU2))
    assert a["size"] == (3, 224, 224) and a["class_weights"] is weights is b["class_weights"]
    assert [t.shape[0] for t in a["boxes"]] == [1, 3] and [t.shape[0] for t in b["boxes"]] == [0]
    assert b["scores"].tolist() == [2]
    # outputs: lists of tensors are a nesting level (pieces of other lengths are refused)
    # unless wrapped in PerSample; a Broadcast value is taken from the first piece
    with pytest.raises(ValueError, match=r"outputs\[1\] is nested differently from outputs\[0\]"):
        concat([a, b])
    joined = concat(
        [
            {"b": PerSample(a["boxes"]), "s": Broadcast(1)},
            {"b": PerSample(b["boxes"]), "s": Broadcast(2)},
        ]
    )
    assert [t.shape[0] for t in joined["b"]] == [1, 3, 0] and joined["s"] == 1
    with pytest.raises(TypeError, match=r"PerSample: value=5 has no len\(\) or no slicing"):
        PerSample(5)


def test_per_sample_sequences_reach_every_api() -> None:
    """MicroBatchRunner, apply and parallel_backward see each row's caption with its row."""
    torch.manual_seed(0)
    x = torch.randn(5, 2)
    batch = {"x": x, "id": [f"s{i}" for i in range(5)], "row": torch.arange(5)}
    seen: list[str] = []

    def check(model: torch.nn.Module, piece: dict[str, Any]) -> Tensor:
        assert piece["id"] == [f"s{int(r)}" for r in piece["row"]]
        seen.extend(piece["id"])
        return model(piece["x"]).sum()

    model = torch.nn.Linear(2, 1)
    opt = Accumulate(torch.optim.SGD(model.parameters(), 0.1), every=3)
    MicroBatchRunner(
        opt, lambda piece: check(model, piece), micro_batch_size=2, loss_reduction="sum"
    )(batch)
    parallel_backward(torch.nn.Linear(2, 1), lambda m, p: check(m, p) / len(p["x"]), batch, CPU2)
    other = torch.nn.Linear(2, 1)

    @accumopt.apply(["x", "id", "row"], 2)
    def loss(x: Tensor, id: list[str], row: Tensor) -> Tensor:
        return check(other, {"x": x, "id": id, "row": row}) / len(x)

    loss(x=x, id=batch["id"], row=batch["row"])
    assert seen == batch["id"] * 3


@st.composite
def aligned_batches(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    n = draw(st.integers(1, 40))
    ids = torch.arange(n)
    words = [draw(st.lists(st.text(max_size=2), max_size=3)) for _ in range(n)]
    batch = {
        "ids": ids,
        "caption": [f"s{i}" for i in range(n)],
        "enc": Encoding({"ids2": ids * 2, "words": words}),
        "sample": Sample(ids.double().unsqueeze(1), [f"c{i}" for i in range(n)]),
        "meta": {"epoch": draw(st.integers()), "split": ("train",)},
    }
    return batch, n


@settings(max_examples=100, deadline=None)
@given(
    case=aligned_batches(),
    weights=st.lists(
        st.one_of(st.integers(1, 9), st.fractions(Fraction(1, 5), 5)), min_size=1, max_size=5
    ),
)
def test_per_sample_lists_stay_aligned_with_tensor_rows(
    case: tuple[dict[str, Any], int], weights: list[Any]
) -> None:
    batch, n = case
    weights = weights[:n]
    pieces = micro_split(batch, ["cpu"] * len(weights), weights=weights)
    for piece in pieces:
        ids = [int(i) for i in piece.batch["ids"]]
        assert piece.batch["caption"] == [f"s{i}" for i in ids]
        assert piece.batch["enc"]["words"] == [batch["enc"]["words"][i] for i in ids]
        assert piece.batch["sample"].caption == [f"c{i}" for i in ids]
        assert piece.batch["sample"].rows == piece.size  # __post_init__ ran on the piece
    assert_same(
        concat([p.batch for p in pieces], sizes=[p.size for p in pieces]),
        batch,
        torch.device("cpu"),
    )


# ---- 3. containers torch's pytree does not know -----------------------------------------------


CONTAINERS: list[tuple[str, Callable[[Tensor, list[str]], Any]]] = [
    ("UserDict", lambda x, t: UserDict({"x": x, "txt": t})),
    ("UserDict subclass", lambda x, t: Encoding({"input_ids": x, "txt": t})),
    ("Mapping subclass", lambda x, t: FrozenMapping({"x": x, "txt": t})),
    ("frozen dataclass", lambda x, t: Sample(x, t)),
    ("nested", lambda x, t: {"a": [Encoding({"s": Sample(x, t)})], "b": (x, t)}),
]


@pytest.mark.parametrize("make", [c[1] for c in CONTAINERS], ids=[c[0] for c in CONTAINERS])
def test_containers_pytree_does_not_know_keep_their_type(make: Callable[..., Any]) -> None:
    x, txt = torch.arange(10.0).reshape(5, 2), list("abcde")
    batch = make(x, txt)
    assert batch_size(batch, "t") == 5
    pieces = micro_split(batch, ["cpu"] * 3, weights=[1, 2, 2])
    starts = [0, 1, 3]
    for piece, start in zip(pieces, starts):
        assert_same(piece.batch, expected_rows(batch, start, start + piece.size, 5), piece.device)
    slicer = RowSlicer(batch, None)
    assert_same(slicer(1, 4), expected_rows(batch, 1, 4, 5), torch.device("cpu"))
    assert_same(concat([p.batch for p in pieces]), batch, torch.device("cpu"))
    # nothing was registered with pytree for the user's types
    assert not {UserDict, Encoding, FrozenMapping, Sample} & set(_pytree.SUPPORTED_NODES)


def test_container_that_cannot_be_rebuilt_is_refused_clearly() -> None:
    class Strict(UserDict[str, Any]):
        def __init__(self, data: dict[str, Any], *, owner: str) -> None:
            super().__init__(data)
            self.owner = owner

    batch = {"enc": Strict({"x": torch.zeros(2)}, owner="me")}
    with pytest.raises(
        TypeError,
        match=r"micro_split: batch\['enc'\]=.* is a .*Strict that cannot be rebuilt from its "
        r"items \(TypeError: .*owner.*\); expected a container that type\(obj\)\(dict_of_items\) "
        r"rebuilds with its cut items\. Convert it to a dict, or wrap it in "
        r"accumopt\.split\.Broadcast",
    ):
        micro_split(batch, CPU2)


def test_transformers_batch_encoding() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    enc = transformers.BatchEncoding(
        {"input_ids": torch.arange(12).reshape(4, 3), "attention_mask": torch.ones(4, 3)}
    )
    pieces = micro_split(enc, CPU2)
    assert all(type(p.batch) is transformers.BatchEncoding for p in pieces)
    assert pieces[1].batch["input_ids"].tolist() == [[6, 7, 8], [9, 10, 11]]


# ---- 4. every tensor kind with a batch dimension ----------------------------------------------


class Tagged(Tensor):
    """A tensor subclass (``as_subclass``), as returned by some libraries."""


def _jagged(n: int) -> Tensor:
    return torch.nested.nested_tensor(
        [torch.arange(3.0 * (k % 3)).reshape(k % 3, 3) + k for k in range(n)], layout=torch.jagged
    )


def _holes(n: int) -> Tensor:
    values = torch.arange(6.0 * n).reshape(3 * n, 2)
    offsets = torch.arange(0, 3 * n + 1, 3)
    lengths = torch.tensor([k % 3 for k in range(n)])
    return torch.nested.nested_tensor_from_jagged(values, offsets, lengths=lengths)


def _dense(n: int, *trailing: int) -> Tensor:
    x = torch.arange(n * int(torch.Size(trailing).numel()), dtype=torch.float32)
    return (x.reshape(n, *trailing) % 3).relu()  # some zeros: sparse tensors have holes


KINDS: list[tuple[str, Callable[[int], Tensor]]] = [
    ("subclass", lambda n: _dense(n, 2).as_subclass(Tagged)),
    ("sparse COO", lambda n: _dense(n, 3).to_sparse()),
    (
        "sparse COO uncoalesced",
        lambda n: torch.sparse_coo_tensor(
            torch.tensor([[0, 0, n - 1], [1, 1, 0]]), torch.tensor([1.0, 2.0, 3.0]), (n, 2)
        ),
    ),
    ("sparse COO hybrid", lambda n: _dense(n, 3, 2).to_sparse(1)),
    ("sparse CSR", lambda n: _dense(n, 4).to_sparse_csr()),
    ("sparse CSR hybrid", lambda n: _dense(n, 4, 2).to_sparse_csr(dense_dim=1)),
    ("batched CSR", lambda n: (_dense(n, 3, 4) + 1).to_sparse_csr()),
    ("batched CSC", lambda n: (_dense(n, 3, 4) + 1).to_sparse_csc()),
    ("batched BSR", lambda n: (_dense(n, 4, 4) + 1).to_sparse_bsr((2, 2))),
    ("nested jagged", _jagged),
    ("nested jagged with holes", _holes),
    ("nested jagged transposed", lambda n: _jagged(n).transpose(1, 2)),
    (
        "nested strided",
        lambda n: torch.nested.nested_tensor([torch.ones(k % 3 + 1, 2) * k for k in range(n)]),
    ),
    (
        "quantized per tensor",
        lambda n: torch.quantize_per_tensor(_dense(n, 2), 0.5, 1, torch.qint8),
    ),
    (
        "quantized per channel",
        lambda n: torch.quantize_per_channel(
            _dense(n, 2),
            torch.linspace(0.1, 1.0, n),
            torch.zeros(n, dtype=torch.long),
            0,
            torch.qint8,
        ),
    ),
]


def _row_list(t: Tensor) -> list[Tensor]:
    """Each row as a plain dense tensor: the meaning of the leaf, whatever its kind."""
    if t.is_nested:
        return [c.contiguous() for c in t.unbind()]
    if t.layout != torch.strided:
        return list(t.to_dense())
    if t.is_quantized:
        return list(t.dequantize())
    return list(t.as_subclass(Tensor))


def _same_kind(a: Tensor, b: Tensor) -> bool:
    return (a.layout, a.is_nested, a.is_quantized, type(a)) == (
        b.layout,
        b.is_nested,
        b.is_quantized,
        type(b),
    )


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # "nested tensors are in prototype stage", sparse CSR beta
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("make", [k[1] for k in KINDS], ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("n", [1, 7])
def test_every_leaf_kind_splits_exactly(make: Callable[[int], Tensor], n: int) -> None:
    leaf = make(n)
    rows = _row_list(leaf)
    batch = {"dense": torch.arange(n), "leaf": leaf}
    devices = ["cpu"] * min(n, 3)
    pieces = micro_split(batch, devices, weights=[1] * len(devices))
    assert [p.size for p in pieces] == [
        n // len(devices) + (k < n % len(devices)) for k in range(len(devices))
    ]
    for piece in pieces:
        ids = piece.batch["dense"].tolist()
        part = piece.batch["leaf"]
        assert _same_kind(part, leaf) and part.size(0) == piece.size == len(ids)
        assert all(torch.equal(a, rows[i]) for a, i in zip(_row_list(part), ids))
    # an empty piece (a share that rounds to 0 rows) is a valid leaf of 0 rows
    empty = RowSlicer(batch, None)(n, n)["leaf"]
    assert empty.size(0) == 0 and _same_kind(empty, leaf)
    # outputs of these kinds join back (not per-channel quantized: torch.cat refuses it)
    if not (leaf.is_quantized and leaf.qscheme() == torch.per_channel_affine):
        joined = concat([p.batch for p in pieces])["leaf"]
        assert _same_kind(joined, leaf) and joined.size(0) == n
        assert all(torch.equal(a, b) for a, b in zip(_row_list(joined), rows))


_CANNOT = r", whose rows \(dim 0\) accumopt cannot cut; expected a dense, sparse COO, .*\. "
REFUSED: list[tuple[str, Callable[[], Tensor], str]] = [
    ("sparse CSC", lambda: _dense(4, 3).to_sparse_csc(), r"sparse_csc tensor" + _CANNOT + r"Conv"),
    (
        "sparse BSR",
        lambda: (_dense(4, 4) + 1).to_sparse_bsr((2, 2)),
        r"sparse_bsr tensor" + _CANNOT,
    ),
    (
        "sparse BSC",
        lambda: (_dense(4, 4) + 1).to_sparse_bsc((2, 2)),
        r"sparse_bsc tensor" + _CANNOT,
    ),
    (
        "MKL-DNN",
        lambda: torch.zeros(4, 3, dtype=torch.float32).to_mkldnn(),
        r"_mkldnn tensor" + _CANNOT + r"Convert it",
    ),
]


@pytest.mark.parametrize(("make", "kind"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_leaf_kinds_that_cannot_be_cut_are_refused_clearly(
    make: Callable[[], Tensor], kind: str
) -> None:
    if "mkldnn" in kind and not torch.backends.mkldnn.is_available():
        pytest.skip("MKL-DNN is not available")
    leaf = make()
    with pytest.raises(TypeError, match=rf"micro_split: batch\['m'\]\[0\] is a {kind}"):
        micro_split({"x": torch.zeros(4), "m": [leaf]}, CPU2)
    with pytest.raises(TypeError, match=rf"MicroBatchRunner: outputs\['m'\] is a {kind}"):
        concat([{"m": leaf}, {"m": leaf}])


def test_torch_errors_on_special_kinds_name_the_leaf() -> None:
    q = torch.quantize_per_channel(
        torch.ones(4, 2, dtype=torch.float32),
        torch.ones(4),
        torch.zeros(4, dtype=torch.long),
        0,
        torch.qint8,
    )
    with pytest.raises(
        TypeError,
        match=r"apply: outputs\['q'\] is a quantized tensor \(per_channel_affine\) that torch "
        r"could not concatenate along dim 0 \(RuntimeError: .*\); expected a tensor kind that "
        r"supports it\. Dequantize it with \.dequantize\(\) first\.",
    ) as info:
        concat([{"q": q[:2]}, {"q": q[2:]}], api="apply")
    assert isinstance(info.value.__cause__, RuntimeError)

    class Unsliceable(Tensor):
        @classmethod
        def __torch_function__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func is Tensor.__getitem__:
                raise NotImplementedError("no slicing here")
            return super().__torch_function__(func, types, args, kwargs or {})

    leaf = torch.zeros(4, 2).as_subclass(Unsliceable)
    with pytest.raises(
        TypeError,
        match=r"micro_split: batch\[1\] is a tensor subclass .*Unsliceable that torch could not "
        r"cut at rows 0:2 \(NotImplementedError: no slicing here\); .*as_subclass",
    ):
        micro_split((torch.zeros(4), leaf), CPU2)


def test_zero_dim_and_mismatched_special_kinds_are_described() -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(
        ValueError,
        match=r"batch\['n'\] has 2 rows along dim 0 \(nested tensor \(strided layout\)\) but "
        r"batch\['x'\] has 3",
    ):
        micro_split({"x": torch.zeros(3), "n": nested}, CPU2)


def test_parallel_backward_with_a_jagged_batch() -> None:
    """A jagged nested batch split over two pieces gives the full batch's gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    jagged = _jagged(5) * 0.1

    def mean_of_sample_sums(module: torch.nn.Module, piece: dict[str, Tensor]) -> Tensor:
        return module(piece["x"]).values().sum() / piece["x"].size(0)

    parallel_backward(model, mean_of_sample_sums, {"x": jagged}, CPU2)
    assert model.weight.grad is not None
    split_grad = model.weight.grad.clone()
    model.zero_grad()
    (sum(model(c).sum() for c in jagged.unbind()) / 5).backward()
    torch.testing.assert_close(split_grad, model.weight.grad)


def test_runner_joins_output_dicts_whose_keys_come_in_another_order() -> None:
    from accumopt import Accumulate, MicroBatchRunner

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    x = torch.randn(7, 3, dtype=torch.float64)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=7)

    def loss_fn(b: torch.Tensor) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        out = model(b)
        outs = {"logits": out.detach(), "rows": b.detach()}
        if b.shape[0] < 3:  # the last micro-batch builds its dict in another order
            outs = {"rows": outs["rows"], "logits": outs["logits"]}
        return out.sum(), b.shape[0], outs

    _, joined = MicroBatchRunner(opt, loss_fn, micro_batch_size=3, loss_reduction="sum")(
        x, return_outputs=True
    )
    assert list(joined) == ["logits", "rows"]
    assert torch.equal(joined["rows"], x)


def test_runner_refuses_other_output_keys_before_the_micro_batch_is_counted() -> None:
    from accumopt import Accumulate, MicroBatchRunner

    model = torch.nn.Linear(3, 2).double()
    x = torch.randn(7, 3, dtype=torch.float64)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=100)

    def loss_fn(b: torch.Tensor) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        out = model(b)
        key = "a" if opt.micro_step == 0 else "b"
        return out.sum(), b.shape[0], {key: out.detach()}

    with pytest.raises(ValueError, match="nested differently"):
        MicroBatchRunner(opt, loss_fn, micro_batch_size=3, loss_reduction="sum")(
            x, return_outputs=True
        )
    assert opt.micro_step == 1 and opt.items == 3  # the second micro-batch was not counted


def test_runner_refuses_outputs_it_cannot_join_before_the_first_backward_pass() -> None:
    """Outputs with a tensor whose rows cannot be concatenated (a 2-D sparse CSC tensor) are
    refused at the first micro-batch, before its backward pass (no gradient, nothing counted),
    not after the whole batch trained; without return_outputs they are not looked at."""
    from accumopt import Accumulate, MicroBatchRunner

    model = torch.nn.Linear(3, 2).double()
    x = torch.randn(7, 3, dtype=torch.float64)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=100)

    def loss_fn(b: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        out = model(b)
        return out.sum(), b.shape[0], out.detach().to_sparse_csc()

    runner = MicroBatchRunner(opt, loss_fn, micro_batch_size=3, loss_reduction="sum")
    with pytest.raises(TypeError, match=r"sparse_csc tensor.*were not"):
        runner(x, return_outputs=True)
    assert opt.micro_step == 0 and all(p.grad is None for p in model.parameters())
    runner(x)
    assert opt.micro_step == 3 and opt.items == 7


@pytest.mark.parametrize("second", ["wider", "0-dim", "number"])
def test_runner_refuses_outputs_that_cannot_join_the_first_ones_before_backward(
    second: str,
) -> None:
    """A dense output leaf whose shape past dim 0 differs from the first micro-batch's (padding
    per micro-batch), or that lost its dim 0, is refused before that micro-batch's backward
    pass; the batch is not trained through to fail at the join (the first micro-batch alone
    was counted)."""
    from accumopt import Accumulate, MicroBatchRunner

    model = torch.nn.Linear(3, 2).double()
    x = torch.randn(7, 3, dtype=torch.float64)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=7)

    def loss_fn(b: torch.Tensor) -> tuple[torch.Tensor, int, dict[str, Any]]:
        out = model(b)
        later = {"wider": torch.zeros(len(b), 3), "0-dim": torch.zeros(()), "number": 1.0}
        pad = torch.zeros(len(b), 2) if opt.micro_step == 0 else later[second]
        return out.sum(), b.shape[0], {"pad": pad}

    with pytest.raises(ValueError, match=r"outputs\['pad'\].*cannot be concatenated.*were not"):
        MicroBatchRunner(opt, loss_fn, micro_batch_size=3, loss_reduction="sum")(
            x, return_outputs=True
        )
    assert opt.micro_step == 1 and opt.updates == 0


def test_runner_joins_a_legacy_empty_output_and_refuses_other_widths_of_any_kind() -> None:
    """``torch.empty(0)`` as one micro-batch's output (a per-token output with no token) is
    joined as ``torch.cat`` joins it; a sparse CSR or jagged output whose width past dim 0
    changes between micro-batches is refused before that micro-batch's backward pass (the CSR
    one was joined into an invalid tensor, the jagged one failed after training)."""
    from accumopt import Accumulate, MicroBatchRunner

    def run(output: Any) -> tuple[Any, Any]:
        model = torch.nn.Linear(4, 3).double()
        opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=5)

        def loss_fn(b: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
            out = model(b)
            return out.pow(2).sum(), len(b), output(out.detach(), opt.micro_step)

        return opt, MicroBatchRunner(opt, loss_fn, micro_batch_size=2, loss_reduction="sum")

    x = torch.randn(5, 4, dtype=torch.float64)
    opt, runner = run(lambda out, k: torch.empty(0, dtype=out.dtype) if k == 1 else out)
    _, joined = runner(x, return_outputs=True)
    assert joined.shape == (3, 3) and opt.updates == 1
    widen = {
        "csr": lambda out, k: torch.cat([out, out[:, :k]], 1).to_sparse_csr(),
        "jagged": lambda out, k: torch.nested.nested_tensor(
            [torch.zeros(2, 3 + k) for _ in range(len(out))], layout=torch.jagged
        ),
    }
    for kind, output in widen.items():
        opt, runner = run(output)
        with pytest.raises(ValueError, match="cannot be concatenated"):
            runner(x, return_outputs=True)
        assert opt.micro_step == 1 and opt.updates == 0, kind


def test_runner_compares_outputs_after_a_first_legacy_empty_one() -> None:
    """When the first micro-batch's output is ``torch.empty(0)``, the later ones are compared
    with the first real one: a width that changes after it is refused before its backward pass
    (it trained the whole batch and then failed at the join)."""
    from accumopt import Accumulate, MicroBatchRunner

    model = torch.nn.Linear(4, 3).double()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=6)

    def loss_fn(b: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        out = model(b)
        k = opt.micro_step
        o = (
            torch.empty(0)
            if k == 0
            else (out.detach() if k == 1 else torch.cat([out.detach()] * 2, 1))
        )
        return out.pow(2).sum(), len(b), o

    with pytest.raises(ValueError, match="cannot be concatenated"):
        MicroBatchRunner(opt, loss_fn, micro_batch_size=2, loss_reduction="sum")(
            torch.randn(6, 4, dtype=torch.float64), return_outputs=True
        )
    assert opt.micro_step == 2 and opt.updates == 0
