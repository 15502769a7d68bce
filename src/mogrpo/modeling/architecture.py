"""What a decoder is made of, read from its own module tree built on the meta device.

No list of field names per architecture: the sizes come from the config class's standard names
(its `attribute_map` turns GPT-2's `n_embd` into `hidden_size`) and from the model that
transformers builds for the config — on the meta device, so no weight is allocated. Its linear
layers (`nn.Linear` and transformers' `Conv1D`) are counted with their shapes, which shows
fused QKV (GPT-2's `c_attn`, Phi-3's `qkv_proj`, GPT-NeoX's `query_key_value`), gated or plain
MLPs, multi-query / grouped attention, and tied embeddings as they are.

The same tree answers which modules LoRA would wrap (peft's matching rules), so a wrong
`lora.target_modules` is reported before any weight loads, with the names the model does have.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mogrpo.errors import ConfigError, ModelError

log = logging.getLogger(__name__)

ROLES = ("attn_in", "attn_out", "mlp_in", "mlp_out", "other")
"""Where a linear layer sits: attention input (q, k, v or fused qkv) / output projection, MLP
input (gate, up, fc1, fused gate_up) / output projection, or outside the decoder blocks."""
_ATTN_OUT = re.compile(r"o_proj|out_proj|dense|c_proj|wo|o|out|proj|output")
_MLP_OUT = re.compile(r"down_proj|fc2|c_proj|dense_4h_to_h|w2|wo|proj|output")
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class LinearLayer:
    """One linear layer (or Conv1D) of the model."""

    name: str
    """Full module name, as peft matches it (`model.layers.0.self_attn.q_proj`)."""
    in_features: int
    out_features: int
    role: str
    """One of `ROLES`, or `head` / `embedding`."""
    layer: int | None = None
    """The decoder block it belongs to (None outside the blocks)."""
    conv1d: bool = False
    """transformers' Conv1D (GPT-2): a linear layer stored transposed (peft's fan_in_fan_out)."""

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class ModuleTree:
    """The modules of a model that LoRA can wrap, and every module name."""

    model_type: str
    linears: tuple[LinearLayer, ...]
    """Every linear layer except the output head, in module order."""
    head: LinearLayer | None
    """The output head (peft's all-linear leaves it out)."""
    embeddings: tuple[LinearLayer, ...]
    """Embedding tables as (num_embeddings → dim): LoRA may target them by name too."""
    module_names: tuple[str, ...]
    """Every module name (what `lora.target_modules` is matched against)."""

    def linear_names(self) -> list[str]:
        """The distinct last names of the linear layers (what `target_modules` usually lists)."""
        return sorted({lin.leaf for lin in self.linears})

    @classmethod
    def from_model(cls, model: Any, roles: bool = False) -> ModuleTree:
        """From a built model (real or meta; a peft model's base); `roles`: find each linear
        layer's block and role (the planner needs them, a LoRA check does not)."""
        import torch

        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        config = model.config.get_text_config()
        head_module = model.get_output_embeddings()
        head = next((n for n, m in model.named_modules() if m is head_module), None)
        blocks = _decoder_blocks(model, config.num_hidden_layers) if roles else None
        return cls(
            model_type=config.model_type,
            linears=tuple(_linear_layers(model, blocks, config.hidden_size, head)),
            head=LinearLayer(head, *_shape(head_module), "head") if head else None,
            embeddings=tuple(LinearLayer(n, m.num_embeddings, m.embedding_dim, "embedding")
                             for n, m in model.named_modules()
                             if isinstance(m, torch.nn.Embedding)),
            module_names=tuple(n for n, _ in model.named_modules() if n))


@dataclass(frozen=True)
class Architecture:
    """The sizes of a decoder that memory depends on, and its modules."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated_mlp: bool
    """SwiGLU/GeGLU (gate × up, two inputs of `intermediate`) rather than fc1 → act → fc2."""
    vocab: int
    tied: bool
    params: int
    """Every parameter of the model (a tied embedding counted once)."""
    block_params: int
    """The parameters of one decoder block (norms and biases included); the rest
    (`params - layers * block_params`) are the embeddings, the head and the final norm."""
    rms_norms: int
    """RMSNorms per block (HF's upcast to fp32 and keep their input)."""
    layer_norms: int
    """LayerNorms per block (keep their input in the activation dtype)."""
    activation: str
    """What a plain MLP's activation keeps: `input` (a fused GELU/SiLU), `output` (ReLU: the
    output, which is also the down projection's input) or `gelu_new` (GPT-2's GELU built from
    elementary ops: its input, tanh, 0.5·x and 1 + tanh)."""
    fused_qkv_view: bool
    """q, k, v come out of one fused layer and q, k are rotated: v is a view of the fused
    output, which therefore stays alive whole (Phi-3, GPT-NeoX)."""
    attention: str
    """The attention implementation transformers picks for this model by default (Gemma2:
    `eager`, for its logit soft-capping; most: `sdpa`)."""
    softcap: bool
    """Attention logits soft-capped (tanh): eager attention keeps one more s×s tensor."""
    modules: ModuleTree
    """The linear layers (with their roles), head, embeddings and module names."""

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def block(self, layer: int = 0) -> list[LinearLayer]:
        """The linear layers of one decoder block (block 0 stands for all)."""
        return [lin for lin in self.modules.linears if lin.layer == layer]

    def linear_params(self) -> int:
        """Weights of every linear layer but the head (what 4-bit loading quantises)."""
        return sum(lin.in_features * lin.out_features for lin in self.modules.linears)

    def embedding_params(self) -> int:
        """Weights of the embedding tables and of an untied head (the matrices besides the
        linear layers); the rest of `params` are 1-D: norms and biases."""
        head = self.modules.head
        untied = head.in_features * head.out_features if head and not self.tied else 0
        return untied + sum(e.in_features * e.out_features for e in self.modules.embeddings)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, *,
                    trust_remote_code: bool = False) -> Architecture:
        """From a transformers config or a config.json dict; the model is built on meta.

        Cached per config: the memory ladder estimates one model many times."""
        key = (json.dumps(dict(config) if isinstance(config, Mapping) else config.to_dict(),
                          sort_keys=True, default=str), trust_remote_code)
        if key not in _CACHE:
            _CACHE[key] = cls.from_model(meta_model(config, trust_remote_code=trust_remote_code))
        return _CACHE[key]

    @classmethod
    def from_model(cls, model: Any) -> Architecture:
        """From a built model (real or on the meta device); a peft model's base is read."""
        import torch

        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        config = model.config.get_text_config()
        _refuse_moe(config)
        hidden = config.hidden_size
        tree = ModuleTree.from_model(model, roles=True)
        if tree.head is None:
            raise ModelError(f"{type(model).__name__} has no output head; the memory planner "
                             "covers causal language models")
        first = {role: [x for x in tree.linears if x.role == role and x.layer == 0]
                 for role in ROLES}
        q_dim = first["attn_out"][0].in_features
        kv_total = sum(x.out_features for x in first["attn_in"]) - q_dim
        intermediate = first["mlp_out"][0].in_features
        mlp_width = sum(x.out_features for x in first["mlp_in"])
        heads = config.num_attention_heads
        if kv_total <= 0 or kv_total % 2 or q_dim % heads or mlp_width not in (
                intermediate, 2 * intermediate):
            shapes = ", ".join(f"{x.leaf} {x.in_features}→{x.out_features}"
                               for x in tree.linears[:8])
            raise ModelError(
                f"cannot read the attention/MLP shape of {config.model_type!r} from its layers "
                f"({shapes}); the memory planner covers decoders with q/k/v (or fused qkv), an "
                "output projection and a plain or gated MLP")
        head_dim = q_dim // heads
        block = model.get_submodule(f"{_decoder_blocks(model, config.num_hidden_layers)}.0")
        norms = [m for m in block.modules() if type(m).__name__.endswith("Norm")
                 and getattr(getattr(m, "weight", None), "shape", (0,))[-1] == hidden]
        layer_norms = sum(isinstance(m, torch.nn.LayerNorm) for m in norms)
        kinds = {type(m).__name__ for m in block.modules()}
        rotary = any("Rotary" in type(m).__name__ for m in model.modules())
        return cls(
            model_type=config.model_type, hidden=hidden, layers=config.num_hidden_layers,
            heads=heads, kv_heads=kv_total // 2 // head_dim, head_dim=head_dim,
            intermediate=intermediate, gated_mlp=mlp_width == 2 * intermediate,
            vocab=tree.head.out_features,
            tied=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            params=sum(p.numel() for p in model.parameters()),
            block_params=sum(p.numel() for p in block.parameters()),
            rms_norms=len(norms) - layer_norms, layer_norms=layer_norms,
            activation="output" if "ReLU" in kinds else "gelu_new" if "NewGELUActivation" in kinds
            else "input",
            fused_qkv_view=len(first["attn_in"]) == 1 and rotary,
            attention=getattr(model.config, "_attn_implementation", None) or "sdpa",
            softcap=bool(getattr(config, "attn_logit_softcapping", None)), modules=tree)


_CACHE: dict[tuple[str, bool], Architecture] = {}


def transformers_config(data: Mapping[str, Any]) -> Any:
    """The transformers config class instance for a config.json dict (its attribute map applies)."""
    from transformers import AutoConfig

    fields = dict(data)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ModelError("the model config has no model_type; the memory planner reads the shape "
                         "through the config class of that model_type (save the config with "
                         "transformers' save_pretrained)")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as err:
        raise ModelError(
            f"model_type {model_type!r} is unknown to this transformers ({err}); upgrade "
            "transformers, or set model.trust_remote_code: true for a model that ships its code"
        ) from None


def meta_model(config: Mapping[str, Any] | Any, *, trust_remote_code: bool = False) -> Any:
    """The causal LM transformers builds for `config`, on the meta device (no memory used)."""
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(config, Mapping):
        config = transformers_config(config)
    else:
        config = copy.deepcopy(config)  # building may set fields (attention implementation)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - any model code may fail on meta; say which model
        raise ModelError(f"cannot build the {config.model_type!r} model from its config to read "
                         f"its shape ({type(err).__name__}: {err})") from None


def _refuse_moe(config: Mapping[str, Any] | Any) -> None:
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    if any(isinstance(get(k), int) and get(k) > 1 for k in _MOE_KEYS):
        raise ModelError("mixture-of-experts models are not modelled by the memory planner yet; "
                         "it covers dense decoders (Llama, Qwen2, Mistral, Gemma, Phi-3, GPT-2, "
                         "OPT, GPT-NeoX, Falcon, …)")


def _decoder_blocks(model: Any, layers: int) -> str:
    """The name of the ModuleList of `layers` decoder blocks (a vision tower's is skipped)."""
    import torch

    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.ModuleList) and len(module) == layers
                and not re.search(r"vision|visual|audio", name)):
            return name
    raise ModelError(f"cannot find the {layers} decoder blocks of {type(model).__name__} "
                     "(no list of num_hidden_layers modules); the memory planner covers decoders")


