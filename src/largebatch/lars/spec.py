"""LARS and LAMB hyperparameters, stated once: names, defaults, valid values, the kernels'
table columns, and each optimizer's typed, frozen group values (``LarsHyperparams``,
``LambHyperparams``). Every implementation takes its defaults and checks from here
(docs/design.md §8: the checks' rules, and what adding a hyperparameter touches)."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, cast

__all__ = [
    "Hyper",
    "OptimizerSpec",
    "LARS_SPEC",
    "LAMB_SPEC",
    "LarsHyperparams",
    "LambHyperparams",
    "UNKNOWN",
    "as_number",
]


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()  # a value not known when checked (traced under jit)


def as_number(name: str, value: Any, rule: str) -> float | None:
    """``value`` as a float, None for :data:`UNKNOWN`; a TypeError naming it otherwise."""
    if value is UNKNOWN:
        return None
    kind = getattr(getattr(value, "dtype", None), "kind", None)  # NumPy and JAX dtypes
    if isinstance(value, bool) or kind == "b":
        raise TypeError(f"Invalid {name}: {value!r} (a bool; must be a number {rule})")
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and kind in ("i", "u", "f"):
        return float(value)
    raise TypeError(f"Invalid {name}: {value!r} (must be a number {rule})")


def as_flag(name: str, value: Any) -> bool | None:
    """``value`` as a bool: only True and False (or NumPy's) are flags."""
    if value is UNKNOWN:
        return None
    if isinstance(value, bool) or _is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"Invalid {name}: {value!r} (must be True or False)")


def _is_numpy_bool(value: Any) -> bool:
    """A NumPy bool scalar (``np.True_``; its type is ``bool_``, named "bool" in NumPy 2)."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


@dataclass(frozen=True)
class Hyper:
    """One hyperparameter: a real number in ``[low, high)`` (``(low, high)`` if
    ``low_open``), a whole number (``kind="count"``, in the same range), a flag, or a pair
    of reals (``parts`` names the two). An ``optional`` one may be None; in the fused
    kernels' table None is ``none_as``."""

    name: str
    default: Any
    doc: str
    kind: str = "real"  # "real", "count", "flag" or "pair"
    low: float = 0.0
    high: float = math.inf
    low_open: bool = False
    optional: bool = False  # None is allowed (and means "off")
    parts: tuple[str, ...] = ()
    none_as: float | None = None  # an optional one's None in the kernels' table

    @property
    def rule(self) -> str:
        if self.kind == "flag":
            return "True or False"
        if self.kind == "count":
            text = f">= {_num(self.low)} and < {_num(self.high)}, a whole number"
            return f"{text}, or None" if self.optional else text
        if self.high == math.inf:
            text = f"> {_num(self.low)}" if self.low_open else f">= {_num(self.low)}"
        else:
            text = f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)})"
        return f"{text} or None" if self.optional else text

    def check(self, value: Any, name: str | tuple[str, ...] | None = None) -> Any:
        """``value`` checked; returns it as a float, bool or pair of floats (UNKNOWN kept).
        ``name`` is the argument's name in messages (for a pair: the two names)."""
        name = name or self.name
        if self.optional and value is None:
            return None
        if self.kind == "flag":
            flag = as_flag(cast(str, name), value)  # a tuple names only a pair's parts
            return value if flag is None else flag
        if self.kind == "pair":
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise ValueError(f"Invalid {self.name}: {value!r} (must be a pair ({', '.join(self.parts)}))")
            parts = name if isinstance(name, tuple) else [f"{name}[{i}]" for i in range(2)]
            return tuple(self._real(x, part) for x, part in zip(value, parts))
        return self._real(value, cast(str, name))

    def _real(self, value: Any, name: str) -> Any:
        number = as_number(name, value, self.rule)
        if number is None:
            return value
        above = number > self.low if self.low_open else number >= self.low
        whole = self.kind != "count" or number.is_integer()
        if not (math.isfinite(number) and above and number < self.high and whole):
            raise ValueError(f"Invalid {name}: {value!r} (must be {self.rule})")
        return int(number) if self.kind == "count" else number


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer's hyperparameters (per param group, ``lr`` first), its optimizer-wide
    options and the names of its per-param state tensors."""

    name: str
    hypers: tuple[Hyper, ...]
    options: tuple[Hyper, ...]
    state: tuple[str, ...]
    hyperparams: type[Hyperparams]  # a group's values but lr, typed (below)
    rules: Callable[[Mapping[str, Any]], None] = lambda values: None  # checks across values

    @property
    def defaults(self) -> dict[str, Any]:
        """Every hyperparameter and option with its default."""
        return {h.name: h.default for h in (*self.hypers, *self.options)}

    @property
    def group_keys(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hypers)

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hypers if h.kind == "flag")

    @property
    def columns(self) -> tuple[str, ...]:
        """The per-group table of the fused kernels: every hyperparameter but ``lr``, a
        pair as its two parts."""
        out: list[str] = []
        for h in self.hypers[1:]:
            out.extend(h.parts or (h.name,))
        return tuple(out)

    def hyper(self, name: str) -> Hyper:
        for h in (*self.hypers, *self.options):
            if h.name == name:
                return h
        raise KeyError(f"{self.name} has no hyperparameter {name!r}; it has {list(self.defaults)}")

    def check(self, values: Mapping[str, Any], names: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Check ``values`` (any subset of the hyperparameters and options, unknown keys
        refused); returns them normalized. ``names`` renames arguments in messages."""
        names = names or {}
        unknown = set(values) - set(self.defaults)
        if unknown:
            raise TypeError(
                f"{self.name} has no hyperparameter {sorted(unknown)}; it has {list(self.defaults)}"
            )
        out = {k: self.hyper(k).check(v, names.get(k)) for k, v in values.items()}
        self.rules(out)
        return out

    def make(self, values: Mapping[str, Any], group: int | None = None) -> Hyperparams:
        """A group's hyperparameters but ``lr`` as this optimizer's typed object:
        ``values`` (missing ones take their defaults; ``lr``, options and unknown keys are
        refused) checked once, here; messages name ``group`` where given."""
        keys = self.group_keys[1:]
        extra = set(values) - set(keys)
        if extra:
            raise TypeError(f"{self.name} group hyperparameters are {list(keys)}, not {sorted(extra)}")
        values = {**{k: self.defaults[k] for k in keys}, **values}
        try:
            return self.hyperparams(**values)
        except (TypeError, ValueError):
            if group is not None:  # the same check again, to name the group
                self.check(values, {k: f"group {group} {k}" for k in keys})
            raise

    def from_arguments(self, arguments: Mapping[str, Any]) -> Hyperparams:
        """The typed hyperparameters from a function's arguments (its ``locals()``), each
        taken by its name in the spec: the constructors and functionals name every one
        in their signatures, and only there."""
        return self.hyperparams(**{k: arguments[k] for k in self.group_keys[1:]})

    def row(self, values: Mapping[str, Any]) -> tuple[float, ...]:
        """A group's numbers in :attr:`columns` order (a flag as 0 or 1, an optional
        one's None as its ``none_as``)."""
        flat: dict[str, Any] = {}
        for h in self.hypers[1:]:
            value = values[h.name]
            if value is None and h.optional:
                value = h.none_as
            flat.update(zip(h.parts, value) if h.parts else [(h.name, value)])
        return tuple(float(flat[c]) for c in self.columns)


