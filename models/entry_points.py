"""cadence-fx's own model families, registered as `cadence_fx.families` entry points (pyproject.toml)."""

from cadence_fx.families import Family

TOKEN2WAV = Family(
    "token2wav",
    contract="cadence_fx.models.token2wav:token2wav_contract",
    compose="cadence_fx.models.token2wav_carry:transform_flow",
    reference="cadence_fx.models.token2wav_carry:reference_stream",
    demo="cadence_fx.models.token2wav_carry:demo",
)
MOSHI = Family(
    "moshi", contract="cadence_fx.models.moshi:moshi_contract", compose="cadence_fx.models.moshi_bound:transform_moshi"
)
FREEZE_OMNI = Family(
    "freeze_omni",
    contract="cadence_fx.models.freeze_omni:freeze_omni_contract",
    binding="cadence_fx.models.freeze_omni:freeze_omni_binding",
    reference="cadence_fx.models.freeze_omni:reference_stream",
)
LLM_BACKBONE = Family("llm_backbone", contract="cadence_fx.models.llm_backbone:llm_backbone_contract")
