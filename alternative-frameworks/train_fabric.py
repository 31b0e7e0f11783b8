"""Chapter 04's FSDP2 training loop with Lightning Fabric: Fabric starts the process group, builds the device mesh and
applies our parallelize function (chapter 04's shard_model) through its ModelParallelStrategy; the loop stays ours.

    torchrun --standalone --nproc-per-node 2 alternative-frameworks/train_fabric.py    # no GPU: 2 CPU processes
"""

import os
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy

import common


def main():
    args = common.parse_args()
    common.require(not args.cpu_offload and not args.async_checkpoint and args.exit_after_steps is None,
                   "--cpu-offload, --async-checkpoint and --exit-after-steps are chapter 04's; leave them out here")
    cuda = torch.cuda.is_available()
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16 if cuda else torch.float32
    # NOTE: Fabric hands the parallelize function a 2-D mesh (data_parallel x tensor_parallel); FSDP2 takes the first.
    strategy = ModelParallelStrategy(
        parallelize_fn=lambda model, mesh: common.shard_model(model, mesh["data_parallel"], dtype, False) or model,
        data_parallel_size=int(os.environ.get("WORLD_SIZE", 1)), tensor_parallel_size=1)
    # NOTE: under torchrun Fabric only joins the processes torchrun started; devices and num_nodes must match them.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    fabric = Fabric(accelerator="cuda" if cuda else "cpu", devices=local_world_size, strategy=strategy,
                    num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local_world_size, precision="32-true")
    fabric.launch()
    rank, world_size, device = fabric.global_rank, fabric.world_size, fabric.device
    common.ch04.setup_logging(rank)
    common.LOGGER.info(f"fabric: {type(fabric.strategy).__name__}, {world_size} processes, device {device}")
    experiment_dir = Path(args.save_dir) / args.experiment_name
    experiment_dir.mkdir(parents=True, exist_ok=True)

    config, model, dataset = common.build_model_and_data(args)
    samples_per_step = args.batch_size * args.grad_accum * world_size
    steps_per_epoch = len(dataset) // samples_per_step
    common.require(steps_per_epoch > 0, f"{len(dataset)} sequences are fewer than one step's {samples_per_step}")
    max_steps = args.max_steps if args.num_epochs is None else args.num_epochs * steps_per_epoch
    # NOTE: the module first, then the optimizer over its DTensor shards: FSDP2 replaces the parameters.
    model = fabric.setup_module(model)
    # NOTE: .module is the model inside Fabric's wrapper: its parameter names (the seeds) are chapter 04's.
    common.init_weights(model.module, args.seed)
    optimizer, lr_scheduler = common.adamw_and_schedule(model.parameters(), args, max_steps)
    optimizer = fabric.setup_optimizers(optimizer)
    common.LOGGER.info(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")

    # NOTE: chapter 04's sampler, not fabric.setup_dataloaders(): that would put a DistributedSampler of its own
    # over the dataset, with another order than chapter 04's (seeded, then dealt out).
    train_state = {"step": 0, "epoch": 0, "samples_seen_in_epoch": 0}
    micro_batches = common.get_micro_batches(dataset, args, train_state, device, rank, world_size)
    metrics_file = open(experiment_dir / "metrics.jsonl", "a") if rank == 0 else None
    model.train()
    tokens_since_log, time_of_last_log = 0, time.perf_counter()
    for step in range(1, max_steps + 1):
        step_loss = torch.zeros((), device=device)
        for _ in range(args.grad_accum):
            input_ids = next(micro_batches)["input_ids"].to(device)
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss / args.grad_accum
            fabric.backward(loss)
            step_loss += loss.detach()
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=args.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_state["step"] = step
        train_state["samples_seen_in_epoch"] += samples_per_step
        tokens_since_log += samples_per_step * args.seq_length

        if step % args.log_freq == 0 or step == max_steps:
            loss_value = fabric.all_reduce(step_loss, reduce_op="mean").item()
            tokens_per_second = tokens_since_log / (time.perf_counter() - time_of_last_log)
            tokens_since_log, time_of_last_log = 0, time.perf_counter()
            record = {"step": step, "epoch": train_state["epoch"], "loss": loss_value,
                      "lr": lr_scheduler.get_last_lr()[0], "grad_norm": grad_norm.item(),
                      "tokens_per_second": tokens_per_second}
            if metrics_file:
                common.log_metrics(metrics_file, record)
    if metrics_file:
        metrics_file.close()
    common.LOGGER.info(f"done: step {train_state['step']} of {max_steps}")


if __name__ == "__main__":
    main()