@dataclass(frozen=True)
class Hyperparams:
    """One group's hyperparameters but ``lr`` (which changes every step and travels
    beside them), typed and frozen: every path of a step reads them from here, and the
    fused kernels' table row is :attr:`row`. The values are checked against the
    optimizer's spec once, when the object is made (:meth:`OptimizerSpec.make` fills in
    the defaults and names the group in messages)."""

    SPEC: ClassVar[OptimizerSpec]

    def __post_init__(self) -> None:
        checked = self.SPEC.check(self.values())
        for name, value in checked.items():  # normalized: floats, bools, a pair as a tuple
            object.__setattr__(self, name, value)

    @property
    def adapts(self) -> bool:
        """Whether the group takes the trust ratio."""
        raise NotImplementedError

    def values(self) -> dict[str, Any]:
        """The values by the spec's names, as a param group holds them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @functools.cached_property
    def row(self) -> tuple[float, ...]:
        """The fused kernels' per-group row (:meth:`OptimizerSpec.row`)."""
        return self.SPEC.row(self.values())


@dataclass(frozen=True)
class LarsHyperparams(Hyperparams):
    """A LARS group's hyperparameters (``LARS_SPEC``: meaning, defaults, ranges)."""

    momentum: float
    weight_decay: float
    trust_coefficient: float
    eps: float
    nesterov: bool
    trust_clip: bool
    trust_ratio: bool
    lr_in_momentum: bool
    zero_norm_skip: bool
    decayed_norm: bool

    @property
    def adapts(self) -> bool:
        """Whether the group takes the trust ratio."""
        return self.trust_ratio


@dataclass(frozen=True)
class LambHyperparams(Hyperparams):
    """A LAMB group's hyperparameters (``LAMB_SPEC``: meaning, defaults, ranges)."""

    betas: tuple[float, float]
    eps: float
    weight_decay: float
    bias_correction: bool
    trust_ratio: bool
    adam_w_mode: bool
    grad_averaging: bool
    adapt_without_decay: bool
    freeze_step: int | None

    @property
    def adapts(self) -> bool:
        """Whether the group takes the trust ratio: its flag, and its weight decay unless
        ``adapt_without_decay``."""
        return self.trust_ratio and (self.adapt_without_decay or self.weight_decay != 0)


