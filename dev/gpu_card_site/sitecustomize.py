"""What dev/gpu_card.py adds to a chapter's training processes, without a line of card code in the chapters.

Python imports this file at start-up when its folder is on PYTHONPATH, as the card and the step-overhead benchmark
put it; it acts only in a process whose script is a chapter's train_llm.py. Each part is switched on by a variable:

CARD_STOP_AFTER_STEP=41   end the process (exit status 0) inside optimizer step 41, before the script logs or saves
                          it. The card reads the steps logged before; a checkpoint of the 1B model (15 GB with the
                          AdamW state) would cost more GPU time than the steps it measures. Data loader workers are
                          ended first.
CARD_SYNC_AUDIT=FILE      count the host-device synchronizations (torch.cuda.set_sync_debug_mode("warn")) between
                          consecutive optimizer steps, from the end of step 1 on, on rank 0, and rewrite FILE (JSON)
                          after every step: {"cuda": bool, "steps": N, "syncs_before_step": {"2": 0, "3": 1, ...},
                          "where": {"file:line (train_llm.py:line)": count}}. syncs_before_step[k] counts those made
                          after step k-1's optimizer step and until step k's: the end of step k-1 (its logging, if it
                          was a logging step) and the whole of step k up to its optimizer step.
CARD_COMPILE_BACKEND=aot_eager  the backend of the chapter's compile() calls (the card's CPU mode: inductor would
                          compile C++ for minutes).

Any sitecustomize this one hides on the path (the installation's own, or the tests' fault injection) runs first.
"""

import os
import sys


def install():
    import json
    import multiprocessing
    import warnings

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    stop_after_step = int(os.environ.get("CARD_STOP_AFTER_STEP", "0"))
    audit_file = os.environ.get("CARD_SYNC_AUDIT") if os.environ.get("RANK", "0") == "0" else None
    state = {"step": 0, "audit": {"cuda": False, "steps": 0, "syncs_before_step": {}, "where": {}}}

    def start_audit():
        # NOTE: from the end of step 1 only: the first step builds the CUDA context, the allocator's pools and the
        # optimizer state, which synchronize once, and sync debug mode needs CUDA initialized on the right device.
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
            state["audit"]["cuda"] = True
        # NOTE: "always": the default filter shows a warning once per code location, and a sync repeated at the
        # same line every layer is exactly what we count. The C++ warning reaches Python as a UserWarning.
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
        show_other_warnings = warnings.showwarning

        def count_syncs(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" not in str(message):
                return show_other_warnings(message, category, filename, lineno, file, line)
            syncs = state["audit"]["syncs_before_step"]
            key = str(state["step"] + 1)
            syncs[key] = syncs.get(key, 0) + 1
            where = f"{os.path.basename(filename)}:{lineno} ({script_line()})"
            state["audit"]["where"][where] = state["audit"]["where"].get(where, 0) + 1

        warnings.showwarning = count_syncs

    def after_optimizer_step(optimizer, args, kwargs):
        # NOTE: one step is one step of the first optimizer that steps: a wrapper such as ZeroRedundancyOptimizer
        # steps the optimizer it wraps, and both call the hook.
        if state.setdefault("optimizer", id(optimizer)) != id(optimizer):
            return
        state["step"] += 1
        if audit_file:
            if state["step"] == 1:
                start_audit()
            else:
                state["audit"]["syncs_before_step"].setdefault(str(state["step"]), 0)
            state["audit"]["steps"] = state["step"]
            with open(audit_file, "w") as file:
                json.dump(state["audit"], file)
        if state["step"] == stop_after_step:
            for child in multiprocessing.active_children():
                child.kill()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    register_optimizer_step_post_hook(after_optimizer_step)


def script_line():
    """The line of the chapter's script that led to the current call."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith("train_llm.py"):
            return f"train_llm.py:{frame.f_lineno}"
        frame = frame.f_back
    return "not from train_llm.py"


def run_shadowed_sitecustomize():
    """Run the sitecustomize this file hides, if any: an installation may use one (to set paths, say), and the tests'
    fault injection (tests/faults) is one too."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest_of_path = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest_of_path)
    if spec is not None and spec.origin and os.path.abspath(spec.origin) != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


run_shadowed_sitecustomize()
if os.environ.get("CARD_COMPILE_BACKEND") and sys.argv[0].endswith("train_llm.py"):
    import functools

    import torch

    backend = os.environ["CARD_COMPILE_BACKEND"]
    torch.compile = functools.partial(torch.compile, backend=backend)
if (os.environ.get("CARD_STOP_AFTER_STEP") or os.environ.get("CARD_SYNC_AUDIT")) and sys.argv[0].endswith("train_llm.py"):
    install()
