"""The examples of one page of docs/ that need a process group, run by
``test_docs_examples.py`` under ``torch.distributed.run`` on gloo processes (CPU).

``python -m torch.distributed.run --standalone --nproc_per_node=2 docs_worker.py PAGE OUT``

Each block marked ``<!-- example run on two processes by tests/test_docs_examples.py: ... -->``
runs as written, in the page's order, in a namespace of its own: first its stand-ins
(``PRELUDES``: a model, a loader, an optimizer, whatever the prose assumes), then the
block, then a check that its objects work (a step, the residuals it should leave). The
blocks of a page share the process group, which the first block's stand-ins (or the
first block itself) start. Each rank writes one JSON line per block to
``OUT/rank{RANK}.jsonl`` and works in ``OUT`` (where a block saves its files).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from test_docs_examples import ON_PROCESSES, blocks

from largebatch.training.distributed import exit_process

_GROUP = """
import datetime
import torch
import torch.distributed as dist
if not dist.is_initialized():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
"""
_NET = """
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                          torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
g = torch.Generator().manual_seed(rank)
batches = [(torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
           for _ in range(103)]
loss_fn = torch.nn.functional.cross_entropy
"""
_SMALL = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 1))
x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
"""
_ENCODER = """
import torch
torch.manual_seed(0)
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 1)
    def forward(self, x):
        return self.head(self.encoder(x)).mean(dim=1)  # not a view of the output
model = Model()
"""

# For each page, for each of its process blocks in order: (stand-ins, check).
PRELUDES: dict[str, list[tuple[str, str]]] = {
    "docs/communication.md": [
        (  # the AdaComp hook: 100 warm-up steps, then 3 compressed ones
            _GROUP + _NET + "loader = batches\nopt = torch.optim.SGD(net.parameters(), lr=0.05)\n",
            """
assert state.step == 103 and state.stats["conv"]["selected"] > 0, state.stats
saved = torch.load(f"ckpt-rank{rank}.pt", weights_only=False)
assert set(saved["adacomp"]["residuals"]) == {"0.weight", "4.weight"}, saved["adacomp"]
""",
        ),
        (  # local clipping, on a DDP model of its own (DDP takes one hook)
            _GROUP + _NET + "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "model = DDP(net)\nscaler = torch.amp.GradScaler('cpu', init_scale=2.0**4)\n",
            """
x, y = batches[0]
scaler.scale(loss_fn(model(x), y)).backward()
grads = torch.cat([p.grad.flatten() for p in net.parameters()])
gathered = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, grads)
assert torch.isfinite(grads).all() and all(torch.equal(grads, other) for other in gathered)
""",
        ),
    ],
    "docs/distributed.md": [
        (  # FSDP2: the block starts the process group itself
            _ENCODER,
            """
from torch.distributed.tensor import DTensor
assert all(isinstance(p, DTensor) for p in model.parameters())
before = [p.full_tensor() for p in model.parameters()]
x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
model(x).float().square().mean().backward()
opt.step()
opt.zero_grad()
assert all(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))
""",
        ),
        (  # ZeroRedundancyOptimizer: each rank holds whole params and steps its own
            _GROUP + _SMALL,
            """
for zero in (ZeroRedundancyOptimizer(param_groups(model, 5e-5), optimizer_class=LARS, lr=10.0),
             opt):
    ddp(x).square().mean().backward()
    zero.step()
    zero.zero_grad()
assert opt.optim.num_steps == 1 and isinstance(opt.optim, LAMB) and opt.optim.partitioned
""",
        ),
    ],
}


def main() -> None:
    page, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    codes = [code for code, where in blocks(page) if where == ON_PROCESSES]
    preludes = PRELUDES.get(page, [])
    if len(codes) != len(preludes):
        raise SystemExit(
            f"{page} has {len(codes)} examples to run on processes, and "
            f"docs_worker.PRELUDES has stand-ins for {len(preludes)}"
        )
    os.chdir(out)
    for i, (code, (prelude, check)) in enumerate(zip(codes, preludes)):
        namespace: dict = {"__name__": "__docs__"}
        exec(compile(prelude, f"{page} (stand-ins {i + 1})", "exec"), namespace)  # noqa: S102
        exec(compile(code, f"{page} (process example {i + 1})", "exec"), namespace)  # noqa: S102
        exec(compile(check, f"{page} (check {i + 1})", "exec"), namespace)  # noqa: S102
        with open(f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"page": page, "block": i + 1, "rank": rank}) + "\n")


if __name__ == "__main__":
    main()
    exit_process(0)  # not a plain return: its docstring says why
