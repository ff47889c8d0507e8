"""Freeze-Omni under the window pass: the adapter behind `transform(encoder, freeze_omni_contract(...))`.

Where the regions live in the in-repo encoder (`freeze_omni_encoder.py`): `infer` threads one flat
list through its layers, `[kv_0, kv_1, ...]` with the linear feed-forward and
`[kv_0, cnn_0, kv_1, cnn_1, ...]` with the conv one. Layer l's attention keeps
``kv_l = [keys, values]`` (None before the first chunk), each ``cat([kept, new], dim=2)[:, :, -W:]``
(the region `attention_kv`, which holds the call's units: the concat is the attention operand);
a conv feed-forward keeps ``cnn_l = cat([cnn_l, x], dim=2)[:, :, -lorder:]``
(`conv_left_context`, which holds only what it retains: the compact lorder-frame carry).

The step is exported once per catalog class (no keys yet, then 1 to `left_chunks` chunks of keys:
K = left_chunks + 1), and the window pass (`passes/window.py`) rewrites every retention on the
exported graph into in-place writes into carries allocated at the derived bounds, one physical
address each for the life of the encoder. The transformed encoder keeps the stock interface
(`init_buffers`, `init_pe_index`, `infer`), so the stock driver `stream_utterance` runs it
unchanged; the buffer list it threads is then made of carry views. A new utterance
(`init_buffers`) writes the base state into the carries in place.

Replay: one `ExactShapeReplay` binding over the step, with the catalog's classes as exact
signatures, the buffer list (the carry views) aliased and the rewritten graphs as its modules.
The window ops keep each carry's retained extent (and its write counts) in Python integers, which
a replay, running no Python, would leave behind: the carries are the binding's `HostCounters`, so
it rewinds them after its probe and moves them after each replay as the eager call of that class
did. Under `audit=True` there is no replay: the auditor compares the stock retention with the
carry on the host inside the step, which a graph cannot hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from cadence_fx.audit import ShadowAuditor
from cadence_fx.capture import capture as export_operator
from cadence_fx.catalog import Catalog, RegionDerivation
from cadence_fx.contract import DTYPES, Contract
from cadence_fx.determinism import envelope, settings
from cadence_fx.passes.carry import Carry
from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.passes.state import Resize
from cadence_fx.passes.window import CarryCounters, Window, WindowCarry, rewrite_windows
from cadence_fx.replay import ExactShapeReplay, ShapeClass, Signature, TensorSpec
from cadence_fx.report import format_bytes
from cadence_fx.transform import Adapter, TransformReport

from .freeze_omni_encoder import FreezeOmniEncoder, FreezeOmniEncoderConfig, InferStep

__all__ = ["FreezeOmniAdapter", "TransformedEncoder", "class_name"]

OPERATOR = "encoder_chunk"
KV, CONV = "attention_kv", "conv_left_context"


def class_name(extent: int) -> str:
    return f"{OPERATOR}[L={extent}]"


@dataclass(frozen=True)
class _Slot:
    """One retention in the buffer list: its site name, region, and pytree path inside `buffer`."""

    site: str
    region: str
    path: tuple[int, ...]
    index: tuple[int, ...]  # where its carry sits in the region's buffer


def _slots(config: FreezeOmniEncoderConfig) -> list[_Slot]:
    """Every retention of the buffer list: per layer its keys and values, and, with the conv
    feed-forward, its conv context in the next entry."""
    per_layer = 2 if config.conv_feed_forward else 1
    slots = []
    for layer in range(config.num_blocks):
        entry = per_layer * layer
        for j, name in enumerate(("keys", "values")):
            slots.append(_Slot(f"{KV}[{layer}].{name}", KV, (entry, j), (layer, j)))
        if config.conv_feed_forward:
            slots.append(_Slot(f"{CONV}[{layer}]", CONV, (entry + 1,), (layer,)))
    return slots


def _leaf_positions(tree) -> dict[tuple, int]:
    """Flat leaf index of every leaf of `tree`, by its path of sequence indices."""
    flat, _ = pytree.tree_flatten_with_path(tree)
    return {tuple(k.idx for k in path): i for i, (path, _) in enumerate(flat)}


def _retained(region: RegionDerivation) -> int:
    """The units a region retains between calls in steady state."""
    return region.lower + region.window


class TransformedEncoder:
    """The encoder's step on carries: the stock `infer` interface, one rewritten graph per class,
    under one replay binding (`replay`, None when replay is off)."""

    def __init__(self, encoder: FreezeOmniEncoder, graphs: dict[int, torch.fx.GraphModule], carries: dict[str, WindowCarry],
                 report: TransformReport, *, replay: bool):
        self.config = encoder.config
        self.graphs = graphs
        self.carries = carries
        self.report = report
        self.auditor = report.auditor
        self._base_context = [entry for entry in encoder.init_buffers() if entry is not None]  # conv only
        self._pe_index = encoder.init_pe_index()
        self.calls = {class_name(extent): 0 for extent in graphs}
        self.replay: ExactShapeReplay | None = None
        if replay:
            device = encoder.global_cmvn.mean.device
            self.replay = ExactShapeReplay(
                self._step, self._classes(encoder, device), name=OPERATOR, aliased=[1], modules=list(graphs.values()),
                host_counters=CarryCounters(list(carries.values())), hooks=(HostConstantHoist(),) if device.type == "cuda" else (),
            )
            report.replays[OPERATOR] = self.replay

    def _classes(self, encoder: FreezeOmniEncoder, device: torch.device) -> list[ShapeClass]:
        """One exact signature per graph: the chunk, the buffer list of carry views retaining
        `extent` frames of keys (none before the first chunk), the positional index."""
        c = self.config
        dtype = encoder.global_cmvn.mean.dtype
        fbank = c.chunk_frames + c.chunk_overlap

        def spec(t: torch.Tensor) -> TensorSpec:
            return TensorSpec(tuple(t.shape), t.dtype, device, stride=tuple(t.stride()))

        classes = []
        for extent in self.graphs:
            buffer: list = []
            for layer in range(c.num_blocks):
                keys, values = (self.carries[f"{KV}[{layer}].{part}"] for part in ("keys", "values"))
                buffer.append(None if extent == 0 else [spec(keys.view(extent)), spec(values.view(extent))])
                if c.conv_feed_forward:
                    buffer.append(spec(self.carries[f"{CONV}[{layer}]"].view(c.lorder)))
            signature = Signature.of(TensorSpec((1, fbank, c.input_dim), dtype, device), buffer,
                                     TensorSpec((), torch.long, device))
            classes.append(ShapeClass(class_name(extent), signature, (("L", extent),)))
        return classes

    def _graph(self, buffer: list) -> tuple[int, torch.fx.GraphModule]:
        """The class of a call (the frames of keys its buffer list retains) and its graph."""
        extent = 0 if buffer[0] is None else buffer[0][0].shape[2]
        graph = self.graphs.get(extent)
        if graph is None:
            raise ValueError(f"no catalog class retains {extent} frames of keys; classes: {sorted(self.graphs)}")
        return extent, graph

    def _step(self, chunk: torch.Tensor, buffer: list, pe_index: torch.Tensor) -> tuple[torch.Tensor, list, torch.Tensor]:
        return self._graph(buffer)[1](chunk, buffer, pe_index)

    def init_buffers(self) -> list:
        """A new utterance: no keys retained, a conv feed-forward's zero context written into its
        carries in place."""
        buffer: list = []
        for layer in range(self.config.num_blocks):
            self.carries[f"{KV}[{layer}].keys"].reset()
            self.carries[f"{KV}[{layer}].values"].reset()
            buffer.append(None)
            if self.config.conv_feed_forward:
                buffer.append(self.carries[f"{CONV}[{layer}]"].reset(self._base_context[layer]))
        return buffer

    def init_pe_index(self) -> torch.Tensor:
        return self._pe_index.clone()

    def infer(self, chunk: torch.Tensor, buffer: list, pe_index: torch.Tensor) -> tuple[torch.Tensor, list, torch.Tensor]:
        """One chunk, as `FreezeOmniEncoder.infer`: `buffer` must be what the last call (or
        `init_buffers`) returned; the returned buffer list is made of carry views."""
        extent, graph = self._graph(buffer)
        self.calls[class_name(extent)] += 1
        with torch.no_grad():
            return graph(chunk, buffer, pe_index) if self.replay is None else self.replay(chunk, buffer, pe_index)


def _check_model(encoder: FreezeOmniEncoder, contract: Contract, catalog: Catalog) -> None:
    c = encoder.config
    symbols = contract.symbols()
    found = {
        "blocks": c.num_blocks,
        "heads": c.attention_heads,
        "d_model": c.attention_dim,
        "head_dim": c.attention_dim // c.attention_heads,
        "chunk_frames": c.chunk_size,
    }
    for name, actual in found.items():
        if symbols[name] != actual:
            raise ValueError(f"contract quantity {name}={symbols[name]} but the encoder has {actual}: declare {name}={actual}")
    names = tuple(region.name for region in contract.regions)
    retained = {KV: c.kv_frames, CONV: c.lorder} if c.conv_feed_forward else {KV: c.kv_frames}
    if names != tuple(retained):
        raise ValueError(f"the contract declares regions {names} but the encoder ({c.feed_forward} feed-forward) "
                         f"keeps {tuple(retained)}: derive the contract with encoder_contract(encoder.config)")
    for region, actual in retained.items():
        declared = _retained(catalog.region(region))
        if declared != actual:
            raise ValueError(f"region {region!r} retains {declared} frames but the encoder keeps {actual}")


def _example(encoder: FreezeOmniEncoder, contract: Contract, catalog: Catalog, extent: int, generator: torch.Generator):
    """Arguments of one call in the class that retains `extent` frames of keys, the retained keys
    as strided views of bound-sized buffers, as the carries hold them."""
    c = encoder.config
    param = encoder.global_cmvn.mean
    fbank = int(contract.symbols()["subsampling"] * c.chunk_size) + c.chunk_overlap
    kv_bound, heads, d_k = catalog.region(KV).bound, c.attention_heads, c.attention_dim // c.attention_heads

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(param)

    buffer: list = []
    for _ in range(c.num_blocks):
        buffer.append(None if extent == 0 else [randn(1, heads, kv_bound, d_k).narrow(2, 0, extent) for _ in range(2)])
        if c.conv_feed_forward:
            buffer.append(randn(1, c.attention_dim, c.lorder))
    return randn(1, fbank, c.input_dim), buffer, encoder.init_pe_index()


def _pinned(contract: Contract, regions: dict[str, RegionDerivation], windows: list[Window]) -> list[Resize]:
    """What the stock retention holds in steady state against the carries: each retained slice is a
    view of its call's concat, so it pins the whole operand (retained + new units) until the next call."""
    resizes = []
    for name, derived in regions.items():
        region = contract.region(name)
        live = {w.live for w in windows if w.region == name}
        (extent,) = live
        stock = tuple(extent if i == region.axis else d for i, d in enumerate(derived.shape))
        beta = DTYPES[region.dtype].itemsize
        resizes.append(Resize("infer buffer list (slices of each call's concat)", name, stock,
                              beta * math.prod(stock), derived.shape, derived.bytes))
    return resizes


