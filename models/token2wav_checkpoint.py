"""The published MiniCPM-o 4.5 Token2Wav: its checkpoint files, and the prompt (speaker) state.

Where the files are. The model repository ``openbmb/MiniCPM-o-4_5`` keeps Token2Wav's assets in
``assets/token2wav/`` (the folder MiniCPM-o's ``init_token2wav`` hands to
``stepaudio2.Token2wav``, and the only one it downloads, with ``snapshot_download(repo_id,
allow_patterns=["assets/token2wav/**"])``):

* ``flow.yaml``: the flow's configuration, four hyperpyyaml ``!new:`` tags (the flow, its
  conformer encoder, its CFM, the CFM's DiT estimator) and their keyword arguments;
* ``flow.pt``: the flow's state dict (``torch.load(weights_only=True)``, loaded strictly);
* ``hift.pt``: the HiFT vocoder's state dict, keys possibly prefixed ``generator.``; HiFT itself is
  ``HiFTGenerator()`` at its defaults (no configuration file);
* ``speech_tokenizer_v2_25hz.onnx`` and ``campplus.onnx``: the speech tokenizer and the speaker
  model, used only to prepare a prompt from audio;

and ``assets/system_ref_audio.wav`` is the model's own reference voice.

How they load. ``Token2wav.__init__`` (stepaudio2/token2wav.py) reads ``flow.yaml`` with
hyperpyyaml, whose ``!new:`` tags can construct any importable object, so a downloaded config
could run arbitrary code. cadence-fx reads the same file with a YAML loader that knows the four
vendor classes only and refuses any other tag; the weights load exactly as the vendor loads them.
The flow's ``CFM.rand_noise`` (the CFM's initial noise) is not in ``flow.pt``: the vendor draws
it from the process's RNG when the flow is constructed. cadence-fx draws it from ``seed``, so a
served voice does not change from one start to the next.

The prompt. A stream starts from the prompt state: the prompt's speech tokens, its mel and its
speaker embedding (:class:`~cadence_fx.models.token2wav_stream.Prompt`), computed from a prompt
WAV by ``Token2wav._prepare_prompt``. That needs the prompt-only packages (``PROMPT_PACKAGES``) and
CUDA (the vendor method places every tensor on CUDA); :func:`prepare_prompt` runs the vendor's
method itself. :func:`save_prompt` writes the result to a safetensors file that
:func:`load_prompt` reads back exactly, so a machine without those packages serves the same voice.
"""

from __future__ import annotations

import functools
import importlib
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from .token2wav_stream import Prompt
from .vendor import VendorFlow, placeholders, token2wav_vendor

__all__ = [
    "ASSET_DIR",
    "FLOW_CLASSES",
    "PREPARE_FILES",
    "PROMPT_FILES",
    "PROMPT_FORMAT",
    "PROMPT_PACKAGES",
    "REFERENCE_VOICE",
    "REPO_ID",
    "STREAM_FILES",
    "CheckpointError",
    "PromptUnavailable",
    "Token2WavCheckpoint",
    "FlowConfig",
    "load_flow",
    "load_hift",
    "load_prompt",
    "locate_checkpoint",
    "prepare_prompt",
    "prompt_frames_fit",
    "read_flow_config",
    "save_prompt",
]

REPO_ID = "openbmb/MiniCPM-o-4_5"
ASSET_DIR = "assets/token2wav"
REFERENCE_VOICE = "assets/system_ref_audio.wav"
FLOW_CONFIG, FLOW_WEIGHTS, HIFT_WEIGHTS = "flow.yaml", "flow.pt", "hift.pt"
STREAM_FILES = (FLOW_CONFIG, FLOW_WEIGHTS, HIFT_WEIGHTS)
PROMPT_FILES = ("speech_tokenizer_v2_25hz.onnx", "campplus.onnx")
PREPARE_FILES = (FLOW_CONFIG,) + PROMPT_FILES  # what prepare_prompt reads (flow.yaml for frames per token)

