"""torch.distributed.checkpoint (DCP) with a plain Accumulate wrapper: the open window survives
``get/set_optimizer_state_dict`` and a ``dcp.save``/``dcp.load`` round trip bit for bit, in one
process and on 2 gloo ranks (FSDP2, DDP); what cannot be exact is refused with what to do.

Every resumed run is compared with ``torch.equal`` against the same run never interrupted,
float64, weighted ragged micro-batches. DCP's ``_init_optim_state`` steps a fresh optimizer
once; the wrapper recognises that step. The entry travels in param group 0, one key per rank,
so flattened optimizer state dicts keep it too.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import scenarios_on_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from accumopt import Accumulate

F64 = torch.float64
EVERY = 4
SIZES = [3, 1, 2, 4, 2, 3, 1, 2, 2, 3, 1, 4]  # three windows of four ragged micro-batches
INNER: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),  # no state at all: DCP steps it every time
}

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def net(seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6, dtype=F64), nn.Tanh(), nn.Linear(6, 3, dtype=F64))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(48, 4, generator=g, dtype=F64), torch.randn(48, 3, generator=g, dtype=F64)


def rows(i: int, rank: int | None) -> tuple[int, int]:
    """Micro-step ``i``'s rows: ``SIZES`` in one process; 1-2 rows of its own on a rank."""
    if rank is None:
        return sum(SIZES[:i]), sum(SIZES[: i + 1])
    a = 4 * i + 2 * rank
    return a, a + 1 + (i + rank) % 2


def train(
    model: nn.Module,
    opt: Accumulate,
    lo: float,
    hi: float,
    weighted: bool = True,
    rank: int | None = None,
) -> None:
    """Micro-steps ``lo..hi-1`` (backward, step, zero_grad). ``hi = k + 0.5``: micro-step
    ``k`` runs its backward pass only (the window is left closed); ``lo = k + 0.5``: its
    ``step()`` comes first."""
    x, y = data()
    start = int(lo)
    if lo != start:
        opt.step()
        opt.zero_grad()
        start += 1
    for i in range(start, math.ceil(hi)):
        a, b = rows(i, rank)
        loss = ((model(x[a:b]) - y[a:b]) ** 2).sum()
        if weighted:
            opt.backward(loss, items=b - a)
        else:
            (loss / (b - a)).backward()
        if i + 1 <= hi:
            opt.step()
            opt.zero_grad()


def wrapper(model: nn.Module, inner: str, **kwargs: Any) -> Accumulate:
    return Accumulate(INNER[inner](model.parameters()), every=EVERY, **kwargs)


def assert_same_run(a: nn.Module, oa: Accumulate, b: nn.Module, ob: Accumulate) -> None:
    assert oa.updates == ob.updates
    for p, q in zip(a.parameters(), b.parameters()):
        sa, sb = oa.state.get(p, {}), ob.state.get(q, {})
        assert torch.equal(p, q) and sa.keys() == sb.keys()
        assert all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)


# where the source run is saved (micro-steps done, k + 0.5: the backward of k only), the
# wrapper's settings, and (micro_step, updates) after loading
POINTS: dict[str, tuple[float, dict[str, Any], tuple[int, int]]] = {
    "mid_window": (6, {}, (2, 1)),
    "mid_window_buffer": (6, {"buffer": True}, (2, 1)),
    "mid_window_unweighted": (6, {}, (2, 1)),
    "closed_window": (7.5, {}, (4, 1)),
    "boundary": (8, {}, (0, 2)),
}


def resumed(inner: str, point: str, target: str, via: Path | None) -> None:
    """Save the run at ``point`` through DCP (into ``via`` if given), load it into a ``target``
    wrapper, finish both and compare with the run never interrupted."""
    stop, kwargs, position = POINTS[point]
    weighted = point != "mid_window_unweighted"
    ref = net()
    ref_opt = wrapper(ref, inner, **kwargs)
    train(ref, ref_opt, 0, len(SIZES), weighted)
    src = net()
    src_opt = wrapper(src, inner, **kwargs)
    train(src, src_opt, 0, stop, weighted)
    saved = {"model": get_model_state_dict(src), "optim": get_optimizer_state_dict(src, src_opt)}
    if via is not None:
        dcp.save(saved, checkpoint_id=via)
    saved = copy.deepcopy(saved)  # DCP references the live tensors
    train(src, src_opt, stop, len(SIZES), weighted)  # saving changed nothing
    assert_same_run(ref, ref_opt, src, src_opt)

    dst = net(seed=99)
    dst_opt = wrapper(dst, inner, **kwargs)
    if target == "trained":  # a wrapper with state, mid-window: all of it is replaced
        train(dst, dst_opt, 0, 6, weighted)
    if via is not None:
        saved = {
            "model": get_model_state_dict(dst),
            "optim": get_optimizer_state_dict(dst, dst_opt),
        }
        dcp.load(saved, checkpoint_id=via)
    set_model_state_dict(dst, saved["model"])
    set_optimizer_state_dict(dst, dst_opt, saved["optim"])
    assert (dst_opt.micro_step, dst_opt.updates) == position
    assert dst_opt.will_update == (point == "closed_window")
    train(dst, dst_opt, stop, len(SIZES), weighted)
    assert_same_run(ref, ref_opt, dst, dst_opt)


