"""Chapter 04: FSDP trains exactly like chapter 01 at any world size while each rank holds 1/N of the memory; its
sharded checkpoints resume exactly, at the same or another world size, survive a crash during a save, and convert
to a Hugging Face model folder.

The runs several tests compare against are made once per session (the `runs` fixture of conftest.py). All of them train 10 steps: the
learning-rate schedule depends on --max-steps, so runs compare only at the same --max-steps.
"""

import json
import os
import re
import shutil
import signal
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from helpers import (FAST_ARGS, GRAD_NORM_TOLERANCE, NO_CLIPPING, REPO, TINY_MODEL, check_family_matrix,
                     checkpoint_weights, cold_start, error_line, free_port, grad_norm_difference, load_script,
                     logged_parameter_count, logged_step, max_difference, memory_held, processes_with_marker,
                     read_losses, read_metrics, run, run_together, train, train_until_signalled, with_faults)

CONVERT = REPO / "04-fully-sharded-data-parallel" / "convert_to_hf.py"
TEN_STEPS = ["--max-steps", "10", "--wandb-mode", "disabled"]


@pytest.fixture(scope="module")
def resumed_runs():
    return {}


def chapter01(runs, env, batch_size, *args):
    return runs.train("01", env, *TEN_STEPS, "--batch-size", batch_size, *args)


def fsdp(runs, env, world_size, batch_size=2, *args):
    return runs.train("04", env, *TEN_STEPS, "--batch-size", batch_size, *args, nproc=world_size)


def interrupted(runs, env):
    """2 ranks x 2 samples, stopped after step 4: the experiment holds checkpoint-00000004 and the metrics of 1-4."""
    return fsdp(runs, env, 2, 2, "--exit-after-steps", "4")


def resume(runs, resumed_runs, env, world_size, batch_size):
    """A copy of the interrupted experiment, resumed to step 10 on world_size ranks (once per module)."""
    key = (world_size, batch_size)
    if key not in resumed_runs:
        _, source = interrupted(runs, env)
        experiment = f"resumed-on-{world_size}x{batch_size}"
        shutil.copytree(source, runs.workdir / "outputs" / experiment)
        resumed_runs[key] = train("04", env, runs.workdir, *TEN_STEPS, "--batch-size", batch_size, nproc=world_size,
                                  experiment=experiment, timeout=600)
    return resumed_runs[key]


@pytest.mark.parametrize("world_size, clipping", [pytest.param(2, [], marks=pytest.mark.quick), (3, []), (2, NO_CLIPPING)],
                         ids=["2", "3", "2-unclipped"])
def test_fsdp_reproduces_chapter_01_losses(runs, env, world_size, clipping):
    # Same global batch (world_size x 2 = chapter 01's batch), same initial weights (seeded by parameter name).
    # Clipping at 1.0 binds at every step, except with NO_CLIPPING.
    _, single = chapter01(runs, env, 2 * world_size, *clipping)
    _, sharded = fsdp(runs, env, world_size, 2, *clipping)
    assert [record["step"] for record in read_metrics(sharded)] == list(range(1, 11))
    difference = max_difference(read_losses(single), read_losses(sharded))
    norm_difference = grad_norm_difference(single, sharded, clipped=not clipping)
    print(f"FSDP {world_size} ranks x 2 vs chapter 01 batch {2 * world_size}: largest loss difference "
          f"{difference:.2e}, relative gradient norm difference {norm_difference:.1e} over 10 steps")
    assert difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE


