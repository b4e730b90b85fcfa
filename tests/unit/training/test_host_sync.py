"""The trainer's step reads values back from the device a fixed number of times per
optimizer step, however many micro-batches it accumulates: on CUDA every such read waits
for all queued kernels, so one per micro-batch would keep the host from running ahead.

On CPU the reads are counted by wrapping the Tensor methods that bring a value to the host
(`.item()`, `.tolist()`, `bool()`, `int()`, `float()`...); on CUDA torch's sync debug mode
counts the synchronisations themselves. `.numpy()` is not counted: it works on host tensors
only (the trainer reads the loader's batch with it), so it can never wait on a device."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support.host_sync import BUDGET, HOST_READS, count_host_reads, reads_per_step, trainer
from training.faults import Faults, Hooks


class ReadsLoss(Hooks):
    """The old step's habit: the loss read back on the host after every micro-batch."""

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        loss.item()
        return loss


def test_the_counter_sees_every_kind_of_host_read():
    x = torch.tensor([2.5])
    before = {n: getattr(torch.Tensor, n) for n in HOST_READS}
    with count_host_reads() as counts:
        x.item()
        x.tolist()
        bool(x)
        float(x)
        int(x)
        range(4)[torch.tensor(1)]
        x.cpu()
    assert counts == dict.fromkeys(HOST_READS, 1)
    assert all(getattr(torch.Tensor, n) is before[n] for n in HOST_READS)  # restored


def test_a_read_per_micro_batch_would_show(train_dataset, tmp_path):
    """The count can fail: a step that reads the loss back per micro-batch (as the step
    once did) makes accum - 1 more reads with accum micro-batches."""
    one, _, _ = reads_per_step(trainer(train_dataset, tmp_path / "1", 1, ReadsLoss()), 2)
    four, _, _ = reads_per_step(trainer(train_dataset, tmp_path / "4", 4, ReadsLoss()), 2)
    assert [f - o for f, o in zip(four, one, strict=True)] == [3, 3]


@pytest.mark.parametrize(
    "guards", [{"enabled": False}, {"warmup_steps": 3}], ids=["no-guards", "spike-guard"]
)
def test_host_reads_per_step_do_not_grow_with_micro_batches(train_dataset, tmp_path, guards):
    """accum 1 and accum 4 (same micro-batch) read the same number of times per optimizer
    step, a few; with the spike guard on, a step it drops costs no extra read either."""
    spike = Faults(spike_at={6}, spike_factor=1000.0)
    one, ours1, acts1 = reads_per_step(
        trainer(train_dataset, tmp_path / "1", 1, spike, guards=guards), 8
    )
    four, ours4, acts4 = reads_per_step(
        trainer(train_dataset, tmp_path / "4", 4, spike, guards=guards), 8
    )
    assert one == four, (one, four)
    assert ours1 == ours4 == [BUDGET] * 8, (ours1, ours4)
    if guards.get("enabled", True):
        assert acts1[6] == acts4[6] == "skip"
        assert acts1[:6] == acts4[:6] == ["ok"] * 6
    else:
        assert acts4 == ["ok"] * 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_synchronisations_per_step_do_not_grow_with_micro_batches(train_dataset, tmp_path):
    """torch's sync debug mode warns at each synchronisation with the device."""

    def syncs(accum: int) -> list[int]:
        t = trainer(train_dataset, tmp_path / str(accum), accum, device="cuda")
        counts = []
        try:
            t.train_step()  # the first step sets up (optimizer state, allocator)
            for _ in range(3):
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        t.train_step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                counts.append(sum("synchronizing" in str(w.message) for w in seen))
        finally:
            t.loader.close()
            t.ckpts.close()
        return counts

    one, four = syncs(1), syncs(4)
    assert one == four, (one, four)
    assert max(four) <= 2, four
