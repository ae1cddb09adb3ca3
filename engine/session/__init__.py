"""A conversation with one model and its projector held in RAM (`Session`, session.py), and
the model's memory of conversations beyond the KV cache (`KeptMemory`, kept.py)."""
from engine.session.session import (
    Conversation,
    HistoryTurn,
    Session,
    SessionConfig,
    TurnResult,
    turn_with_recovery,
)

__all__ = ["Conversation", "HistoryTurn", "Session", "SessionConfig", "TurnResult",
           "turn_with_recovery"]
