"""The process group of a distributed encode, launched with `torchrun` (one process per GPU, any number of nodes).

Work units are assigned round-robin by rank, so the assignment depends only on the plan and the world size, and
every unit is computed the same way whichever rank runs it: the artifact is byte-identical for any world size.
Ranks exchange nothing but barriers (gloo, CPU-side); finished units travel through the shared work dir.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

BARRIER_TIMEOUT = datetime.timedelta(hours=48)  # rank 0 waits at the end for the slowest rank's last unit


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mine(self, units: list) -> list:
        return units[self.rank :: self.world]

    def device(self, device: str) -> str:
        """This rank's GPU: 'cuda' becomes cuda:LOCAL_RANK; other devices are kept."""
        return f"cuda:{self.local_rank}" if device == "cuda" and self.world > 1 else device

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def join() -> Ranks:
    """Join the group torchrun describes in the environment (WORLD_SIZE > 1), else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
    return Ranks(
        torch.distributed.get_rank(), torch.distributed.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    )


def leave(ranks: Ranks) -> None:
    if ranks.world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
