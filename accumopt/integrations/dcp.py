"""``torch.distributed.checkpoint`` (DCP) with a plain ``Accumulate`` wrapper: nothing to call.

DCP's ``get_optimizer_state_dict(model, opt)`` (the FSDP2 checkpoint path of Accelerate,
Lightning's ModelParallelStrategy, torchtitan) keeps only two parts of ``opt.state_dict()``:
``"state"`` (per parameter, keys turned into parameter names) and ``"param_groups"`` (extra
keys kept). ``dcp.load`` fills only the keys of the template a fresh optimizer gives, and
``set_optimizer_state_dict`` hands the result to ``opt.load_state_dict``. Both first call
``step()`` once, with zero gradients and every lr 0, on an optimizer with no state and no
``.grad`` (``_init_optim_state``), so that the template has state tensors to fill.

So the wrapper's ``"accumopt"`` entry (``accumopt._checkpoint``), when DCP asks, travels in
param group 0 as one ``bytes`` value: one key on every rank, window open or not, that a fresh
wrapper's template has too. Inside it: ``{"world_size": W, "entries": [bytes]}``, each a
``torch.save`` of an entry, DTensor gradients as this rank's local shard. Mid-window on several
ranks each rank's window is its own (DCP stores one copy of a key), so the entries of all ranks
are gathered (one ``all_gather_object`` of the window's size per rank, host memory) and each
rank loads its own. Package-internal: ``accumopt._checkpoint`` and the wrapper call these.

Refused, with what to do: ``flatten_optimizer_state_dict=True`` (at save: DCP's unflattening
would drop the entry), a window saved on other ranks or another sharding (at load).
"""

from __future__ import annotations

import io
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_map_only

from accumopt import _grads

if TYPE_CHECKING:
    from accumopt.accumulate import AccumulatingOptimizer

_DCP = "torch.distributed.checkpoint.state_dict"

FLATTENED = (
    "Accumulate.state_dict: called by torch.distributed.checkpoint's get_optimizer_state_dict "
    "with StateDictOptions(flatten_optimizer_state_dict=True); at load DCP rebuilds such a "
    "dict from the keys the live optimizer has, so accumopt's entry (the open window, updates, "
    "the schedule's position) would be dropped without a word; expected "
    "flatten_optimizer_state_dict=False (the default). Nothing was saved."
)


def caller_checked() -> bool:
    """Whether ``state_dict()`` is called by DCP's ``get_optimizer_state_dict`` (from its
    private ``_get_optim_state_dict``, the first caller outside accumopt).

    Raises:
        ValueError: DCP was asked for a flattened optimizer state dict (:data:`FLATTENED`).
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("accumopt"):
        frame = frame.f_back
    if frame is None or frame.f_globals.get("__name__") != _DCP:
        return False
    if getattr(frame.f_locals.get("info"), "flatten_optimizer_state_dict", False):
        raise ValueError(FLATTENED)
    return True


def _dtensor() -> Any:
    """``DTensor`` if the program imported it (else no tensor can be one), or None."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: Any) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def pack(opt: AccumulatingOptimizer, entry: dict[str, Any]) -> bytes:
    """``entry`` (the plain form's ``"accumopt"`` dict) in DCP form (module docstring).

    Tensors are copied into the bytes in their own dtype and shape (a DTensor as this rank's
    local shard). Mid-window on W > 1 ranks a collective of every rank (``all_gather_object``
    on accumopt's gloo group; every rank then holds W windows in host memory), as DCP's own
    calls are: all ranks save together.
    """
    dtensor, ranks = _dtensor(), opt._ranks
    if dtensor is not None:
        entry = tree_map_only(dtensor, lambda t: t.to_local(), entry)
    world = 1 if ranks is None else ranks.world_size
    parts: list[Any] = [_to_bytes(entry)]
    if ranks is not None and world > 1 and opt._window.micro_step:
        mine, parts = parts[0], [None] * world
        dist.all_gather_object(parts, mine, group=ranks.side)
    return _to_bytes({"world_size": world, "entries": parts})


