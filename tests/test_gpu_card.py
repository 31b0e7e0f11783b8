"""The GPU card (dev/gpu_card.py) in its CPU mode, its pieces, and the step-overhead benchmark it runs.

The CPU mode runs the card's whole pipeline on the tiny model, so that the script a GPU visit depends on cannot rot:
every chapter's row with its numbers, chapter 05's options, the checks, the benchmark and the sync-audit plumbing.
"""

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from helpers import REPO, in_background, load_script, run

CARD = REPO / "dev" / "gpu_card.py"
BENCHMARK = REPO / "dev" / "benchmark_step_overhead.py"
CARD_SITE = REPO / "dev" / "gpu_card_site"
WHEELS = REPO / "dev" / "gpu_card_requirements.txt"
CHAPTER_DIRS = sorted(path.parent.name for path in REPO.glob("[0-9][0-9]-*/train_llm.py"))
OPTIONS = "05-training-llama-405b"


def load_card_module():
    spec = importlib.util.spec_from_file_location("gpu_card", CARD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def card_cache():
    return {}


@pytest.fixture
def cpu_card(card_cache, background, env):
    """The CPU card, made once per session: in the background from the session's start (conftest.py), and read by
    the first test that asks for it."""
    if "card" not in card_cache:
        card_cache["card"] = None  # NOTE: a card that overran is not waited for again by the next test
        started = time.monotonic()
        card_run, out_dir = background["cpu-card"]
        result = card_run.wait(timeout=2300)
        card_cache["card"] = (result, out_dir)
        print(f"CPU card: waited {time.monotonic() - started:.0f}s\n{(out_dir / 'card.md').read_text()}")
    assert card_cache["card"] is not None, "the CPU card did not finish (see the first test that asked for it)"
    result, out_dir = card_cache["card"]
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-3000:]}"
    return json.loads((out_dir / "card.json").read_text()), (out_dir / "card.md").read_text(), out_dir


# NOTE: long: the card runs every chapter and its options (about 30 processes, under 2 minutes on 2 free cores), in
# the background from the session's start; the first test to read it waits for what is left (pytest.ini stops a
# test at 15 minutes).
CARD_TIMEOUT = pytest.mark.timeout(2400)
in_background("cpu-card", "cpu_card", lambda out_dir: [sys.executable, CARD, "--cpu", "--steps", "4", "--log-freq", "2", "--out", out_dir])


def by_name(card):
    return {run["name"]: run for run in card["runs"]}


@CARD_TIMEOUT
def test_the_cpu_card_has_every_chapter_with_its_numbers(cpu_card):
    card, markdown, out_dir = cpu_card
    runs = by_name(card)
    assert card["mode"] == "cpu" and card["finished"] and markdown.startswith("# CPU card")
    assert card["environment"]["ceiling"]["tflops"] > 0
    for chapter in CHAPTER_DIRS:
        record = runs[chapter]
        assert record["status"] == "ok", record
        assert record["tokens_per_second"] > 0 and record["memory_rss_gb"] > 0
        assert record["fraction_of_ceiling"] > 0
        assert record["mfu"] is None and record["syncs"]["per_step"] is None
        assert len(record["losses"]) == card["settings"]["steps"] // card["settings"]["log_freq"]
        assert (out_dir / record["log"]).exists()
        # NOTE: at world size 1 chapters 08, 09, 10 and 11 run no pipeline, no ring and no all-to-all: their rows say so.
        options = "(parallelism not exercised on 1 GPU)" if chapter in (
            "08-pipeline-parallel", "09-context-parallel", "10-expert-parallel", "11-4d-parallel") else ""
        row = next(line for line in markdown.splitlines() if line.startswith(f"| {chapter} | {options} |"))
        assert f"| {record['tokens_per_second']:,.0f} | n/a | {record['fraction_of_ceiling']:.1%} |" in row
        if chapter == "01-single-gpu":
            assert row.endswith("| reference |")
        else:
            # NOTE: fp32 on the CPU: every chapter at world size 1 trains exactly like chapter 01.
            assert record["loss_match"]["match"] and record["loss_match"]["max_difference"] <= 1e-4, record
            assert "✓" in row.split("|")[-2]
    assert "08-pipeline-parallel" not in CHAPTER_DIRS or "--pp 1" in markdown
    # Chapter 10's experts on the tiny Qwen3-MoE, against chapter 01 on the same model.
    assert runs["01-single-gpu+moe"]["status"] == "ok" and runs["10-expert-parallel+moe"]["status"] == "ok"
    assert runs["10-expert-parallel+moe"]["loss_match"]["max_difference"] <= 1e-4, runs["10-expert-parallel+moe"]
    ring_block = card["ring_block"]["09-context-parallel"]
    assert [row["tokens"] for row in ring_block["rows"]] == [64, 256] and "ring attention block on one cpu" in markdown