class FreezeOmniAdapter(Adapter):
    family = "freeze_omni"

    def transform(self, model, contract, catalog, *, audit, capture, replay):
        if not capture:
            raise ValueError("freeze_omni: the carries live in the rewritten exported step, so capture cannot be skipped")
        _check_model(model, contract, catalog)
        report = TransformReport(family=self.family, catalog=catalog, auditor=ShadowAuditor() if audit else None)
        report.determinism = settings()
        report.stamps.append(envelope())
        param = model.global_cmvn.mean
        regions = {region.name: catalog.region(region.name) for region in contract.regions}
        buffers = {}
        for name, region in regions.items():
            dtype = DTYPES[contract.region(name).dtype]
            buffers[name] = torch.zeros(region.shape, dtype=dtype, device=param.device)
            report.carries[name] = Carry(name, buffers[name], axis=contract.region(name).axis)
        report.stamps.append(
            "state rule: carries at the derived bounds, "
            + ", ".join(f"{n} {'x'.join(map(str, r.shape))} ({format_bytes(r.bytes)})" for n, r in regions.items())
        )
        slots = _slots(model.config)
        carries = {}
        for slot in slots:
            region = contract.region(slot.region)
            view = buffers[slot.region][slot.index]
            axis = region.axis - len(slot.index)
            carries[slot.site] = WindowCarry(slot.site, slot.region, view, axis, auditor=report.auditor)
        op = catalog.operator(OPERATOR)
        generator = torch.Generator().manual_seed(0)
        graphs = {}
        for shape_class in op.classes:
            extent, name = shape_class.extent, class_name(shape_class.extent)
            args = _example(model, contract, catalog, extent, generator)
            captured = export_operator(name, InferStep(model), args)
            report.stamps.append(captured.stamp)
            gm = captured.graph_module
            placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            inputs = {path: placeholders[i] for path, i in _leaf_positions((args, {})).items()}
            outputs = _leaf_positions(pytree.tree_unflatten(list(range(gm._out_spec.num_leaves)), gm._out_spec))
            windows = []
            for slot in slots:
                region, derived = contract.region(slot.region), regions[slot.region]
                keep = _retained(derived)
                retained = extent if slot.region == KV else keep
                windows.append(Window(
                    site=slot.site,
                    region=slot.region,
                    output=outputs[(1, *slot.path)],
                    input=inputs.get((0, 1, *slot.path)),
                    axis=carries[slot.site].axis,
                    keep=keep,
                    live=retained + shape_class.call,
                    held=region.holds_call,
                ))
            if extent == max(op.grid):
                report.resizes.extend(_pinned(contract, regions, windows))
            after, sites, stamp = rewrite_windows(gm, tuple(windows), carries, graph=name)
            report.sites.extend(sites)
            report.stamps.append(stamp)
            report.graphs[name] = (gm, after)
            graphs[extent] = after
        replay = replay and not audit
        if replay:
            report.stamps.append(f"replay: {OPERATOR} K={len(graphs)}, the buffer list aliased, the carries' "
                                 "extents as host counters")
        else:
            report.stamps.append("replay: off" + (" under audit (the auditor compares on the host inside the step)"
                                                  if audit else ""))
        return TransformedEncoder(model, graphs, carries, report, replay=replay), report


