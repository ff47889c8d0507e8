"""Token2Wav on the one pipeline: its binding and the family's hook behind `transform(flow, contract)`.

Where the regions live in the vendor flow (minicpmo-utils 1.0.6), as `FLOW_BINDING` says:

* the CFM loop (``flow.decoder.forward_chunk``) takes the estimator's caches as ``att_cache`` /
  ``cnn_cache`` and returns the new ones: views of its own ``att_cache_buffer`` /
  ``cnn_cache_buffer``, where it writes each solver step's [new | cached] keys;
* the conformer encoder (``flow.encoder.forward_chunk``) takes its attention cache as
  ``att_cache`` and returns it grown by the chunk (it concatenates internally);
* the caller (the vendor's streaming loop, token2wav.py:192-204) trims both attention caches to
  ``cat([c[..., :P], c[..., -100:]])``: the binding says so (``caller_trims``), so the transformed
  calls return that retention themselves, copied into carries at one address each, and the
  caller's trim finds nothing more to cut.

What the hook adds (`transform_flow`) is what no binding can say: the vendor provisions its
scratch buffers as stock envelopes (16 steps x 16 blocks x 1000 frames); the state rule
(`passes/state.py`) sizes them to demand on the transformed copy (`ENVELOPES`). Another lane's
transform, or another flow of the same structure, reuses its exports (`cadence_fx.pipeline.export.EXPORTS`).
Warm-up turns at construction allocate the carries and verify every class (`WARM_UP_TURNS`). HiFT retains nothing itself (its
caches are its caller's inputs), so it runs
through one exact-shape replay of its call, with its own catalog (`hift_classes`).

A turn reset writes the prompt state, kept once and shared by every turn (it is only ever read),
into the carries in place. It is read once per turn, so it is kept in pinned host memory: a reset
costs a host-to-device copy (about 400 MB at full size) instead of a second copy on the device.
"""

from __future__ import annotations

import copy
import sys

import torch

from cadence_fx.binding import Binding, OperatorBinding, RegionBinding
from cadence_fx.catalog import Catalog, derive
from cadence_fx.contract import Contract
from cadence_fx.multiplex import Transformed
from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.passes.piecewise import Piecewise
from cadence_fx.passes.retention import PromptPlusHistory
from cadence_fx.passes.state import Envelope, apply_state_rule, shed_envelopes
from cadence_fx.pipeline import BoundModel
from cadence_fx.replay import ExactShapeReplay, ShapeClass, Signature, TensorSpec
from cadence_fx.transform import TransformReport, transform

from .token2wav_stream import Prompt, StockStream, Vocoder, random_chunks, random_prompt
from .vendor import VendorFlow

__all__ = [
    "ENVELOPES",
    "FLOW_BINDING",
    "CarryStream",
    "TransformedFlow",
    "contract_for_flow",
    "demo",
    "reference_flow",
    "reference_stream",
    "transform_flow",
]

FLOW_BINDING = Binding(
    regions=(
        RegionBinding("estimator_att_cache", at=("att_cache",), out=("return.2",), caller_trims=True, operators=("cfm_loop",)),
        RegionBinding("estimator_cnn_cache", at=("cnn_cache",), out=("return.1",), operators=("cfm_loop",)),
        RegionBinding(
            "conformer_att_cache", at=("att_cache",), out=("return.2",), caller_trims=True, operators=("conformer_encoder",)
        ),
    ),
    operators=(
        OperatorBinding("cfm_loop", method="decoder.forward_chunk", units=("mu", 2)),
        # 28 tokens a chunk, 3 of them look-ahead: 50 mel frames, or 56 on the last chunk (padded).
        OperatorBinding("conformer_encoder", method="encoder.forward_chunk", units=50, flush="last_chunk"),
    ),
)

#: The stream cache's entries the bound operators keep, by (operator, site path).
CACHE_SITES = {
    "estimator_att_cache": ("cfm_loop", "att_cache"),
    "estimator_cnn_cache": ("cfm_loop", "cnn_cache"),
    "conformer_att_cache": ("conformer_encoder", "att_cache"),
}

ENVELOPES = (
    Envelope("decoder.att_cache_buffer", "estimator_att_cache"),
    Envelope("decoder.cnn_cache_buffer", "estimator_cnn_cache"),
    Envelope("decoder.estimator.att_cache_buffer", "dit_block_att_cache"),
    Envelope("decoder.estimator.cnn_cache_buffer", "dit_block_cnn_cache"),
)

#: Turns of random speech streamed at construction, each of 4 chunks and a flush: every class of
#: the catalog is visited twice, so it is verified; on a GPU one more turn captures each.
WARM_UP_TURNS, WARM_UP_CHUNKS = 2, 5


