"""torchrun support: rank/world from the environment, gather of accumulator states (and of the images each
rank could not read) to rank 0.

`torchrun --nproc_per_node=N -m vitscope run ...` sets RANK / WORLD_SIZE; the process group uses gloo on
CPU and nccl on GPU. Without those variables everything here is a no-op for a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as tdist


def local_rank() -> int | None:
    """This process's rank on its machine under torchrun (``LOCAL_RANK``), None outside it."""
    v = os.environ.get("LOCAL_RANK", "")
    return int(v) if v.isdigit() else None


def rank_device(device: str, local: int | None, n_gpus: int) -> str:
    """The device a torchrun rank computes on: a bare ``cuda`` is the rank's own GPU on its machine (its
    ``local`` rank modulo the ``n_gpus`` there), so N ranks on one machine use N GPUs; an explicit index
    (``cuda:1``), any other device, or a process outside torchrun, as given."""
    if device == "cuda" and local is not None and n_gpus > 0:
        return f"cuda:{local % n_gpus}"
    return device


def backend_for(cuda: bool, device_env: str, local_world: int, n_gpus: int) -> str:
    """The process group's backend: NCCL where every rank on this machine can have a GPU of its own (NCCL
    refuses two ranks on one GPU), else gloo: on the CPU, and when torchrun starts more processes on a machine
    (``local_world``, torchrun's LOCAL_WORLD_SIZE) than it has GPUs, which then share them. vitscope's gathers
    are pickled CPU states (`Dist.gather`), which gloo carries as well."""
    if not cuda or device_env == "cpu" or n_gpus < 1 or local_world > n_gpus:
        return "gloo"
    return "nccl"


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @classmethod
    def from_env(cls) -> Dist:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not tdist.is_initialized():
            import torch

            cuda = torch.cuda.is_available()
            n_gpus = torch.cuda.device_count() if cuda else 0
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
            device_env = os.environ.get("VITSCOPE_DEVICE", "")
            backend = backend_for(cuda, device_env, local_world, n_gpus)
            if cuda and n_gpus and device_env != "cpu":  # before the group forms
                torch.cuda.set_device(torch.device(rank_device("cuda", local_rank(), n_gpus)))
            if backend == "gloo" and cuda and n_gpus and local_world > n_gpus and local_rank() == 0:
                import sys

                print(f"vitscope: torchrun started {local_world} processes on this machine, which has {n_gpus} "
                      f"GPU(s): ranks share them (gloo gathers the states; NCCL needs one GPU per process)",
                      file=sys.stderr)
            tdist.init_process_group(backend=backend)
        return cls(tdist.get_rank(), tdist.get_world_size())

    def device(self, device: str) -> str:
        """`rank_device` of this process (torchrun with several processes), else ``device`` as given."""
        if self.world <= 1:
            return device
        import torch

        return rank_device(device, local_rank(), torch.cuda.device_count() if torch.cuda.is_available() else 0)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            tdist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (every rank gets the list). Single process: [obj]."""
        if self.world == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world
        tdist.all_gather_object(gathered, obj)
        return gathered

    def gather_states(self, jobs: list[Any]) -> list[list[dict[str, Any]]]:
        """Per job, the state of every rank in rank order (rank 0's first). Single process: [[own]]."""
        gathered = self.gather([j.analysis.state_dict() for j in jobs])
        return [[gathered[r][i] for r in range(self.world)] for i in range(len(jobs))]
