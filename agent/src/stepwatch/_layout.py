"""Which part of the model this rank holds, read from its parameters' device meshes (DTensor).

FSDP2 (`fully_shard`), HSDP (a 2-D mesh: replicate x shard), tensor parallel (`parallelize_module`) and
their mixes make parameters DTensors: each knows its mesh (the ranks it spans, one coordinate per mesh
dimension) and a placement per dimension (`Shard(d)`: split along d; `Replicate()`: a full copy).

- A mesh dimension on which any parameter is split is a *shard* dimension: ranks that differ there hold
  different values. The rank's shard index is its coordinate over those dimensions (row-major) and
  `num_shards` their product.
- The others (every parameter replicated there: HSDP's replicate dimension) are *replica* dimensions;
  so are the ranks outside the mesh (DDP over tensor-parallel groups: each group has its own mesh).
  `replica_group` tells the copies apart: the coordinate over the replica dimensions, offset by the
  mesh's lowest rank (distinct per mesh).
- Ranks with the same shard index in different replica groups must hold bit-identical parameters: the
  only ones whose fingerprints are compared. With as many shards as ranks (FSDP2 or TP over all ranks)
  there is nothing to compare.
- A gradient norm is combined over the shards of one replica from each rank's sum of squares. A
  parameter replicated over some shard dimensions (a norm's weight under TP, a plain tensor beside
  DTensors) is held by several ranks of one replica: its square counts 1/copies on each.

Reading the layout touches no device memory: meshes and placements are host objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `import stepwatch` needs no torch
    import torch


@dataclass(frozen=True)
class Layout:
    shard: int
    num_shards: int
    replica_group: int
    replicas: int  # copies of every shard across the world (1: no fingerprint has a peer)
    copies: tuple[float, ...]  # per parameter (model.parameters() order): ranks of one replica holding it
    description: str  # e.g. "2 shards x 2 replicas (mesh dp_replicate=2, dp_shard=2)"


def _placements(p: torch.Tensor) -> tuple[object, tuple[object, ...]] | None:
    mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
    if mesh is None or placements is None:
        return None
    return mesh, tuple(placements)


def _replicated(placement: object) -> bool:
    is_replicate = getattr(placement, "is_replicate", None)
    return bool(is_replicate()) if callable(is_replicate) else False


def from_params(params: list[torch.Tensor], rank: int, world_size: int) -> Layout | None:
    """The layout of `rank`, or None when no parameter is a DTensor (DDP, a single process)."""
    placed = [(i, pl) for i, p in enumerate(params) if (pl := _placements(p)) is not None]
    if not placed:
        return None
    # The mesh with the most dimensions (then ranks) is the model's: FSDP2 x TP params live on the 2-D one.
    meshes = {id(m): m for _, (m, _) in placed}
    mesh = max(meshes.values(), key=lambda m: (m.ndim, m.size()))  # type: ignore[attr-defined]
    coord = mesh.get_coordinate()  # type: ignore[attr-defined]
    if coord is None:  # this rank is not in the model's mesh: nothing to say
        return None
    sizes = tuple(int(s) for s in mesh.shape)  # type: ignore[attr-defined]
    on_mesh = [pls for _, (m, pls) in placed if m is mesh]
    split = tuple(any(not _replicated(pls[d]) for pls in on_mesh) for d in range(len(sizes)))
    shard_dims = [d for d in range(len(sizes)) if split[d]]
    replica_dims = [d for d in range(len(sizes)) if not split[d]]

    def ravel(dims: list[int]) -> int:
        index = 0
        for d in dims:
            index = index * sizes[d] + int(coord[d])
        return index

    num_shards = math.prod(sizes[d] for d in shard_dims)
    in_mesh = math.prod(sizes[d] for d in replica_dims)
    lowest = int(mesh.mesh.min())  # type: ignore[attr-defined]
    replica_group = lowest * in_mesh + ravel(replica_dims)
    replicas = max(1, world_size // max(num_shards, 1))
    by_index = dict(placed)
    copies: list[float] = []
    for i in range(len(params)):
        pl = by_index.get(i)
        if pl is None:  # a plain tensor beside DTensors: a full copy on every shard of the replica
            copies.append(float(num_shards))
        elif pl[0] is mesh:
            copies.append(float(math.prod(sizes[d] for d in shard_dims if _replicated(pl[1][d]))))
        else:  # on another (smaller) mesh: replicated wherever that mesh has no split of its own
            other_sizes: list[int] = [int(x) for x in pl[0].shape]  # type: ignore[attr-defined]
            own = math.prod(n for n, q in zip(other_sizes, pl[1], strict=True) if not _replicated(q))
            copies.append(float(max(1, num_shards // max(1, own))))
    names = getattr(mesh, "mesh_dim_names", None) or tuple(f"dim{d}" for d in range(len(sizes)))
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, sizes, strict=True))
    plural = {True: "s", False: ""}
    description = f"{num_shards} shard{plural[num_shards != 1]} x {replicas} replica{plural[replicas != 1]} (mesh {dims})"
    return Layout(int(ravel(shard_dims)), num_shards, replica_group, replicas, tuple(copies), description)
