"""PersonaPlex's Mimi at batch B, a streaming state per row: Kyutai's 0.2.13 `MimiModel` on
PersonaPlex's Mimi weights, so Mimi runs once per tick for every slot instead of once per slot.

Why Kyutai's class: PersonaPlex's fork of Mimi keeps one streaming state for the whole batch (no
exec mask, no reset mask; its conv buffers are None until the first call), so its batch can only
run in step. Kyutai's 0.2.13 Mimi has the per-row mechanism Moshi's slots run on
(`models/moshi_slots.py`): `set_exec_mask(mask)` advances only the rows that execute (the others
are computed and their state written through `torch.where`), `reset_streaming(mask)` gives the
masked rows a fresh stream and leaves the others alone. The two forks' Mimi are the same network
with the same parameters: `batched_mimi` builds Kyutai's classes at PersonaPlex's sizes
(`PersonaPlexConfig`, as `loaders.get_mimi` builds them) and loads PersonaPlex's state dict into
them strictly (any missing or extra parameter is refused), sharing its tensors (no copy).

What is exact (`tests/test_personaplex_mimi.py`): at batch 1 its codes and PCM are PersonaPlex's
Mimi's, `torch.equal`, across a reset; at batch B a row's codes and PCM do not depend on the
other rows (busy, masked or reset), so a slot is the same slot run alone in the same row of the
same batch. What is not: a row at B > 1 against batch 1. CPU kernels round a batch otherwise
(oneDNN convolutions above batch 1, the transformer's matrix products with more rows), as
PersonaPlex's own Mimi does at batch B; measured on this CPU at the tiny size, B = 8, 12 frames:
codes equal, PCM within 7.5e-8 of batch 1's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["batched_mimi"]


def batched_mimi(mimi: Any, config: Any, batch: int) -> Any:
    """Kyutai's 0.2.13 `MimiModel` with `mimi`'s weights (a PersonaPlex `MimiModel` built at
    `config`'s sizes, a `PersonaPlexConfig`), streaming at `batch` (every row fresh, every row
    executing), on `mimi`'s device, in eval mode, at `mimi`'s number of codebooks."""
    import moshi.modules as modules
    from moshi.models.compression import MimiModel
    from moshi.quantization import SplitResidualVectorQuantizer

    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive batch size, got {batch!r}")
    device = next(mimi.parameters()).device
    encoder = modules.SEANetEncoder(**config.seanet)
    model = MimiModel(
        encoder,
        modules.SEANetDecoder(**config.seanet),
        SplitResidualVectorQuantizer(**config.quantizer),
        channels=mimi.channels,
        sample_rate=mimi.sample_rate,
        frame_rate=mimi.frame_rate,
        encoder_frame_rate=mimi.encoder_frame_rate,
        causal=True,
        resample_method="conv",
        encoder_transformer=modules.transformer.ProjectedTransformer(**config.transformer),
        decoder_transformer=modules.transformer.ProjectedTransformer(**config.transformer),
    )
    try:
        # Kyutai's attention renames PersonaPlex's `in_proj_weight` as it loads (`in_projs.0.weight`).
        model.load_state_dict(mimi.state_dict(), strict=True, assign=True)
    except RuntimeError as error:
        raise ValueError(f"this Mimi's weights do not fit the configuration's sizes ({config.transformer}): {error}") from None
    model.to(device).eval()
    model.set_num_codebooks(mimi.num_codebooks)
    model.streaming_forever(batch)
    return model
