"""NVIDIA ModelOpt quantizers on the megapipe model, and their state as JSON + tensors (never a pickle).

What a quantized checkpoint stores beside its weights, and how loading puts it back (``restore_quantized``); the
quantization itself (formats, calibration) is megapipe.posttrain.quantize. ModelOpt is a heavy optional package:
it is imported on first use only.

ModelOpt's own save (``mto.save`` / ``modelopt_state``) goes through ``torch.save``. A megapipe checkpoint keeps
the same information in two safe places instead: the quantizer tensors (``..._quantizer._amax``,
``..._quantizer._pre_quant_scale``) are buffers of the model, so they travel in the DCP shards with the weights;
the quantize config and every quantizer's properties (``num_bits``, ``axis``, ``block_sizes``, enabled or not,
...) are JSON in the manifest. Restoring re-applies the config through ``mto.restore_from_modelopt_state`` (what
``mto.restore`` does), with the buffer shapes read from the DCP metadata; the tensors are then loaded like
any weight.

KV-cache quantization needs quantizers on the keys and values the attention consumes. ModelOpt adds them to
Hugging Face attention classes; ``register_modules`` does the same for megapipe's ``Attention``: k and v are
quantized after RoPE, right before they reach the cache or SDPA, as ModelOpt's HF plugin does.

MoE experts are 3-D weights, which ModelOpt's linear quantizers do not reach: ``prepare`` puts them in the layout of
transformers 5's fused experts (megapipe.models.fused_experts), which ``register_modules`` hands to ModelOpt's own
wrapper for those, before quantizing and before restoring. Routers and shared-expert gates stay unquantized
(``UNQUANTIZED``, ModelOpt's convention for ``mlp.gate`` / ``shared_expert_gate``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megapipe.checkpoint.safe_dcp import read_metadata
from megapipe.errors import MegapipeError

INSTALL_HINT = "install it with `pip install 'megapipe[quant]'` (nvidia-modelopt)"
STATE_VERSION = 1
# quantize-config entries for megapipe's names of what ModelOpt's presets exclude under their HF names
UNQUANTIZED = [{"quantizer_name": "*moe.gate.*", "enable": False},
               {"quantizer_name": "*moe.shared_gate.*", "enable": False}]


@contextlib.contextmanager
def quiet():
    """ModelOpt prints progress and warns about untested transformers versions; keep megapipe's output clean."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(level)


def modelopt_version() -> str:
    try:
        return importlib.metadata.version("nvidia-modelopt")
    except importlib.metadata.PackageNotFoundError:
        raise MegapipeError(f"quantization needs NVIDIA ModelOpt, which is not installed: {INSTALL_HINT}") from None


def announce_modelopt_import() -> None:
    """One stderr line before ModelOpt's first import in a process: it takes up to a minute on a small CPU machine
    (the fp8 sample of ``make demo`` was silent that long)."""
    if "modelopt.torch.quantization" not in sys.modules:
        print("megapipe: loading NVIDIA ModelOpt (up to a minute, once) ...", file=sys.stderr,
              flush=True)


def mtq():
    """``modelopt.torch.quantization`` (imported on first use; a clear error when it is missing)."""
    modelopt_version()
    announce_modelopt_import()
    with quiet():
        import modelopt.torch.quantization as mtq_module
    register_modules()
    return mtq_module


def prepare(model: nn.Module) -> nn.Module:
    """``model`` with its MoE experts in the layout ModelOpt quantizes (in place; a model without MoE is unchanged)."""
    from megapipe.models.fused_experts import fuse_experts

    fuse_experts(model)
    return model


# --------------------------------------------------------------------------------------------------- attention


class _QuantizedSDPA:
    def __init__(self, sdpa, attention):
        self.sdpa, self.attention = sdpa, attention

    def __call__(self, q, k, v, *args, **kwargs):
        return self.sdpa(*self.attention.quantize_qkv(q, k, v), *args, **kwargs)


class _QuantizedCache:
    """The KV cache as the model sees it, with the new keys/values quantized before they are stored."""

    def __init__(self, cache, attention):
        self._cache, self._attention = cache, attention

    def attend(self, layer_id, q, k, v):
        return self._cache.attend(layer_id, *self._attention.quantize_qkv(q, k, v))

    def __getattr__(self, name):
        return getattr(self._cache, name)


_REGISTERED = False


