"""MiniCPM-o 4.5 Token2Wav: the contract of the flow decoder and the HiFT vocoder.

The numbers are the vendor's configuration; everything else (extents, K,
bytes, the 1.95 GiB envelope against its demand) is derived by `cadence_fx.catalog.derive`.
"""

from __future__ import annotations

from cadence_fx.contract import (
    Admission,
    Clock,
    ClockKind,
    Contract,
    DeviceConstant,
    Effect,
    Interactivity,
    Lifetime,
    Operator,
    Rate,
    Region,
)
from cadence_fx.passes.retention import PromptPlusHistory, SlidingWindow

__all__ = ["token2wav_contract"]


def token2wav_contract(
    *,
    f_prompt: int = 302,
    f_retained: int = 100,
    f_chunk: int = 50,
    f_call: int = 56,
    n_steps: int = 10,
    frames_per_token: int = 2,
    dit_depth: int = 16,
    conformer_blocks: int = 10,
) -> Contract:
    """The primary operating point by default: a 302-frame prompt plus 100 retained frames,
    50-frame chunks, a 56-frame final chunk, 10 solver steps per chunk."""
    flush = (f_call,) if f_call != f_chunk else ()
    # The vendor's buffers have 16 solver-step slots, 16 block slots whatever the depth, 1000 frames.
    stock_steps, stock_slots, stock_frames = 16, 16, 1000
    return Contract(
        family="token2wav",
        clocks=(
            Clock("token", ClockKind.TOKENS),
            Clock("mel_frame", ClockKind.FRAMES),
            Clock("solver_step", ClockKind.SOLVER_STEPS),
            Clock("sample", ClockKind.SAMPLES),
            Clock("chunk", ClockKind.CALLS),
            Clock("turn", ClockKind.TURNS),
        ),
        rates=(
            Rate("mel_frame", "token", frames_per_token, name="frames_per_token"),
            Rate("solver_step", "chunk", n_steps, name="n_steps"),
            Rate("mel_frame", "chunk", f_chunk, name="f_chunk"),
            Rate("sample", "mel_frame", 480, name="hop"),
        ),
        quantities={
            "depth": dit_depth,
            "cfg_batch": 2,
            "heads": 8,
            "kv_width": 128,
            "dit_channels": 1024,
            "conformer_blocks": conformer_blocks,
            "mel_bins": 80,
        },
        regions=(
            Region(
                "estimator_att_cache",
                dims=("n_steps", "depth", "cfg_batch", "heads", "mel_frame", "kv_width"),
                axis=4,
                clock="mel_frame",
                stride=f_chunk,
                dtype="float32",
                lifetime=Lifetime.PER_TURN,
                retention=PromptPlusHistory(prompt=f_prompt, history=f_retained),
                stock_dims=(stock_steps, stock_slots, 2, 8, stock_frames, 128),
            ),
            Region(
                "estimator_cnn_cache",
                dims=("n_steps", "depth", "cfg_batch", "dit_channels", "mel_frame"),
                axis=4,
                clock="mel_frame",
                stride=f_chunk,
                dtype="float32",
                lifetime=Lifetime.PER_TURN,
                retention=SlidingWindow(window=2, initial=2),
                holds_call=False,
                stock_dims=(stock_steps, stock_slots, 2, 1024, 2),
            ),
            Region(
                "dit_block_att_cache",
                dims=("depth", "cfg_batch", "heads", "mel_frame", "kv_width"),
                axis=3,
                clock="mel_frame",
                stride=f_chunk,
                dtype="float32",
                lifetime=Lifetime.PER_TURN,
                retention=PromptPlusHistory(prompt=f_prompt, history=f_retained),
                stock_dims=(stock_slots, 2, 8, stock_frames, 128),
            ),
            Region(
                "dit_block_cnn_cache",
                dims=("depth", "cfg_batch", "dit_channels", "mel_frame"),
                axis=3,
                clock="mel_frame",
                stride=f_chunk,
                dtype="float32",
                lifetime=Lifetime.PER_TURN,
                retention=SlidingWindow(window=2, initial=2),
                holds_call=False,
                stock_dims=(stock_slots, 2, 1024, 2),
            ),
            Region(
                # The encoder concatenates inside the call; the carry holds what the trim keeps.
                "conformer_att_cache",
                dims=("conformer_blocks", 1, "heads", "mel_frame", "kv_width"),
                axis=3,
                clock="mel_frame",
                stride=f_chunk,
                dtype="float32",
                lifetime=Lifetime.PER_TURN,
                retention=PromptPlusHistory(prompt=f_prompt, history=f_retained),
                holds_call=False,
            ),
            Region(
                "hift_mel_cache",
                dims=(1, "mel_bins", "mel_frame"),
                axis=2,
                clock="mel_frame",
                stride=f_chunk,
                dtype="float32",
                lifetime=Lifetime.PER_TURN,
                retention=SlidingWindow(window=8),
            ),
            Region(
                "hift_source_cache",
                dims=(1, 1, "sample"),
                axis=2,
                clock="sample",
                stride=f_chunk * 480,
                dtype="float32",
                lifetime=Lifetime.PER_TURN,
                retention=SlidingWindow(window=3840),
                holds_call=False,
            ),
        ),
        operators=(
            Operator("cfm_loop", "estimator_att_cache", steady=f_chunk, flush=flush),
            Operator("dit_estimator", "estimator_att_cache", steady=f_chunk, flush=flush),
            Operator("conformer_encoder", "conformer_att_cache", steady=f_chunk, flush=flush),
            Operator("hift", "hift_mel_cache", steady=f_chunk, flush=flush, effect=Effect.DEVICE_RNG),
        ),
        admission=Admission("mel_frame", max_per_call=f_call),
        interactivity=Interactivity(stages=("flow.encoder", "flow.cfm", "hift")),
        constants=(
            DeviceConstant(
                "timestep_freqs",
                "stepaudio2.cosyvoice2.flow.decoder_dit.TimestepEmbedder.timestep_embedding",
                "frequency table built on the CPU and moved with .to(t) every call",
            ),
            DeviceConstant(
                "stft_window",
                "stepaudio2.flashcosyvoice.modules.hifigan.HiFTGenerator",
                "CPU Hann window moved with .to(x.device) every call",
            ),
            DeviceConstant(
                "harmonic_multipliers",
                "stepaudio2.flashcosyvoice.modules.hifigan_components.layers.SineGen.forward",
                "torch.FloatTensor([[range(1, harmonic_num + 2)]]) built on the CPU every call",
            ),
        ),
    )
