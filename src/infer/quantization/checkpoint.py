"""Checkpoints stored quantized: `config.json`'s `quantization_config` read into the method
every linear layer is built with (so its weights are allocated as stored), and the
checkpoint's tensors checked against it before the model is built.

Read:
- HF fine-grained FP8 (`quant_method: "fp8"`, as Qwen3-*-FP8 ship): `fmt: "e4m3"`,
  `activation_scheme: "dynamic"`, `weight_block_size: [128, 128]`; each linear layer's
  `weight` is F8_E4M3 and `weight_scale_inv` holds one float per tile (`fp8_block.py`).
  Without `weight_block_size`, one `weight_scale` per tensor.
- compressed-tensors (`quant_method: "compressed-tensors"`, as llm-compressor writes it),
  one config group targeting `Linear` layers, 8-bit symmetric weights, activations
  quantized dynamically or not at all:
  - `format: "float-quantized"`: FP8 weights, `weight_scale` per channel (`[out, 1]`), per
    tensor (`[1]`) or per tile (`strategy: "block"`, `block_structure`);
  - `format: "int-quantized"`: INT8 weights, `weight_scale` per channel; W8A8 when the
    activations are quantized per token, W8A16 when they are not.
  (FP8 weights are run as `fp8.py` and `fp8_block.py` run them, whatever the group says
  of the activations: dynamic per-token FP8 activations where `fp8.py` quantizes them.)
  A `kv_cache_scheme` of static FP8 scales per tensor brings each attention layer's
  `self_attn.k_scale` and `self_attn.v_scale` (`kv_scales.py`).
Anything else is refused by name (static activation scales, asymmetric or non-8-bit
weights, another KV-cache scheme, another `quant_method`). Layers the config leaves unquantized
(`ignore`, `modules_to_not_convert`) may only be ones that are not linear layers here (the
LM head); a linear layer stored in float is refused when it loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from infer.loader.errors import ModelLoadError
from infer.models.linear import LinearMethod
from infer.quantization.fp8 import Fp8LinearMethod
from infer.quantization.fp8_block import Fp8BlockLinearMethod
from infer.quantization.int8 import Int8W8A8LinearMethod, Int8WeightOnlyLinearMethod
from infer.quantization.kv_scales import KV_SCALE_LEAVES

# (name, safetensors dtype) of the float dtypes a scale may be stored in
FLOAT_DTYPES = ("F32", "BF16", "F16")
# safetensors header of one tensor: (dtype, shape)
Header = tuple[str, list[int]]


@dataclass(frozen=True)
class CheckpointScheme:
    """How a checkpoint stores its linear layers' weights."""

    format: str  # what /v1/models reports: "fp8", "fp8-block", "w8a8-int8" or "int8"
    weight_dtype: str  # the quantized weights' safetensors dtype: "F8_E4M3" or "I8"
    scale_name: str  # the scale tensor beside each quantized `weight`
    scale_kind: str  # "channel", "tensor" or "block"
    block: tuple[int, int] | None
    make_method: Callable[[], LinearMethod]
    kv_scales: bool = False  # each attention layer's KV-cache scales (kv_scales.py)

    def check_tensors(self, headers: dict[str, Header], where: str) -> None:
        """Every quantized weight has its scale, of the shape its layout gives, and every
        scale its weight; with `kv_scales`, every attention layer (a module with a
        `k_proj`) its KV-cache scales, single floats: a `ModelLoadError` naming the tensor
        otherwise."""
        if self.kv_scales:
            _check_kv_scales(headers, where)
        for name, (dtype, shape) in headers.items():
            module, _, leaf = name.rpartition(".")
            if leaf in KV_SCALE_LEAVES or leaf == "kv_scale":
                if not self.kv_scales:
                    raise ModelLoadError(f"{where}: tensor {name!r} is a KV-cache scale, but "
                                         "the quantization_config has no kv_cache_scheme")
                continue
            if leaf == self.scale_name:
                weight = headers.get(f"{module}.weight")
                if weight is None or weight[0] != self.weight_dtype:
                    raise ModelLoadError(f"{where}: scale {name!r} belongs to no "
                                         f"{self.weight_dtype} weight")
                continue
            if leaf in ("input_scale", "weight_zero_point", "input_zero_point"):
                raise ModelLoadError(f"{where}: tensor {name!r}: static activation scales and "
                                     "zero points are not supported (the config says the "
                                     "activations are quantized dynamically, per token)")
            if dtype != self.weight_dtype:
                continue
            if leaf != "weight" or len(shape) != 2:
                raise ModelLoadError(f"{where}: tensor {name!r} is {dtype} {shape}; only the "
                                     f"2-D weights of linear layers are stored quantized")
            scale = headers.get(f"{module}.{self.scale_name}")
            if scale is None:
                raise ModelLoadError(f"{where}: {dtype} weight {name!r} has no scale "
                                     f"({self.scale_name!r})")
            self._check_scale(f"{module}.{self.scale_name}", scale, shape, where)

    def _check_scale(self, name: str, header: Header, weight_shape: list[int], where: str
                     ) -> None:
        dtype, shape = header
        if dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"{where}: scale {name!r} is {dtype}, not a float type")
        out, cols = weight_shape
        if self.scale_kind == "block":
            rows, block_cols = self.block
            allowed = [[-(-out // rows), -(-cols // block_cols)]]
        elif self.scale_kind == "channel":
            allowed = [[out, 1], [out]]
        else:
            allowed = [[], [1]]
        if list(shape) not in allowed:
            raise ModelLoadError(
                f"{where}: scale {name!r} has shape {list(shape)}; a {self.scale_kind} scale "
                f"of a {weight_shape} weight has shape {' or '.join(map(str, allowed))}")


def _check_kv_scales(headers: dict[str, Header], where: str) -> None:
    attention = {name.removesuffix(".k_proj.weight") for name in headers
                 if name.endswith(".k_proj.weight")}
    for module in sorted(attention):
        for leaf in KV_SCALE_LEAVES:
            name = f"{module}.{leaf}"
            if name not in headers:
                raise ModelLoadError(f"{where}: the kv_cache_scheme needs tensor {name!r}, "
                                     "which the checkpoint lacks")
            dtype, shape = headers[name]
            if dtype not in FLOAT_DTYPES or list(shape) not in ([], [1]):
                raise ModelLoadError(f"{where}: KV-cache scale {name!r} is {dtype} "
                                     f"{list(shape)}; it must be one float (shape [] or [1])")
    for name in headers:
        module, _, leaf = name.rpartition(".")
        if leaf == "kv_scale" or (leaf in KV_SCALE_LEAVES and module not in attention):
            raise ModelLoadError(f"{where}: tensor {name!r}: KV-cache scales are read as "
                                 "`self_attn.k_scale` and `self_attn.v_scale` of a layer "
                                 "with a k_proj")


def read_scheme(config: dict[str, Any] | None, where: str) -> CheckpointScheme | None:
    """The scheme of a `quantization_config` (None: the checkpoint is not quantized)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: quantization_config must be an object")
    method = config.get("quant_method")
    if method == "fp8":
        return _hf_fp8(config, where)
    if method == "compressed-tensors":
        return _compressed_tensors(config, where)
    raise ModelLoadError(f"{where}: quantization_config.quant_method {method!r} is not "
                         "supported (supported: 'fp8', 'compressed-tensors')")


def _hf_fp8(config: dict[str, Any], where: str) -> CheckpointScheme:
    if config.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{where}: FP8 format {config.get('fmt')!r} is not supported "
                             "(only e4m3)")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(f"{where}: activation_scheme {config.get('activation_scheme')!r} "
                             "is not supported (only 'dynamic')")
    block = config.get("weight_block_size")
    if block is None:
        return CheckpointScheme("fp8", "F8_E4M3", "weight_scale", "tensor", None,
                                Fp8LinearMethod)
    block = _block(block, "weight_block_size", where)
    return CheckpointScheme("fp8-block", "F8_E4M3", "weight_scale_inv", "block", block,
                            lambda: Fp8BlockLinearMethod(block, "weight_scale_inv"))


def _compressed_tensors(config: dict[str, Any], where: str) -> CheckpointScheme:
    fmt = config.get("format")
    if fmt not in ("float-quantized", "int-quantized", "naive-quantized"):
        raise ModelLoadError(f"{where}: compressed-tensors format {fmt!r} is not supported "
                             "(supported: float-quantized, int-quantized)")
    kv_scales = _kv_cache_scheme(config.get("kv_cache_scheme"), where)
    scheme = _compressed_tensors_weights(config, where)
    return replace(scheme, kv_scales=True) if kv_scales else scheme


def _kv_cache_scheme(kv: Any, where: str) -> bool:
    """Whether a compressed-tensors checkpoint ships KV-cache scales: static FP8 scales, one
    per tensor (a layer's keys, its values), as llm-compressor writes them."""
    if kv is None:
        return False
    if not (isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float"
            and kv.get("strategy") == "tensor" and not kv.get("dynamic", False)
            and kv.get("symmetric", True)):
        raise ModelLoadError(f"{where}: kv_cache_scheme {kv} is not supported (only static "
                             "8-bit float scales per tensor)")
    return True


def _compressed_tensors_weights(config: dict[str, Any], where: str) -> CheckpointScheme:
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ModelLoadError(f"{where}: compressed-tensors config_groups must hold exactly one "
                             "group (mixed schemes are not supported)")
    (name, group), = groups.items()
    if group.get("targets") != ["Linear"]:
        raise ModelLoadError(f"{where}: config group {name!r} targets {group.get('targets')}; "
                             "only ['Linear'] is supported")
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    kind, strategy = weights.get("type"), weights.get("strategy")
    if weights.get("num_bits") != 8 or kind not in ("float", "int") or \
            not weights.get("symmetric", False) or weights.get("dynamic", False):
        raise ModelLoadError(f"{where}: config group {name!r}: weights {weights} are not "
                             "supported (8-bit symmetric int or float, static scales)")
    if acts is not None and (not acts.get("dynamic") or acts.get("num_bits") != 8
                             or acts.get("type", kind) != kind
                             or not acts.get("symmetric", True)):
        raise ModelLoadError(f"{where}: config group {name!r}: input activations {acts} are "
                             "not supported (dynamic, symmetric, 8-bit of the weights' type)")
    if group.get("output_activations") is not None:
        raise ModelLoadError(f"{where}: config group {name!r}: output activations are not "
                             "supported")
    if kind == "int":
        if strategy != "channel":
            raise ModelLoadError(f"{where}: INT8 weights with strategy {strategy!r} are not "
                                 "supported (only 'channel')")
        if acts is None:
            return CheckpointScheme("int8", "I8", "weight_scale", "channel", None,
                                    Int8WeightOnlyLinearMethod)
        return CheckpointScheme("w8a8-int8", "I8", "weight_scale", "channel", None,
                                Int8W8A8LinearMethod)
    if strategy in ("channel", "tensor"):
        return CheckpointScheme("fp8", "F8_E4M3", "weight_scale", strategy, None,
                                Fp8LinearMethod)
    if strategy == "block":
        block = _block(weights.get("block_structure"), "block_structure", where)
        return CheckpointScheme("fp8-block", "F8_E4M3", "weight_scale", "block", block,
                                lambda: Fp8BlockLinearMethod(block, "weight_scale"))
    raise ModelLoadError(f"{where}: FP8 weights with strategy {strategy!r} are not supported "
                         "(supported: channel, tensor, block)")


def _block(value: Any, field: str, where: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and v > 0 for v in value)):
        raise ModelLoadError(f"{where}: {field} must be two positive integers, got {value!r}")
    return value[0], value[1]
