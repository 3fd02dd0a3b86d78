"""Tensor parallelism: what a rank's cache needs from ``torch.distributed`` and from a sharded transformers model.

Under tensor parallelism each rank holds a share of every layer's KV heads, so each rank keeps its own
:class:`~torch_zipkv.CompressedPagedKVCache` of those heads, compressed on its own. Their pages compress differently
(different heads, different data), so the room each rank has left differs; admission must still be one decision for
all ranks, or one rank would run a request that another cannot hold. The cache therefore takes the minimum over the
ranks of its process group (:func:`all_min`) wherever it decides what fits; everything else stays per rank.
"""

from __future__ import annotations

import torch

__all__ = ["all_min", "broadcast_from_first", "check_process_group", "exchange", "host_group", "local_kv_heads",
           "tp_group", "tp_size"]


def check_process_group(process_group):
    """``process_group`` if it is a ``torch.distributed`` process group of more than one rank, else None (a group of
    one agrees with itself: nothing to reduce). TypeError for anything but a ProcessGroup or None."""
    if process_group is None:
        return None
    import torch.distributed as dist

    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(process_group).__name__}")
    return process_group if dist.get_world_size(process_group) > 1 else None


def all_min(values: list[int], process_group, device: torch.device) -> list[int]:
    """The elementwise minimum of ``values`` over the ranks of ``process_group`` (a collective: every rank calls it
    with as many values). Gloo reduces host tensors; a group without gloo (NCCL) reduces on ``device``."""
    import torch.distributed as dist

    backend = str(dist.get_backend(process_group))
    on = torch.device("cpu") if "gloo" in backend or device.type == "cpu" else device
    t = torch.tensor(values, dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=process_group)
    return t.tolist()


def host_group(process_group):
    """A gloo group over the ranks of ``process_group`` (itself if it is gloo already): for what the host decides
    (admission, the engine's per-step exchange), so that those collectives run on the host and never wait for the
    device, as an NCCL collective read back on the host would. Only the group's ranks call it."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend(process_group)):
        return process_group
    return dist.new_group(dist.get_process_group_ranks(process_group), backend="gloo",
                          use_local_synchronization=True)


def exchange(obj, process_group) -> list:
    """Every rank's ``obj`` (picklable), in group rank order, on every rank: a collective."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def broadcast_from_first(obj, process_group):
    """The group's first rank's ``obj`` (picklable), on every rank (the others pass anything): a collective."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, group=process_group, group_src=0)
    return box[0]


def _tp_mesh(model):
    """The 1-D tensor-parallel mesh of a transformers model (its device mesh's "tp" dimension, or the whole mesh
    where it has one unnamed dimension, as transformers once made it), or None."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    if "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
        return mesh["tp"]
    return mesh if mesh.ndim == 1 else None


def tp_size(model) -> int:
    """Ranks a transformers model's layers are sharded across: transformers' ``_tp_size``, else the size of its
    tensor-parallel mesh; 1 for a model that is not sharded."""
    size = getattr(model, "_tp_size", None)
    if size is None:
        mesh = _tp_mesh(model)
        size = 1 if mesh is None else mesh.size()
    return int(size)


def tp_group(model):
    """The tensor-parallel process group of a transformers model sharded with ``tp_plan`` (its device mesh's "tp"
    dimension), or None for a model that is not sharded."""
    if tp_size(model) <= 1:
        return None
    mesh = _tp_mesh(model)
    if mesh is None:
        raise ValueError(f"model is sharded across {tp_size(model)} ranks, but its device mesh "
                         f"{getattr(model, '_device_mesh', None)} has no 'tp' dimension")
    return mesh.get_group()


def _local_rows(weight: torch.Tensor) -> int:
    """Output features of a linear weight held by this rank (a DTensor's local shard, or a plain tensor)."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return local.shape[0]


def local_kv_heads(model, num_kv_heads: int, head_dim: int) -> int:
    """KV heads of each attention layer on this rank: ``num_kv_heads`` (the config's count) for a model that is not
    sharded; under transformers' tensor parallelism (:func:`tp_size` > 1) this rank's share, read from the width
    of each attention module's ``k_proj`` shard (what the module's forward produces). ValueError when the heads do
    not split into whole heads, or split differently across layers: transformers cuts ``k_proj`` into equal row
    slices, so with KV heads not divisible by the TP size a rank would hold part of a head, and the model itself
    fails at its first forward."""
    ranks = tp_size(model)
    if ranks == 1:  # not sharded: the config's count (and no other tower's attention can get in the way)
        return num_kv_heads
    counts = set()
    for name, module in model.named_modules():
        k_proj = getattr(module, "k_proj", None)
        if getattr(module, "layer_idx", None) is None or not isinstance(k_proj, torch.nn.Linear):
            continue
        rows = _local_rows(k_proj.weight)
        if rows != num_kv_heads * head_dim and rows % head_dim:  # sharded mid-head
            raise ValueError(
                f"{num_kv_heads} KV heads do not split evenly across {ranks} tensor-parallel ranks: this rank's "
                f"{name}.k_proj holds {rows} of {num_kv_heads * head_dim} outputs ({rows / head_dim:g} heads of "
                f"{head_dim}); use a TP size that divides the number of KV heads")
        counts.add(rows // head_dim)
    if not counts:
        raise ValueError(f"model is sharded across {ranks} ranks, but it has no attention module with a k_proj "
                         "to read this rank's KV heads from")
    if len(counts) > 1:
        raise ValueError(f"attention layers hold different numbers of KV heads on this rank ({sorted(counts)}); "
                         "the cache needs one count for every layer")
    return counts.pop()