def register_modules() -> None:
    """Teach ModelOpt megapipe's Attention (q/k/v_bmm_quantizer on the post-RoPE q, k, v: KV-cache quantization) and
    FusedExperts (ModelOpt's wrapper of transformers' fused experts)."""
    global _REGISTERED
    if _REGISTERED:
        return
    with quiet():
        from modelopt.torch.quantization.nn import QuantModuleRegistry, TensorQuantizer
        from modelopt.torch.quantization.nn.modules.quant_module import QuantModule
        from modelopt.torch.quantization.plugins.huggingface import _QuantFusedExperts

    from megapipe.models.attention import Attention
    from megapipe.models.fused_experts import FusedExperts

    class QuantAttention(QuantModule):
        def _setup(self):
            self.q_bmm_quantizer = TensorQuantizer()
            self.k_bmm_quantizer = TensorQuantizer()
            self.v_bmm_quantizer = TensorQuantizer()

        def quantize_qkv(self, q, k, v):
            return self.q_bmm_quantizer(q), self.k_bmm_quantizer(k), self.v_bmm_quantizer(v)

        def forward(self, x, rope, cache=None, mask=None):
            sdpa = self.sdpa
            self.sdpa = _QuantizedSDPA(sdpa, self)
            try:
                return super().forward(x, rope, _QuantizedCache(cache, self) if cache is not None else None, mask)
            finally:
                self.sdpa = sdpa

    if Attention not in QuantModuleRegistry:
        QuantModuleRegistry.register({Attention: "megapipe.Attention"})(QuantAttention)
    if FusedExperts not in QuantModuleRegistry:
        QuantModuleRegistry.register({FusedExperts: "megapipe.FusedExperts"})(_QuantFusedExperts)
    _REGISTERED = True


# --------------------------------------------------------------------------------------------------- JSON codec