# flow.yaml's tags, and the attribute of `token2wav_vendor()` each one names.
FLOW_CLASSES = {
    "!new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec": "flow",
    "!new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2": "encoder",
    "!new:cosyvoice2.flow.flow_matching.CausalConditionalCFM": "cfm",
    "!new:cosyvoice2.flow.decoder_dit.DiT": "estimator",
}

# What Token2wav._prepare_prompt imports at run time (through stepaudio2/token2wav.py,
# s3tokenizer and flashcosyvoice/utils/audio.py), with how to install each.
PROMPT_PACKAGES = {
    "torchaudio": "pip install torchaudio==<the version of your torch> (a build for your torch and CUDA)",
    "s3tokenizer": "pip install --no-deps s3tokenizer==0.3.0 (its own pins pull an unpinned torchaudio)",
    "onnx": "pip install onnx",
    "onnxruntime": "pip install onnxruntime",
    "soundfile": "pip install soundfile",
    "librosa": "pip install librosa",
}

PROMPT_FORMAT = "cadence-fx/token2wav-prompt"
PROMPT_VERSION = "1"
SPEAKER_DIM, MEL_BINS = 192, 80

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HOW_TO_DOWNLOAD = f"download them with: hf download {REPO_ID} --include '{ASSET_DIR}/*' --local-dir DIR, then pass DIR"


class CheckpointError(ValueError):
    """A Token2Wav checkpoint or prompt file is missing, unreachable or not in the vendor's format."""


class PromptUnavailable(ValueError):
    """A prompt was asked to be prepared from audio where that cannot run (packages or CUDA
    missing); the way out is an argument: a prompt file prepared elsewhere."""


@dataclass(frozen=True)
class Token2WavCheckpoint:
    """Where a Token2Wav checkpoint's files are: ``assets`` holds flow.yaml, flow.pt, hift.pt (and
    the prompt models when they were asked for); ``root`` is the model folder above it, when known."""

    source: str  # what the user named: a folder or a hub id
    assets: Path
    root: Path | None

    def file(self, name: str) -> Path:
        return self.assets / name

    @property
    def reference_voice(self) -> Path | None:
        """The model's own reference voice, when the model folder is known and holds it."""
        if self.root is None or not (self.root / REFERENCE_VOICE).is_file():
            return None
        return self.root / REFERENCE_VOICE


def locate_checkpoint(
    weights: str | Path,
    files: tuple[str, ...] = STREAM_FILES,
    *,
    reference_voice: bool = False,
    cache_dir: str | Path | None = None,
) -> Token2WavCheckpoint:
    """Find ``files`` of the Token2Wav checkpoint ``weights``: a folder holding them
    (``assets/token2wav`` itself), a MiniCPM-o model folder (its ``assets/token2wav``), or a hub
    id, whose ``files`` only are downloaded (or taken from the hub cache) with huggingface_hub.
    ``reference_voice`` asks for the model's reference WAV too.

    Raises :class:`CheckpointError` naming the files looked for and the places looked in.
    """
    path = Path(weights).expanduser()
    if path.is_dir():
        inside_model = path.parts[-2:] == tuple(ASSET_DIR.split("/"))
        candidates = [(path, path.parents[1] if inside_model else None), (path / ASSET_DIR, path)]
        for assets, root in candidates:
            missing = [name for name in files if not (assets / name).is_file()]
            if not missing:
                return _checked(Token2WavCheckpoint(str(weights), assets, root), reference_voice)
            if len(missing) < len(files):  # a checkpoint folder, incomplete: say what it lacks
                raise CheckpointError(
                    f"{assets} lacks {', '.join(missing)} of the MiniCPM-o 4.5 Token2Wav checkpoint "
                    f"(needed here: {', '.join(files)}); {_HOW_TO_DOWNLOAD}"
                )
        raise CheckpointError(
            f"{weights} holds no MiniCPM-o 4.5 Token2Wav checkpoint: looked for {', '.join(files)} in "
            f"{' and '.join(str(assets) for assets, _ in candidates)}; {_HOW_TO_DOWNLOAD}"
        )
    if path.exists():
        raise CheckpointError(f"--weights {weights} is a file; expected a checkpoint folder or a hub id such as {REPO_ID}")
    if not _REPO_ID.match(str(weights)):
        raise CheckpointError(f"--weights {weights} is neither an existing folder nor a hub id (OWNER/NAME, e.g. {REPO_ID})")
    patterns = [f"{ASSET_DIR}/{name}" for name in files] + ([REFERENCE_VOICE] if reference_voice else [])
    root = _download(str(weights), patterns, cache_dir)
    assets = root / ASSET_DIR
    missing = [name for name in files if not (assets / name).is_file()]
    if missing:
        raise CheckpointError(
            f"hub repository {weights} has no {', '.join(f'{ASSET_DIR}/{name}' for name in missing)}: "
            f"is it MiniCPM-o 4.5 ({REPO_ID})?"
        )
    return _checked(Token2WavCheckpoint(str(weights), assets, root), reference_voice)


