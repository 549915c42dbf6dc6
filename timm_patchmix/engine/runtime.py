"""The process a run trains in: its device and place among DDP processes, sums over them, and the seeds."""
from __future__ import annotations

import atexit
import types
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from .errors import TrainSetupError

__all__ = ['Runtime', 'init_runtime', 'release_runtime', 'reduce_sum', 'seed_all', 'epoch_seed', 'StridedSampler']


@dataclass(frozen=True)
class Runtime:
    """Where this process trains: its device, its rank among ``world_size`` processes, and whether this run
    started the process group (which then ends when the process exits)."""
    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def primary(self) -> bool:
        return self.rank == 0


def init_runtime(device: Optional[str] = None) -> Runtime:
    """The device (default: CUDA when present, else the CPU) and, under torchrun, SLURM or MPI, the process group,
    through ``timm.utils.init_distributed_device`` (NCCL on GPUs, gloo on the CPU). A process group that already
    exists is joined as it is and left for its owner to end."""
    from timm.utils import init_distributed_device
    from ..cli_types import device_problem
    name = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    problem = device_problem(name)
    if problem is not None:
        raise TrainSetupError(f'--device {name}: {problem}')
    if dist.is_initialized():
        from timm.utils import world_info_from_env
        local_rank = world_info_from_env()[0]
        dev = torch.device(f'cuda:{local_rank}' if name.startswith('cuda') and ':' not in name else name)
        if dev.type == 'cuda':
            torch.cuda.set_device(dev)
        return Runtime(dev, dist.get_rank(), local_rank, dist.get_world_size(), owns_group=False)
    ns = types.SimpleNamespace(device=name, dist_backend=None, dist_url=None)  # timm's function fills it in
    dev = init_distributed_device(ns)
    if dev.type == 'cuda' and dev.index is None:
        dev = torch.device('cuda', torch.cuda.current_device())
    return Runtime(dev, ns.rank, ns.local_rank, ns.world_size, owns_group=ns.distributed)


def release_runtime(rt: Runtime, finished: bool) -> None:
    """After a finished run, wait until every process has arrived. A process group this run started stays for the
    process's later runs (torchrun's store cannot host a second one: gloo would read the first group's addresses)
    and ends when the process exits."""
    if rt.owns_group and dist.is_initialized():
        if finished:
            dist.barrier()
        end_group_at_exit()


_END_AT_EXIT = []


def end_group_at_exit() -> None:
    """End the process group, if one is still up, when the process exits (registered once)."""
    if not _END_AT_EXIT:
        atexit.register(_end_group)
        _END_AT_EXIT.append(True)


def _end_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def reduce_sum(values: List[float], device) -> List[float]:
    """``values`` summed over the processes of the group (as they are without one), in float64."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (``timm.utils.random_seed``) with ``seed`` taken modulo 2**32, the range all
    three accept."""
    from timm.utils import random_seed
    random_seed(seed % (2 ** 32))


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """Each epoch's augmentation and mixing streams derive from (seed, rank, epoch), so a resumed run replays them."""
    return (seed * 1_000_003 + rank * 10_007 + epoch) % (2 ** 63)


class StridedSampler(torch.utils.data.Sampler):
    """Rank r gets items r, r + W, r + 2W...: no padding, so reduced metrics count each image once."""

    def __init__(self, n: int, rank: int, world: int):
        self.indices = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)