def test_a_tied_model_trains_one_matrix_as_chapter_01_does(runs, env, tmp_path, tied_model):
    """With tie_word_embeddings the embedding and the head are one parameter, in the root group: FSDP shards it
    once, and the sharded model trains chapter 01's curve with chapter 01's parameter count."""
    reference_result, single = runs.train("01", env, "-m", tied_model, *TEN_STEPS, "--batch-size", 4)
    result, sharded = runs.train("04", env, "-m", tied_model, *TEN_STEPS, "--batch-size", 2, nproc=2)
    difference = max_difference(read_losses(single), read_losses(sharded))
    weights = checkpoint_weights(sharded / "checkpoint-00000010", tmp_path)
    head_vs_embedding = (weights["lm_head.weight"] - weights["model.embed_tokens.weight"]).abs().max().item()
    print(f"tied model, FSDP 2 ranks x 2 vs chapter 01 batch 4: largest loss difference {difference:.2e} over 10 "
          f"steps; parameters {logged_parameter_count(result)} vs {logged_parameter_count(reference_result)}; "
          f"checkpoint's head vs embedding {head_vs_embedding:.1e}")
    assert difference <= 1e-5
    assert grad_norm_difference(single, sharded, clipped=True) <= GRAD_NORM_TOLERANCE
    assert logged_parameter_count(result) == logged_parameter_count(reference_result)
    assert head_vs_embedding == 0


def test_each_rank_holds_one_nth_of_parameters_gradients_and_optimizer_state(runs, resumed_runs, env):
    # Chapter 01 holds everything in fp32: parameters and gradients 4 bytes each, AdamW's two moments 8 bytes.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    num_params = sum(p.numel() for p in model.parameters())
    totals_mb = {"parameters": 4 * num_params / 1e6, "gradients": 4 * num_params / 1e6,
                 "optimizer state": 8 * num_params / 1e6}
    results = {2: fsdp(runs, env, 2)[0], 4: resume(runs, resumed_runs, env, 4, 1)[0]}
    lines = [f"chapter 01, one process: {num_params:,} parameters; "
             + ", ".join(f"{kind} {mb:.2f} MB" for kind, mb in totals_mb.items()),
             "world size | rank | parameters MB | gradients MB | optimizer state MB | ratio to 1/N (p, g, o)"]
    worst = 0.0
    for world_size, result in results.items():
        held = memory_held(result)
        assert sorted(held) == list(range(world_size)), result.stdout[-3000:]
        for rank, memory in sorted(held.items()):
            ratios = [memory[kind] / (totals_mb[kind] / world_size) for kind in totals_mb]
            worst = max(worst, *(abs(ratio - 1) for ratio in ratios))
            lines.append(f"{world_size} | {rank} | " + " | ".join(f"{memory[kind]:.2f}" for kind in totals_mb)
                         + " | " + ", ".join(f"{ratio:.3f}" for ratio in ratios))
    print("\n".join(lines))
    assert worst <= 0.02


def test_resume_at_the_same_world_size_is_exact_and_survives_a_crash_during_a_save(runs, env, tmp_path):
    # 2 ranks: steps 1-4, exit with a checkpoint; resume, saving every 2 steps, and die inside the step-8 save
    # (the 2nd dcp.save of that run, on every rank, after its shards are written but before the folder is
    # renamed); resume again from checkpoint-00000006 to step 10. Together: the uninterrupted run's losses.
    _, straight = fsdp(runs, env, 2)
    _, source = interrupted(runs, env)
    shutil.copytree(source, tmp_path / "outputs" / "crashed")
    crash_env = with_faults(env, FAULT_KILL_ON_CALL="torch.distributed.checkpoint.save:2")
    result, crashed = train("04", crash_env, tmp_path, *TEN_STEPS, "--batch-size", "2", "--ckpt-freq", "2", nproc=2,
                            experiment="crashed", check=False)
    assert result.returncode != 0 and "resumed from" in result.stdout
    assert sorted(path.name for path in crashed.iterdir() if "checkpoint" in path.name) == [
        "checkpoint-00000006", "tmp-checkpoint-00000008"]
    result, _ = train("04", env, tmp_path, *TEN_STEPS, "--batch-size", "2", nproc=2, experiment="crashed")
    assert "resumed from" in result.stdout and "checkpoint-00000006" in result.stdout
    difference = max_difference(read_losses(straight), read_losses(crashed))
    print(f"2 ranks, exit after 4, crash in the save of 8, resume from 6: largest loss difference {difference:.2e}")
    assert difference <= 1e-6
    assert grad_norm_difference(straight, crashed, clipped=True) <= 1e-6