def _checked(checkpoint: Token2WavCheckpoint, reference_voice: bool) -> Token2WavCheckpoint:
    if reference_voice and checkpoint.reference_voice is None:
        raise CheckpointError(
            f"no prompt was given and {checkpoint.source} has no reference voice ({REFERENCE_VOICE} of the model "
            f"folder); pass --prompt with a WAV or a prompt file written by `cadence-fx prompt`"
        )
    return checkpoint


def _download(repo_id: str, patterns: list[str], cache_dir: str | Path | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache_dir))
    except Exception as error:  # offline, unreachable, gated, unknown repository: all end here
        raise CheckpointError(
            f"could not get {', '.join(patterns)} of hub repository {repo_id} "
            f"({type(error).__name__}: {error}). Without network access here, {_HOW_TO_DOWNLOAD} "
            f"(a folder copied from another machine)"
        ) from error


# -- flow.yaml ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlowConfig:
    """One ``!new:`` node of flow.yaml: the vendor class it names and its keyword arguments, in
    file order (nested nodes are FlowConfigs too)."""

    tag: str
    kwargs: dict[str, Any]

    def build(self) -> torch.nn.Module:
        """Construct the node as hyperpyyaml does: arguments first, depth first, in file order."""
        cls = getattr(token2wav_vendor(), FLOW_CLASSES[self.tag])
        return cls(**{k: v.build() if isinstance(v, FlowConfig) else v for k, v in self.kwargs.items()})

    @property
    def up_rate(self) -> int:
        """Mel frames per speech token (the encoder's up_stride; CausalMaskedDiffWithXvec.up_rate)."""
        try:
            return int(self.kwargs["encoder"].kwargs["up_stride"])
        except (KeyError, AttributeError):
            raise CheckpointError("flow.yaml's flow has no `encoder` with an `up_stride`") from None


class _FlowConfigLoader(yaml.SafeLoader):
    """A safe YAML loader that knows flow.yaml's four vendor tags and nothing else."""


def _construct(tag: str, loader: _FlowConfigLoader, node: yaml.Node) -> FlowConfig:
    if not isinstance(node, yaml.MappingNode):
        raise yaml.constructor.ConstructorError(None, None, f"{tag} must be a mapping of arguments", node.start_mark)
    arguments = loader.construct_mapping(node, deep=True)
    kwargs = {name: value for name, value in arguments.items() if isinstance(name, str)}
    if len(kwargs) != len(arguments):
        odd = next(name for name in arguments if not isinstance(name, str))
        raise yaml.constructor.ConstructorError(
            None, None, f"{tag}'s argument names must be strings, got {odd!r}", node.start_mark
        )
    return FlowConfig(tag, kwargs)


for _tag in FLOW_CLASSES:
    _FlowConfigLoader.add_constructor(_tag, functools.partial(_construct, _tag))
del _tag


def read_flow_config(path: str | Path) -> FlowConfig:
    """flow.yaml as a :class:`FlowConfig`; any tag but the four vendor classes is refused."""
    try:
        with open(path, encoding="utf-8") as stream:
            config = yaml.load(stream, Loader=_FlowConfigLoader)
    except yaml.YAMLError as error:
        raise CheckpointError(
            f"{path} is not a MiniCPM-o Token2Wav flow.yaml: {error}. cadence-fx reads only the tags {', '.join(FLOW_CLASSES)}"
        ) from None
    flow = config.get("flow") if isinstance(config, dict) else None
    if not isinstance(flow, FlowConfig) or flow.tag != next(iter(FLOW_CLASSES)):
        raise CheckpointError(f"{path} must define `flow: {next(iter(FLOW_CLASSES))}` at its top level")
    return flow


