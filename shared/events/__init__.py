"""Every message on the Tidal bus, one module per subject family.

    from shared.events import SubmitRequest, TokenChunk, WorkerStats
    from shared.events.ctl import CtlRequest        # a family's tagged union

Which subject carries which message is `shared.subjects.CATALOG`; the JSON Schemas in
`schemas/` are generated from these classes by `tidal schemas`.
"""
from __future__ import annotations

import inspect
from types import ModuleType

from shared.events import base, common, ctl, dispatch, plan, predict, registry, stream, worker
from shared.events.base import Message, Value, message_tag
from shared.events.common import *  # noqa: F403
from shared.events.ctl import *  # noqa: F403
from shared.events.dispatch import *  # noqa: F403
from shared.events.plan import *  # noqa: F403
from shared.events.predict import *  # noqa: F403
from shared.events.registry import *  # noqa: F403
from shared.events.stream import *  # noqa: F403
from shared.events.worker import *  # noqa: F403

FAMILY_MODULES: dict[str, ModuleType] = {
    "dispatch": dispatch,
    "worker": worker,
    "ctl": ctl,
    "stream": stream,
    "registry": registry,
    "plan": plan,
    "predict": predict,
    "common": common,
}


def family_messages(module: ModuleType) -> list[type[Message]]:
    """The concrete Message classes defined in a family module, in source order."""
    found = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, Message) and obj.__module__ == module.__name__
    ]
    found.sort(key=lambda cls: inspect.getsourcelines(cls)[1])
    return [cls for cls in found if cls is not ctl.CtlCommand]  # CtlCommand is an abstract base


def all_messages() -> list[type[Message]]:
    """Every concrete Message class, by family then source order."""
    return [cls for module in FAMILY_MODULES.values() for cls in family_messages(module)]


__all__ = [  # noqa: F405 - the families' own __all__ are re-exported above
    "FAMILY_MODULES",
    "Message",
    "Value",
    "all_messages",
    "base",
    "family_messages",
    "message_tag",
    *common.__all__,
    *ctl.__all__,
    *dispatch.__all__,
    *plan.__all__,
    *predict.__all__,
    *registry.__all__,
    *stream.__all__,
    *worker.__all__,
]
