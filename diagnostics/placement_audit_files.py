"""The placement audit on a user's own model files (``tools/doctor.py --audit FILE...``).

Each file (safetensors, or GGUF with ComfyUI's tensor names as ComfyUI-GGUF writes diffusion models and VAEs) is
read for its tensor names, shapes and dtypes only, and identified the way ComfyUI identifies it: diffusion models by
``comfy.model_detection`` (from shapes), text encoders and VAEs by the keys ``comfy.sd``'s loaders branch on. Then
ComfyUI's own loader (``load_diffusion_model_state_dict``, ``load_text_encoder_state_dicts``, ``comfy.sd.VAE``) builds
the real class at the file's configuration from a state dict of FakeTensors with the file's shapes and dtypes (small
tensors that loaders read by value, such as quantization configs, tokenizers and scales, are read for real), and each
model the file holds is audited as the built-in configuration of ``placement_audit`` is: same budgets, same calls.
Nothing full-size is read into memory.

On a machine with CUDA, safetensors files are audited on the real device instead: ComfyUI's loader reads the real
weights (memory-mapped), the legacy loader and ``ModelPatcherDynamic`` place them on ``cuda:0`` at each budget and the
calls run there. GGUF weights need ComfyUI-GGUF's ops to run, so GGUF files are always audited on FakeTensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from dataclasses import asdict

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import placement_runs
from .placement_models import models
from .placement_recorder import COMPUTE

SMALL = 1024  # elements: tensors this small are read for real (loaders read configs, scales and flags by value)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
GGUF_MAGIC = b"GGUF"
GGUF_ORIGINAL_SHAPE = "comfy.gguf.orig_shape."  # ComfyUI-GGUF's key for shapes GGUF cannot hold as they are
# What each ComfyUI loader builds from a MiniMax file: the class it builds (by name), and the audited models
# (placement_audit's names) that class holds, with how to reach each from what the loader returns.
VAE_MODELS = {
    "MiniMaxH3VideoVAE": {"H3 video VAE decoder": None, "H3 video VAE encoder": None},
    "MiniMaxH3AudioVAE": {"H3 audio VAE": None},
    "MiniMaxMusic3DAV": {"Music 3 DAV": None},
}
DIFFUSION_MODELS = {"MiniMaxH3": {"H3 DiT": None}, "MiniMaxMusic3": {"Music 3 DiT": None}}
TEXT_ENCODERS = {
    "MiniMaxH3TEModel_": {"H3 text encoder: Qwen3-VL vision tower": "qwen3vl_32b.transformer.visual",
                          "H3 text encoder: language model": None},
    "MiniMaxMusic3TEModel": {"Music 3 text encoder (AR)": None},
}
# the keys comfy.sd's loaders branch on where ComfyUI has no detection function to call: the Music 3 text encoder
# (comfy.sd.load_text_encoder_state_dicts) and the VAEs (comfy.sd.VAE); diffusion models and the H3 text encoder are
# detected by comfy.model_detection and comfy.sd.detect_te_model themselves
MUSIC3_TEXT_ENCODER_KEY = "model.audio_decoder.projection.weight"
VAE_KEYS = ({"decoder.transformer_blocks.0.scale1", "encoder.down.5.block.0.conv1.weight"},
            {"pre_block.attn.zero_k_bias"}, {"dec_in_proj.weight", "decoder.model.0.weight_g"})


class ModelFileError(Exception):
    """A file the audit cannot take: missing, unreadable, or not a MiniMax model. One line, no traceback."""


@dataclasses.dataclass
class Header:
    """What a model file says about its tensors, without their data."""

    path: str
    format: str  # "safetensors" / "GGUF"
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    metadata: dict
    read_small: object  # (key) -> torch.Tensor: one small tensor's real values

    def meta_state_dict(self) -> dict:
        """Shapes only (``meta``), for detection that reads nothing but shapes."""
        return {k: torch.empty(s, dtype=self.dtypes[k], device="meta") for k, s in self.shapes.items()}

    def fake_state_dict(self) -> dict:
        """The state dict a loader sees, built under the audit's fake mode: FakeTensors with the file's shapes and
        dtypes, and the small tensors' real values."""
        state = {}
        for key, shape in self.shapes.items():
            if math.prod(shape) <= SMALL or (self.dtypes[key] == torch.uint8 and len(shape) == 1):
                with unset_fake_temporarily():
                    state[key] = self.read_small(key)
            else:
                state[key] = torch.empty(shape, dtype=self.dtypes[key])
        return state


