"""What a parameter accepts, checked with a one-line message: notebooks' papermill parameters and TrainConfig fields.

A :class:`Param` says what one value may be (its type and range) and turns a wrong one into
``ValueError("<name>=<value!r>: expected <what>")``. Notebooks check their parameters right after the
``parameters`` cell, so that ``papermill -p trials lots`` stops there with ``trials='lots': expected an int >= 1``
instead of a TypeError deep in a later cell, and a misspelled name (``papermill -p trails 5``) stops with
``trails=5: not a parameter of this notebook (did you mean trials?); its parameters: ...`` instead of running the
defaults::

    check_params({"trials": integer(1), "a": real(), "run": optional(text()), "n_ones": list_of(integer(0))}, globals())

:mod:`lpfa.train` checks every TrainConfig field with the same constructors.
"""

from __future__ import annotations

import difflib
import math
import numbers
import types
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Param", "check_params", "undeclared", "integer", "real", "boolean", "text", "optional", "list_of",
           "dict_of"]


@dataclass(frozen=True)
class Param:
    """``expected``: what is accepted, in words ("an int >= 1"); ``accepts(value)``: whether ``value`` is;
    ``convert(value)``: the value as stored (an int given for a float becomes a float)."""

    expected: str
    accepts: Callable[[Any], bool]
    convert: Callable[[Any], Any] = lambda v: v

    def check(self, name: str, value):
        """``value`` converted, or ValueError ``"<name>=<value!r>: expected <expected>"``."""
        if not self.accepts(value):
            raise ValueError(f"{name}={value!r}: expected {self.expected}")
        return self.convert(value)


IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit"})  # IPython's own globals (and "_"-names)


def undeclared(spec: dict[str, Param], namespace: dict) -> list[str]:
    """The names of ``namespace`` that a parameters cell or papermill's injected cell could have set but ``spec``
    does not declare: not IPython's own (:data:`IPYTHON_NAMES`, names starting with "_"), not a module, function or
    class (what the check cell imports)."""
    return [name for name, value in namespace.items()
            if name not in spec and name not in IPYTHON_NAMES and not name.startswith("_")
            and not isinstance(value, (types.ModuleType, type)) and not callable(value)]


def check_params(spec: dict[str, Param], namespace: dict) -> None:
    """Check the parameters named in ``spec`` (``{name: Param}``) as found in ``namespace`` (a notebook's
    ``globals()``, right after its parameters cell and papermill's injected one): the first wrong one raises ValueError
    ``"<name>=<value!r>: expected <what>"``, and a name the notebook does not declare (``papermill -p trails 5``)
    ``"trails=5: not a parameter of this notebook; its parameters: ..."`` (:func:`undeclared`)."""
    extra = undeclared(spec, namespace)
    if extra:
        close = difflib.get_close_matches(extra[0], list(spec), n=1)
        raise ValueError(f"{extra[0]}={namespace[extra[0]]!r}: not a parameter of this notebook"
                         + (f" (did you mean {close[0]}?)" if close else "")
                         + f"; its parameters: {', '.join(spec)}")
    for name, param in spec.items():
        if name not in namespace:
            raise ValueError(f"{name}: not defined by the parameters cell (the check names a parameter that does not "
                             "exist)")
        param.check(name, namespace[name])


def _range_text(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi:g}"
    return ""


def _in_range(v, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    return ((lo is None or (v > lo if lo_open else v >= lo))
            and (hi is None or (v < hi if hi_open else v <= hi)))


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def integer(lo: int | None = None, hi: int | None = None) -> Param:
    """An int (not a bool, not a float such as 2.0) in [lo, hi]."""
    return Param(f"an int{_range_text(lo, hi, False, False)}",
                 lambda v: _is_int(v) and _in_range(v, lo, hi, False, False), int)


def real(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False) -> Param:
    """A finite number (an int is fine) in the range, each end closed unless ``lo_open`` / ``hi_open``."""
    return Param(f"a finite number{_range_text(lo, hi, lo_open, hi_open)}",
                 lambda v: (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                            and _in_range(v, lo, hi, lo_open, hi_open)), float)


def boolean() -> Param:
    """True or False (not 1, not "yes")."""
    return Param("true or false", lambda v: isinstance(v, bool))


def text(*choices: str, nonempty: bool = False) -> Param:
    """A string; one of ``choices`` when given; not "" when ``nonempty``."""
    if choices:
        return Param("one of " + ", ".join(map(repr, choices)), lambda v: isinstance(v, str) and v in choices)
    return Param("a non-empty string" if nonempty else "a string",
                 lambda v: isinstance(v, str) and (v != "" or not nonempty))


def optional(param: Param) -> Param:
    """None, or what ``param`` accepts."""
    return Param(f"None or {param.expected}", lambda v: v is None or param.accepts(v),
                 lambda v: None if v is None else param.convert(v))


def list_of(item: Param, nonempty: bool = True) -> Param:
    """A list (or tuple) whose every item ``item`` accepts; not empty when ``nonempty``."""
    return Param(f"a {'non-empty ' if nonempty else ''}list, each item {item.expected}",
                 lambda v: (isinstance(v, (list, tuple)) and (len(v) > 0 or not nonempty)
                            and all(item.accepts(x) for x in v)),
                 lambda v: [item.convert(x) for x in v])


def dict_of(key: Param, value: Param, nonempty: bool = False, required: tuple = ()) -> Param:
    """A dict whose every key ``key`` accepts and every value ``value`` accepts; with the keys ``required``
    (e.g. the labels a notebook reads), and not empty when ``nonempty``."""
    with_keys = f" with the keys {', '.join(map(repr, required))}" if required else ""
    what = (f"a {'non-empty ' if nonempty else ''}dict{with_keys}, each key {key.expected} and each value "
            f"{value.expected}")
    return Param(what,
                 lambda v: (isinstance(v, dict) and (len(v) > 0 or not nonempty) and all(k in v for k in required)
                            and all(key.accepts(k) and value.accepts(x) for k, x in v.items())),
                 lambda v: {key.convert(k): value.convert(x) for k, x in v.items()})
