"""Checks of a model folder brought from elsewhere, made before any weight is loaded.

A folder saved by another tool or another transformers version is read for what it claims (config.json) and
what it holds (the safetensors headers, or the tensors of a ``pytorch_model.bin`` unpickled weights-only and
memory-mapped), and refused with a message naming the problem when the two disagree or cannot be served:

- ``auto_map`` in config.json names model code shipped in the folder; clawpipe never runs it
  (no ``trust_remote_code``), and an ``model_type`` transformers does not know has no code to run at all;
- a tensor whose stored shape is not the one config.json gives it, or fewer stored parameters than the config
  describes (absurd sizes such as ``vocab_size`` 2**31, tensors left out): transformers would initialise what
  is missing at random, and for an absurd size allocate it first, killing the server instead of refusing;
- a shard named in ``model.safetensors.index.json`` that is not there, or a file shorter than its header says
  (a folder still being written);
- a ``pytorch_model.bin`` whose pickle carries anything but tensors (a pickle can run code when loaded);
- a model larger than the memory free to hold it.

The shapes come from the model built on the meta device from config.json, which allocates nothing.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

from clawpipe.errors import ServingError
from clawpipe.modelbuild import MODEL_BUILD

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format caps its JSON header at 100 MB
MAX_LAYERS = 4096  # building the meta model costs time per layer: a config with more is refused first
# what every refusal of a folder caught mid-write ends with (a copy, a save_pretrained, a checkpoint not renamed)
INCOMPLETE = "the folder is not completely written: wait for its writer to finish, or copy it again"
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class StoredWeights:
    """What the weight files of a folder hold: each tensor's shape, and the files they were read from."""

    shapes: dict[str, tuple[int, ...]]
    files: list[Path]

    def numel(self) -> int:
        total = 0
        for shape in self.shapes.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