def encode(value: Any) -> Any:
    """ModelOpt's config/property values -> JSON: tuples, slices, dtypes, int-keyed dicts (block_sizes) kept apart."""
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, torch.Size)):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, slice):  # the padding of a last, partial quantization block
        return {"__slice__": [encode(value.start), encode(value.stop), encode(value.step)]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} {value!r} as JSON")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__slice__" in value:
            return slice(*(decode(v) for v in value["__slice__"]))
        if "__items__" in value:
            return {decode(k): decode(v) for k, v in value["__items__"]}
        return {k: decode(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------------------------------- save / restore


def export_state(model: nn.Module) -> dict:
    """The JSON-able ModelOpt state of a quantized model: each applied mode (``quantize``, then the calibration
    mode, e.g. ``awq_lite_calibrate``) with its config and every quantizer's properties, deduplicated.

    Tensors are not in it: the buffers are part of the model's state dict (only their names are kept, the shapes
    come from the checkpoint). Tensor-valued *properties* are calibration leftovers (SmoothQuant's
    ``_amax_for_smoothing``) that nothing reads after calibration.
    """
    with quiet():
        import modelopt.torch.opt as mto

        state = mto.modelopt_state(model)
    kinds: list[dict] = []
    index: dict[str, int] = {}
    modes = []
    for mode, entry in state["modelopt_state_dict"]:
        metadata = dict(entry["metadata"])
        quantizers = {}
        for name, props in metadata.pop("quantizer_state", {}).items():
            meta = props.get("_pytorch_state_metadata", {})
            if meta.get("params"):
                raise MegapipeError(f"quantizer {name} has learned parameters {sorted(meta['params'])}: "
                                    "megapipe stores post-training quantization state only")
            kept = {k: encode(v) for k, v in sorted(props.items())
                    if k != "_pytorch_state_metadata" and not isinstance(v, torch.Tensor)}
            if "_pytorch_state_metadata" in props:
                kept["_buffers"] = sorted(meta.get("buffers", {}))
            key = repr(kept)
            if key not in index:
                index[key] = len(kinds)
                kinds.append(kept)
            quantizers[name] = index[key]
        modes.append({"mode": mode, "config": encode(entry["config"]), "metadata": encode(metadata),
                      "quantizers": _compact(quantizers, _num_layers(model))})
    return {"version": STATE_VERSION, "modelopt_version": state["modelopt_version"], "modes": modes, "kinds": kinds}


QUANTIZER_TENSOR = re.compile(r"_quantizers?\.")  # a linear's ``weight_quantizer.``, fused experts' ``_quantizers.3.``


def is_quantizer_tensor(name: str) -> bool:
    """Whether state-dict key ``name`` is a quantizer's tensor (``_amax``, ``_pre_quant_scale``), not a weight."""
    return QUANTIZER_TENSOR.search(name) is not None


def restore_quantized(model: nn.Module, quantization: dict, ckpt: Path, where: str) -> nn.Module:
    """Re-apply the quantizers a checkpoint's manifest describes (before its tensors are loaded)."""
    if not isinstance(quantization, dict) or not isinstance(quantization.get("modelopt"), dict):
        raise MegapipeError(f"{where}: 'quantization' lacks the ModelOpt quantizer state ('modelopt')")
    shapes = {k: (tuple(m.size), m.properties.dtype)
              for k, m in read_metadata(ckpt / "model").state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata) and is_quantizer_tensor(k)}
    return restore(model, quantization["modelopt"], shapes, where)


def restore(model: nn.Module, state: dict, tensor_shapes: dict[str, tuple[tuple, torch.dtype]],
            where: str = "the manifest") -> nn.Module:
    """Put the quantizers of ``state`` (from ``export_state``) back on a freshly built ``model``.

    ``tensor_shapes``: state-dict key -> (shape, dtype) of the stored quantizer buffers, so the buffers are created
    with the right shapes before the checkpoint's tensors are loaded into them.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        raise MegapipeError(f"{where}: quantization.modelopt holds no state this megapipe reads (version {version!r})")
    mtq()
    prepare(model)
    with quiet():
        import modelopt.torch.opt as mto

    def quantizer_state(names: dict[str, int]) -> dict:
        out = {}
        for name, kind in names.items():
            props = decode(state["kinds"][kind])
            buffers = props.pop("_buffers", None)
            if buffers is not None:
                meta = {}
                for buf in buffers:
                    key = f"{name}.{buf}"
                    if key not in tensor_shapes:
                        raise MegapipeError(f"{where}: quantizer tensor {key} is missing from the checkpoint")
                    shape, dtype = tensor_shapes[key]
                    meta[buf] = {"shape": torch.Size(shape), "dtype": dtype}
                props["_pytorch_state_metadata"] = {"params": {}, "buffers": meta}
            out[name] = props
        return out

    modelopt_state = {
        "modelopt_state_dict": [
            (m["mode"], {"config": decode(m["config"]),
                         "metadata": {**decode(m["metadata"]), "quantizer_state": quantizer_state(names)}})
            for m in state["modes"]
            for names in [_expand(m["quantizers"], _num_layers(model))]
        ],
        "modelopt_version": state.get("modelopt_version"),
    }
    try:
        with quiet():
            model = mto.restore_from_modelopt_state(model, modelopt_state)
    except MegapipeError:
        raise
    except Exception as e:  # noqa: BLE001 - ModelOpt raises several kinds on a mismatched state
        raise MegapipeError(f"{where}: the stored quantizer state does not fit this model ({e})") from None
    return model


LAYER = re.compile(r"^layers\.(\d+)\.")


def _num_layers(model: nn.Module) -> int:
    layers = getattr(model, "layers", None)
    return len(layers) if layers is not None else 0


def _compact(names: dict[str, int], num_layers: int) -> dict[str, int]:
    """``layers.<i>.x`` entries that are alike in every layer become one ``layers.*.x`` entry."""
    out: dict[str, int] = {}
    per_pattern: dict[str, dict[int, int]] = {}
    for name, kind in names.items():
        m = LAYER.match(name)
        if m:
            per_pattern.setdefault(LAYER.sub("layers.*.", name), {})[int(m.group(1))] = kind
        else:
            out[name] = kind
    for pattern, layers in per_pattern.items():
        if len(set(layers.values())) == 1 and sorted(layers) == list(range(num_layers)):
            out[pattern] = next(iter(layers.values()))
        else:
            out.update({pattern.replace("*", str(i), 1): kind for i, kind in layers.items()})
    return dict(sorted(out.items()))


def _expand(names: dict[str, int], num_layers: int) -> dict[str, int]:
    out = {}
    for name, kind in names.items():
        if name.startswith("layers.*."):
            out.update({name.replace("*", str(i), 1): kind for i in range(num_layers)})
        else:
            out[name] = kind
    return out
