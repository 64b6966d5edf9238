"""Data parallelism across processes (several GPUs, or several CPU processes): who this process is, and the
few collectives that training and data generation need.

Launch any `dflashkit train` or `dflashkit data` command with ``torchrun --nproc-per-node N -m dflashkit ...``:
torchrun sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` and a rendezvous address, :func:`from_environment` joins
the process group (NCCL on CUDA, gloo on the CPU), and each process takes its share of the work. Without
torchrun the same commands run as one process, and every collective here is a no-op.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import Tensor

from dflashkit.errors import InvalidInputError

# τ estimates and checkpoints run on the first process while the others wait for it: allow them time
TIMEOUT = timedelta(minutes=60)


@dataclass(frozen=True)
class Parallel:
    """This process's place among ``world_size`` data-parallel processes (rank 0 writes logs and files)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this process group was joined by from_environment (close() leaves it)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, count: int) -> range:
        """The contiguous part of ``count`` items (rows of a batch) that this process takes; may be empty."""
        base, extra = divmod(count, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def all_sum(self, tensor: Tensor) -> Tensor:
        """The element-wise sum of ``tensor`` over all processes (a new tensor; ``tensor`` itself is unchanged)."""
        total = tensor.detach().clone()
        if self.enabled:
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
        return total

    def any(self, flag: bool, device: torch.device | str = "cpu") -> bool:
        """True on every process when ``flag`` is true on at least one (e.g. a stop request one of them got)."""
        if not self.enabled:
            return flag
        return bool(self.all_sum(torch.tensor([int(flag)], device=device)).item())

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """Run the block on the first process, then on the others: what fills a cache they share (the embedded
        target's conversion, a download) happens once."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def close(self) -> None:
        """Leave the process group at the end of a command, if the command joined it (a caller that set one up
        before calling the command keeps it)."""
        if self.owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def gather_objects(self, obj: object) -> list[object]:
        """Every process's ``obj`` (picklable), in rank order, on every process."""
        if not self.enabled:
            return [obj]
        out: list[object] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out


SINGLE = Parallel()


def from_environment(device: str = "cpu") -> tuple[Parallel, str]:
    """This process's :class:`Parallel` and the device it should use, from torchrun's environment.

    Under torchrun (``WORLD_SIZE`` > 1) this joins the default process group unless already in one; ``device``
    ``"cuda"``
    becomes ``"cuda:LOCAL_RANK"`` (one GPU per process). Without torchrun: one process, ``device`` unchanged.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE, device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    kind = torch.device(device).type
    if kind == "cuda":
        if torch.device(device).index is not None:
            raise InvalidInputError(
                f"--device {device}: under torchrun each process takes the GPU of its local rank; pass --device cuda"
            )
        if local_rank >= torch.cuda.device_count():
            raise InvalidInputError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                "start at most that many processes per node"
            )
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    elif kind != "cpu":
        raise InvalidInputError(f"data-parallel runs support cpu and cuda devices, not {device!r}")
    owns = not torch.distributed.is_initialized()
    if owns:
        if kind == "cuda":  # bound to this process's GPU (NCCL's barrier need not guess it)
            torch.distributed.init_process_group("nccl", timeout=TIMEOUT, device_id=torch.device(device))
        else:
            torch.distributed.init_process_group("gloo", timeout=TIMEOUT)
    return Parallel(rank=rank, world_size=world, local_rank=local_rank, owns_group=owns), device
