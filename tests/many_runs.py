"""Runs a chapter's script several times in one job, one run after another, each with its own arguments: the family
matrix and the compile checks start one job per chapter, not one per run (a job's start and end are most of a
tiny run's time on the 2-core test machine).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/many_runs.py RUNS.json SCRIPT [ARGS ...]

RUNS.json holds a list of argument lists; every rank runs the same list in the same order. Each run is the script's
own main(), as `python SCRIPT ARGS... RUN'S ARGS...` would run it (runpy, __name__ == "__main__"): the run's own
arguments come last, so they override the common ones. After each one, every rank
prints one line: `[rank R] run N: exit CODE` (0, or the SystemExit's code), then `[rank R] run N: error: ...` if the
run stopped with a one-line error, and `[rank R] run N: graphs G, breaks B`: the graphs torch.compile's dynamo made
and the breaks in them. A run that raises anything else ends the job, with its traceback.

Each run's process group has a store of its own, as a process group cannot be made twice on the same keys: rank 0
starts it before the run and hands its port to the others through torchrun's store, and every rank's chapter
connects to it as torchrun's workers connect to their agent's (TORCHELASTIC_USE_AGENT_STORE). One process picks a
port of its own for each run.

With MANY_RUNS_BUFFERS=1, the model a run builds (its from_config() call) has every buffer compared, just before its
first optimizer step, with those of the same config built by from_config() on the CPU, its constructor's values:
`[rank R] run N: buffers equal: NAME, ...` or `[rank R] run N: buffers differ: NAME, ...`.
"""

import gc
import json
import os
import runpy
import sys
import time


def main():
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    runs, script, common = json.loads(open(sys.argv[1]).read()), sys.argv[2], sys.argv[3:]
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    agent_store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    check_buffers = os.environ.get("MANY_RUNS_BUFFERS") == "1" and BufferCheck(rank)
    for number, arguments in enumerate(runs):
        run_store = None
        if agent_store is None:
            os.environ.pop("MASTER_PORT", None)
        elif rank == 0:
            # NOTE: started before its port is handed on: no rank tries to connect to it before it listens.
            run_store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, is_master=True, wait_for_workers=False)
            agent_store.set(f"many_runs/{number}", str(run_store.port))
        if agent_store is not None:
            os.environ["MASTER_PORT"] = agent_store.get(f"many_runs/{number}").decode()
        sys.argv = [script, *common, *map(str, arguments)]
        counters.clear()
        if check_buffers:
            check_buffers.start(number)
        code = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stopped:
            code = stopped.code
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            if agent_store is not None:
                # NOTE: the run's store outlives every rank's use of it.
                agent_store.add(f"many_runs/{number}/done", 1)
                while run_store is not None and agent_store.add(f"many_runs/{number}/done", 0) < world_size:
                    time.sleep(0.01)
            del run_store
            gc.collect()
        line = f"[rank {rank}] run {number}: exit {0 if code is None else (code if isinstance(code, int) else 1)}\n"
        if isinstance(code, str):
            line += f"[rank {rank}] run {number}: {code}\n"
        line += (f"[rank {rank}] run {number}: graphs {counters['stats']['unique_graphs']}, breaks "
                 f"{sum(counters['graph_break'].values())}\n")
        # NOTE: one write: the ranks share torchrun's stdout.
        sys.stdout.write(line)
        sys.stdout.flush()


class BufferCheck:
    """The buffers of each run's model against its constructor's (see the module's docstring)."""

    def __init__(self, rank):
        import transformers
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.rank, self.models, self.number = rank, [], None
        self.from_config = transformers.AutoModelForCausalLM.from_config
        transformers.AutoModelForCausalLM.from_config = self.build
        register_optimizer_step_pre_hook(self.compare)

    def start(self, number):
        self.models, self.number = [], number

    def build(self, config, **kwargs):
        model = self.from_config(config, **kwargs)
        self.models.append(model)
        return model

    def compare(self, optimizer, args, kwargs):
        if not self.models:
            return
        import torch

        model, self.models = self.models[0], []
        reference = dict(self.from_config(model.config, dtype=torch.float32).named_buffers())
        names = {name.replace("_checkpoint_wrapped_module.", ""): buffer for name, buffer in model.named_buffers()}
        differ = [name for name, buffer in names.items()
                  if name not in reference or not torch.equal(buffer.cpu(), reference[name])]
        verdict = f"buffers differ: {', '.join(differ)}" if differ else f"buffers equal: {', '.join(names)}"
        sys.stdout.write(f"[rank {self.rank}] run {self.number}: {verdict}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
