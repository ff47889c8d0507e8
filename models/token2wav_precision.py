"""The vendor's two Token2Wav configurations, declared: float32 and float16.

``Token2wav(float16=True)`` (minicpmo-utils 1.0.6, ``stepaudio2/token2wav.py``) calls
``flow.half()`` before loading the weights and runs the flow under ``autocast("cuda", float16)``;
HiFT stays float32 (the stream's concatenation with HiFT's float32 mel cache promotes the chunk's
mel). Without float16 it runs the flow under ``autocast("cuda", float32)``, which leaves kernels as
they are. Autocast on "cuda" leaves CPU ops alone, so the float16 configuration exists only on
CUDA: asked for on another device it is refused by name rather than silently run at float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .token2wav_stream import FULL_DEPTH, FlowDepth, Prompt, StockStream, build_flow, build_hift

__all__ = ["FLOAT16", "FLOAT32", "PRECISIONS", "Precision", "build_models", "precision", "stock_stream"]


@dataclass(frozen=True)
class Precision:
    name: str
    flow_dtype: torch.dtype
    autocast_dtype: torch.dtype
    devices: tuple[str, ...]
    vendor: str

    @property
    def float16(self) -> bool:
        return self.flow_dtype == torch.float16

    def check_device(self, device: torch.device | str) -> None:
        kind = torch.device(device).type
        if kind not in self.devices:
            raise ValueError(
                f"token2wav precision {self.name!r} is the vendor's {'/'.join(self.devices)} configuration "
                f"({self.vendor}); it does not exist on {kind!r}: use 'float32' there"
            )


FLOAT32 = Precision(
    "float32",
    torch.float32,
    torch.float32,
    ("cpu", "cuda"),
    "Token2wav(float16=False): the flow in float32 under autocast('cuda', float32)",
)
FLOAT16 = Precision(
    "float16",
    torch.float16,
    torch.float16,
    ("cuda",),
    "Token2wav(float16=True): flow.half(), the flow under autocast('cuda', float16), HiFT in float32",
)
PRECISIONS = {p.name: p for p in (FLOAT32, FLOAT16)}


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"token2wav precision must be one of {sorted(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


def build_models(
    chosen: Precision, depth: FlowDepth = FULL_DEPTH, *, device: torch.device | str, seed: int = 0, hift_channels: int = 512
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The flow at the configuration's dtype (as ``flow.half()`` leaves it) and HiFT in float32."""
    chosen.check_device(device)
    flow = build_flow(depth, seed=seed, device=device, dtype=chosen.flow_dtype)
    return flow, build_hift(seed=seed, device=device, base_channels=hift_channels)


def stock_stream(chosen: Precision, flow: torch.nn.Module, hift: torch.nn.Module, prompt: Prompt, **kwargs) -> StockStream:
    """The vendor's stream at this configuration (its autocast)."""
    chosen.check_device(prompt.mels.device)
    return StockStream(flow, hift, prompt, float16=chosen.float16, **kwargs)
