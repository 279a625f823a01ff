"""LARS and LAMB on sharded params: FSDP2 (``fully_shard``) and ZeroRedundancyOptimizer on
two gloo processes equal one process given the same gradients, on every path; the
failure modes (per-shard norms, clipping from one rank's grads) are caught; what cannot
work is refused with a clear error.

The two-process cases run once, in ``sharded_worker.py`` under ``torch.distributed.run``;
each test here reads its cases. ``err`` <= 1 means every element of every param (and
fp32 master) is within torch's float32 tolerance of the one-process run (bfloat16's for
bfloat16 params).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from largebatch.torch import LAMB, LARS

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built"),
    pytest.mark.slow,  # every test reads the torchrun worker's results
]

WORKER = Path(__file__).with_name("sharded_worker.py")
OPTIMIZERS = ("lars", "lamb")
EQUAL = (
    [f"fsdp2/{o}/{p}" for o in OPTIMIZERS for p in ("single_tensor", "foreach", "fused")]
    + [f"fsdp2-mp-policy/{o}/foreach" for o in OPTIMIZERS]
    + [f"fsdp2-bf16-masters/{o}/{p}" for o in OPTIMIZERS for p in ("foreach", "fused")]
    + [f"fsdp2-some-layers/{o}/{p}" for o in OPTIMIZERS for p in ("single_tensor", "foreach")]
    + [f"fsdp2-decayed-norm/lars/{p}" for p in ("single_tensor", "foreach", "fused")]
)
ZERO = [f"zero/{o}/{p}" for o in OPTIMIZERS for p in ("foreach", "fused")] + [
    f"zero-bucket-view/{o}/foreach" for o in OPTIMIZERS
]
# LAMB(partitioned=True) on a rank that holds no grad: it still joins the global norm.
NO_GRADS = [f"zero-rank-without-grads/lamb/{p}" for p in ("foreach", "fused")]
FAILURE_MODES = [f"fsdp2-per-shard-norms/{o}/foreach" for o in OPTIMIZERS] + [
    "zero-not-partitioned/lamb/foreach"
]
# Grads zeroed in place (FSDP2 accumulates into the same DTensors): the fused steps after
# the first run on its plan.
KEPT_GRADS = [f"fsdp2-grads-kept/{o}/fused" for o in OPTIMIZERS]
SKIPS = [f"skip/{o}/{p}" for o in OPTIMIZERS for p in ("single_tensor", "fused")]
SCALERS = [f"grad-scaler/{o}/{p}" for o in OPTIMIZERS for p in ("foreach", "fused")]
RESUMES = [f"resume-{how}/{o}" for how in ("dcp", "zero") for o in OPTIMIZERS]
REFUSED = {
    "refused/compiled": "compiled=True does not apply to sharded (DTensor) params",
    "refused/fused-mixed-layouts": "fused=True needs every param of the optimizer sharded the same way",
}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("sharded") / "cases.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        str(out),
    ]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "SHARDED_WORKER_TMP": str(out.parent),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    found = {}
    if out.exists():
        found = {c["case"]: c for c in map(json.loads, out.read_text().splitlines())}
    return proc, found


@pytest.fixture
def cases(worker) -> dict[str, dict]:
    """The cases the worker recorded (it writes each as it finishes); one it did not reach
    fails its test with the worker's error."""
    proc, found = worker

    class Cases(dict):
        def __missing__(self, case: str) -> dict:
            pytest.fail(f"the worker did not reach {case}: {proc.stderr[-3000:]}")

    return Cases(found)


def test_the_worker_ran_every_case(worker):
    proc, found = worker
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = {*EQUAL, *KEPT_GRADS, *ZERO, *NO_GRADS, *FAILURE_MODES, *SKIPS, *SCALERS, *RESUMES, *REFUSED}
    assert set(found) == expected


@pytest.mark.parametrize("case", KEPT_GRADS)
def test_fsdp2_with_grads_kept_replays_and_equals_one_process(cases, case):
    assert cases[case]["err"] <= 1
    reused = cases[case]["reused"]
    assert reused == ["full"] + ["replay"] * (len(reused) - 1) and len(reused) > 1


