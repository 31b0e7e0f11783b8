"""The loss of logits split along the vocabulary, before and after chapter 06 computed it on local tensors: the
operators one loss's forward and backward dispatch on the host (plain, and those with a DTensor argument) and the
bytes the plain ones write (views apart), for DTensor's loss_parallel() (before) and chapter 06's
VocabParallelCrossEntropy (after).

    torchrun --standalone --nproc-per-node 2 dev/benchmark_vocab_parallel_loss.py --tokens 2048 --vocab 32768

Both give the same loss and gradient from the same fp32 logits (checked), the chapter's through its loss function.
Each runs once before it is counted (DTensor caches its shape propagation, as steps after the first do). As in
dev/count_host_ops.py, a dispatch with a DTensor argument is counted and handed to DTensor, whose operators on local
tensors come back and count as plain; FakeTensor dispatches (shape propagation) are not counted. Bytes written: each
output of an operator, but only the source of a scatter or index_put (a few elements). The peak is not measured.
"""

import argparse
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CHAPTER_06 = Path(__file__).resolve().parent.parent / "06-tensor-parallel" / "train_llm.py"


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.plain, self.dtensor, self.written = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(kind, DTensor) for kind in types):
            self.dtensor += 1
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if any(issubclass(kind, FakeTensor) for kind in types):
            return out
        self.plain += 1
        name = func.overloadpacket.__name__
        if name in PARTIAL_WRITES:
            self.written += tensor_bytes(args[PARTIAL_WRITES[name]])
        elif not func.is_view:  # NOTE: a view writes nothing
            self.written += tensor_bytes(out)
        return out


# In-place operators that write only the elements of one argument: its position.
PARTIAL_WRITES = {"index_put_": 2, "index_put": 2, "scatter_add_": 3, "scatter_add": 3, "scatter_": 3}


def tensor_bytes(value):
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    spec = importlib.util.spec_from_file_location("chapter_06", CHAPTER_06)
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    local = torch.randn(args.tokens, args.vocab, generator=generator).chunk(world_size, -1)[rank].contiguous()
    def before(logits):
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(DTensor.from_local(logits, mesh, [Shard(-1)], run_check=False),
                                                     labels)
            loss.backward()
        return loss

    def after(logits):
        loss = chapter.vocab_parallel_loss(logits, None, args.vocab, shift_labels=labels, tp_group=mesh.get_group())
        loss.backward()
        return loss

    results = {}
    for name, loss_of in [("loss_parallel()", before), ("local tensors", after)]:
        loss_of(local.clone().requires_grad_())
        logits, counter = local.clone().requires_grad_(), Counter()
        with counter:
            loss = loss_of(logits)
        value = loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item()
        results[name] = (value, counter.plain, counter.dtensor, counter.written, logits.grad)
    (loss_a, *_, grad_a), (loss_b, *_, grad_b) = results.values()
    assert abs(loss_a - loss_b) < 1e-5 and torch.allclose(grad_a, grad_b, atol=1e-7), (loss_a, loss_b)
    if rank == 0:
        slice_mb = local.numel() * local.element_size() / 1e6
        print(f"{args.tokens} tokens x {args.vocab} logits over {world_size} ranks (a rank's fp32 slice {slice_mb:.1f} "
              f"MB); loss {loss_a:.6f} both ways")
        print("| loss, forward and backward | operators | of them with a DTensor argument | MB written | logit slices |")
        print("| --- | --- | --- | --- | --- |")
        for name, (_, plain, dtensor, written, _) in results.items():
            print(f"| {name} | {plain + dtensor} | {dtensor} | {written / 1e6:,.1f} | {written / 1e6 / slice_mb:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