def _shape(module: Any) -> tuple[int, int]:
    """(in, out) features of an nn.Linear (weight [out, in]) or a Conv1D (weight [in, out])."""
    from transformers.pytorch_utils import Conv1D

    rows, cols = module.weight.shape
    return (rows, cols) if isinstance(module, Conv1D) else (cols, rows)


def _linear_layers(model: Any, blocks: str | None, hidden: int,
                   head: str | None) -> list[LinearLayer]:
    """Every nn.Linear / Conv1D but the head, each with its block and role in the block (all
    `other` when `blocks`, the name of the blocks' list, is None)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    found = [(name, module) for name, module in model.named_modules()
             if name != head and isinstance(module, torch.nn.Linear | Conv1D)]
    by_block: dict[int, list[tuple[str, int, int]]] = {}
    for name, module in found:
        match = blocks is not None and re.match(rf"{re.escape(blocks)}\.(\d+)\.", name)
        if match:
            by_block.setdefault(int(match[1]), []).append((name, *_shape(module)))
    roles: dict[str, tuple[str, int]] = {}
    for layer, items in by_block.items():
        prefix = f"{blocks}.{layer}."
        roles |= {n: (role, layer) for n, role in _block_roles(prefix, items, hidden).items()}
    return [LinearLayer(name, *_shape(module), *roles.get(name, ("other", None)),
                        conv1d=isinstance(module, Conv1D)) for name, module in found]


def _block_roles(prefix: str, items: list[tuple[str, int, int]], hidden: int) -> dict[str, str]:
    """attn_in / attn_out / mlp_in / mlp_out for the linear layers of one block."""
    rel = {n: n[len(prefix):] for n, *_ in items}
    attn = [x for x in items if re.search(r"attn|attention", rel[x[0]], re.I)]
    mlp = [x for x in items if x not in attn]
    if not attn or not mlp:
        raise ModelError(f"cannot tell the attention from the MLP layers in {prefix.rstrip('.')} "
                         f"({', '.join(rel.values())}); the memory planner covers decoders whose "
                         "attention module is named *attn* or *attention*")
    # the attention output maps to hidden; the MLP output maps the intermediate width to hidden
    attn_out = _output(attn, _ATTN_OUT, rel, lambda x: x[2] == hidden)
    mlp_out = _output(mlp, _MLP_OUT, rel, lambda x: x[2] == hidden and x[1] != hidden)
    roles = {x[0]: "attn_in" for x in attn} | {x[0]: "mlp_in" for x in mlp}
    return roles | {attn_out: "attn_out", mlp_out: "mlp_out"}


def _output(items: list[tuple[str, int, int]], names: re.Pattern, rel: dict[str, str],
            fits: Any) -> str:
    """The output projection: the one layer of its shape, else by name, else the last one."""
    candidates = [x for x in items if fits(x)] or items
    if len(candidates) > 1:  # e.g. q_proj and o_proj are both hidden → hidden
        candidates = [x for x in candidates
                      if names.fullmatch(rel[x[0]].rsplit(".", 1)[-1])] or candidates
    return candidates[-1][0]


def lora_targets(tree: ModuleTree, target_modules: list[str] | str,
                 field: str = "lora.target_modules") -> list[LinearLayer]:
    """The linear layers LoRA wraps for `target_modules`, by peft's rules.

    `all-linear`: every linear layer but the output head. A string: a regular expression
    matched against the full module name. A list: names matched exactly or as the end of a
    module name (`q_proj` matches `model.layers.0.self_attn.q_proj`). Every listed name must
    match a linear layer, else a ConfigError names the field and the names the model has.
    """
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        return list(tree.linears)
    if isinstance(target_modules, str):
        chosen = {n for n in tree.module_names if re.fullmatch(target_modules, n)}
        unknown = [] if chosen else [target_modules]
    else:
        chosen, unknown = set(), []
        for target in target_modules:
            hits = {n for n in tree.module_names if n == target or n.endswith(f".{target}")}
            chosen |= hits
            if not hits:
                unknown.append(target)
    heads = (tree.head,) if tree.head else ()
    wrappable = {lin.name: lin for lin in (*tree.linears, *heads, *tree.embeddings)}
    not_linear = sorted(n for n in chosen if n not in wrappable)
    if unknown or not_linear:
        if isinstance(target_modules, str) and unknown:
            what = f"the pattern matches no module name of this {tree.model_type} model"
        elif unknown:
            what = f"no module of this {tree.model_type} model is named {', '.join(unknown)}"
        else:
            what = f"{not_linear[0]} is not a linear layer"
        raise ConfigError(
            f"{field} = {target_modules!r}: {what}; its linear layers are "
            f"{', '.join(tree.linear_names())} (or use all-linear, the default)")
    return [lin for name, lin in wrappable.items() if name in chosen]


def check_lora_targets(config: Any, target_modules: list[str] | str, *,
                       trust_remote_code: bool = False) -> list[LinearLayer] | None:
    """Validate `lora.target_modules` against the model `config` describes, before any weight
    loads (its module tree is built on the meta device). None when the tree cannot be built
    here (peft then checks the names after loading)."""
    try:
        tree = ModuleTree.from_model(meta_model(config, trust_remote_code=trust_remote_code))
    except ModelError as err:  # an early courtesy: peft still checks the names after loading
        log.debug("LoRA targets not checked before loading: %s", err)
        return None
    return lora_targets(tree, target_modules)
