"""Fused multi-tensor Triton kernels for LARS and LAMB: the engine of the torch fused path.

The update rules are those of ``largebatch.lars.reference`` (docs/design.md §2); this package
only changes where they run. A whole model's step is a constant number of launches,
whatever its tensor count.

Files: ``plan.py`` the host side (FusedGroup, input checks, the launch plan and its
cache, the two entry points); ``common.py`` the per-tensor table's columns and the
``@triton.jit`` helpers and kernels both optimizers use; ``lars.py`` and ``lamb.py``
each optimizer's kernels; ``compile_check.py`` the kernels' launches compiled for GPUs
without one.

Host API
--------
``FusedGroup``: one optimizer param group, already filtered to params with grads::

    params   list[Tensor]    fp32 / fp16 / bf16 model params, updated in place
    grads    list[Tensor]    same dtypes as params; never written
    masters  list[Tensor | None] | None
                             fp32 master copies of the params: the math then runs on the
                             master and the param is rewritten as its cast. None (for the
                             list or one entry): no master, the math runs on the param
    state    dict[str, list[Tensor]]
                             LARS {"momentum_buffer"}, LAMB {"exp_avg", "exp_avg_sq"}
                             (the spec's ``state``); fp32 for a param with a master, else
                             the param dtype
    steps    list[Tensor]    one fp32 0-dim count per param (params may share one): steps
                             it took so far; LAMB's bias correction uses its own count;
                             +1 on the device unless the step is skipped
    lr       Tensor          fp32 0-dim; read by the kernels, so a schedule may change it
    hyper    dict            the group's hyperparameters but lr, by the names of
                             ``LARS_SPEC`` / ``LAMB_SPEC`` (``largebatch.lars.spec``);
                             LARS: momentum, weight_decay, trust_coefficient, eps,
                             nesterov, trust_clip, trust_ratio; LAMB: betas (a pair),
                             eps, weight_decay, bias_correction, trust_ratio. Missing keys
                             take the spec's defaults; an unknown key is a ValueError
                             naming it; the values pass ``spec.check`` when a plan is built.

``fused_lars_step_(groups, *, grad_scale=None, found_inf=None, counter=None,
reduce_norms=None)`` and ``fused_lamb_step_(groups, *, max_grad_norm=None,
grad_scale=None, found_inf=None, counter=None, reduce_norms=None, reduce_global=None)``
take one step on every group. ``grad_scale`` (fp32 device tensor) divides every grad
first; ``max_grad_norm`` (LAMB, a Python float) divides all grads by
``max(1, ||all grads|| / max_grad_norm)`` over every group. If ``found_inf`` (fp32
device tensor, as set by ``torch.amp.GradScaler``) is nonzero, the step changes nothing:
params, masters, state and steps stay bitwise as they were. That is decided on the
device; nothing here reads a device value on the host. Without ``found_inf`` an inf/NaN
gradient is applied, as in every other path and in torch.optim. ``counter`` (fp32
0-dim, optional) counts the applied steps, like the per-param counts. For params
sharded across processes (FSDP2) the groups hold each rank's local blocks, and
``reduce_norms(table)`` sums the fp64 per-tensor sums of squares over the shards in place
after the pass that forms them (pass 1), before any norm is read; LAMB's
``reduce_global(table)`` does the same for the global grad sum of squares after pass 0
(sharded params, or an optimizer that holds only part of the model, as under
``ZeroRedundancyOptimizer``).

Kernels and launches
--------------------
Tensors are bucketed by (param dtype, masters or not). Per bucket a ``meta`` table holds
each tensor's addresses (int64 ``data_ptr``), size, group and first partial-sum slot, and
a ``chunks`` table maps each program to its chunk (tensor, chunk index in it): BLOCK *
TILES = 4096 elements, fewer when every tensor of the bucket is smaller. Small per-group
tables hold the hyperparameters and the address of ``lr``: the hyperparameter table is
fp64 (for an accurate 1 - beta**t), one row per group (``spec.row``: a flag as 0 / 1),
one column per ``spec.columns`` entry, which the kernels read by name (``lars.py``,
``lamb.py``). Sums of squares are squared and added in fp32 within a tile of BLOCK
elements, and taken into fp64 once per tile: a tile whose fp32 sum is not a normal
number above 2**-80 (an overflow, as above ||x|| ~ 1.8e19, a NaN, or squares that may
have underflowed, as below |x| ~ 1e-19) is summed again scaled by a power of two
(``common._sum_sq``), so no finite weight or gradient overflows or loses its norm, and no
fp64 instruction runs per element. Each chunk writes its fp64 sums to its own slot of a
partial-sums table (the tensor's first slot plus the chunk's index), and
``_finish_kernel`` adds each tensor's slots in slot order, in a fixed tree: a norm has
the same bits on every run, whatever order the GPU ran the programs in (atomic
additions would land in that order). The same kernel forms LAMB's global grad sum of
squares from every slot. Full chunks run without effective masks and, when every
address of the bucket is 16-byte aligned, with 16-byte loads and stores; only each
tensor's last chunk is masked. Programs run 4 warps (8 elements a thread in a
1024-element block), 8 in an unaligned bucket of 1024-element blocks, whose one-element
loads each hold an address. ``compile_check.py`` compiles every launch the fused path
makes for sm_80 and sm_90 and checks registers, spills and fp64 work (``make
check-kernels``).

    LARS  pass 1 _grad_check_kernel   each chunk's sums of w^2, g^2 (_lars_norms_kernel
                                      when a group has decayed_norm: (g + wd * w)^2 for
                                      its tensors)
          finish _finish_kernel       ||w||^2, ||g||^2 per tensor; the step counted
          pass 2 _lars_apply_kernel   trust ratio, momentum, w (and param from master)
    LAMB (pass 0 _grad_check_kernel   each chunk's sum of g^2: only with max_grad_norm
          finish _finish_kernel       ||g||^2 of all groups)
          pass 1 _lamb_moments_kernel new m, v; each chunk's sums of w^2, u^2
          finish _finish_kernel       ||w||^2, ||u||^2 per tensor; the step counted
          pass 2 _lamb_apply_kernel   u again from the stored m, v; trust ratio; w

Every bucket's pass k runs before any bucket's pass k + 1, because the global norm spans
all buckets. Launches per step: 2 per bucket (LAMB with max_grad_norm: 3) and one
``_finish_kernel`` after each pass that forms sums (LAMB with max_grad_norm: 2): an fp32
model takes 3 (LAMB with max_grad_norm: 5), fp16 params with masters plus fp32 norm
layers 5 (8). Every slot, sum and count is written, never added to, so no memset
precedes the step. Shapes and addresses are fixed and nothing syncs, so the step can be
captured in a CUDA graph once its plan exists.

Bytes moved per param, pass by pass (the roofline's numerator; LAMB with max_grad_norm
adds the grad read of pass 0: 4 B for fp32 grads, 2 B for fp16/bf16)::

    params                          LARS            LAMB
    fp32                            8 + 20 = 28     24 + 16 = 40
    fp16 / bf16, fp32 masters       6 + 20 = 26     22 + 18 = 40
    fp16 / bf16, state in that type 4 + 10 = 14     12 +  8 = 20

Pass 0 exists because clipping needs the global norm before any moment is written.
Pass 2 recomputes u from w, m and v; storing u in pass 1 and reading it
back would move as many bytes and need a model-sized buffer. fp16 state without
masters is a poor fit for LAMB: exp_avg_sq = (1 - beta2) g^2 underflows fp16 for
small grads.

Plan cache: the tables and the workspace are built once per distinct content (device,
and every tensor address, size, dtype and hyperparameter of the call) and kept in a
small LRU cache, so a changed tensor, a new grad allocation or a new hyperparameter
builds a new plan (its tables packed on the host into one buffer and sent in one
``non_blocking`` copy, from pinned memory on CUDA: the host never waits for the device)
and nothing needs invalidating by hand. Grads freed by ``zero_grad(set_to_none=True)``
usually come back at the same addresses, and then the plan is reused. Changing ``lr`` or
step values is free; new ``lr`` tensors cost one small copy of their address table (new
step tensors, a new plan). Keep one ``lr`` tensor per group and update it in place: that
is also what a CUDA graph needs. The key reads every tensor's address at each step, in
C-level ``map`` calls: about 0.4 ms per 1,000 tensors on a 2-core CPU, on the host,
while the device runs the step before. A key over groups alone would miss grads that
moved; torch's own foreach and fused optimizers also group every tensor at each step.

Limits: all tensors of a call on one device; each tensor's grad, master and state
share its strides and are dense (contiguous in some memory format); steps count
exactly up to 2**24 (fp32 counters, as in torch.optim).
"""

from __future__ import annotations

from largebatch.lars.kernels.plan import FusedGroup, fused_lamb_step_, fused_lars_step_

__all__ = ["FusedGroup", "fused_lars_step_", "fused_lamb_step_"]
