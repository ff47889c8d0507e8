"""The retention policies, one file each: how a region's extent stays bounded (C2).

Each is a frozen dataclass subclassing `cadence_fx.contract.Retention`, which registers it in
`cadence_fx.contract.RETENTION_POLICIES`; the core reads a region's policy through that interface
(its checks, its retained extent r(t), whether its shape is fixed, what it keeps at the head) and
never imports one. A new policy is one file here, imported below, plus its tests.
"""

from .in_place import InPlace
from .prompt_history import PromptPlusHistory
from .ring import RingCache
from .window import SlidingWindow

__all__ = ["InPlace", "PromptPlusHistory", "RingCache", "SlidingWindow"]