def warm_up_turns(device: torch.device | str) -> int:
    """How many turns the transform's own warm-up streams on `device`: `WARM_UP_TURNS`, and one
    more on a GPU, which captures each class."""
    return WARM_UP_TURNS + (torch.device(device).type == "cuda")


def warm_up_chunks(device: torch.device | str) -> int:
    """How many chunks the transform's own warm-up streams on `device`: `warm_up_turns` turns of
    `WARM_UP_CHUNKS` chunks."""
    return warm_up_turns(device) * WARM_UP_CHUNKS


class TransformedFlow(Transformed):
    """The flow with its envelopes at demand and its hot operators bound (`bound`); HiFT replayed."""

    def __init__(self, flow: VendorFlow, hift: Vocoder | None, bound: BoundModel, contract: Contract, report: TransformReport):
        self.flow, self.hift, self.bound, self.contract, self.report = flow, hift, bound, contract, report
        self.auditor = report.auditor
        retention = contract.region("estimator_att_cache").retention
        if not isinstance(retention, PromptPlusHistory):
            raise ValueError(f"the contract's estimator_att_cache must keep the prompt (PromptPlusHistory), got {retention!r}")
        self.prompt_frames = retention.prompt
        self.base: dict[str, torch.Tensor] | None = None

    @property
    def carries(self) -> dict:
        """Each bound region's carry, by region."""
        return self.report.carries

    def _carry(self, key: str):
        operator, path = CACHE_SITES[key]
        return self.bound.operators[operator].carries[path]

    def setup_cache(self, tokens: torch.Tensor, mels: torch.Tensor, spk: torch.Tensor, n_timesteps: int) -> dict:
        """The vendor's setup (its calls run the stock code: no class of the catalog is the prompt's
        call), the prompt state taken into the carries and kept once."""
        cache = self.flow.setup_cache(tokens, mels, spk, n_timesteps=n_timesteps)
        if cache["estimator_att_cache"].shape[4] != self.prompt_frames:
            raise ValueError(
                f"the prompt has {cache['estimator_att_cache'].shape[4]} mel frames, the contract declares "
                f"f_prompt={self.prompt_frames}: build the contract for this prompt"
            )
        for key in CACHE_SITES:
            cache[key] = self._carry(key).reset(cache[key])
        self.base = {key: _host_copy(value) for key, value in cache.items()}
        return cache

    def reset_turn(self) -> dict:
        """A turn boundary: the prompt state written into the carries in place."""
        if self.base is None:
            raise RuntimeError("reset_turn before setup_cache: there is no prompt state to return to")
        cache = {key: self._carry(key).reset(self.base[key]) for key in CACHE_SITES}
        cache["conformer_cnn_cache"] = self.base["conformer_cnn_cache"].to(self.device())
        return cache

    # -- several streams over one set of graphs (cadence_fx.multiplex) -------------------------

    def device(self) -> torch.device:
        return self.flow.decoder.cnn_cache_buffer.device

    def resident(self) -> tuple[list[torch.Tensor], list[int]]:
        """Every carry, and the carries' host counters (the stream's conformer conv cache is its own:
        it travels in its cache dict)."""
        return self.bound.resident()

    def set_counters(self, counters: list[int]) -> None:
        self.bound.set_counters(counters)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """The prompt state, read once per turn, kept in (pinned) host memory rather than on the device."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    return host.copy_(t)


class CarryStream(StockStream):
    """The vendor's streaming loop on a transformed flow: the same steps, its trim included (it
    finds nothing to cut: the bound calls return the retained state), carries for the caches."""

    def __init__(self, transformed: TransformedFlow, prompt: Prompt, **kwargs):
        super().__init__(transformed.flow, transformed.hift, prompt, **kwargs)
        self.transformed = transformed

    def setup_cache(self, tokens: torch.Tensor, mels: torch.Tensor, spk: torch.Tensor) -> dict:
        return self.transformed.setup_cache(tokens, mels, spk, self.n_timesteps)

    def reset_turn(self) -> None:
        self.stream_cache = self.transformed.reset_turn()
        self.reset_vocoder()


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


def _check_model(flow: VendorFlow, contract: Contract) -> None:
    """The contract must describe this flow: fail before touching anything if it does not."""
    symbols = contract.symbols()
    found = {
        "depth": len(flow.decoder.estimator.blocks),
        "conformer_blocks": len(flow.encoder.encoders) + len(flow.encoder.up_encoders),
    }
    for name, actual in found.items():
        if symbols[name] != actual:
            raise ValueError(f"contract quantity {name}={symbols[name]} but the flow has {actual}: declare {name}={actual}")


def transform_flow(
    model, contract: Contract, *, audit: bool, replay: bool, budget: int
) -> tuple[TransformedFlow, TransformReport]:
    """The family's hook (`Family.compose`): `model` is the flow, or (flow, hift) to replay the
    vocoder too. The flow is copied around the caller's weights, its envelopes sized to demand,
    bound from `FLOW_BINDING` on the one pipeline and warmed up; the caller's flow is left untouched."""
    stock_flow, stock_hift = model if isinstance(model, tuple) else (model, None)
    _check_model(stock_flow, contract)
    catalog = derive(contract, budget=budget)
    shared = {id(t): t for t in (*stock_flow.parameters(), *stock_flow.buffers())}
    flow = copy.deepcopy(stock_flow, {**shared, **shed_envelopes(stock_flow, ENVELOPES)})
    device = stock_flow.decoder.att_cache_buffer.device
    resizes, stamp = apply_state_rule(flow, ENVELOPES, catalog, device=device)
    bound, report = transform(flow, contract, FLOW_BINDING, audit=audit, replay=replay, budget=budget)
    report.resizes.extend(resizes)
    report.stamps.append(stamp)
    flow.decoder.forward_chunk = bound.operators["cfm_loop"]
    flow.encoder.forward_chunk = bound.operators["conformer_encoder"]
    hift: Vocoder | None = None
    if stock_hift is not None:
        vocoder: torch.nn.Module = copy.deepcopy(stock_hift)
        hift = vocoder
        if replay and not audit:
            window = catalog.region("hift_source_cache").bound
            if window is None:
                raise ValueError("the contract's hift_source_cache has no bound: HiFT's replay needs its source window")
            hift = ExactShapeReplay(
                vocoder,
                hift_classes(vocoder, catalog, window),
                name="hift",
                hooks=[Piecewise(), HostConstantHoist()],
                inference=True,
            )
            report.replays["hift"] = hift
    transformed = TransformedFlow(flow, hift, bound, contract, report)
    _warm_up(transformed)
    return transformed, report


