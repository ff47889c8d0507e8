"""Token2Wav under the state rule and the carry: the adapter behind `transform(flow, contract)`.

Where the regions live in the vendor flow (minicpmo-utils 1.0.6):

* the CFM's ``att_cache_buffer`` / ``cnn_cache_buffer`` and the DiT's block buffers are stock
  envelopes (16 steps x 16 blocks x 1000 frames); the state rule resizes them to demand. The CFM
  writes each step's [new | cached] keys into its buffer and returns a view of it, so once resized
  that buffer is the estimator cache's carry: the vendor code itself writes into it, in place;
* the caller's per-chunk trim (token2wav.py:192-204, ``cat([c[..., :P], c[..., -100:]])``) is
  rewritten by the carry pass into in-place compaction within the carry (estimator) or writes of
  the kept units into a demand-sized carry (conformer, whose encoder concatenates internally);
* the DiT prepends (``cat([k, k_cache])``) and the conformer appends (``cat([key_cache, k])``):
  both are found on their exported graphs and reported.

A turn reset writes the prompt state, kept once and shared by every turn (copy-on-write: it is
only ever read), into the carries in place. The prompt state is read once per turn, so it is kept
in pinned host memory: a reset costs a host-to-device copy (about 400 MB at full size) instead of
holding a second copy of the caches on the device.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch

from cadence_fx.audit import ShadowAuditor
from cadence_fx.capture import capture as export_operator
from cadence_fx.catalog import Catalog
from cadence_fx.contract import Contract
from cadence_fx.passes.carry import Carry, find_retention_sites, rewrite_trims, stock_trim, trace_trim
from cadence_fx.determinism import envelope, settings
from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.passes.piecewise import Piecewise
from cadence_fx.passes.state import Envelope, apply_state_rule, shed_envelopes
from cadence_fx.replay import ExactShapeReplay, ShapeClass, Signature, TensorSpec
from cadence_fx.transform import Adapter, TransformReport
from cadence_fx.transformed import Transformed

from .token2wav_stream import Prompt, StockStream

__all__ = [
    "ENVELOPES",
    "GLUE_TRIMS",
    "CarryStream",
    "Token2WavAdapter",
    "TransformedFlow",
    "contract_for_flow",
    "demo",
    "reference_flow",
    "reference_stream",
]

ENVELOPES = (
    Envelope("decoder.att_cache_buffer", "estimator_att_cache"),
    Envelope("decoder.cnn_cache_buffer", "estimator_cnn_cache"),
    Envelope("decoder.estimator.att_cache_buffer", "dit_block_att_cache"),
    Envelope("decoder.estimator.cnn_cache_buffer", "dit_block_cnn_cache"),
)


@dataclass(frozen=True)
class GlueTrim:
    """A retention in the caller's Python glue, declared by the adapter: cache key, region, axis."""

    key: str
    region: str
    axis: int


GLUE_TRIMS = (
    GlueTrim("estimator_att_cache", "estimator_att_cache", 4),
    GlueTrim("conformer_att_cache", "conformer_att_cache", 3),
)


