"""LARS and LAMB as ``torch.optim.Optimizer`` subclasses, with their functionals, laid out
as in ``torch.optim`` (docs/design.md §3: how a step runs, file by file)."""

from largebatch.lars.torch._common import default_exclude, param_groups
from largebatch.lars.torch._compiled import COMPILE_MIN_TENSOR
from largebatch.lars.torch._lamb import LAMB, lamb
from largebatch.lars.torch._lars import LARS, lars
from largebatch.lars.torch._paths import COMPILE_MIN_NUMEL
from largebatch.lars.torch._ratios import named_trust_ratios, trust_ratio_tensor, trust_ratios

__all__ = [
    "LARS",
    "LAMB",
    "lars",
    "lamb",
    "param_groups",
    "default_exclude",
    "trust_ratios",
    "named_trust_ratios",
    "trust_ratio_tensor",
    "COMPILE_MIN_NUMEL",
    "COMPILE_MIN_TENSOR",
]