@CARD_TIMEOUT
def test_the_cpu_card_benchmarks_the_step_overhead(cpu_card):
    card, markdown, out_dir = cpu_card
    # NOTE: on the CPU the card benchmarks chapter 01 only; chapter 04's benchmark is the next test's.
    assert list(card["benchmark"]) == ["01-single-gpu"]
    for chapter, result in card["benchmark"].items():
        assert result["order"] == ["bare", "chapter"] * 2
        assert result["bare_median_ms"] == statistics.median(result["bare_step_ms"])
        assert result["chapter_median_ms"] == statistics.median(result["chapter_step_ms"])
        assert result["ratio"] == pytest.approx(result["chapter_median_ms"] / result["bare_median_ms"])
        assert f"| {chapter} | {result['bare_median_ms']:.1f} | {result['chapter_median_ms']:.1f} | " \
               f"{result['ratio']:.3f} |" in markdown
        row = next(line for line in markdown.splitlines() if line.startswith(f"| {chapter} |  |"))
        assert f"| {result['overhead_percent']:+.1f}% |" in row


@CARD_TIMEOUT
def test_the_cpu_card_runs_chapter_05s_options_and_the_checks(cpu_card):
    card, markdown, out_dir = cpu_card
    runs = by_name(card)
    pretrained = runs[f"{OPTIONS}+pretrained"]
    assert pretrained["status"] == "ok" and pretrained["loss_match"]["reference"] == OPTIONS
    # NOTE: the folder holds exactly the seeded weights: fine-tuning from it repeats the seeded run.
    assert pretrained["loss_match"]["max_difference"] <= 1e-5
    for option in ["activation-checkpointing", "compile"]:
        record = runs[f"{OPTIONS}+{option}"]
        assert record["status"] == "ok" and record["loss_match"]["match"], record
        assert record["loss_match"]["reference"] == f"{OPTIONS}+pretrained"
    for name in [f"{OPTIONS}+cpu-offload", "04-fully-sharded-data-parallel+cpu-offload"]:
        assert runs[name]["status"] == "expected error", runs[name]
        assert runs[name]["error"].startswith("error: --cpu-offload needs CUDA")
    assert runs[f"{OPTIONS}+flash-attention-error"]["error"].startswith(
        "error: --attn-implementation flash_attention_2 needs")
    assert "| 05-training-llama-405b | --cpu-offload | expected error ✓ |" in markdown
    local_rank = [run for run in card["runs"] if run["name"].startswith("local-rank-1-")]
    assert local_rank and all(run["status"] == "ok" for run in local_rank)
    assert "LOCAL_RANK=1: ✓ trains" in markdown