# -- weights ---------------------------------------------------------------------------------------


def load_flow(checkpoint: Token2WavCheckpoint, *, seed: int = 0, device: str | torch.device = "cpu") -> VendorFlow:
    """The flow of flow.yaml with flow.pt's weights (strict, as Token2wav.__init__ loads them), in
    eval mode on ``device``; ``CFM.rand_noise`` drawn under ``seed``. The caller's RNG is untouched."""
    config = read_flow_config(checkpoint.file(FLOW_CONFIG))
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        try:
            flow = config.build()
        except TypeError as error:  # an argument the vendor class does not take, or a tag in the wrong place
            raise CheckpointError(f"{checkpoint.file(FLOW_CONFIG)} does not build the vendor flow: {error}") from None
    state = _load_state(checkpoint.file(FLOW_WEIGHTS))
    _load_strict(flow, state, checkpoint.file(FLOW_WEIGHTS), checkpoint.file(FLOW_CONFIG))
    return flow.to(device).eval()


def load_hift(checkpoint: Token2WavCheckpoint, *, device: str | torch.device = "cpu") -> torch.nn.Module:
    """``HiFTGenerator()`` with hift.pt's weights, ``generator.`` prefixes dropped as the vendor does."""
    with torch.random.fork_rng(devices=[]):
        hift = token2wav_vendor().hift()
    state = {k.replace("generator.", ""): v for k, v in _load_state(checkpoint.file(HIFT_WEIGHTS)).items()}
    _load_strict(hift, state, checkpoint.file(HIFT_WEIGHTS), None)
    return hift.to(device).eval()


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{path} is not a torch state dict: {type(error).__name__}: {error}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} must hold a state dict (parameter name -> tensor), got {type(state).__name__}")
    return state


def _load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], path: Path, config: Path | None) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:
        described = f" as {config} describes it" if config is not None else ""
        raise CheckpointError(f"{path} does not fit the {type(module).__name__}{described}: {error}") from None


# -- the prompt state ----------------------------------------------------------------------------


def prepare_prompt(checkpoint: Token2WavCheckpoint, wav: str | Path) -> Prompt:
    """The prompt state of ``wav``, computed by the vendor's own ``Token2wav._prepare_prompt`` with
    the checkpoint's speech tokenizer and speaker model, built as ``Token2wav.__init__`` builds them.

    Raises :class:`PromptUnavailable` naming what is missing (``PROMPT_PACKAGES``, CUDA)."""
    missing = _missing_prompt_packages()
    if missing:
        raise PromptUnavailable(
            f"preparing a prompt from {wav} runs the vendor's Token2wav._prepare_prompt, which needs "
            f"{', '.join(missing)} (not installed or not loadable here). Install: "
            + "; ".join(PROMPT_PACKAGES[name] for name in missing)
            + ". Or prepare it on a machine that has them (`cadence-fx prompt`) and pass the saved file."
        )
    if not torch.cuda.is_available():
        raise PromptUnavailable(
            f"preparing a prompt from {wav} runs the vendor's Token2wav._prepare_prompt, which places the "
            "prompt on CUDA, and torch.cuda.is_available() is False here; prepare it on a GPU machine "
            "(`cadence-fx prompt`) and pass the saved file"
        )
    if not Path(wav).is_file():
        raise CheckpointError(f"prompt WAV {wav} does not exist")
    token2wav = importlib.import_module("stepaudio2.token2wav")
    s3tokenizer, onnxruntime = importlib.import_module("s3tokenizer"), importlib.import_module("onnxruntime")
    # The attributes _prepare_prompt reads, built as Token2wav.__init__ builds them.
    option = onnxruntime.SessionOptions()
    option.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    option.intra_op_num_threads = 1
    models = types.SimpleNamespace(
        audio_tokenizer=s3tokenizer.load_model(str(checkpoint.file(PROMPT_FILES[0]))).cuda().eval(),
        spk_model=onnxruntime.InferenceSession(
            str(checkpoint.file(PROMPT_FILES[1])), sess_options=option, providers=["CPUExecutionProvider"]
        ),
        flow=types.SimpleNamespace(up_rate=read_flow_config(checkpoint.file(FLOW_CONFIG)).up_rate),
    )
    with torch.no_grad():
        tokens, _, spk, mels, _ = token2wav.Token2wav._prepare_prompt(models, str(wav))
    return Prompt(tokens=tokens, mels=mels, spk=spk)