def test_a_preempted_job_checkpoints_the_step_it_stops_at_exits_0_and_resumes_the_same_curve(runs, env, tmp_path):
    # SIGTERM to every process of the job but torchrun once step 2 is logged, as Slurm signals the processes of a job
    # step: the ranks and their DataLoader workers (started here, not warm-started, so that they are found). The
    # ranks agree on a step, save it and exit 0, and so does torchrun. The job started again resumes there.
    _, straight = fsdp(runs, env, 2)
    result, signalled, seconds = train_until_signalled("04", cold_start(env), tmp_path, *TEN_STEPS, "--batch-size",
                                                       "2", "--num-workers", "1", nproc=2,
                                                       signals=[(logged_step(2), signal.SIGTERM)])
    assert result.returncode == 0, result.stderr[-3000:]
    stopped = read_metrics(signalled)[-1]["step"]
    print(f"SIGTERM to both ranks after step 2: stopped at step {stopped}, exit 0 {seconds:.1f}s after the signal")
    assert 2 < stopped < 10
    for rank in (0, 1):
        assert f"[rank {rank}] INFO done: step {stopped} of 10" in result.stdout
    assert [path.name for path in signalled.glob("*checkpoint-*")] == [f"checkpoint-{stopped:08d}"]
    result, resumed = train("04", env, tmp_path, *TEN_STEPS, "--batch-size", "2", nproc=2, experiment="signalled")
    assert f"resumed from {resumed / f'checkpoint-{stopped:08d}'} at step {stopped}" in result.stdout
    difference = max_difference(read_losses(straight), read_losses(resumed))
    print(f"resumed from step {stopped}: largest loss difference to the uninterrupted run {difference:.1e}")
    assert difference <= 1e-6
    assert grad_norm_difference(straight, resumed, clipped=True) <= 1e-6


def test_a_save_slower_than_the_dist_timeout_waits_on_the_checkpoint_group(env, tmp_path):
    # Rank 0 starts its save 12 s late (fault injection), as a slow file system writes a terabyte checkpoint: rank 1
    # waits inside dcp.save. --dist-timeout 8 does not end the job: the save's collectives run on the checkpoint
    # group (--ckpt-timeout); with --ckpt-timeout 8 the same wait does end it.
    slow_env = with_faults(env, FAULT_SLEEP_ON_CALL="torch.distributed.checkpoint.save:12", FAULT_RANK="0")
    flags = ["--max-steps", "2", "--dist-timeout", "8"]
    result, experiment = train("04", slow_env, tmp_path, *flags, nproc=2, experiment="slow-save")
    assert "injected fault: rank 0 sleeps 12s" in result.stderr
    assert (experiment / "checkpoint-00000002" / "train_state.pt").is_file()
    result, experiment = train("04", slow_env, tmp_path, *flags, "--ckpt-timeout", "8", nproc=2,
                               experiment="short-ckpt-timeout", check=False, timeout=120)
    assert result.returncode != 0 and not (experiment / "checkpoint-00000002").exists()


WRITER = "torch.distributed.checkpoint.filesystem._write_files_from_queue"  # DCP's writer, in async_save's thread