def test_a_failing_run_is_recorded_and_the_card_goes_on(env, tmp_path):
    out_dir = tmp_path / "card"
    result = run([sys.executable, CARD, "--cpu", "--out", out_dir, "--only", "01,02", "--parts", "chapters",
                  "--chapter-args", "01-single-gpu=--seq-length 100000"], env, REPO, timeout=600, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: 1 run(s) failed or timed out: 01-single-gpu")
    card = json.loads((out_dir / "card.json").read_text())
    runs = by_name(card)
    assert runs["01-single-gpu"]["status"] == "failed"
    assert runs["01-single-gpu"]["error"].startswith("error: --seq-length 100000 exceeds the model's")
    assert runs["02-distributed-data-parallel"]["status"] == "ok"
    assert runs["02-distributed-data-parallel"]["tokens_per_second"] > 0
    assert runs["02-distributed-data-parallel"]["loss_match"]["max_difference"] is None
    markdown = (out_dir / "card.md").read_text()
    assert "| 01-single-gpu |  | failed ✗ |" in markdown
    assert "- 01-single-gpu: failed: error: --seq-length 100000" in markdown


def test_a_run_past_its_timeout_or_the_budget_is_stopped_and_recorded(env, tmp_path, monkeypatch):
    card_module = load_card_module()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = argparse.Namespace(cpu=True, budget_s=0, model=str(REPO / "data" / "tiny-llama"), seq_length=64,
                              batch_size=4, steps=12, log_freq=4)
    card = card_module.Card(tmp_path, args)
    sleeper = [sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(300)"]

    def sleep_run(name, timeout):
        return card_module.ProcessRun(name=name, chapter="", options=[], kind="check", command=sleeper,
                                      timeout=timeout)

    started = time.monotonic()
    record, = card_module.execute(card, [sleep_run("over-its-timeout", 3)])
    assert record["status"] == "timed out" and record["error"] == "stopped after 3s"
    assert time.monotonic() - started < 30
    # NOTE: the card starts no run with less than MIN_SECONDS_TO_START left; 2 s here, so the cut comes after 4.
    monkeypatch.setattr(card_module, "MIN_SECONDS_TO_START", 2)
    card.deadline = time.monotonic() + 4
    cut, = card_module.execute(card, [sleep_run("cut-by-the-budget", 300)])
    skipped, = card_module.execute(card, [sleep_run("past-the-budget", 300)])
    assert cut["status"] == "timed out" and cut["seconds"] < 40
    assert skipped["status"] == "skipped" and "budget" in skipped["error"]
    assert "sleeping" in (tmp_path / "logs" / "over-its-timeout.log").read_text()


def test_a_gpu_run_is_read_and_shown_with_its_gpu_figures(tmp_path):
    """What only a GPU run logs (MFU, allocated and reserved memory, a CUDA sync audit), read as the card reads it,
    from files shaped as the chapters and the card's sitecustomize write them."""
    card_module = load_card_module()
    args = argparse.Namespace(cpu=False, budget_s=480, model=str(REPO / "data" / "llama-3.2-1b-shape"),
                              seq_length=2048, batch_size=4, steps=10, log_freq=5)
    card = card_module.Card(tmp_path, args)
    card.data["environment"] = {"model": {"parameters": 1_235_814_400, "layers": 16, "flops_per_token": 8.22e9},
                                "fp32_gqa_attention": {"fused": False, "heads": 32, "kv_heads": 8,
                                                       "error": "No viable backend"},
                                "ceiling": {"size": 8192, "dtype": "bfloat16", "tflops": 790.0}, "packages": {}}
    card.data["settings"]["nproc"] = 1
    card.data["chapter_args"] = {"04-fully-sharded-data-parallel": []}
    card.data["runs"].append({"name": "01-single-gpu", "losses": {"5": 10.0, "10": 9.0}})
    run_dir = tmp_path / "runs" / "04-fully-sharded-data-parallel"
    run_dir.mkdir(parents=True)
    records = [{"step": step, "loss": loss, "tokens_per_second": tokens, "mfu": mfu, "memory_allocated_gb": allocated,
                "memory_reserved_gb": allocated + 2}
               for step, loss, tokens, mfu, allocated in [(5, 10.01, 20000.0, 0.17, 30.0), (10, 9.02, 48000.0, 0.4, 31.0)]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    syncs = {str(step): 0 for step in range(2, 12)}
    syncs.update({"4": 16, "6": 3, "11": 3})  # 6 and 11 follow the logging steps 5 and 10
    (run_dir / "sync_audit.json").write_text(json.dumps({"cuda": True, "steps": 11, "syncs_before_step": syncs,
                                                         "where": {"utils.py:12 (train_llm.py:140)": 16}}))
    (tmp_path / "logs" / "04-fully-sharded-data-parallel.log").write_text("training\n")
    run = card_module.ProcessRun(name="04-fully-sharded-data-parallel", chapter="04-fully-sharded-data-parallel",
                                 options=[], kind="chapter", reference="01-single-gpu", audit=True, min_records=2)
    run.nproc, run.main_model = 1, True
    record = {"name": run.name, "chapter": run.chapter, "options": [], "kind": "chapter", "status": "ok",
              "log": "logs/04-fully-sharded-data-parallel.log", "note": None, "error": None}
    card_module.summarize_run(card, run, record)

    assert record["tokens_per_second"] == 48000.0 and record["mfu"] == 0.4  # the window after the first
    assert record["memory_allocated_gb"] == 31.0 and record["memory_reserved_gb"] == 33.0
    assert record["fraction_of_ceiling"] == pytest.approx(48000.0 * 8.22e9 / 790e12)
    # NOTE: audited: steps 3-5 and 7-10; the 16 syncs of step 4 are 16 of them, 7 steps.
    assert record["syncs"]["per_step"] == pytest.approx(16 / 7) and record["syncs"]["syncs_after_logging_steps"] == 6
    assert record["loss_match"]["max_difference"] == pytest.approx(0.02) and record["loss_match"]["match"]
    card.data["runs"] = [record]
    row = card_module.table_row(record, card.data)
    assert row == ("| 04-fully-sharded-data-parallel |  | 48,000 | 40.0% | 49.9% | 31.0 / 33.0 GB |  | 2.3 "
                   "| ✓ 2.0e-02 vs 01-single-gpu |")
    markdown = card_module.render_markdown(card.data)
    assert "- 04-fully-sharded-data-parallel: syncs at utils.py:12 (train_llm.py:140) x16" in markdown
    assert "**Ceiling**: a bfloat16 8192x8192x8192 matmul runs at 790 TFLOP/s here" in markdown
    assert ("**fp32 attention**: `--dtype float32` with 32 query and 8 key/value heads has only SDPA's math kernel "
            "(No viable backend)." in markdown)


def test_the_fp32_attention_probe_names_the_kernel_that_runs_grouped_query_heads():
    """The probe's check, on the CPU: its memory-efficient kernel does not exist there (the math kernel's case, named
    by its error), its flash kernel takes fp32 with grouped-query heads (the fused case)."""
    card_module = load_card_module()
    config = AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")
    missing = card_module.fp32_gqa_attention_kernel(torch, config, 64, device="cpu")
    assert missing["fused"] is False and "No viable backend" in missing["error"]
    assert (missing["heads"], missing["kv_heads"]) == (config.num_attention_heads, config.num_key_value_heads)
    fused = card_module.fp32_gqa_attention_kernel(torch, config, 64, device="cpu", backend="FLASH_ATTENTION")
    assert fused == {"fused": True, "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads}


def test_the_sync_audit_counts_syncs_outside_logging_steps_and_the_stop_hook_ends_the_process(env, tmp_path):
    """The injected hooks, in a script that plays a chapter: it emits the warning CUDA's sync debug mode emits."""
    script = tmp_path / "train_llm.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing, sys, time, warnings
        import torch

        SYNC = "called a synchronizing CUDA operation"
        syncs_before_step = {1: 1, 2: 1, 4: 5, 5: 2, 7: 3}  # 4 and 7 follow the logging steps 3 and 6

        if __name__ == "__main__":
            worker = multiprocessing.Process(target=time.sleep, args=(300,))
            worker.start()
            open(sys.argv[1], "w").write(str(worker.pid))
            parameter = torch.nn.Parameter(torch.zeros(1))
            optimizer = torch.optim.SGD([parameter], lr=0.1)
            for step in range(1, 20):
                for _ in range(syncs_before_step.get(step, 0)):
                    warnings.warn(SYNC)
                parameter.grad = torch.ones(1)
                optimizer.step()
                print(f"step {step} done", flush=True)
    """))
    audit_file = tmp_path / "audit.json"
    worker_pid_file = tmp_path / "worker.pid"
    environment = {**env, "PYTHONPATH": str(CARD_SITE), "CARD_STOP_AFTER_STEP": "8", "CARD_SYNC_AUDIT": str(audit_file)}
    # NOTE: not run() (which kills the whole session afterwards): the hook itself must end the data loader workers.
    result = subprocess.run([sys.executable, script, worker_pid_file], env=environment, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "step 7 done"
    worker_pid = int(worker_pid_file.read_text())
    for _ in range(50):
        if not Path(f"/proc/{worker_pid}").exists() or Path(f"/proc/{worker_pid}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(worker_pid, 9)
        raise AssertionError("the stop hook left the worker process running")
    audit = json.loads(audit_file.read_text())
    assert audit["steps"] == 8 and audit["cuda"] is False
    assert audit["syncs_before_step"] == {"2": 1, "3": 0, "4": 5, "5": 2, "6": 0, "7": 3, "8": 0}
    assert sum(audit["where"].values()) == 11 and all("train_llm.py:" in place for place in audit["where"])
    summary = load_card_module().read_sync_audit(audit_file, log_freq=3)
    # NOTE: audited: steps 3, 5, 6 and 8 (not 1 and 2, which set things up, nor 4 and 7, which follow logging).
    assert summary["audited_steps"] == 4 and summary["syncs_in_audited_steps"] == 2 and summary["per_step"] == 0.5
    assert summary["syncs_in_step_2"] == 1 and summary["syncs_after_logging_steps"] == 8


def test_the_card_site_runs_the_sitecustomize_it_hides(env, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("print('the hidden sitecustomize ran')\n")
    result = run([sys.executable, "-c", "print('then the program')"],
                 {**env, "PYTHONPATH": os.pathsep.join([str(CARD_SITE), str(tmp_path)])}, tmp_path, timeout=120)
    assert result.stdout.splitlines() == ["the hidden sitecustomize ran", "then the program"]


def test_the_benchmark_times_both_loops_in_fresh_processes_alternately(env, tmp_path):
    log_dir = tmp_path / "logs"
    result = run([sys.executable, BENCHMARK, "--chapter", "04-fully-sharded-data-parallel", "--steps", "2",
                  "--repeats", "2", "--log-dir", log_dir, "--json-out", tmp_path / "result.json", "--",
                  "--seq-length", "32", "--batch-size", "2", "--num-workers", "0"], env, tmp_path, timeout=900)
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert printed == json.loads((tmp_path / "result.json").read_text())
    assert printed["order"] == ["bare", "chapter", "bare", "chapter"]
    assert len(printed["bare_step_ms"]) == len(printed["chapter_step_ms"]) == 2
    assert all(ms > 0 for ms in printed["bare_step_ms"] + printed["chapter_step_ms"])
    assert printed["bare_median_ms"] == statistics.median(printed["bare_step_ms"])
    assert printed["ratio"] == pytest.approx(printed["chapter_median_ms"] / printed["bare_median_ms"])
    assert printed["overhead_percent"] == pytest.approx((printed["ratio"] - 1) * 100)
    for repeat in [1, 2]:
        chapter_log = (log_dir / f"04-fully-sharded-data-parallel-chapter-{repeat}.log").read_text()
        assert "started by torchrun" in chapter_log and "saved" not in chapter_log
        bare_log = (log_dir / f"04-fully-sharded-data-parallel-bare-{repeat}.log").read_text()
        assert json.loads(bare_log.strip().splitlines()[-1])["step_seconds"] > 0
        # NOTE: like with like: chapter 04's precision is FSDP's MixedPrecisionPolicy, not autocast.
        assert "bare loop: torch.float32 via fsdp" in bare_log


@CARD_TIMEOUT
def test_fill_readmes_writes_a_gpu_card_into_every_section(cpu_card, tmp_path, monkeypatch):
    card, markdown, out_dir = cpu_card
    card_module = load_card_module()
    fake_repo = tmp_path / "repo"
    for readme in [REPO / "README.md", *sorted(REPO.glob("[0-9][0-9]-*/README.md"))]:
        target = fake_repo / readme.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(readme, target)
    (fake_repo / "99-new-chapter").mkdir()
    (fake_repo / "99-new-chapter" / "README.md").write_text("# 99\n\n## Run it\n\ntext\n\n## Next\n\nmore\n")
    monkeypatch.setattr(card_module, "REPO", fake_repo)

    with pytest.raises(SystemExit, match="is not a GPU card"):
        card_module.fill_readmes(out_dir)
    gpu_dir = tmp_path / "gpu-card"
    gpu_dir.mkdir()
    (gpu_dir / "card.md").write_text(card_module.render_markdown({**card, "mode": "gpu"}))
    card_module.fill_readmes(gpu_dir)

    top = (fake_repo / "README.md").read_text()
    assert "Not yet measured on a GPU" not in top and "[docs/gpu-card/card.md](docs/gpu-card/card.md)" in top
    assert (fake_repo / "docs" / "gpu-card" / "card.md").read_text() == (gpu_dir / "card.md").read_text()
    assert top.replace(section(top), "") == (REPO / "README.md").read_text().replace(section((REPO / "README.md").read_text()), "")
    for readme in sorted(fake_repo.glob("[0-9][0-9]-*/README.md")):
        chapter = readme.parent.name
        filled = section(readme.read_text())
        assert "`data/tiny-llama`, sequence length " in filled and "Not yet measured" not in filled
        assert "**Model**" not in filled, "the card's header stays in the card"
        rows = [line for line in filled.splitlines() if line.startswith("| ") and not line.startswith("| chapter")
                and not line.startswith("| ---")]
        if chapter == "99-new-chapter":
            assert rows == [] and "The card has no run of 99-new-chapter." in filled
            assert readme.read_text().index("## Measured on a GPU") < readme.read_text().index("## Next")
            continue
        assert rows and all(row.startswith(f"| {chapter} |") for row in rows)
    chapter_05 = section((fake_repo / OPTIONS / "README.md").read_text())
    assert "| 05-training-llama-405b | --activation-checkpointing |" in chapter_05
    assert "| 01-single-gpu | " in section((fake_repo / "01-single-gpu" / "README.md").read_text())
    card_module.fill_readmes(gpu_dir)  # again: the same text, not a second copy
    assert (fake_repo / "README.md").read_text() == top


def section(text):
    begin, end = "<!-- gpu-card: begin -->", "<!-- gpu-card: end -->"
    return text[text.index(begin):text.index(end) + len(end)]


def test_every_readme_holds_the_kept_gpu_card_or_says_how_to_measure_one(tmp_path, monkeypatch):
    readmes = [REPO / "README.md", *sorted(REPO.glob("[0-9][0-9]-*/README.md"))]
    kept_card = REPO / "docs" / "gpu-card" / "card.md"
    for readme in readmes:
        text = readme.read_text()
        headings = [line for line in text.splitlines() if line.startswith(("## ", "### "))]
        # The top-level README has the section of its own, before its layout; a chapter's is part of its notes and
        # measurements, its last section.
        section_heading = "## Measured on a GPU" if readme == REPO / "README.md" else "### Measured on a GPU"
        assert headings.count(section_heading) == 1 and text.count("Measured on a GPU\n") == 1, readme
        if readme == REPO / "README.md":
            assert headings[-2] == section_heading, readme
        else:
            sections = [heading for heading in headings if heading.startswith("## ")]
            assert sections[-1] == "## Notes and measurements", readme
            assert headings.index(section_heading) > headings.index(sections[-1]), readme
        if not kept_card.exists():
            assert "Not yet measured on a GPU" in section(text)
            assert "python dev/gpu_card.py --out gpu-card" in section(text)
            assert "python dev/gpu_card.py --fill-readmes gpu-card" in section(text)
    if kept_card.exists():
        # NOTE: the sections are what --fill-readmes writes from the kept card: none edited by hand, none stale.
        fake_repo = tmp_path / "repo"
        for path in [*readmes, kept_card, kept_card.with_name("card.json")]:
            (fake_repo / path.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, fake_repo / path.relative_to(REPO))
        card_module = load_card_module()
        monkeypatch.setattr(card_module, "REPO", fake_repo)
        card_module.fill_readmes(fake_repo / "docs" / "gpu-card")
        for readme in readmes:
            assert (fake_repo / readme.relative_to(REPO)).read_text() == readme.read_text(), readme


def test_the_wheels_to_bring_are_exact_pins_with_datasets_and_wandb_at_the_repositorys():
    def pins(path):
        return dict(line.split("==") for line in path.read_text().splitlines() if line and not line.startswith("#"))

    wheels, required = pins(WHEELS), pins(REPO / "requirements.txt")
    for name in ("datasets", "wandb"):
        assert wheels.get(name) == required[name], f"{WHEELS.relative_to(REPO)} pins {name} unlike requirements.txt"
    assert f"-d .whl -r {WHEELS.relative_to(REPO)}" in load_card_module().__doc__


def test_the_gpu_check_of_chapter_05_is_the_card(env, tmp_path):
    """gpu_check.sh runs the card for chapters 04 and 05; without a GPU the card says so in one line."""
    result = run(["bash", REPO / OPTIONS / "gpu_check.sh", tmp_path / "check"], env, REPO, timeout=300, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == \
        "error: no CUDA GPU here (torch.cuda.is_available() is False); use --cpu"
    card = json.loads((tmp_path / "check" / "card.json").read_text())
    assert card["mode"] == "gpu" and "--only 04,05" in card["command"]


LAYOUT_CHAPTERS = dict.fromkeys(["06-tensor-parallel", "07-2d-parallel", "08-pipeline-parallel", "09-context-parallel",
                                 "11-4d-parallel"])


@pytest.mark.parametrize("nproc", [1, 2, 4, 8])
def test_the_cards_arguments_pass_each_chapters_own_layout_checks(nproc, tmp_path, monkeypatch):
    """The card's commands on a machine of nproc GPUs, read by each chapter's own parser and layout checks: on 8
    GPUs --pp 8 with 4 sequences (the card's batch) was refused by 1F1B; every degree above 1 is exercised."""
    import torch
    from transformers import AutoConfig

    card_module = load_card_module()
    monkeypatch.setattr("sys.argv", ["gpu_card.py", "--out", str(tmp_path / "card"), "--parts", "chapters"])
    card = card_module.Card(tmp_path / "card", card_module.parse_args())
    environment = {"gpus": ["NVIDIA H100 80GB HBM3"] * nproc, "pretrained_dir": str(tmp_path / "seeded")}
    plan = card_module.make_plan(card, CHAPTER_DIRS, environment, tmp_path, {"chapters"})
    degrees = {}
    for item in plan:
        command = item.command
        assert item.chapter == "01-single-gpu" or command[command.index("--nproc-per-node") + 1] == str(nproc)
        if item.chapter not in LAYOUT_CHAPTERS:
            continue
        script = next(index for index, part in enumerate(command) if part.endswith("train_llm.py"))
        chapter = LAYOUT_CHAPTERS[item.chapter] = LAYOUT_CHAPTERS[item.chapter] or load_script(item.chapter[:2])
        monkeypatch.setattr("sys.argv", command[script:])
        args = chapter.parse_args()
        config = AutoConfig.from_pretrained(args.model_name)
        monkeypatch.setattr(chapter, "init_device_mesh", lambda *args, **kwargs: None, raising=False)
        if item.chapter == "06-tensor-parallel":
            chapter.check_tensor_parallel_degree(nproc, config, args.seq_length)
            degrees[item.chapter] = nproc
        elif item.chapter == "07-2d-parallel":
            chapter.get_device_mesh(torch.device("cpu"), nproc, args.tp, args.dp_replicate)
            chapter.check_tensor_parallel_degree(args.tp, config, args.seq_length)
            degrees[item.chapter] = args.tp
        elif item.chapter == "08-pipeline-parallel":
            chapter.check_pipeline_layout(args, config)
            degrees[item.chapter] = args.pp
            # The 1F1B rule the old arguments broke: --pp 8 with 4 micro-batches.
            monkeypatch.setattr("sys.argv", [*command[script:], "--pp", str(nproc)])
            if nproc > args.batch_size:
                with pytest.raises(SystemExit, match="1f1b needs at least one micro-batch per stage"):
                    chapter.check_pipeline_layout(chapter.parse_args(), config)
        elif item.chapter == "09-context-parallel":
            chapter.get_device_mesh(torch.device("cpu"), nproc, args.cp)
            chapter.check_context_parallel(args, config)
            degrees[item.chapter] = args.cp
        elif item.chapter == "11-4d-parallel":
            chapter.get_device_mesh(torch.device("cpu"), nproc, args.tp, args.pp, args.cp)
            chapter.check_pipeline_layout(args, config)
            chapter.check_tensor_parallel_degree(args.tp, config, args.seq_length // args.cp)
            degrees[item.chapter] = (args.tp, args.pp)
        assert item.note == ("parallelism not exercised on 1 GPU" if nproc == 1 and item.chapter in
                             ("08-pipeline-parallel", "09-context-parallel", "11-4d-parallel") else item.note)
    assert degrees == {"06-tensor-parallel": nproc, "07-2d-parallel": nproc,
                       "08-pipeline-parallel": min(nproc, 4), "09-context-parallel": nproc,
                       "11-4d-parallel": {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (2, 4)}[nproc]}


def test_the_ring_block_timing_calls_chapter_09s_block_and_sdpa_on_the_same_shapes(tmp_path):
    """The card's single-GPU timing of chapter 09's ring attention block against SDPA's flash kernel, on the CPU
    with tiny shapes: the chapter's own block gives the flash kernel's output, and the card shows both timings."""
    card_module = load_card_module()
    settings = {"mode": "cpu", "output": str(tmp_path / "ring.json"), "heads": 4, "kv_heads": 2, "head_dim": 8,
                "tokens": [16, 32], "repeats": 2}
    result = card_module.time_ring_block(settings)
    assert result["device"] == "cpu" and [row["tokens"] for row in result["rows"]] == [16, 32]
    for row in result["rows"]:
        assert row["max_output_difference"] <= 1e-5
        flops = 4 * 4 * row["tokens"] ** 2 * 8 / 2
        for name in ("ring_block", "sdpa_flash"):
            timing = row[name]
            assert timing["forward_tflops"] == pytest.approx(flops / timing["forward_ms"] / 1e9)
            assert timing["backward_tflops"] == pytest.approx(2.5 * flops / timing["backward_ms"] / 1e9)
    args = argparse.Namespace(cpu=True, budget_s=0, model=str(REPO / "data" / "tiny-llama"), seq_length=64,
                              batch_size=4, steps=12, log_freq=4)
    card = card_module.Card(tmp_path, args)
    card.data["ring_block"]["09-context-parallel"] = result
    markdown = card_module.render_markdown(card.data)
    assert "09-context-parallel's ring attention block on one cpu (float32, 4 heads, 2 key/value heads of 8" in markdown
    assert sum(line.startswith("| 16 |") or line.startswith("| 32 |") for line in markdown.splitlines()) == 2
