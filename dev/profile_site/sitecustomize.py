"""Profile steps 3 to 5 of a chapter's train_llm.py on rank 0 with torch.profiler, from outside the chapter.

With this folder on PYTHONPATH, a chapter's process profiles the three optimizer steps after step 2 (the CUDA context,
the allocator's pools and the optimizer state are built by then), writes PROFILE_DIR/PROFILE_NAME.txt (the host's wall
time per step, then the operators by GPU time and by host time) and exits before it logs or saves:

    PYTHONPATH=dev/profile_site PROFILE_NAME=08 torchrun --standalone --nproc-per-node 1 \\
        08-pipeline-parallel/train_llm.py -m data/llama-3.2-1b-shape --seq-length 2048 --pp 1 -e profile-08

How 08's row of the GPU card was explained (08-pipeline-parallel/README.md, "One GPU: why its row is slow").
A step whose host time (the operators' self CPU time) nears its wall time is host-bound: the GPU waits for work.
"""

import os
import sys
import time

if sys.argv[0].endswith("train_llm.py"):
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    state = {"step": 0}

    def after_optimizer_step(optimizer, args, kwargs):
        if state.setdefault("optimizer", id(optimizer)) != id(optimizer):
            return
        state["step"] += 1
        if state["step"] == 2:
            torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            state["profiler"] = torch.profiler.profile(activities=activities)
            state["profiler"].__enter__()
            state["start"] = time.perf_counter()
        elif state["step"] == 5:
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - state["start"]) / 3 * 1e3
            state["profiler"].__exit__(None, None, None)
            events = state["profiler"].key_averages()
            host_ms = sum(event.self_cpu_time_total for event in events) / 3 / 1e3
            if os.environ.get("RANK", "0") == "0":
                name = os.environ.get("PROFILE_NAME", "profile")
                with open(os.path.join(os.environ.get("PROFILE_DIR", "."), f"{name}.txt"), "w") as file:
                    file.write(f"{name}: wall {wall_ms:.1f} ms/step, host (self CPU) {host_ms:.1f} ms/step, "
                               f"peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB\n")
                    file.write(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
                    file.write(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
            sys.stdout.flush()
            os._exit(0)

    register_optimizer_step_post_hook(after_optimizer_step)
