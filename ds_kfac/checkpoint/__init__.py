"""K-FAC's saved state: its layout (:mod:`.record`), writing and reading it (:mod:`.io`), and checking it whole
before anything is installed (:mod:`.validation`)."""

from .record import METHOD_KEYS, STATE_VERSION, LayerRecord
from .validation import CheckedState, ExpectedLayer, ExpectedState, check_state

__all__ = [
    "METHOD_KEYS",
    "STATE_VERSION",
    "CheckedState",
    "ExpectedLayer",
    "LayerRecord",
    "ExpectedState",
    "check_state",
]