def unpack(opt: AccumulatingOptimizer, state_dict: dict[str, Any], key: str) -> dict[str, Any]:
    """A dict from DCP's ``set_optimizer_state_dict`` (the packed entry under ``key`` in a
    param group) in the plain form: this rank's entry under ``key``, its shards as DTensors
    like the parameters. Any other dict is returned unchanged.

    Raises:
        ValueError: the packed entry cannot be read; it holds an open window saved on another
            number of ranks, or shards of other shapes (another sharding). Nothing changed.
    """
    groups = state_dict.get("param_groups")
    groups = groups if isinstance(groups, list) else []
    packed = [g[key] for g in groups if isinstance(g, dict) and key in g]
    if not packed:
        return state_dict
    ranks = opt._ranks
    ours, rank = (1, 0) if ranks is None else (ranks.world_size, dist.get_rank(ranks.side))
    try:
        outer = _from_bytes(packed[0])
        world, entries = int(outer["world_size"]), outer["entries"]
        entry = _from_bytes(entries[rank if len(entries) > 1 and world == ours else 0])
        window = entry["window"]
    except Exception as err:
        raise ValueError(
            "Accumulate.load_state_dict: the accumopt entry that torch.distributed.checkpoint "
            f"loaded into param group 0 cannot be read ({type(err).__name__}: {err}); expected "
            "the bytes that Accumulate.state_dict() packs there for DCP. Load an intact "
            "checkpoint. Nothing was changed."
        ) from err
    if (window is not None or len(entries) > 1) and world != ours:
        raise ValueError(
            f"Accumulate.load_state_dict: the checkpoint was saved mid-window on {world} "
            f"rank(s), this wrapper trains on {ours}; expected the same ranks, since each "
            "rank's part of an open window is its own. Resume on the same ranks (then save at "
            "a boundary, opt.micro_step == 0, to change them). Nothing was changed."
        )
    if window is not None:
        params = _grads.params_of(opt.param_groups)
        for kind in ("grads", "buffer"):
            window[kind] = {i: _shard_like(i, t, params) for i, t in window[kind].items()}
    groups = [{k: v for k, v in g.items() if k != key} for g in groups]
    return {**state_dict, "param_groups": groups, key: entry}


def _shard_like(i: int, tensor: Tensor, params: list[Tensor]) -> Tensor:
    """``tensor`` (a local shard saved by :func:`pack`) as a DTensor like ``params[i]`` if
    that is one; ValueError if this rank's shard has another shape (another sharding)."""
    dtensor = _dtensor()
    param: Any = params[i] if i < len(params) else None
    if dtensor is None or not isinstance(param, dtensor) or isinstance(tensor, dtensor):
        return tensor
    local = param.to_local()
    if tuple(local.shape) != tuple(tensor.shape):
        raise ValueError(
            f"Accumulate.load_state_dict: the checkpoint's window holds a shard of shape "
            f"{tuple(tensor.shape)} for parameter {i}, this rank's shard has shape "
            f"{tuple(local.shape)}; expected the sharding the window was saved with (the same "
            "ranks, mesh and placements). Resume with that sharding (then save at a boundary "
            "to reshard). Nothing was changed."
        )
    shard: Tensor = dtensor.from_local(
        tensor.to(local.device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    return shard


def dcp_init_step(opt: AccumulatingOptimizer) -> bool:
    """Whether this ``step()`` is DCP's optimizer-state initialisation; if so, run it.

    That is a ``step()`` with no backward pass since the last one, an empty inner state, every
    lr 0 and every trainable ``.grad`` all zeros (``_init_optim_state``, module docstring).
    Between windows the inner optimizer then steps once (its state is created, as for a bare
    optimizer, so that ``dcp.load`` has tensors to fill; ``updates`` does not count it); inside
    an open window nothing steps. Either way the zero gradients are removed (``.grad`` None),
    so DCP's ``zero_grad()`` after it, a no-op inside a window, leaves nothing behind.

    Returns:
        True when it was that call (``step()`` then returns at once); False, changing
        nothing, otherwise (``step()`` goes on: a missing backward pass is refused there).
    """
    inner, window = opt.optimizer, opt._window
    if inner.state or not window.stepped or window.closed:
        return False
    if any(float(g.get("lr", 0.0)) != 0.0 for g in opt.param_groups):
        return False
    params = [p for p in _grads.params_of(opt.param_groups) if p.requires_grad]
    dtensor = _dtensor()
    for p in params:
        grad: Any = p.grad
        if dtensor is not None and isinstance(grad, dtensor):
            grad = grad.to_local()
        if grad is None or grad.is_sparse or bool(grad.any()):
            return False
    if params and not window.micro_step:
        opt._inner_stepping = True
        try:
            inner.step()
        finally:
            opt._inner_stepping = False
    for p in params:
        p.grad = None
    return bool(params)