def test_async_checkpoints_at_every_step_leave_the_curve_and_the_weights_as_they_are(runs, env, tmp_path):
    # Resumed from step 4 with --async-checkpoint --ckpt-freq 1: a save in flight at every step, each waited for by
    # the next. The curve and the last checkpoint's weights are the uninterrupted run's, bit for bit, and only that
    # checkpoint is left.
    _, straight = fsdp(runs, env, 2)
    _, source = interrupted(runs, env)
    shutil.copytree(source, tmp_path / "outputs" / "async")
    result, resumed = train("04", env, tmp_path, *TEN_STEPS, "--batch-size", "2", "--ckpt-freq", "1",
                            "--async-checkpoint", nproc=2, experiment="async")
    assert "resumed from" in result.stdout and "checkpoint of step 9 staged" in result.stdout
    assert sorted(path.name for path in resumed.iterdir() if "checkpoint" in path.name) == ["checkpoint-00000010"]
    weights = [checkpoint_weights(folder / "checkpoint-00000010", tmp_path) for folder in (straight, resumed)]
    weight_difference = max((weights[0][name] - weights[1][name]).abs().max().item() for name in weights[0])
    difference = max_difference(read_losses(straight), read_losses(resumed))
    print(f"async saves at steps 5-10 vs no save: largest loss difference {difference:.1e}, checkpoint-00000010's "
          f"largest weight difference {weight_difference:.1e}")
    assert difference == 0 and weight_difference == 0
    assert grad_norm_difference(straight, resumed, clipped=True) == 0


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint_to_resume_from(runs, env, tmp_path):
    # --async-checkpoint --ckpt-freq 2 from step 4. Rank 0's writer sleeps 3 s before writing step 6's shards: steps
    # 7 and 8 train meanwhile, so checkpoint-00000006 is written from what async_save staged at step 6. Every rank
    # dies inside its writer at step 8's save, after writing its shards, before the metadata. Resumed from 6, the
    # run ends on the uninterrupted run's curve, bit for bit.
    _, straight = fsdp(runs, env, 2)
    _, source = interrupted(runs, env)
    shutil.copytree(source, tmp_path / "outputs" / "killed")
    crash_env = with_faults(env, FAULT_KILL_ON_CALL=f"{WRITER}:2", FAULT_SLEEP_ON_CALL=f"{WRITER}:3", FAULT_RANK="0")
    result, killed = train("04", crash_env, tmp_path, *TEN_STEPS, "--batch-size", "2", "--ckpt-freq", "2",
                           "--async-checkpoint", nproc=2, experiment="killed", check=False)
    assert result.returncode != 0 and "checkpoint of step 6 staged" in result.stdout
    assert "injected fault: rank 0 sleeps 3s" in result.stderr
    rank_0 = [line for line in result.stdout.splitlines() if "[rank 0]" in line]
    saved_6 = next(at for at, line in enumerate(rank_0) if "saved" in line and "checkpoint-00000006" in line)
    assert any("INFO step 7 |" in line for line in rank_0[:saved_6]), "step 7 trained before 6 was written"
    assert sorted(path.name for path in killed.iterdir() if "checkpoint" in path.name) == [
        "checkpoint-00000006", "tmp-checkpoint-00000008"]
    assert not (killed / "tmp-checkpoint-00000008" / ".metadata").exists()
    result, _ = train("04", env, tmp_path, *TEN_STEPS, "--batch-size", "2", nproc=2, experiment="killed")
    assert "resumed from" in result.stdout and "checkpoint-00000006" in result.stdout
    difference = max_difference(read_losses(straight), read_losses(killed))
    print(f"async, killed in the background write of 8, resume from 6: largest loss difference {difference:.1e}")
    assert difference == 0
    assert grad_norm_difference(straight, killed, clipped=True) == 0


def test_an_async_save_blocks_less_than_a_synchronous_one_and_trains_the_same_losses(env, tmp_path):
    # 19 steps on 2 ranks, a save every 3 steps, synchronous and with --async-checkpoint. A step's logged time runs
    # from the previous step's log line, so the step after a save includes what the save blocked (the whole save, or
    # async_save's staging) and, with --async-checkpoint, the training done while the shards are written.
    flags = ["--max-steps", "19", "--ckpt-freq", "3", "--batch-size", "2", "--wandb-mode", "disabled"]
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    numbers, losses = {}, {}
    for mode, extra in [("sync", []), ("async", ["--async-checkpoint"])]:
        result, experiment = train("04", env, tmp_path, *flags, *extra, nproc=2, experiment=mode)
        seconds = {record["step"]: 2 * 2 * 64 / record["tokens_per_second"] for record in read_metrics(experiment)}
        blocked = re.findall(r"\[rank 0\] INFO checkpoint of step \d+ (?:took|staged in) ([\d.]+)s", result.stdout)
        numbers[mode] = [median([seconds[step] for step in seconds if step > 1 and step % 3 != 1]),
                         median([seconds[step] for step in seconds if step > 1 and step % 3 == 1]),
                         median([float(value) for value in blocked])]
        losses[mode] = read_losses(experiment)
    print("median seconds, 2 ranks x 2 x 64 tokens | step, no save | step after a save | the save blocked training\n"
          + "\n".join(f"{mode} | {' | '.join(f'{value:.3f}' for value in values)}" for mode, values in numbers.items()))
    assert losses["sync"] == losses["async"]
    assert numbers["async"][2] < numbers["sync"][2]