class TransformedFlow(Transformed):
    """The flow with its envelopes at demand and its glue trims running on carries."""

    def __init__(
        self,
        flow: torch.nn.Module,
        hift: torch.nn.Module | None,
        contract: Contract,
        report: TransformReport,
    ):
        self.flow = flow
        self.hift = hift
        self.contract = contract
        self.report = report
        self.auditor = report.auditor
        self.carries = report.carries
        retention = contract.region("estimator_att_cache").retention
        self.prompt_frames, self.history = retention.prompt, retention.history
        self.trims = {}
        for glue in GLUE_TRIMS:
            before = trace_trim(glue.axis, self.prompt_frames, self.history)
            after, sites, stamp = rewrite_trims(before, {"cache": glue.region}, self.carries, graph=f"{glue.key}_trim")
            self.trims[glue.key] = after
            report.sites.extend(sites)
            report.stamps.append(stamp)
            report.graphs[f"{glue.key}_trim"] = (before, after)
        self.base: dict[str, torch.Tensor] | None = None
        self.chunk = 0

    def setup_cache(self, tokens: torch.Tensor, mels: torch.Tensor, spk: torch.Tensor, n_timesteps: int) -> dict:
        """The vendor's setup, with the prompt state adopted by the carries and kept once."""
        cache = self.flow.setup_cache(tokens, mels, spk, n_timesteps=n_timesteps)
        if cache["estimator_att_cache"].shape[4] != self.prompt_frames:
            raise ValueError(
                f"the prompt has {cache['estimator_att_cache'].shape[4]} mel frames, the contract declares "
                f"f_prompt={self.prompt_frames}: build the contract for this prompt"
            )
        for glue in GLUE_TRIMS:
            cache[glue.key] = self.carries[glue.region].adopt(cache[glue.key])
        self.base = {key: _host_copy(value) for key, value in cache.items()}
        self.chunk = 0
        return cache

    def reset_turn(self) -> dict:
        """A turn boundary: the prompt state written into the carries and buffers in place."""
        if self.base is None:
            raise RuntimeError("reset_turn before setup_cache: there is no prompt state to return to")
        cache = {}
        for glue in GLUE_TRIMS:
            cache[glue.key] = self.carries[glue.region].reset(self.base[glue.key])
        estimator_cnn = self.flow.decoder.cnn_cache_buffer
        estimator_cnn.copy_(self.base["estimator_cnn_cache"])
        cache["estimator_cnn_cache"] = estimator_cnn
        cache["conformer_cnn_cache"] = self.base["conformer_cnn_cache"].to(estimator_cnn.device)
        self.chunk = 0
        return cache

    def retain(self, cache: dict) -> dict:
        """The caller's trim on the carries; audited against the stock trim when asked."""
        self.chunk += 1
        limit = self.prompt_frames + self.history
        for glue in GLUE_TRIMS:
            full = cache[glue.key]
            carry = self.carries[glue.region]
            evicts = full.shape[glue.axis] > limit
            expected = None
            if self.auditor is not None:
                expected = stock_trim(full, glue.axis, self.prompt_frames, self.history) if evicts else full.clone()
            cache[glue.key] = self.trims[glue.key](full) if evicts else carry.adopt(full)
            if expected is not None:
                self.auditor.check(
                    glue.key, self.chunk, expected, cache[glue.key], evicted=evicts, address=carry.address
                )
        return cache

    # -- several streams over one set of bindings (cadence_fx.transformed) ----------------------

    def device(self) -> torch.device:
        return self.flow.decoder.cnn_cache_buffer.device

    def resident(self) -> tuple[list[torch.Tensor], list[int]]:
        """The stream state that lives at the bindings' fixed addresses: every carry, and the CFM's
        conv cache buffer (written in place by the vendor each chunk); the carries' extents."""
        tensors = [c.buffer for c in self.carries.values()] + [self.flow.decoder.cnn_cache_buffer]
        return tensors, [c.extent for c in self.carries.values()]

    def set_counters(self, counters: list[int]) -> None:
        for carry, extent in zip(self.carries.values(), counters, strict=True):
            carry.extent = extent


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """The prompt state, read once per turn, kept in (pinned) host memory rather than on the device."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    return host.copy_(t)


class CarryStream(StockStream):
    """The vendor's streaming loop on a transformed flow: same steps, carries for the caches."""

    def __init__(self, transformed: TransformedFlow, prompt: Prompt, **kwargs):
        super().__init__(transformed.flow, transformed.hift, prompt, **kwargs)
        self.transformed = transformed

    def setup_cache(self, tokens: torch.Tensor, mels: torch.Tensor, spk: torch.Tensor) -> dict:
        return self.transformed.setup_cache(tokens, mels, spk, self.n_timesteps)

    def reset_turn(self) -> None:
        self.stream_cache = self.transformed.reset_turn()
        self.reset_vocoder()

    def retain(self, cache: dict) -> dict:
        return self.transformed.retain(cache)


class _EstimatorStep(torch.nn.Module):
    """One DiT estimator call as the CFM makes it (flow_matching.py:152)."""

    def __init__(self, estimator: torch.nn.Module):
        super().__init__()
        self.estimator = estimator

    def forward(self, x, mu, t, spks, cond, cnn_cache, att_cache):
        return self.estimator.forward_chunk(x=x, mu=mu, t=t, spks=spks, cond=cond, cnn_cache=cnn_cache, att_cache=att_cache)


