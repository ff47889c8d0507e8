"""Model-family adapters: one contract (and, where built, one runner) per family."""

from __future__ import annotations

from typing import Callable

from cadence_fx.contract import Contract

from .freeze_omni import freeze_omni_contract
from .llm_backbone import llm_backbone_contract
from .moshi import moshi_contract
from .token2wav import token2wav_contract
from . import token2wav_carry  # noqa: F401  registers the Token2Wav adapter; the vendor loads on use
from . import freeze_omni_carry  # noqa: F401  registers the Freeze-Omni adapter
from . import moshi_replay  # noqa: F401  registers the Moshi adapter; the vendor loads on use

#: Every family the CLI knows, by name, with the factory of its default contract.
FAMILIES: dict[str, Callable[[], Contract]] = {
    "token2wav": token2wav_contract,
    "moshi": moshi_contract,
    "freeze_omni": freeze_omni_contract,
    "llm_backbone": llm_backbone_contract,
}


def family_contract(name: str) -> Contract:
    try:
        factory = FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; expected one of {sorted(FAMILIES)}") from None
    return factory()