def _read_safetensors(path: str) -> Header:
    from safetensors import safe_open

    handle = safe_open(path, framework="pt")  # reads and checks the header; data stays on disk (memory-mapped)
    shapes, dtypes = {}, {}
    for key in handle.keys():
        view = handle.get_slice(key)
        shapes[key], dtypes[key] = tuple(view.get_shape()), SAFETENSORS_DTYPES[view.get_dtype()]
    return Header(path, "safetensors", shapes, dtypes, handle.metadata() or {}, handle.get_tensor)


def _read_gguf(path: str) -> Header:
    import gguf
    import numpy

    reader = gguf.GGUFReader(path)  # memory-mapped: the header is parsed, tensor data is not read
    metadata = {field.name: field for field in reader.fields.values()}
    plain = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16,
             gguf.GGMLQuantizationType.BF16: torch.bfloat16, gguf.GGMLQuantizationType.I8: torch.int8,
             gguf.GGMLQuantizationType.I32: torch.int32}
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    shapes, dtypes = {}, {}
    for name, tensor in tensors.items():
        original = metadata.get(GGUF_ORIGINAL_SHAPE + name)
        shapes[name] = (tuple(int(original.parts[i][0]) for i in original.data) if original is not None
                        else tuple(int(size) for size in reversed(tensor.shape)))
        # quantized weights are dequantized to the compute dtype at each use (ComfyUI-GGUF's ops)
        dtypes[name] = plain.get(tensor.tensor_type, torch.bfloat16)

    def read_small(name):
        tensor = tensors[name]
        if tensor.tensor_type not in plain:
            return torch.empty(shapes[name], dtype=dtypes[name])
        if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
            return torch.from_numpy(numpy.array(tensor.data).view(numpy.int16)).view(torch.bfloat16).reshape(shapes[name])
        return torch.from_numpy(numpy.array(tensor.data)).reshape(shapes[name])

    return Header(path, "GGUF", shapes, dtypes, {}, read_small)


def read_header(path: str) -> Header:
    """The file's tensor names, shapes and dtypes; ``ModelFileError`` for a missing or unreadable file."""
    if not os.path.isfile(path):
        raise ModelFileError(f"{path}: no such file" + (" (a folder: name the model files in it)"
                                                        if os.path.isdir(path) else ""))
    try:
        with open(path, "rb") as file:
            magic = file.read(4)
        return _read_gguf(path) if magic == GGUF_MAGIC else _read_safetensors(path)
    except Exception as exc:  # every parser error means the same to a user: the file is damaged or of another kind
        kind = "GGUF" if magic == GGUF_MAGIC else "safetensors"
        raise ModelFileError(f"{path}: cannot be read as {kind} ({type(exc).__name__}: {exc}); a truncated download "
                             "or another file type? (the audit reads .safetensors and .gguf model files)") from exc


@dataclasses.dataclass
class Identified:
    """A MiniMax model file: which ComfyUI loader builds it, the class it builds, the audited models it holds."""

    header: Header
    loader: str  # "diffusion model", "text encoder", "VAE"
    built: str  # the class ComfyUI builds
    models: dict  # audited model name -> attribute path in what the loader builds (None: the built module itself)


def identify(header: Header) -> Identified:
    """Which MiniMax model the file is, as ComfyUI decides it; ``ModelFileError`` when it is none."""
    import comfy.model_detection

    keys = set(header.shapes)
    meta = header.meta_state_dict()
    prefix = comfy.model_detection.unet_prefix_from_state_dict(meta)  # a checkpoint's, or a guess: kept if it fits
    unet = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix)} or meta
    try:
        config = comfy.model_detection.model_config_from_unet(unet, "")
    except Exception:  # detection of another family read something a shape-only tensor lacks: not MiniMax
        config = None
    built = type(config).__name__ if config is not None else None
    if built in DIFFUSION_MODELS:
        return Identified(header, "diffusion model", built, DIFFUSION_MODELS[built])
    if MUSIC3_TEXT_ENCODER_KEY in keys or _detect_text_encoder(meta) == "QWEN3VL_32B":
        built = "MiniMaxMusic3TEModel" if MUSIC3_TEXT_ENCODER_KEY in keys else "MiniMaxH3TEModel_"
        return Identified(header, "text encoder", built, TEXT_ENCODERS[built])
    for marker, built in zip(VAE_KEYS, VAE_MODELS, strict=True):
        if marker <= keys:
            return Identified(header, "VAE", built, VAE_MODELS[built])
    sample = ", ".join(sorted(keys)[:3]) or "no tensors"
    raise ModelFileError(f"{header.path}: not a MiniMax model ComfyUI can build ({len(keys)} tensors: {sample}"
                         f"{', ...' if len(keys) > 3 else ''}); the audit takes MiniMax H3 and Music 3 diffusion model, "
                         "text encoder and VAE files")