@pytest.mark.parametrize("target", ["fresh", "trained"])
@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("inner", list(INNER))
def test_dcp_get_set_optimizer_state_dict_resumes_bit_for_bit(
    inner: str, point: str, target: str
) -> None:
    resumed(inner, point, target, via=None)


@pytest.mark.parametrize("target", ["fresh", "trained"])
@pytest.mark.parametrize("point", ["mid_window", "closed_window", "boundary"])
def test_dcp_save_load_directory_mid_window_resumes_bit_for_bit(
    point: str, target: str, tmp_path: Path
) -> None:
    resumed("adamw", point, target, via=tmp_path / "ckpt")


def test_dcp_init_step_on_a_fresh_wrapper_is_the_bare_optimizers() -> None:
    bare_model, model = net(), net()
    bare = INNER["adamw"](bare_model.parameters())
    opt = Accumulate(INNER["adamw"](model.parameters()), every=1)
    get_optimizer_state_dict(bare_model, bare)  # both get their state created by a zero step
    get_optimizer_state_dict(model, opt)
    assert opt.updates == 0 and opt.param_groups[0]["lr"] == 0.05
    assert all(p.grad is None for p in model.parameters())
    x, y = data()
    for m, o in ((bare_model, bare), (model, opt)):
        for _ in range(2):
            ((m(x) - y) ** 2).sum().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(bare_model.parameters(), model.parameters()))


def trained_pair() -> tuple[nn.Module, Accumulate]:
    """A wrapper with inner state, one micro-step into its second window (no DCP init step)."""
    model = net()
    opt = wrapper(model, "adamw")
    train(model, opt, 0, 5)
    return model, opt


def test_dcp_flattened_optimizer_state_dict_resumes_mid_window_bit_for_bit() -> None:
    """``flatten_optimizer_state_dict=True`` (torchtitan's setting) rebuilds the loaded dict
    from the live optimizer's keys: the live param group 0 carries the entry's key."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model, opt = trained_pair()
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt, options=flat))
    params = copy.deepcopy(model.state_dict())
    train(model, opt, 5, 12)
    resumed = net()
    resumed.load_state_dict(params)
    fresh = wrapper(resumed, "adamw")
    set_optimizer_state_dict(resumed, fresh, saved, options=flat)
    assert (fresh.micro_step, fresh.updates) == (1, 1)
    train(resumed, fresh, 5, 12)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


def _load_refused(packed: bytes, match: str) -> None:
    model, opt = trained_pair()
    osd = get_optimizer_state_dict(model, opt)
    osd["param_groups"][0]["accumopt"] = packed
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=match):
        set_optimizer_state_dict(model, opt, osd)
    assert (opt.micro_step, opt.updates) == (1, 1)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))


def test_dcp_damaged_entry_is_refused_at_load_and_changes_nothing() -> None:
    _load_refused(b"not a checkpoint", "cannot be read")


# ------------------------------------------------------------------ 2 gloo ranks


def _rank_runs(kind: str, n: int, **kw: Any) -> list[tuple[nn.Module, Accumulate]]:
    """``n`` equal runs of an FSDP2-sharded (uneven shards: 3 rows over 2 ranks) or DDP model,
    each with its AdamW wrapper (windows of 3)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh, runs = init_device_mesh("cpu", (2,)), []
    for _ in range(n):
        model = net()
        if kind == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            for layer in [*(m for m in model if isinstance(m, nn.Linear)), model]:
                fully_shard(layer, mesh=mesh)
        opt = Accumulate(INNER["adamw"](model.parameters()), every=3, model=model, **kw)
        runs.append((model, opt))
    return runs


def _full(model: nn.Module) -> list[list[float]]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
        for p in model.parameters()
    ]


