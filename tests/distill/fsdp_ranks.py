"""One optimizer step of the distill loop's pieces under FSDP2, run by torchrun on gloo ranks (CPU); each rank
writes what it saw to <out>/rank<r>.json. Driven by tests/distill/test_loop.py, which computes the same step in one
process. The model is sharded as accelerate's FSDP2 prepare does it: each LlamaDecoderLayer, then the root."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from distill.heldout_eval import cached_eval
from distill.loop import trainable_parameters
from distill.step import ResponseLogits, loss_step
from tests.distill.fsdp_step import SETTINGS, heldout_and_batches, tiny_draft


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    heldout, batches, num_tokens = heldout_and_batches(rank, world)
    draft = tiny_draft()
    before_prepare = trainable_parameters(draft)
    model = ResponseLogits(draft)
    for layer in draft.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = type(next(model.parameters())).__name__
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=SETTINGS.learning_rate)
    loss = sum(loss_step(model, batch, SETTINGS, num_tokens=num_tokens, token_ids=None, device="cpu")
               for batch in batches)
    # FSDP2, like DDP, averages gradients over ranks; the loss is already a share of the global token mean, so the
    # loop scales it by the world size (distill.loop: `accelerator.backward(loss * P)`).
    (loss * world).backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), SETTINGS.max_grad_norm)
    stale = sum(p.grad is not None for p in before_prepare)
    optimizer.step()
    model.eval()
    metrics = cached_eval(model, heldout, None, gamma=3)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "world": world, "loss": total.item(), "grad_norm": float(grad_norm.full_tensor()),
        "sharded": sharded, "grads_on_parameters_before_prepare": stale,
        "eval": metrics}))
    # Both ranks past their last collective before teardown, and no tensor of a gloo work left for interpreter exit:
    # a rank that destroys its group while the other still gathers aborts ("terminate called without an active
    # exception"), as the distill loop's own `wait_for_everyone` before `end_training` prevents.
    dist.barrier()
    del model, optimizer, loss, total, grad_norm
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