def _detect_text_encoder(meta: dict) -> str | None:
    import comfy.sd

    try:
        found = comfy.sd.detect_te_model(meta)
    except Exception:  # another family's detection read what a shape-only tensor lacks
        return None
    return getattr(found, "name", None)


class _RealOperandsStayReal(TorchDispatchMode):
    """Under the audit's fake mode, an op whose operands are all real tensors runs for real: loaders read the values
    of the small tensors the file gives for real (``tokenizer_json.detach().cpu().numpy()``, a quantization config),
    which a fake mode would turn into FakeTensors first. Factories and ops on the fake weights stay fake."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        target = kwargs.get("device")
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors) and (
                target is None or torch.device(target).type != COMPUTE.type):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _load_with_comfyui(found: Identified, on_device: bool):
    """What ComfyUI's loader for ``found`` returns, built from the file: the model module it holds."""
    import comfy.sd
    import comfy.utils

    try:
        if on_device:
            state, metadata = comfy.utils.load_torch_file(found.header.path, return_metadata=True)
        else:
            state, metadata = found.header.fake_state_dict(), found.header.metadata
        with contextlib.nullcontext() if on_device else _RealOperandsStayReal():
            if found.loader == "diffusion model":
                return comfy.sd.load_diffusion_model_state_dict(state, metadata=metadata).model
            if found.loader == "text encoder":
                clip = comfy.sd.load_text_encoder_state_dicts([state], clip_type=comfy.sd.CLIPType.MINIMAX)
                return clip.cond_stage_model
            return comfy.sd.VAE(sd=state, metadata=metadata).first_stage_model
    except Exception as exc:  # a variant this ComfyUI does not build: what ComfyUI's own loader node would raise
        raise ModelFileError(f"{found.header.path}: ComfyUI's {found.loader} loader cannot build it "
                             f"({type(exc).__name__}: {exc})") from exc


def _part(module, path):
    if path is None:
        return module
    holder = torch.nn.Module()  # the audited part under the name the built-in configuration gives it
    holder.add_module(path.rsplit(".", 1)[-1], module.get_submodule(path))
    return holder


def _check_built(module, found: Identified):
    if type(module).__name__ != found.built:
        raise ModelFileError(f"{found.header.path}: ComfyUI built {type(module).__name__} from it, not {found.built}")
    return module


def file_models(found: Identified, on_device: bool) -> tuple[list, list]:
    """``placement_audit`` models built from the file (same names and calls as the built-in ones), and rows for the
    models the file holds that cannot be audited."""
    specs = {spec.name: spec for spec in models()}
    audited, not_audited = [], []
    for name, path in found.models.items():
        spec = specs[name]
        if spec.build is None:  # this core lacks the class (the loader would fail on the file before this)
            not_audited.append(placement_runs.Row(name, "-", "-", not_audited=spec.unavailable))
            continue

        def build(path=path):
            return _part(_check_built(_load_with_comfyui(found, on_device), found), path)

        audited.append(dataclasses.replace(spec, build=build))
    return audited, not_audited


def audit_files(paths: list[str], budgets=None, show_progress=False) -> list[placement_runs.Row]:
    """Every MiniMax model in ``paths`` at every load (``budgets``: default every budget and dynamic), pack off and
    on, each row's model named with its file. ``ModelFileError`` names the first file that cannot be audited, before
    any audit runs."""
    found = [identify(read_header(path)) for path in paths]
    rows = []
    for each in found:
        on_device = torch.cuda.is_available() and each.header.format == "safetensors"
        audited, not_audited = file_models(each, on_device)
        for row in placement_runs.audit(budgets, audited=audited, on_device=on_device, show_progress=show_progress) + not_audited:
            row.model = f"{row.model} ({os.path.basename(each.header.path)}, "
            row.model += f"{'cuda:0' if on_device else 'FakeTensor cuda:0'})"
            rows.append(row)
    return rows


def main(model_files: list[str], as_json: bool) -> int:
    """The audit of ``model_files`` (``placement_audit.main`` with files): the table (or JSON); exit 2 with one line
    on stderr for a file the audit cannot take, 1 when the pack leaves a finding it does not accept."""
    try:
        rows = audit_files(model_files, show_progress=True)
    except ModelFileError as exc:
        print(f"placement audit: {exc}", file=sys.stderr)
        return 2
    print(json.dumps([asdict(r) for r in rows], indent=1) if as_json else placement_runs.table(rows))
    return placement_runs.exit_code(rows)