def check_model_folder(path: str | Path, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ServingError when the folder at `path` cannot be loaded as the causal LM its config.json describes,
    or would not fit in the memory free on `device` in `dtype`. Reads headers and config only."""
    folder = Path(path)
    raw = read_config(folder)
    cfg = _config(folder, raw)
    expected, n_params, tied = _expected_shapes(folder, cfg)
    stored = stored_weights(folder)
    _compare(folder, cfg, expected, tied, stored, n_params)
    _check_memory(folder, n_params, dtype, device)


def read_config(folder: Path) -> dict[str, Any]:
    """config.json as a dict, refused when it names its own model code or an architecture transformers lacks."""
    file = folder / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ServingError(f"{folder} has no config.json: pass a folder written by save_pretrained") from None
    except (OSError, ValueError) as exc:
        raise ServingError(f"{file} is not readable JSON ({exc}); {INCOMPLETE}") from exc
    if not isinstance(raw, dict):
        raise ServingError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    auto_map = raw.get("auto_map")
    if auto_map:
        names = ", ".join(f"{k}: {v}" for k, v in auto_map.items()) if isinstance(auto_map, dict) else str(auto_map)
        raise ServingError(
            f"{file} names model code shipped in the folder (auto_map {names}); clawpipe never runs code from a "
            "model folder (no trust_remote_code): use a folder of an architecture transformers has built in, or "
            f"remove auto_map if the model is a plain {raw.get('model_type', '<model_type>')}"
        )
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ServingError(
            f"{file} has model_type {model_type!r}, which is not an architecture this transformers knows; "
            "clawpipe never runs code from a model folder (no trust_remote_code): convert the model to a "
            "built-in causal LM architecture (e.g. qwen2, llama)"
        )
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, int) and not 0 < layers <= MAX_LAYERS:
        raise ServingError(f"{file} has num_hidden_layers {layers}; at most {MAX_LAYERS} are loaded")
    return raw


def _config(folder: Path, raw: dict[str, Any]) -> Any:
    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises many types for a config it cannot read
        raise ServingError(f"{folder / 'config.json'} is not a valid {raw['model_type']} config: {exc}") from exc


def _expected_shapes(folder: Path, cfg: Any) -> tuple[dict[str, tuple[int, ...]], int, dict[str, str]]:
    """Parameter shapes of the model config.json describes (built on the meta device: nothing allocated), its
    parameter count, and the parameters that share another's storage (tied: name -> the name it shares with),
    either of which a folder may store."""
    try:
        with MODEL_BUILD, torch.device("meta"):  # one build at a time (clawpipe/modelbuild.py)
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # an architecture without a causal LM head, or sizes it cannot build
        raise ServingError(f"{folder} does not describe a causal LM transformers can build: {exc}") from exc
    shapes: dict[str, tuple[int, ...]] = {}
    seen: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied[name] = seen[id(p)]
            continue
        seen[id(p)] = name
        shapes[name] = tuple(p.shape)
    n_params = sum(p.numel() for p in model.parameters())
    return shapes, n_params, tied


def stored_weights(folder: Path) -> StoredWeights:
    """The tensor shapes stored in the folder's weight files, in the order transformers looks for them."""
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif (folder / "model.safetensors.index.json").is_file():
        files = _shards(folder, "model.safetensors.index.json")
    elif (folder / "pytorch_model.bin").is_file():
        files = [folder / "pytorch_model.bin"]
    elif (folder / "pytorch_model.bin.index.json").is_file():
        files = _shards(folder, "pytorch_model.bin.index.json")
    else:
        raise ServingError(
            f"{folder} has no weights (model.safetensors, model.safetensors.index.json with its shards, or "
            f"pytorch_model.bin); {INCOMPLETE}"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        shapes.update(_safetensors_shapes(file) if file.suffix == ".safetensors" else _pickle_shapes(file))
    return StoredWeights(shapes, files)


def _shards(folder: Path, index_name: str) -> list[Path]:
    index = folder / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ServingError(f"{index} is not a weight index with a weight_map ({exc})") from exc
    files = []
    for name in names:
        shard = (folder / name).resolve()
        if not isinstance(name, str) or shard.parent != folder.resolve():
            raise ServingError(f"{index} names a shard outside the folder: {name!r}")
        if not shard.is_file():
            raise ServingError(f"{index} lists the shard {name}, which is not in {folder}: {INCOMPLETE}")
        files.append(shard)
    return files


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Shapes from a safetensors header, with the file's length checked against the data the header promises."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise ServingError(
                f"{file} is not a whole safetensors file (header length {n}, {size} bytes): {INCOMPLETE}"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ServingError(f"{file} has an unreadable safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise ServingError(f"{file} has a safetensors header that is not a JSON object")
    shapes, end = {}, 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = tuple(int(d) for d in meta["shape"])
            end = max(end, int(meta["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ServingError(f"{file}: the header entry of {name} has no shape and offsets ({exc})") from exc
    if 8 + n + end > size:
        raise ServingError(f"{file} holds {size} bytes but its header describes {8 + n + end}: {INCOMPLETE}")
    return shapes


def _pickle_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Shapes from a pickled state dict, unpickled weights-only: a pickle naming any callable other than the
    tensor rebuilders (one that would run code) is refused before anything in it runs."""
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as exc:  # not a zip archive: the legacy format cannot be memory-mapped
        if "mmap" not in str(exc):
            raise ServingError(f"{file} does not load as a state dict: {exc}") from exc
        state = _load_weights_only(file)
    except Exception as exc:
        raise _pickle_refused(file, exc) from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ServingError(f"{file} does not hold a state dict of tensors; not loaded")
    return {str(k): tuple(v.shape) for k, v in state.items()}


def _load_weights_only(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise _pickle_refused(file, exc) from exc


def _pickle_refused(file: Path, exc: Exception) -> ServingError:
    # torch's message suggests weights_only=False; only its line naming the refused global is worth passing on
    lines = [ln for ln in str(exc).splitlines() if "GLOBAL" in ln or "global" in ln]
    why = lines[0].strip()[:300] if lines else type(exc).__name__
    return ServingError(
        f"{file} is a pickle that holds more than tensors and was not loaded ({why}): unpickling it could run "
        "code, and clawpipe loads pickled weights only weights-only; get the weights as safetensors from a "
        "source you trust"
    )


def _compare(
    folder: Path,
    cfg: Any,
    expected: dict[str, tuple[int, ...]],
    tied: dict[str, str],
    stored: StoredWeights,
    n_params: int,
) -> None:
    sizes = ", ".join(f"{k} {getattr(cfg, k)}" for k in SIZE_FIELDS if getattr(cfg, k, None) is not None)
    aliases: dict[str, list[str]] = {name: [name] for name in expected}
    for name, shared in tied.items():
        aliases[shared].append(name)  # lm_head.weight may be what a folder stores of a tied embedding
    for name, shape in expected.items():
        for alias in aliases[name]:
            got = _lookup(stored.shapes, alias)
            if got is not None and got != shape:
                raise ServingError(
                    f"{alias} is stored in {folder} with shape {list(got)} but config.json ({sizes}) gives it "
                    f"{list(shape)}: the config does not describe these weights; fix config.json or the weights"
                )
    held = stored.numel()
    for name, names in aliases.items():  # a tied tensor stored under both names counts once
        copies = sum(_lookup(stored.shapes, a) is not None for a in names)
        held -= max(0, copies - 1) * _numel(expected[name])
    if held < n_params:
        missing = [n for n, names in aliases.items() if all(_lookup(stored.shapes, a) is None for a in names)]
        listed = f" (missing: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})" if missing else ""
        raise ServingError(
            f"config.json of {folder} ({sizes}) describes {n_params:,} parameters but its weight files hold "
            f"{held:,}{listed}: loading would fill the rest with random values; fix config.json or complete the "
            "weights"
        )


def _lookup(shapes: dict[str, tuple[int, ...]], name: str) -> tuple[int, ...] | None:
    """A parameter's stored shape, also under the spellings with or without the base model's prefix that
    transformers accepts when loading (a base model's weights saved without ``model.``)."""
    if name in shapes:
        return shapes[name]
    _, _, rest = name.partition(".")
    return shapes.get(rest) if rest else None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_memory(folder: Path, n_params: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a model whose weights alone would not fit in the memory free on the device."""
    need = n_params * torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    if need > free:
        raise ServingError(
            f"the model in {folder} has {n_params:,} parameters, {need / 2**30:.1f} GiB in {dtype}, more than the "
            f"{free / 2**30:.1f} GiB free on {device}: not loaded; serve it on a larger machine or a smaller model"
        )