ADAPTER = FreezeOmniAdapter()


def reference_encoder(depth: str = "reduced", device: str = "cpu"):
    """The in-repo Freeze-Omni encoder with random weights, on `device`, and its contract, for the CLI.

    `depth` is "reduced" (2 blocks, 64 wide) or "full" (24 blocks, 1024 wide).
    """
    from .freeze_omni import encoder_contract
    from .freeze_omni_encoder import FreezeOmniEncoderConfig, build_encoder

    if depth not in ("reduced", "full"):
        raise ValueError(f"depth must be 'reduced' or 'full', got {depth!r}")
    config = FreezeOmniEncoderConfig.small() if depth == "reduced" else FreezeOmniEncoderConfig()
    return build_encoder(config).to(device), encoder_contract(config)


def reference_stream(depth: str, device: str = "cpu"):
    """The reference encoder on `device`, its contract, and a short stream through its transformed
    encoder, for the CLI's diff: `stream(transformed, chunks)` runs `chunks` chunks and says what it ran."""
    from .freeze_omni_encoder import stream_utterance

    encoder, contract = reference_encoder(depth, device)

    def stream(transformed, chunks: int) -> str:
        c = encoder.config
        feats = torch.randn(1, chunks * c.chunk_frames, c.input_dim, generator=torch.Generator().manual_seed(0))
        stream_utterance(transformed, feats.to(device))
        return f"one utterance of {chunks} chunks of random fbank features"

    return encoder, contract, stream
