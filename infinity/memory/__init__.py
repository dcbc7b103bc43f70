"""The tiered memory manager: one record per managed group with an explicit location
state machine, leased buffer pools per tier, the placement plan and byte accounting.
See docs/architecture.md."""
from .accounting import LINKS, TIERS, Accounting
from .manager import MemoryManager
from .plan import PlacementPlan, WorkingSetError
from .pool import BufferPool, PoolExhausted
from .record import GroupRecord, Location, ParamSlot, StateError, placeholder

__all__ = ["Accounting", "TIERS", "LINKS", "MemoryManager", "PlacementPlan", "WorkingSetError",
           "BufferPool", "PoolExhausted", "GroupRecord", "Location", "ParamSlot", "StateError",
           "placeholder"]