def _missing_prompt_packages() -> list[str]:
    missing = []
    for name in PROMPT_PACKAGES:
        try:
            importlib.import_module(name)
        except Exception:  # a torchaudio built for another torch fails with OSError
            missing.append(name)
            continue
        if any(module == name or module.startswith(name + ".") for module in placeholders()):
            missing.append(name)
    return missing


def save_prompt(prompt: Prompt, path: str | Path, *, source: str = "") -> None:
    """Write ``prompt`` as a safetensors file :func:`load_prompt` reads back exactly."""
    from safetensors.torch import save_file

    _check_prompt(prompt, str(path))
    tensors = {"tokens": prompt.tokens, "mels": prompt.mels, "spk": prompt.spk}
    save_file(
        {name: t.detach().cpu().contiguous() for name, t in tensors.items()},
        str(path),
        metadata={"format": PROMPT_FORMAT, "version": PROMPT_VERSION, "source": source},
    )


def load_prompt(path: str | Path, *, device: str | torch.device = "cpu") -> Prompt:
    """A prompt file written by :func:`save_prompt` (``cadence-fx prompt``), on ``device``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            names = set(file.keys())
            tensors = {name: file.get_tensor(name) for name in names}
    except (OSError, SafetensorError) as error:
        raise CheckpointError(
            f"{path} is not a Token2Wav prompt file (safetensors written by `cadence-fx prompt`): {error}"
        ) from None
    if metadata.get("format") != PROMPT_FORMAT or metadata.get("version") != PROMPT_VERSION:
        raise CheckpointError(
            f"{path} is not a Token2Wav prompt file: its metadata says format={metadata.get('format')!r} "
            f"version={metadata.get('version')!r}, expected {PROMPT_FORMAT!r} version {PROMPT_VERSION!r}"
        )
    if names != {"tokens", "mels", "spk"}:
        raise CheckpointError(f"{path} holds tensors {sorted(names)}, expected ['mels', 'spk', 'tokens']")
    prompt = Prompt(**tensors)
    _check_prompt(prompt, str(path))
    return prompt.to(device)


def _check_prompt(prompt: Prompt, where: str) -> None:
    tokens, mels, spk = prompt.tokens, prompt.mels, prompt.spk
    problems = []
    if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.dtype not in (torch.int32, torch.int64):
        problems.append(f"tokens must be int32 or int64 of shape (1, T), got {tokens.dtype} {tuple(tokens.shape)}")
    if mels.dim() != 3 or mels.shape[0] != 1 or mels.shape[2] != MEL_BINS or not mels.is_floating_point():
        problems.append(f"mels must be floating point of shape (1, frames, {MEL_BINS}), got {mels.dtype} {tuple(mels.shape)}")
    if tuple(spk.shape) != (1, SPEAKER_DIM) or not spk.is_floating_point():
        problems.append(f"spk must be floating point of shape (1, {SPEAKER_DIM}), got {spk.dtype} {tuple(spk.shape)}")
    if problems:
        raise CheckpointError(f"{where}: not a Token2Wav prompt: " + "; ".join(problems))


def prompt_frames_fit(prompt: Prompt, up_rate: int, where: str) -> None:
    """The flow's own precondition (``setup_cache``: frames = tokens x up_rate), said before it asserts."""
    tokens, frames = prompt.tokens.shape[1], prompt.mels.shape[1]
    if frames != tokens * up_rate:
        raise CheckpointError(
            f"{where}: the prompt has {tokens} speech tokens and {frames} mel frames; this flow needs "
            f"{tokens * up_rate} ({up_rate} frames per token)"
        )