class _EncoderStep(torch.nn.Module):
    """One conformer encoder call as the flow makes it (flow.py:201)."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, xs, cnn_cache, att_cache):
        return self.encoder.forward_chunk(xs=xs, last_chunk=False, cnn_cache=cnn_cache, att_cache=att_cache)


def capture_hot_operators(flow: torch.nn.Module, contract: Contract) -> dict:
    """Export the DiT estimator and the conformer encoder at the first steady catalog class."""
    retention = contract.region("estimator_att_cache").retention
    extent, f = retention.prompt, contract.region("estimator_att_cache").stride
    depth = len(flow.decoder.estimator.blocks)
    blocks = len(flow.encoder.encoders) + len(flow.encoder.up_encoders)
    g = torch.Generator().manual_seed(0)
    dit_args = (
        torch.randn(2, 80, f, generator=g),
        torch.randn(2, 80, f, generator=g),
        torch.rand(2, generator=g),
        torch.randn(2, 80, generator=g),
        torch.randn(2, 80, f, generator=g),
        torch.randn(depth, 2, 1024, 2, generator=g),
        torch.randn(depth, 2, 8, extent, 128, generator=g),
    )
    encoder_args = (
        torch.randn(1, f // 2 + 3, 512, generator=g),
        torch.randn(1, 512, 6, generator=g),
        torch.randn(blocks, 1, 8, extent, 128, generator=g),
    )
    bound = retention.prompt + retention.history
    return {
        "dit_estimator": export_operator("dit_estimator", _EstimatorStep(flow.decoder.estimator), dit_args,
                                 clocks={"att_cache": {3: "mel_frame"}}, max_extent=bound),
        "conformer": export_operator("conformer", _EncoderStep(flow.encoder), encoder_args,
                             clocks={"att_cache": {3: "mel_frame"}}, max_extent=bound),
    }


def cfm_loop_classes(flow: torch.nn.Module, catalog: Catalog, n_timesteps: int) -> list[ShapeClass]:
    """The CFM loop's catalog as replay signatures: `mu`/`cond` of the call's frames, the carry
    views of the retained extent (strided views of the demand-sized buffers).

    On a GPU each class comes in two precisions: the vendor's `Token2wav(float16=True)` runs the
    flow under fp16 autocast (CUDA only), where `mu`, `spks` and `cond` arrive in float16 while
    the caches stay float32. A signature also records the autocast state, so a graph captured
    under one precision never replays under the other."""
    decoder = flow.decoder
    att, cnn = decoder.att_cache_buffer, decoder.cnn_cache_buffer
    device, dtype = att.device, att.dtype
    activations = (dtype, torch.float16) if device.type == "cuda" else (dtype,)
    classes = []
    for act in activations:
        for c in catalog.operator("cfm_loop").classes:
            att_shape = (*att.shape[:4], c.extent, att.shape[5])
            signature = Signature.of(
                mu=TensorSpec((1, 80, c.call), act, device),
                spks=TensorSpec((1, 80), act, device),
                cond=TensorSpec((1, 80, c.call), act, device),
                n_timesteps=n_timesteps,
                temperature=1.0,
                cnn_cache=TensorSpec(tuple(cnn.shape), dtype, device),
                att_cache=TensorSpec(att_shape, dtype, device, stride=att.stride()),
            )
            name = f"{'flush' if c.flush else 'steady'} f={c.call} L={c.extent}" + ("" if act == dtype else " fp16-autocast")
            classes.append(ShapeClass(name, signature, (("f", c.call), ("L", c.extent))))
    return classes


def encoder_classes(flow: torch.nn.Module, carry: Carry, catalog: Catalog) -> list[ShapeClass]:
    """The conformer encoder's catalog as replay signatures: one chunk of token embeddings (the
    chunk's tokens plus the pre-lookahead ones), `last_chunk` (the flush pads the look-ahead),
    its conv cache, and the carry view of the retained extent."""
    encoder = flow.encoder
    embedding = flow.input_embedding.weight
    device, dtype = embedding.device, embedding.dtype
    lookahead = encoder.pre_lookahead_layer.pre_lookahead_len
    frames_per_token = encoder.up_layer.stride
    cnn = 2 + encoder.up_layer.stride * 2  # pre-lookahead frames + upsampling frames
    buffer = carry.buffer
    classes = []
    op = catalog.operator("conformer_encoder")
    steady = max(c.call for c in op.classes if not c.flush)
    for c in op.classes:
        signature = Signature.of(
            xs=TensorSpec((1, steady // frames_per_token + lookahead, embedding.shape[1]), dtype, device),
            last_chunk=c.flush,
            cnn_cache=TensorSpec((1, encoder.output_size(), cnn), dtype, device),
            att_cache=TensorSpec((*buffer.shape[:3], c.extent, buffer.shape[4]), dtype, device, stride=buffer.stride()),
        )
        name = f"{'flush' if c.flush else 'steady'} L={c.extent}"
        classes.append(ShapeClass(name, signature, (("f", c.call), ("L", c.extent))))
    return classes


def hift_classes(hift: torch.nn.Module, catalog: Catalog, source_window: int) -> list[ShapeClass]:
    """HiFT's catalog: mel of the retained 8 frames plus the call's, and the source cache (empty
    on a stream's first call, its 3,840-sample window afterwards)."""
    device = next(hift.parameters()).device
    classes = []
    for c in catalog.operator("hift").classes:
        source = 0 if c.extent == 0 else source_window
        signature = Signature.of(TensorSpec((1, 80, c.call + c.extent), device=device), TensorSpec((1, 1, source), device=device))
        classes.append(ShapeClass(f"mel={c.call + c.extent} source={source}", signature, (("f", c.call), ("L", c.extent))))
    return classes


def _check_model(flow: torch.nn.Module, contract: Contract) -> None:
    """The contract must describe this flow: fail before touching anything if it does not."""
    symbols = contract.symbols()
    found = {
        "depth": len(flow.decoder.estimator.blocks),
        "conformer_blocks": len(flow.encoder.encoders) + len(flow.encoder.up_encoders),
    }
    for name, actual in found.items():
        if symbols[name] != actual:
            raise ValueError(f"contract quantity {name}={symbols[name]} but the flow has {actual}: declare {name}={actual}")


class Token2WavAdapter(Adapter):
    family = "token2wav"

    def transform(self, model, contract, catalog, *, audit, capture, replay):
        """`model` is the flow, or (flow, hift) to transform the vocoder too."""
        stock_flow, stock_hift = model if isinstance(model, tuple) else (model, None)
        _check_model(stock_flow, contract)
        flow = copy.deepcopy(stock_flow, shed_envelopes(stock_flow, ENVELOPES))
        hift = None if stock_hift is None else copy.deepcopy(stock_hift)
        report = TransformReport(family=self.family, catalog=catalog, auditor=ShadowAuditor() if audit else None)
        report.determinism = settings()
        report.stamps.append(envelope())
        device = stock_flow.decoder.att_cache_buffer.device
        resizes, stamp = apply_state_rule(flow, ENVELOPES, catalog, device=device)
        report.resizes.extend(resizes)
        report.stamps.append(stamp)
        conformer = catalog.region("conformer_att_cache")
        report.carries["estimator_att_cache"] = Carry("estimator_att_cache", flow.decoder.att_cache_buffer, axis=4)
        dtype = flow.decoder.att_cache_buffer.dtype
        report.carries["conformer_att_cache"] = Carry(
            "conformer_att_cache", torch.zeros(conformer.shape, dtype=dtype, device=device), axis=3
        )
        regions = {"dit_estimator": "estimator_att_cache", "conformer": "conformer_att_cache"}
        if capture:
            before = capture_hot_operators(stock_flow, contract)
            after = capture_hot_operators(flow, contract)
            for name, captured in after.items():
                report.stamps.append(captured.stamp)
                report.sites.extend(find_retention_sites(captured.graph_module, {"att_cache": regions[name]}, graph=name))
                report.graphs[name] = (before[name].graph_module, captured.graph_module)
        if replay:
            n_steps = contract.symbols()["n_steps"]
            # One graph pool for the stream's engines: the encoder, the CFM loop and HiFT run one
            # after another on one stream and clone their outputs, so each capture may reuse what
            # the earlier ones freed instead of holding a pool of its own.
            pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
            engine = ExactShapeReplay(
                flow.decoder.forward_chunk,
                cfm_loop_classes(flow, catalog, n_steps),
                name="cfm_loop",
                aliased=["cnn_cache", "att_cache"],
                hooks=[HostConstantHoist()],
                pool=pool,
                inference=True,
            )
            flow.decoder.forward_chunk = engine
            report.replays["cfm_loop"] = engine
            encoder = ExactShapeReplay(
                flow.encoder.forward_chunk,
                encoder_classes(flow, report.carries["conformer_att_cache"], catalog),
                name="conformer_encoder",
                aliased=["att_cache"],
                hooks=[HostConstantHoist()],
                pool=pool,
                inference=True,
            )
            flow.encoder.forward_chunk = encoder
            report.replays["conformer_encoder"] = encoder
            if hift is not None:
                window = catalog.region("hift_source_cache").bound
                vocoder = ExactShapeReplay(
                    hift, hift_classes(hift, catalog, window), name="hift", hooks=[Piecewise(), HostConstantHoist()],
                    pool=pool, inference=True,
                )
                report.replays["hift"] = vocoder
                hift = vocoder
        return TransformedFlow(flow, hift, contract, report), report


ADAPTER = Token2WavAdapter()


def contract_for_flow(flow: torch.nn.Module, prompt_frames: int) -> Contract:
    """The Token2Wav contract of this flow (its DiT and conformer depths) for a prompt of
    ``prompt_frames`` mel frames, at the vendor's streaming operating point otherwise."""
    from .token2wav import token2wav_contract

    return token2wav_contract(
        f_prompt=prompt_frames,
        frames_per_token=flow.up_rate,
        dit_depth=len(flow.decoder.estimator.blocks),
        conformer_blocks=len(flow.encoder.encoders) + len(flow.encoder.up_encoders),
    )


def reference_flow(depth: str = "reduced", *, prompt_tokens: int | None = None, device: str = "cpu"):
    """The real vendor flow with random weights, on `device`, and its contract, for the CLI and the demo.

    `depth` is "reduced" (1 + 1 conformer blocks, 2 DiT blocks; a 51-token prompt, fast on a
    CPU) or "full" (the MiniCPM-o 4.5 configuration and its 151-token prompt).
    """
    from .token2wav_stream import FULL_DEPTH, PROMPT_TOKENS, REDUCED_DEPTH, build_flow

    if depth not in ("reduced", "full"):
        raise ValueError(f"depth must be 'reduced' or 'full', got {depth!r}")
    layout = REDUCED_DEPTH if depth == "reduced" else FULL_DEPTH
    tokens = prompt_tokens or (51 if depth == "reduced" else PROMPT_TOKENS)
    flow = build_flow(layout, device=device)
    return flow, contract_for_flow(flow, 2 * tokens), tokens


def reference_stream(depth: str, device: str = "cpu"):
    """The reference flow on `device`, its contract, and a short stream through its transformed
    flow, for the CLI's diff: `stream(transformed, chunks)` runs `chunks` chunks and says what it ran."""
    from .token2wav_stream import random_chunks, random_prompt

    flow, contract, prompt_tokens = reference_flow(depth, device=device)

    def stream(transformed, chunks: int) -> str:
        carried = CarryStream(transformed, random_prompt(0, n_tokens=prompt_tokens, device=device))
        carried.setup()
        for i, tokens in enumerate(random_chunks(0, chunks, device=device)):
            carried.flow_chunk(tokens, last_chunk=i == chunks - 1)
        return f"{chunks} chunks of random speech tokens after a {prompt_tokens}-token prompt, the last one flushing"

    return flow, contract, stream


def demo(depth: str, blocks: int, chunks: int) -> bool:
    """The CLI's demo: the vendor flow streamed stock and transformed, side by side, `blocks` turns
    of `chunks` chunks (a reset between turns, the last chunk of each flushing), each chunk's mel
    compared bit for bit; True when every chunk was identical."""
    from cadence_fx.report import format_bytes
    from cadence_fx.transform import transform

    from .token2wav_stream import random_chunks, random_prompt

    print(f"building the vendor Token2Wav flow ({depth} depth, random weights)...", file=sys.stderr, flush=True)
    flow, contract, prompt_tokens = reference_flow(depth)
    print("transforming (state rule, carry pass, replay of the CFM loop)...", file=sys.stderr, flush=True)
    transformed, report = transform(flow, contract, audit=True)
    prompt = random_prompt(0, n_tokens=prompt_tokens)
    stock, carried = StockStream(flow, None, prompt), CarryStream(transformed, prompt)
    exact = True
    for block in range(blocks):
        for stream in (stock, carried):
            stream.setup() if block == 0 else stream.reset_turn()
        turn = random_chunks(block, chunks)
        for i, tokens in enumerate(turn):
            mels = [stream.flow_chunk(tokens, last_chunk=i == len(turn) - 1) for stream in (stock, carried)]
            same = torch.equal(*mels)
            exact &= same
            address = carried.stream_cache["estimator_att_cache"].data_ptr()
            print(f"block {block} chunk {i}: mel {tuple(mels[1].shape)} bit-identical={same} carry at {address:#x}", flush=True)
    print()
    print(report)
    before, after = sum(b for b, _ in report.managed_bytes().values()), sum(a for _, a in report.managed_bytes().values())
    print(f"\nall {blocks * chunks} chunks bit-identical to the vendor stream: {exact}; "
          f"managed state {format_bytes(before)} -> {format_bytes(after)}")
    return exact
