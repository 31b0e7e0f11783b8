"""Chapter 04's FSDP2 training loop with Hugging Face Accelerate: the Accelerator starts the process group, picks the
device and shards the model with its FSDP2 plugin; the loop stays ours.

    torchrun --standalone --nproc-per-node 2 alternative-frameworks/train_accelerate.py    # no GPU: 2 CPU processes
"""

import time
from pathlib import Path

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType

import common


def main():
    args = common.parse_args()
    common.require(not args.cpu_offload and not args.async_checkpoint and args.exit_after_steps is None,
                   "--cpu-offload, --async-checkpoint and --exit-after-steps are chapter 04's; leave them out here")
    # NOTE: fsdp_version=2 is fully_shard(); one group per decoder layer, named as chapter 04 groups them.
    # NOTE: cpu_ram_efficient_loading=False: every rank builds the full model; init_weights() overwrites it anyway.
    fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True, cpu_ram_efficient_loading=False, state_dict_type="SHARDED_STATE_DICT")
    # NOTE: "no" is fp32 everywhere, chapter 04's --dtype auto on the CPU; "bf16" its default on GPUs.
    cpu = not torch.cuda.is_available()
    accelerator = Accelerator(cpu=cpu, fsdp_plugin=fsdp_plugin, mixed_precision="bf16" if args.dtype == "bfloat16"
                              else "no" if cpu or args.dtype == "float32" else "bf16")
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        # NOTE: Accelerate drops the FSDP plugin on the CPU (multi-CPU is DDP-only there); fully_shard() itself runs
        # on gloo, so the plugin is put back by hand. On GPUs this branch never runs.
        accelerator.state.distributed_type, accelerator.state.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
    rank, world_size, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    common.ch04.setup_logging(rank)
    common.LOGGER.info(f"accelerate: {accelerator.distributed_type}, {world_size} processes, device {device}")
    experiment_dir = Path(args.save_dir) / args.experiment_name
    experiment_dir.mkdir(parents=True, exist_ok=True)

    config, model, dataset = common.build_model_and_data(args)
    samples_per_step = args.batch_size * args.grad_accum * world_size
    steps_per_epoch = len(dataset) // samples_per_step
    common.require(steps_per_epoch > 0, f"{len(dataset)} sequences are fewer than one step's {samples_per_step}")
    max_steps = args.max_steps if args.num_epochs is None else args.num_epochs * steps_per_epoch
    optimizer, lr_scheduler = common.adamw_and_schedule(model.parameters(), args, max_steps)
    # NOTE: model and optimizer in one prepare(): FSDP2 replaces the parameters by DTensor shards, and Accelerate
    # points the optimizer at the shards. The scheduler is not prepared: Accelerate would step it once per process.
    model, optimizer = accelerator.prepare(model, optimizer)
    common.init_weights(model, args.seed)
    common.LOGGER.info(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")

    # NOTE: chapter 04's sampler, not accelerator.prepare(dataloader): that deals whole batches to ranks in turn,
    # another order than DistributedSampler's (rank r gets samples r, r + world_size, ...).
    train_state = {"step": 0, "epoch": 0, "samples_seen_in_epoch": 0}
    micro_batches = common.get_micro_batches(dataset, args, train_state, device, rank, world_size)
    metrics_file = open(experiment_dir / "metrics.jsonl", "a") if accelerator.is_main_process else None
    model.train()
    tokens_since_log, time_of_last_log = 0, time.perf_counter()
    for step in range(1, max_steps + 1):
        step_loss = torch.zeros((), device=device)
        for _ in range(args.grad_accum):
            input_ids = next(micro_batches)["input_ids"].to(device)
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss / args.grad_accum
            accelerator.backward(loss)
            step_loss += loss.detach()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_state["step"] = step
        train_state["samples_seen_in_epoch"] += samples_per_step
        tokens_since_log += samples_per_step * args.seq_length

        if step % args.log_freq == 0 or step == max_steps:
            loss_value = accelerator.reduce(step_loss, reduction="mean").item()
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
    accelerator.end_training()


if __name__ == "__main__":
    main()