def test_every_rank_resumes_from_the_checkpoint_rank_0_finds(runs, env, tmp_path):
    # Rank 1's directory listing is stale (fault injection): it shows checkpoint-00000002, a folder deleted since,
    # and not checkpoint-00000004, as a shared file system's cached listing can. Every rank must read the shards of
    # the checkpoint rank 0 found.
    _, straight = fsdp(runs, env, 2)
    _, source = interrupted(runs, env)
    shutil.copytree(source, tmp_path / "outputs" / "stale")
    stale_env = with_faults(env, FAULT_STALE_LISTING="checkpoint-00000002", FAULT_RANK="1")
    result, resumed = train("04", stale_env, tmp_path, *TEN_STEPS, "--batch-size", "2", nproc=2, experiment="stale")
    for rank in [0, 1]:
        assert f"[rank {rank}] INFO resumed from {resumed / 'checkpoint-00000004'} at step 4" in result.stdout
    assert max_difference(read_losses(straight), read_losses(resumed)) <= 1e-6
    assert grad_norm_difference(straight, resumed, clipped=True) <= 1e-6


def test_resume_on_4_ranks_with_the_same_global_batch_continues_exactly(runs, resumed_runs, env):
    # The checkpoint of 2 ranks x 2 samples, resharded on load to 4 ranks x 1 sample: the same global batches.
    _, straight = fsdp(runs, env, 2)
    result, resumed = resume(runs, resumed_runs, env, 4, 1)
    assert "resumed from" in result.stdout and "checkpoint-00000004" in result.stdout
    assert [record["step"] for record in read_metrics(resumed)] == list(range(1, 11))
    difference = max_difference(read_losses(straight), read_losses(resumed))
    norm_difference = grad_norm_difference(straight, resumed, clipped=True)
    print(f"2 ranks x 2 -> 4 ranks x 1 after step 4: largest loss difference {difference:.2e}, relative gradient "
          f"norm difference {norm_difference:.1e}")
    assert difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE


def test_an_elastic_restart_on_3_ranks_of_a_2_rank_job_keeps_the_global_batch_and_the_curve(runs, env, tmp_path):
    """--global-batch-size 6 --batch-size 1, the command an elastic job restarts with: 2 ranks accumulate 3
    micro-batches, stopped after step 4 (a node lost or gained); resumed on 3 ranks they accumulate 2, so the global
    batch stays 6 and the run continues the parity test's 3 ranks x 2 exactly."""
    _, straight = fsdp(runs, env, 3)
    elastic = ["--batch-size", 1, "--global-batch-size", 6]
    train("04", env, tmp_path, *TEN_STEPS, *elastic, "--exit-after-steps", 4, nproc=2, experiment="elastic")
    result, resumed = train("04", env, tmp_path, *TEN_STEPS, *elastic, nproc=3, experiment="elastic")
    assert f"resumed from {resumed / 'checkpoint-00000004'}" in result.stdout
    loss_difference = max_difference(read_losses(straight), read_losses(resumed))
    norm_difference = grad_norm_difference(straight, resumed, clipped=True)
    weights_straight = checkpoint_weights(straight / "checkpoint-00000010", tmp_path)
    weights_resumed = checkpoint_weights(resumed / "checkpoint-00000010", tmp_path)
    weight_difference = max((weights_straight[name] - weights_resumed[name]).abs().max().item()
                            for name in weights_straight)
    print(f"2 ranks x 1 x 3 micro-steps -> 3 ranks x 1 x 2 after step 4: largest loss difference {loss_difference:.2e}, relative gradient "
          f"norm difference {norm_difference:.1e}, largest weight difference {weight_difference:.1e}")
    assert loss_difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE
    # NOTE: a weight whose gradient is ~0 moves by its rounding noise over AdamW's running size of it, up to lr:
    # measured 9.0e-5; 2e-4, as chapters 07 and 08 bound FSDP's weights against chapter 01's.
    assert weight_difference <= 2e-4


