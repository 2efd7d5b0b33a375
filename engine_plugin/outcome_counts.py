"""The action type an outcome is counted under, bounded.

An action's type comes from the wire: any string a sender wrote. Counting outcomes by the
raw string would grow a counter by one key per made-up type, for good (memory in the
engine, and a stats read that folds them all on the scheduler thread). So counters are
keyed by :func:`counted_action_type` when they are incremented: the types this contract
defines as they are, "" for an action that could not be identified at all, and
:data:`OTHER_ACTION_TYPE` for the rest. The outcome itself still carries the real type.

These keys are fixed points of the ``action`` label of ``kvhint:hints_total``
(``metrics.hint_action_label``: "" -> "unknown", "other" -> "other", a known type -> itself),
so folding again at export changes nothing.
"""

from __future__ import annotations

from kvhint.schemas.advice import DONOR_ACTION_TYPE
from kvhint.schemas.hints import ACTION_TYPE_VALUES

KNOWN_ACTION_TYPES = ACTION_TYPE_VALUES | {DONOR_ACTION_TYPE}
OTHER_ACTION_TYPE = "other"


def counted_action_type(action_type: str) -> str:
    """The bounded key an outcome of ``action_type`` is counted under (see above)."""
    if not action_type or action_type in KNOWN_ACTION_TYPES:
        return action_type
    return OTHER_ACTION_TYPE
