"""The one shape of every executor: a table of handlers per class, built once.

An executor performs the effects an operation yields. Each of its methods that handles effects
says which (``@handles(fx.Register)``); the class's table, built once when the class is made,
maps every effect type it performs to its handler, and :meth:`Executor.perform` looks the
effect up there. A class may hand a whole family of effects to a part it holds
(``parts = {RegistryEffects: "registry_effects"}``: every effect ``RegistryEffects`` handles is
performed by the object in ``self.registry_effects``), so an effect shared by several
executors has one handler in the whole code base. An effect handled twice in one table, by the
class and a part or by two parts, is refused when the class is made (:class:`TypeError`).

Driving a sequence to its end or to a stop point is :class:`~rollsafe.operations.effects.Run`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from rollsafe.operations.effects import Effect, OperationError, Outcome

__all__ = ["Executor", "handles"]

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")

_MARK = "__rollsafe_handles__"


def handles(*effects: type[Effect[Any]], step: Any = None) -> Callable[[F], F]:
    """Mark an executor method as the handler of ``effects`` (each an effect class).

    ``step``: what step these effects are, declared once here (a name, or the declaration an
    executor reads: the recovery's ``TimedStep``); an executor that times or records its steps
    reads it from :attr:`Executor.declared_steps` (the recovery runs such a step under the attempt's
    deadline and records it once under its name; a sync adds its seconds to that timing)."""
    if not effects:
        raise TypeError("handles() needs at least one effect class")

    def mark(fn: F) -> F:
        setattr(fn, _MARK, (tuple(effects), step))
        return fn

    return mark


class Executor:
    """Base of every executor: :meth:`perform` through the class's table.

    ``parts`` maps another executor class to the attribute of ``self`` that holds an instance
    of it: the effects that class handles are performed by that instance.
    """

    parts: ClassVar[Mapping[type[Executor], str]] = {}
    #: effect type -> (the part attribute, or None for the class itself; the handler's name)
    table: ClassVar[Mapping[type[Effect[Any]], tuple[str | None, str]]] = {}
    #: effect type -> the step its handler declared (``handles(..., step=)``)
    declared_steps: ClassVar[Mapping[type[Effect[Any]], Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[type[Effect[Any]], tuple[str | None, str]] = {}
        steps: dict[type[Effect[Any]], Any] = {}
        owners: dict[type[Effect[Any]], str] = {}
        for klass in reversed(cls.__mro__):
            for name, member in vars(klass).items():
                declared, step = getattr(member, _MARK, ((), None))
                for effect in declared:
                    if step is not None:
                        steps[effect] = step
                    previous = owners.get(effect)
                    if previous is not None and previous != name and klass is cls:
                        raise TypeError(
                            f"{cls.__name__}: {effect.__name__} is handled by both "
                            f"{previous} and {name}"
                        )
                    table[effect], owners[effect] = (None, name), name
        for part, attribute in cls.parts.items():
            for effect, (inner, name) in part.table.items():
                if inner is not None:
                    raise TypeError(
                        f"{cls.__name__}: part {part.__name__} delegates {effect.__name__} "
                        "itself; hand that family to this class directly"
                    )
                if effect in table:
                    raise TypeError(
                        f"{cls.__name__}: {effect.__name__} is handled both by "
                        f"{owners.get(effect) or table[effect][0]} and by part {part.__name__}"
                    )
                table[effect] = (attribute, name)
                if effect in part.declared_steps:
                    steps[effect] = part.declared_steps[effect]
        cls.table = table
        cls.declared_steps = steps

    def perform(self, effect: Effect[R]) -> Outcome[R]:
        """Perform ``effect`` with its handler; :class:`OperationError` when this executor has
        none (an operation yielded an effect its executor does not know)."""
        entry = self.table.get(type(effect))
        if entry is None:
            raise OperationError(f"{type(self).__name__} cannot perform {effect!r}")
        part, name = entry
        owner = self if part is None else getattr(self, part)
        handler: Callable[[Effect[R]], Outcome[R]] = getattr(owner, name)
        return handler(effect)

    @classmethod
    def performs(cls) -> frozenset[type[Effect[Any]]]:
        """The effect types this executor performs."""
        return frozenset(cls.table)