# NOTE: long (about 40 s): two cold agents, the survivor's restart (cold) and 10 slowed steps.
def test_a_live_elastic_job_that_loses_a_node_goes_on_alone_with_chapter_01s_curve(runs, env, tmp_path):
    """related-topics/elastic-training.md's experiment: two torchrun agents of one worker each (--nnodes 1:2,
    --max-restarts 1, c10d rendezvous hosted by node A), --batch-size 2 --global-batch-size 4. Node B, agent and
    worker, is killed once checkpoint 4 (or a later one) exists; node A's worker fails, its agent re-forms the job at
    world size 1, which resumes and accumulates 2 micro-batches a step: the curve is chapter 01's at batch 4, and A
    exits 0."""
    import datetime
    import time

    port, experiment = free_port(), tmp_path / "outputs" / "elastic-live"
    # NOTE: 1 s keep-alives and last call: torchrun's defaults (5 s x 3, 30 s) are for real nodes. 60 s timeouts: once
    # gloo missed the killed peer's close, and node A's all-gather waited out the default 600 s (the print says which).
    rendezvous = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
             "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
             "elastic-live", "--local-addr", "127.0.0.1"]
    args = [REPO / "04-fully-sharded-data-parallel" / "train_llm.py", *FAST_ARGS, *TEN_STEPS, "--batch-size", 2,
            "--global-batch-size", 4, "--ckpt-freq", 2, "--dist-timeout", 60, "--ckpt-timeout", 60,
            "-e", "elastic-live"]
    # NOTE: slowed steps, so that B dies mid-run; B's marker extends A's, so the test's clean-up finds both.
    node_env = with_faults(cold_start(env), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                           FAULT_SLEEP_ON_CALL="torch.nn.utils.clip_grad_norm_:0.5:every")
    node_b_env = {**node_env, "TEST_PROCESS_MARKER": f"{env['TEST_PROCESS_MARKER']}-node-b"}
    killed = {}

    def kill_node_b(processes):
        deadline = time.monotonic() + 300
        # NOTE: any of checkpoints 4 to 8: a save prunes the one before it, so a busy machine may miss 4's.
        while not any(experiment.glob("checkpoint-0000000[4-8]")) and time.monotonic() < deadline:
            if any(process.poll() is not None for process in processes):
                return
            time.sleep(0.1)
        killed["at"], killed["clock"] = time.monotonic(), datetime.datetime.now()
        for pid in processes_with_marker(node_b_env["TEST_PROCESS_MARKER"]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    started = time.monotonic()
    node_a, _ = run_together([[*agent, "--rdzv-conf", f"is_host=true,{rendezvous}", *args],
                              [*agent, "--rdzv-conf", f"is_host=false,{rendezvous}", *args]],
                             [node_env, node_b_env], tmp_path, timeout=600, while_running=kill_node_b)
    output = node_a.stdout + node_a.stderr
    assert node_a.returncode == 0, output[-5000:]
    assert "at" in killed, f"an agent ended before node B was killed: {output[-5000:]}"
    # NOTE: c10d ranks the agents by address and process id: node A may be rank 0 or 1 of 2, then rank 0 of 1.
    assert re.search(r"rank [01] of 2 \(local rank 0\)", output) and "rank 0 of 1 (local rank 0)" in output, \
        output[-5000:]
    resumed = re.search(r"^(\d\d:\d\d:\d\d) \[rank 0\] INFO resumed from \S+/checkpoint-0000000(\d) at step", output,
                        re.MULTILINE)
    assert resumed and int(resumed.group(2)) >= 4, output[-5000:]
    resumed_at = datetime.datetime.combine(killed["clock"].date(), datetime.time.fromisoformat(resumed.group(1)))
    _, single = chapter01(runs, env, 4)
    loss_difference = max_difference(read_losses(single), read_losses(experiment))
    norm_difference = grad_norm_difference(single, experiment, clipped=True)
    print(f"\nlive elastic job: node B killed {killed['at'] - started:.0f} s in; node A resumed alone from step "
          f"{resumed.group(2)} {(resumed_at - killed['clock']).total_seconds():.0f} s after the kill (to the second) "
          f"and ended {time.monotonic() - killed['at']:.0f} s after it; vs chapter 01 at batch 4: "
          f"largest loss difference {loss_difference:.1e}, relative gradient norm difference {norm_difference:.1e}")
    assert [record["step"] for record in read_metrics(experiment)] == list(range(1, 11))
    assert loss_difference <= 1e-5 and norm_difference <= GRAD_NORM_TOLERANCE


def test_resume_on_3_ranks_with_a_larger_global_batch_continues_the_curve(runs, resumed_runs, env):
    """2 ranks x 2 -> 3 ranks x 2 after step 4: the global batch grows from 4 to 6, so the losses cannot be equal.

    The checks: the learning-rate schedule continues exactly (same lr at every step); the first resumed loss (step 5:
    the same weights as the uninterrupted run's step 5, and 4 of its 6 samples the same) is within 0.25 of the
    uninterrupted run's, far below the initial loss (a run that restarted from fresh weights would be at ~8.4); and
    the last loss is within 0.25 of the uninterrupted run's. That no sample is skipped or repeated is shown exactly
    by test_the_data_position_carries_over_to_another_world_size below.
    """
    _, straight = fsdp(runs, env, 2)
    result, resumed = resume(runs, resumed_runs, env, 3, 2)
    assert "resumed from" in result.stdout and "checkpoint-00000004" in result.stdout
    straight_records, resumed_records = read_metrics(straight), read_metrics(resumed)
    assert [record["step"] for record in resumed_records] == list(range(1, 11))
    assert max(abs(a["lr"] - b["lr"]) for a, b in zip(straight_records, resumed_records)) <= 1e-12
    initial, straight_losses, resumed_losses = straight_records[0]["loss"], read_losses(straight), read_losses(resumed)
    print(f"2 ranks x 2 -> 3 ranks x 2 after step 4: step 5 loss {resumed_losses[4]:.4f} (uninterrupted "
          f"{straight_losses[4]:.4f}), step 10 loss {resumed_losses[9]:.4f} (uninterrupted {straight_losses[9]:.4f}),"
          f" initial loss {initial:.4f}")
    assert abs(resumed_losses[4] - straight_losses[4]) <= 0.25 and resumed_losses[4] < initial - 0.5
    assert abs(resumed_losses[9] - straight_losses[9]) <= 0.25


def test_the_data_position_carries_over_to_another_world_size():
    # 50 samples whose input_ids are their own index. 4 steps of 2 ranks x 2 samples see chapter 01's first 4
    # batches of 4; then 3 ranks x 2 samples, resuming at sample 16, see chapter 01's batches of 6 from there on:
    # no sample of the epoch is skipped or repeated.
    chapter_01, chapter_04 = load_script("01"), load_script("04")
    dataset = [{"input_ids": torch.tensor([index])} for index in range(50)]
    cpu = torch.device("cpu")

    def args(batch_size):
        return chapter_04.get_parser().parse_args(["--batch-size", str(batch_size), "--num-workers", "0"])

    def global_batches(samples_seen, world_size, batch_size):
        loaders = [chapter_04.get_dataloader(dataset, args(batch_size), 0, samples_seen, cpu, rank, world_size)
                   for rank in range(world_size)]
        return [sorted(torch.cat([batch["input_ids"] for batch in batches]).flatten().tolist())
                for batches in zip(*loaders)]

    def chapter_01_batches(samples_seen, batch_size):
        return [sorted(batch["input_ids"].flatten().tolist())
                for batch in chapter_01.get_dataloader(dataset, args(batch_size), 0, samples_seen, cpu)]

    assert global_batches(0, 2, 2)[:4] == chapter_01_batches(0, 4)[:4]
    after_resume = global_batches(16, 3, 2)
    assert len(after_resume) == (50 - 16) // 6
    assert after_resume == chapter_01_batches(16, 6)[:len(after_resume)]


def test_convert_to_hf_gives_the_model_fsdp_trained(runs, env, tmp_path):
    """The converted folder loads with from_pretrained() and computes the logits of the checkpoint's weights.

    The reference is the same checkpoint read by torch's own converter, dcp_to_torch_save(), a code path independent
    of convert_to_hf.py, into a model built from model_config.json: logits within 1e-5 (they are equal). This is the
    exact check. Chapter 01's model.pt after the same 10 steps is compared as well: it is the same training, but its
    weights differ by AdamW-amplified rounding (~4e-5 after 10 steps), so that check can only be loose (1e-3); it
    shows the end to end claim, that the converted model is the model chapter 01 would have trained.
    """
    _, experiment = fsdp(runs, env, 2)
    # The experiment folder, not a checkpoint folder: the tool takes its latest checkpoint.
    result = run([sys.executable, CONVERT, experiment], env, tmp_path)
    converted = experiment / "hf-checkpoint-00000010"
    assert str(converted) in result.stdout
    assert len(AutoTokenizer.from_pretrained(converted)) == len(AutoTokenizer.from_pretrained(TINY_MODEL))
    input_ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=input_ids).logits

    converted_logits = logits(AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32))
    checkpoint_dir = experiment / "checkpoint-00000010"
    dcp_to_torch_save(checkpoint_dir, tmp_path / "checkpoint.pt")
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint_dir / "model_config.json"),
                                                 dtype=torch.float32)
    reference.load_state_dict(torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)["model"])
    _, single = chapter01(runs, env, 4)
    single_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float32)
    single_model.load_state_dict(torch.load(single / "checkpoint-00000010" / "model.pt", map_location="cpu",
                                            weights_only=True))
    difference = (converted_logits - logits(reference)).abs().max().item()
    difference_01 = (converted_logits - logits(single_model)).abs().max().item()
    print(f"converted vs DCP checkpoint: largest logit difference {difference:.2e}; "
          f"vs chapter 01 trained alike: {difference_01:.2e}")
    assert difference <= 1e-5 and difference_01 <= 1e-3