def _lars_rules(values: Mapping[str, Any]) -> None:
    if values.get("nesterov") is True and values.get("momentum", 1.0) == 0.0:
        raise ValueError(f"Invalid nesterov=True with momentum={values['momentum']!r} (needs momentum > 0)")
    if values.get("decayed_norm") is True and values.get("zero_norm_skip") is True:
        raise ValueError(
            "Invalid decayed_norm=True with zero_norm_skip=True: apex LARC's zero-norm "
            "rule (zero_norm_skip) and optax's denominator ||g + wd * w|| "
            "(decayed_norm) are no one source's; pass at most one of them"
        )


def _lr(default: float) -> Hyper:
    return Hyper("lr", default, "the learning rate (a float, a one-element tensor or a schedule)")


_WEIGHT_DECAY = Hyper(
    "weight_decay",
    0.0,
    "wd: added to the update direction (g + wd * w for LARS, r + wd * w for "
    "LAMB), so it enters the trust ratio's denominator",
)
_TRUST_RATIO = Hyper(
    "trust_ratio",
    True,
    "adapt this group; False: ratio 1 (weight decay still applies)",
    kind="flag",
)

LARS_SPEC = OptimizerSpec(
    name="LARS",
    hypers=(
        _lr(1.0),
        Hyper("momentum", 0.9, "the momentum coefficient", high=1.0),
        _WEIGHT_DECAY,
        Hyper("trust_coefficient", 0.001, "tc (eta in the paper)", low_open=True),
        Hyper("eps", 0.0, "added to the trust-ratio denominator"),
        Hyper("nesterov", False, "Nesterov momentum", kind="flag"),
        Hyper("trust_clip", False, "LARC: min(ratio / lr, 1)", kind="flag"),
        _TRUST_RATIO,
        Hyper(
            "lr_in_momentum",
            True,
            "v = m * v + lr * ratio * d, w -= v (MLPerf's TF reference); "
            "False: v = m * v + ratio * d, w -= lr * v (torch SGD, apex LARC, NVIDIA's MXNet, "
            "timm)",
            kind="flag",
        ),
        Hyper(
            "zero_norm_skip",
            False,
            "where ||w|| or ||g|| is 0, d = g: ratio 1, no clip, no "
            "weight decay (apex LARC); False: ratio 1, then clip and weight decay",
            kind="flag",
        ),
        Hyper(
            "decayed_norm",
            False,
            "ratio = tc * ||w|| / (||g + wd * w|| + eps), 1 where ||w|| or "
            "||g + wd * w|| is 0 (optax, optax/_src/alias.py lars); False: the denominator "
            "||g|| + wd * ||w|| + eps",
            kind="flag",
        ),
    ),
    options=(),
    state=("momentum_buffer",),
    hyperparams=LarsHyperparams,
    rules=_lars_rules,
)

LAMB_SPEC = OptimizerSpec(
    name="LAMB",
    hypers=(
        _lr(1e-3),
        Hyper(
            "betas",
            (0.9, 0.999),
            "the moments' decay rates, each in [0, 1)",
            kind="pair",
            high=1.0,
            parts=("b1", "b2"),
        ),
        Hyper("eps", 1e-6, "added to sqrt(v_hat)"),
        _WEIGHT_DECAY,
        Hyper("bias_correction", True, "divide the moments by 1 - b^t", kind="flag"),
        _TRUST_RATIO,
        Hyper(
            "adam_w_mode",
            True,
            "u = r + wd * w (decoupled); False: L2, g + wd * w enters "
            "the moments and u = r (apex FusedLAMB adam_w_mode=False)",
            kind="flag",
        ),
        Hyper(
            "grad_averaging",
            True,
            "m = b1 * m + (1 - b1) * g; False: m = b1 * m + g (apex FusedLAMB, timm)",
            kind="flag",
        ),
        Hyper(
            "adapt_without_decay",
            True,
            "the trust ratio also where weight_decay is 0; "
            "False: only where it is not (apex FusedLAMB's default, timm's)",
            kind="flag",
        ),
        Hyper(
            "freeze_step",
            None,
            "after step t = freeze_step, v and its bias correction "
            "stay as they are (1-bit LAMB's and 1-bit Adam's frozen variance); None: never",
            kind="count",
            low=1,
            high=float(2**31 - 1),
            optional=True,
            none_as=float(2**31 - 1),
        ),
    ),
    options=(
        Hyper(
            "max_grad_norm", None, "clip all grads by their global norm first", low_open=True, optional=True
        ),
    ),
    state=("exp_avg", "exp_avg_sq"),
    hyperparams=LambHyperparams,
)


def _bind(spec: OptimizerSpec) -> None:
    """Tie a spec to its typed hyperparameters, whose fields must be its group keys but lr."""
    spec.hyperparams.SPEC = spec
    names = tuple(f.name for f in fields(spec.hyperparams))
    if names != spec.group_keys[1:]:
        raise AssertionError(
            f"{spec.hyperparams.__name__}'s fields {names} are not {spec.name}'s "
            f"group keys but lr, {spec.group_keys[1:]}"
        )


_bind(LARS_SPEC)
_bind(LAMB_SPEC)