def _rank_resume(rank: int, kind: str, stop: float, swap: bool = False, **kw: Any) -> Any:
    """Uninterrupted vs saved at ``stop`` (a directory shared by the ranks) and resumed in a
    fresh wrapper: (both runs' parameters, the position after loading, the packed entry).
    ``swap``: each rank loads the other rank's part of the window (other shard shapes)."""
    (ref, ref_opt), (src, src_opt), (dst, dst_opt) = _rank_runs(kind, 3, **kw)
    train(ref, ref_opt, 0, 9, rank=rank)
    train(src, src_opt, 0, stop, rank=rank)
    path = os.path.join(os.environ["ACCUMOPT_TEST_DCP"], f"{kind}-{stop}-{swap}")
    saved = {"model": get_model_state_dict(src), "optim": get_optimizer_state_dict(src, src_opt)}
    dcp.save(saved, checkpoint_id=path)
    sd = {"model": get_model_state_dict(dst), "optim": get_optimizer_state_dict(dst, dst_opt)}
    dcp.load(sd, checkpoint_id=path)
    key = "accumopt" if rank == 0 else f"accumopt.rank{rank}"
    packed = sd["optim"]["param_groups"][0][key]
    if swap:  # each rank is handed the other rank's entry under its own key
        import torch.distributed as dist

        both: list[Any] = [None, None]
        dist.all_gather_object(both, packed)
        sd["optim"]["param_groups"][0][key] = both[1 - rank]
        with pytest.raises(ValueError) as refused:
            set_optimizer_state_dict(dst, dst_opt, sd["optim"])
        return str(refused.value), dst_opt.micro_step
    set_model_state_dict(dst, sd["model"])
    set_optimizer_state_dict(dst, dst_opt, sd["optim"])
    position = (dst_opt.micro_step, dst_opt.updates, dst_opt.will_update)
    train(dst, dst_opt, stop, 9, rank=rank)
    return _full(ref), _full(dst), position, packed


def _rank_refused(rank: int) -> Any:
    """FSDP2 without reduce_every_micro_step, mid-window: both save forms refuse, and training
    goes on as if nothing happened (DCP restored the learning rate, no zero gradient is left)."""
    (ref, ref_opt), (src, src_opt) = _rank_runs("fsdp", 2)
    train(ref, ref_opt, 0, 3, rank=rank)
    train(src, src_opt, 0, 2, rank=rank)  # first window, no inner state yet: DCP's init step
    errors = []
    for save in (lambda: get_optimizer_state_dict(src, src_opt), src_opt.state_dict):
        try:
            save()
            errors.append("not refused")
        except RuntimeError as err:
            errors.append(str(err))
    train(src, src_opt, 2, 3, rank=rank)
    return errors, src_opt.updates, _full(ref) == _full(src)


SCENARIOS: dict[str, Callable[[int], Any]] = {
    "fsdp_reduce_every_mid_window": lambda r: _rank_resume(
        r, "fsdp", 5, reduce_every_micro_step=True
    ),
    "fsdp_closed_window": lambda r: _rank_resume(r, "fsdp", 5.5),
    "fsdp_boundary": lambda r: _rank_resume(r, "fsdp", 6),
    "ddp_mid_window": lambda r: _rank_resume(r, "ddp", 4),
    "fsdp_other_shards": lambda r: _rank_resume(
        r, "fsdp", 5, swap=True, reduce_every_micro_step=True
    ),
    "fsdp_unreduced_refused": _rank_refused,
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    os.environ["ACCUMOPT_TEST_DCP"] = str(tmp_path_factory.mktemp("dcp"))  # the ranks inherit it
    try:
        yield scenarios_on_ranks(__name__, "SCENARIOS", timeout_s=60)
    finally:
        del os.environ["ACCUMOPT_TEST_DCP"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "position"),
    [
        ("fsdp_reduce_every_mid_window", (2, 1, False)),
        ("fsdp_closed_window", (3, 1, True)),
        ("fsdp_boundary", (0, 2, False)),
        ("ddp_mid_window", (1, 1, False)),
    ],
)
def test_dcp_save_load_on_2_ranks_resumes_bit_for_bit(
    ranks: list[dict[str, Any]], scenario: str, position: tuple[int, int, bool]
) -> None:
    for r in ranks:
        reference, resumed_run, got, _ = r[scenario]
        assert tuple(got) == position
        assert resumed_run == reference
    assert ranks[0][scenario][0] == ranks[1][scenario][0]


@pytest.mark.slow
def test_dcp_fsdp2_unreduced_window_is_refused_at_save(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        errors, updates, same = r["fsdp_unreduced_refused"]
        assert len(errors) == 2
        for error in errors:
            assert "held by FSDP2 itself" in error and "reduce_every_micro_step=True" in error
        assert updates == 1 and same  # the window survived the refusal intact


@pytest.mark.slow
def test_dcp_window_of_another_sharding_is_refused_at_load(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        error, micro_step = r["fsdp_other_shards"]
        assert "and is loaded on rank" in error and micro_step == 0  # each rank's own window


@pytest.mark.slow
def test_dcp_window_saved_on_other_ranks_is_refused_at_load(ranks: list[dict[str, Any]]) -> None:
    packed = ranks[0]["ddp_mid_window"][3]
    _load_refused(packed, "saved by rank 0 of 2, and is loaded on rank 0 of 1")