def test_convert_to_hf_saves_the_tokenizer_of_the_model_the_run_was_trained_with(runs, env, tmp_path):
    # Every checkpoint records its run's -m. Pointed at a copy of the tiny model whose tokenizer is marked
    # (model_max_length 1234), the record is where the tool takes the tokenizer from when -m is not given.
    _, experiment = fsdp(runs, env, 2)
    checkpoint = experiment / "checkpoint-00000010"
    assert json.loads((checkpoint / "model_source.json").read_text()) == {"model_name": str(TINY_MODEL)}
    marked_model = tmp_path / "marked-llama"
    shutil.copytree(TINY_MODEL, marked_model)
    tokenizer_config = json.loads((marked_model / "tokenizer_config.json").read_text())
    (marked_model / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": 1234}))
    copy = tmp_path / "checkpoint-00000010"
    shutil.copytree(checkpoint, copy)
    (copy / "model_source.json").write_text(json.dumps({"model_name": str(marked_model)}))
    run([sys.executable, CONVERT, copy, "-o", tmp_path / "converted"], env, tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path / "converted").model_max_length == 1234
    # A checkpoint that does not say (one written before the record existed) needs -m.
    (copy / "model_source.json").unlink()
    result = run([sys.executable, CONVERT, copy, "-o", tmp_path / "again"], env, tmp_path, check=False)
    assert result.returncode == 1 and "no model_source.json" in error_line(result) and "pass -m" in error_line(result)


@pytest.mark.parametrize("case", ["missing", "incomplete"])
def test_convert_to_hf_refuses_a_missing_or_incomplete_checkpoint(env, tmp_path, case):
    # An incomplete checkpoint: a save cut short leaves a tmp-checkpoint folder with some shards and no index.
    path = tmp_path / "outputs" / "run" / "tmp-checkpoint-00000008"
    if case == "incomplete":
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(b"")
    expected = {"missing": "is not a folder", "incomplete": "is not a complete checkpoint"}[case]
    result = run([sys.executable, CONVERT, path], env, tmp_path, check=False)
    assert result.returncode == 1
    assert error_line(result).startswith(f"error: {path} ") and expected in error_line(result), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_cpu_offload_without_a_gpu_gets_a_one_line_error(env, tmp_path):
    result, _ = train("04", env, tmp_path, "--cpu-offload", "--max-steps", "2", check=False, timeout=120)
    assert result.returncode == 1
    assert error_line(result).startswith("error: --cpu-offload") and "needs CUDA" in error_line(result)
    assert "Traceback" not in result.stderr


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("04", runs, env, family_models)
