"""alternative-frameworks/: chapter 04's FSDP2 run, written with Hugging Face Accelerate, DeepSpeed ZeRO-3 and
Lightning Fabric, trains chapter 04's curve: the same weights, samples and schedule give the same losses and gradient
norms on 2 CPU processes. Skipped where a framework is not installed
(pip install -r alternative-frameworks/requirements.txt).

`pytest -s` prints the figures: the largest relative loss and gradient-norm differences from chapter 04.
"""

import importlib.util

import pytest

from helpers import FAST_ARGS, GRAD_NORM_TOLERANCE, REPO, read_metrics, run, torchrun

FRAMEWORKS = {"accelerate": "train_accelerate.py", "deepspeed": "train_deepspeed.py", "lightning": "train_fabric.py"}
# NOTE: the same arguments as chapter 04's test_fsdp_reproduces_chapter_01_losses at 2 ranks: a whole suite trains
# the reference once (the `runs` fixture). Clipping at 1.0 binds at every one of these steps.
TEN_STEPS = ["--max-steps", "10", "--wandb-mode", "disabled", "--batch-size", "2"]
# NOTE: measured 0.0 (bitwise equal, 10 steps, both frameworks): the same fp32 operations in the same order.
# 1e-6 leaves room for a summation order a framework version may change (fp32's epsilon is 1.2e-7), not more.
TOLERANCE = 1e-6
# NOTE: DeepSpeed sums the squares in float64 (deepspeed/runtime/zero/utils.py); torch's fp32 CPU norm of lm_head's
# 1M-element gradient reads 2.8e-4 of itself low. Measured: 8.2e-5 to 8.8e-5 by step 10 (losses 1.3e-7), the
# chapters' bound.
NORM_TOLERANCE = {"deepspeed": GRAD_NORM_TOLERANCE}


def relative_difference(reference, other, key):
    assert [record["step"] for record in other] == [record["step"] for record in reference]
    return max(abs(a[key] - b[key]) / abs(a[key]) for a, b in zip(reference, other))


@pytest.mark.parametrize("package", FRAMEWORKS)
def test_a_framework_trains_chapter_04s_curve(runs, env, tmp_path, package):
    # NOTE: found, not imported: an import here would set variables in the tests' own process (lightning does).
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: pip install -r alternative-frameworks/requirements.txt")
    _, reference_dir = runs.train("04", env, *TEN_STEPS, nproc=2)
    command = [*torchrun(2), REPO / "alternative-frameworks" / FRAMEWORKS[package], *FAST_ARGS, *TEN_STEPS,
               "--save-dir", tmp_path / "outputs", "-e", package]
    run(command, env, tmp_path)
    reference, other = read_metrics(reference_dir), read_metrics(tmp_path / "outputs" / package)
    assert [record["step"] for record in other] == list(range(1, 11))
    loss_difference = relative_difference(reference, other, "loss")
    norm_difference = relative_difference(reference, other, "grad_norm")
    print(f"{package} vs chapter 04, 2 ranks x 2, 10 steps: largest relative loss difference {loss_difference:.1e}, "
          f"gradient norm {norm_difference:.1e}")
    assert loss_difference <= TOLERANCE
    assert norm_difference <= NORM_TOLERANCE.get(package, TOLERANCE)
    assert all(record["grad_norm"] > 1.0 for record in reference), "clipping binds at every step"