@pytest.mark.parametrize("case", EQUAL)
def test_fsdp2_equals_one_process(cases, case):
    assert cases[case]["err"] <= 1.0, cases[case]


@pytest.mark.parametrize("case", ZERO)
def test_zero_redundancy_equals_one_process_and_keeps_params_whole(cases, case):
    assert cases[case]["whole"], "a rank's optimizer holds a part of a param, or a param twice"
    assert cases[case]["err"] <= 1.0, cases[case]


@pytest.mark.parametrize("case", NO_GRADS)
def test_a_partitioned_rank_without_grads_still_joins_the_global_norm(cases, case):
    assert cases[case]["err"] <= 1.0, cases[case]


@pytest.mark.parametrize("case", FAILURE_MODES)
def test_the_failure_modes_are_caught(cases, case):
    # Norms of each rank's own block (an optimizer unaware of FSDP2), or LAMB clipping
    # from this rank's share of the grads under ZeRO: far outside the tolerance above.
    assert cases[case]["err"] > 10.0, cases[case]


@pytest.mark.parametrize("case", SKIPS)
def test_a_step_found_inf_on_one_rank_is_skipped_on_every_rank(cases, case):
    assert cases[case]["ok"]


@pytest.mark.parametrize("case", SCALERS)
def test_grad_scaler_on_fsdp2_skips_together_and_equals_one_process(cases, case):
    result = cases[case]
    assert result["scales"] == [[1024.0, 512.0, 512.0, 512.0]] * 2  # one skip, on both ranks
    assert result["steps"] == 3
    assert result["err"] <= 1.0, result


@pytest.mark.parametrize("case", RESUMES)
def test_a_checkpoint_resumes_bit_exactly(cases, case):
    # FSDP2 through torch.distributed.checkpoint (sharded optimizer state), ZeRO through
    # its consolidated state dict: the restored run goes on with bitwise the same params.
    assert cases[case]["ok"]


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_cannot_be_right_is_refused(cases, case):
    assert REFUSED[case] in cases[case]["message"]


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_fsdp1_flat_params_are_refused(cls):
    from torch.distributed.fsdp._common_utils import _set_fsdp_flattened

    model = torch.nn.Linear(4, 3)
    _set_fsdp_flattened(model.weight)  # what FSDP1 marks every param it flattens with
    with pytest.raises(ValueError, match="flattened FSDP"):
        cls(model.parameters(), lr=1.0)


def test_partitioned_is_a_flag_kept_through_copies():
    param = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="Invalid partitioned: 'yes'"):
        LAMB([param], partitioned="yes")
    opt = LAMB([param], max_grad_norm=1.0)
    opt.partitioned = True  # as a process group would allow
    assert copy.deepcopy(opt).partitioned is True
    assert LAMB([param]).partitioned is False


def test_partitioned_without_a_process_group_says_so():
    param = torch.nn.Parameter(torch.ones(3))
    message = "partitioned=True sums over torch.distributed's default process group"
    with pytest.raises(ValueError, match=message):
        LAMB([param], max_grad_norm=1.0, partitioned=True)


DTENSOR_AFTER = """
import sys

import torch

from largebatch.torch import LARS

# LARS finds DTensors by their class, which it takes only once torch.distributed.tensor
# is imported (importing it itself would cost every import of largebatch.torch 0.7 s).
assert "torch.distributed.tensor" not in sys.modules, "largebatch.torch imported DTensor"
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
param = torch.nn.Parameter(distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Shard(0)]))
try:
    LARS([param], lr=0.1, compiled=True)
except ValueError as error:
    print(error)
dist.destroy_process_group()
"""


def test_dtensors_made_after_the_import_are_found():
    """A program that imports largebatch.torch first and makes its DTensors afterwards
    (FSDP2 imports torch.distributed.tensor only when it is imported): LARS still sees
    them as sharded, here by refusing compiled=True for them."""
    run = subprocess.run([sys.executable, "-c", DTENSOR_AFTER], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert REFUSED["refused/compiled"] in run.stdout, (run.stdout, run.stderr[-3000:])
