"""Where this process runs: rank, local rank, world size, node, replica group, shard."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ._config import Config
from ._layout import Layout

# (rank, world size, local rank) variables, in order of preference: torchrun, SLURM (srun), Open MPI's
# mpirun, then MPICH / Intel MPI (Hydra's PMI).
_ENV_SCHEMES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


@dataclass(frozen=True)
class Identity:
    run: str
    rank: int
    world_size: int
    local_rank: int
    node: str
    replica_group: int
    shard: int
    num_shards: int

    def fields(self) -> dict[str, object]:
        """The identity fields of an ingest batch."""
        return {
            "run": self.run,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "node": self.node,
            "replica_group": self.replica_group,
            "shard": self.shard,
            "num_shards": self.num_shards,
        }


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    try:
        value = int(environ[name])
    except (KeyError, ValueError):
        return None
    return value if value >= 0 else None


def _from_torch_distributed() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # a half-initialised process group: fall back to the environment
        return None
    return None


def detect(config: Config, environ: Mapping[str, str] = os.environ) -> Identity:
    """torch.distributed when initialised, else torchrun/SLURM/MPI variables, else a single process."""
    rank, world, local = 0, 1, None
    for rank_var, world_var, local_var in _ENV_SCHEMES:
        env_rank, env_world = _env_int(environ, rank_var), _env_int(environ, world_var)
        if env_rank is not None and env_world is not None and env_rank < env_world:
            rank, world, local = env_rank, env_world, _env_int(environ, local_var)
            break
    from_dist = _from_torch_distributed()
    if from_dist is not None:
        rank, world = from_dist
    if local is None:
        local = _env_int(environ, "LOCAL_RANK")
    node = config.node or socket.gethostname() or "unknown"
    return Identity(
        run=config.run,
        rank=rank,
        world_size=max(world, rank + 1),
        local_rank=local if local is not None else 0,
        node=node[:200],
        replica_group=config.replica_group if config.replica_group is not None else rank,
        shard=config.shard if config.shard is not None else 0,
        num_shards=config.num_shards if config.num_shards is not None else 1,
    )


def with_layout(identity: Identity, layout: Layout | None, config: Config) -> Identity:
    """The identity with the replica group, shard and shards per replica read from the device meshes,
    except those the user set (options win)."""
    if layout is None:
        return identity
    return replace(
        identity,
        replica_group=config.replica_group if config.replica_group is not None else layout.replica_group,
        shard=config.shard if config.shard is not None else layout.shard,
        num_shards=config.num_shards if config.num_shards is not None else layout.num_shards,
    )