def _warm_up(transformed: TransformedFlow) -> None:
    """`WARM_UP_TURNS` turns of random speech tokens after a random prompt of the contract's length
    (one more on a GPU): the carries are allocated and every class verified (and, on a GPU,
    captured) before the first stream. The caller's generators are left as they were (the flow
    draws none; HiFT is not run)."""
    device = transformed.device()
    prompt = random_prompt(0, n_tokens=transformed.prompt_frames // transformed.flow.up_rate, device=device)
    stream = CarryStream(transformed, prompt)
    with torch.no_grad():
        for turn in range(warm_up_turns(device)):
            stream.setup() if turn == 0 else stream.reset_turn()
            for i, tokens in enumerate(random_chunks(turn, WARM_UP_CHUNKS, device=device)):
                stream.flow_chunk(tokens, last_chunk=i == WARM_UP_CHUNKS - 1)
    transformed.base = None


def contract_for_flow(flow: VendorFlow, prompt_frames: int) -> Contract:
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

    `depth` is "tiny" (1 + 1 conformer blocks, 1 DiT block: the demo's), "reduced" (1 + 1
    conformer blocks, 2 DiT blocks; both with a 51-token prompt, fast on a CPU) or "full" (the
    MiniCPM-o 4.5 configuration and its 151-token prompt).
    """
    from .token2wav_stream import FULL_DEPTH, PROMPT_TOKENS, REDUCED_DEPTH, TINY_DEPTH, build_flow

    layouts = {"tiny": TINY_DEPTH, "reduced": REDUCED_DEPTH, "full": FULL_DEPTH}
    if depth not in layouts:
        raise ValueError(f"depth must be one of {sorted(layouts)}, got {depth!r}")
    layout = layouts[depth]
    tokens = prompt_tokens or (PROMPT_TOKENS if depth == "full" else 51)
    flow = build_flow(layout, device=device)
    return flow, contract_for_flow(flow, 2 * tokens), tokens


def reference_stream(depth: str, device: str = "cpu"):
    """The reference flow on `device`, its contract, and a short stream through its transformed
    flow, for the CLI's diff: `stream(transformed, chunks)` runs `chunks` chunks and says what it ran."""
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

    print(f"building the vendor Token2Wav flow ({depth} depth, random weights)...", file=sys.stderr, flush=True)
    flow, contract, prompt_tokens = reference_flow(depth)
    print(
        "transforming (state rule, the flow's binding on the one pipeline, a warm-up turn per class)...",
        file=sys.stderr,
        flush=True,
    )
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
            assert carried.stream_cache is not None  # set by setup(), kept by every flow_chunk
            address = carried.stream_cache["estimator_att_cache"].data_ptr()
            print(f"block {block} chunk {i}: mel {tuple(mels[1].shape)} bit-identical={same} carry at {address:#x}", flush=True)
    print()
    print(report)
    before, after = sum(b for b, _ in report.managed_bytes().values()), sum(a for _, a in report.managed_bytes().values())
    print(
        f"\nall {blocks * chunks} chunks bit-identical to the vendor stream: {exact}; "
        f"managed state {format_bytes(before)} -> {format_bytes(after)}"
    )
    return exact
