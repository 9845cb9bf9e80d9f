"""Stage 2 and 4: moving tokens to the ranks that hold their experts, and back."""

from safeserve.moe.dispatch.base import CombineInput, Dispatcher, DispatchOutput
from safeserve.moe.dispatch.local import LocalDispatcher

__all__ = ["CombineInput", "DispatchOutput", "Dispatcher", "LocalDispatcher"]
