"""Chapter 04's training with DeepSpeed ZeRO stage 3: its engine partitions the parameters, gradients and AdamW state
over the ranks (FSDP's sharding, in DeepSpeed's flat buffers), clips, steps and schedules; the loop stays ours.

    torchrun --standalone --nproc-per-node 2 alternative-frameworks/train_deepspeed.py    # no GPU: 2 CPU processes
"""

import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import common


def main():
    args = common.parse_args()
    common.require(not args.cpu_offload and not args.async_checkpoint and args.exit_after_steps is None,
                   "--cpu-offload, --async-checkpoint and --exit-after-steps are chapter 04's; leave them out here")
    cuda = torch.cuda.is_available()
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16 if cuda else torch.float32
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    common.ch04.setup_logging(rank)
    common.LOGGER.info(f"deepspeed {deepspeed.__version__}: ZeRO-3, {world_size} processes, device {device}")
    experiment_dir = Path(args.save_dir) / args.experiment_name
    experiment_dir.mkdir(parents=True, exist_ok=True)

    config, model, dataset = common.build_model_and_data(args)
    samples_per_step = args.batch_size * args.grad_accum * world_size
    steps_per_epoch = len(dataset) // samples_per_step
    common.require(steps_per_epoch > 0, f"{len(dataset)} sequences are fewer than one step's {samples_per_step}")
    max_steps = args.max_steps if args.num_epochs is None else args.num_epochs * steps_per_epoch
    # NOTE: the whole model's weights, before DeepSpeed partitions them: the values chapter 04's shards hold.
    common.init_full_weights(model, args.seed)
    optimizer, lr_scheduler = common.adamw_and_schedule(model.parameters(), args, max_steps)
    # NOTE: what chapter 04's flags say, in DeepSpeed's JSON. Our torch AdamW is "untested" to ZeRO: allowed here.
    ds_config = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": args.grad_accum,
                 "gradient_clipping": args.max_grad_norm, "zero_optimization": {"stage": 3},
                 "bf16": {"enabled": dtype == torch.bfloat16}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 2 ** 31}
    # NOTE: the engine steps the scheduler at each optimizer step, and scales each loss by 1 / grad_accum.
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(model=model.to(device), optimizer=optimizer,
                                                              lr_scheduler=lr_scheduler, config=ds_config)
    common.LOGGER.info(f"model: {sum(p.ds_numel for p in model.parameters()) / 1e6:.1f}M parameters")

    # NOTE: chapter 04's sampler, not deepspeed.initialize(training_data=...): that would deal samples its own way.
    train_state = {"step": 0, "epoch": 0, "samples_seen_in_epoch": 0}
    micro_batches = common.get_micro_batches(dataset, args, train_state, device, rank, world_size)
    metrics_file = open(experiment_dir / "metrics.jsonl", "a") if rank == 0 else None
    engine.train()
    tokens_since_log, time_of_last_log = 0, time.perf_counter()
    for step in range(1, max_steps + 1):
        step_loss = torch.zeros((), device=device)
        for _ in range(args.grad_accum):
            input_ids = next(micro_batches)["input_ids"].to(device)
            loss = engine(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            engine.backward(loss)
            # NOTE: an optimizer step only after the last micro-batch (the engine counts them): clip, AdamW, schedule.
            engine.step()
            step_loss += loss.detach() / args.grad_accum
        train_state["step"] = step
        train_state["samples_seen_in_epoch"] += samples_per_step
        tokens_since_log += samples_per_step * args.seq_length

        if step % args.log_freq == 0 or step == max_steps:
            dist.all_reduce(step_loss)
            tokens_per_second = tokens_since_log / (time.perf_counter() - time_of_last_log)
            tokens_since_log, time_of_last_log = 0, time.perf_counter()
            record = {"step": step, "epoch": train_state["epoch"], "loss": step_loss.item() / world_size,
                      "lr": lr_scheduler.get_last_lr()[0], "grad_norm": float(engine.get_global_grad_norm()),
                      "tokens_per_second": tokens_per_second}
            if metrics_file:
                common.log_metrics(metrics_file, record)
    if metrics_file:
        metrics_file.close()
    common.LOGGER.info(f"done: step {train_state['step']} of {max_steps}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
