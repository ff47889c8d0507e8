"""The state rule: every contract-managed region is allocated at exactly its declared extent.

Stock code provisions envelopes (Token2Wav's CFM keeps a (16, 16, 2, 8, 1000, 128) fp32 cache for
at most 10 solver steps and 458 live frames). The adapter names the module buffer that holds each
region; this pass replaces it, in place on the module, with a zeroed buffer of the demand shape
the catalog derived. The stock code keeps indexing the same attribute, so it runs unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cadence_fx.catalog import Catalog
from cadence_fx.contract import DTYPES

__all__ = ["Envelope", "Resize", "apply_state_rule", "shed_envelopes"]


@dataclass(frozen=True)
class Envelope:
    """A stock module buffer (``decoder.att_cache_buffer``) that holds region `region`."""

    path: str
    region: str


@dataclass(frozen=True)
class Resize:
    path: str
    region: str
    stock_shape: tuple[int, ...]
    stock_bytes: int
    demand_shape: tuple[int, ...]
    demand_bytes: int


def _owner(module: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str, torch.Tensor]:
    """The module that holds the buffer at `path`, the buffer's name there, and the buffer."""
    owner_path, _, name = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if name not in owner._buffers:  # noqa: SLF001 - buffers are what the rule replaces
        raise ValueError(f"{path!r} is not a buffer of {type(owner).__name__}; buffers: {sorted(owner._buffers)}")
    stock = owner._buffers[name]  # noqa: SLF001
    if stock is None:
        raise ValueError(f"{path!r} is a buffer of {type(owner).__name__} set to None; the rule resizes a tensor")
    return owner, name, stock


def shed_envelopes(module: torch.nn.Module, envelopes: tuple[Envelope, ...]) -> dict[int, torch.Tensor]:
    """A `copy.deepcopy` memo that copies each envelope as an empty meta tensor of its shape, so
    copying a model never duplicates the envelopes the state rule is about to replace."""
    memo = {}
    for envelope in envelopes:
        _, _, stock = _owner(module, envelope.path)
        memo[id(stock)] = torch.empty(stock.shape, dtype=stock.dtype, device="meta")
    return memo


def apply_state_rule(module: torch.nn.Module, envelopes: tuple[Envelope, ...], catalog: Catalog, *, device: torch.device):
    """Resize each envelope of `module` to its region's derived demand, allocated on `device`.

    Returns the resizes and a stamp."""
    started = time.perf_counter()
    resizes = []
    for envelope in envelopes:
        region = catalog.region(envelope.region)
        shape, demand_bytes = region.demand()
        owner, name, stock = _owner(module, envelope.path)
        if stock.dim() != len(shape):
            raise ValueError(f"{envelope.path!r} has shape {tuple(stock.shape)}, region {region.name!r} has rank {len(shape)}")
        if any(d > s for d, s in zip(shape, stock.shape)):
            raise ValueError(
                f"{envelope.path!r}: demand {shape} exceeds the stock envelope {tuple(stock.shape)}; "
                "the contract and the model disagree"
            )
        if stock.dtype != DTYPES[region.dtype]:
            raise ValueError(f"{envelope.path!r} is {stock.dtype}, region {region.name!r} declares {region.dtype}")
        owner._buffers[name] = torch.zeros(shape, dtype=stock.dtype, device=device)  # noqa: SLF001
        resizes.append(
            Resize(
                envelope.path,
                region.name,
                tuple(stock.shape),
                stock.numel() * stock.element_size(),
                shape,
                demand_bytes,
            )
        )
    took = (time.perf_counter() - started) * 1e3
    stamp = f"state rule: {len(resizes)} envelopes resized to demand, took {took:.1f} ms"
    return resizes, stamp
