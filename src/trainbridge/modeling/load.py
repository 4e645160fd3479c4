"""Loading the model and processing class a run trains with: ``load_model(args)`` and
``load_processing_class(args)`` (``load_tokenizer``: its tokenizer), the one place the builder
(``trainbridge.loop.build``) gets them from.

In order: the model comes from ``model_init()`` or ``from_pretrained(model_path, **model_kwargs)``
(for a PEFT adapter folder: its base model, then the adapter, trainable); gradient checkpointing is
switched on; ``peft_config`` wraps it with ``peft.get_peft_model``.  All of it happens before the
engine wraps the model (DDP / FSDP2 / DeepSpeed) and builds the optimizer, so only the adapter's
parameters are trainable and held in optimizer state.

Also here, because they need the same loading rules: ``check_model_setup`` (the preflight check of
``peft_config`` against the model's modules, on the meta device) and ``merge_adapter`` (the merged
export: base + adapter folder -> ``merge_and_unload`` -> Hugging Face layout).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainbridge.core.config import ModelKwargs, TrainingArgs, build_peft_config, peft_adapter_base
from trainbridge.modeling import quantization

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from trainbridge.core.config.plan import ModelInit, ScriptData

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
"""PEFT's adapter weights file name."""


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (False when peft is not installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def unwrap_peft(model: Any) -> Any:
    """The transformers model inside a ``PeftModel`` (its LoRA layers injected in place); ``model`` itself
    otherwise.  What the padding-free and attention checks look at."""
    return model.get_base_model() if is_peft_model(model) else model


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.txt", "spiece.model", "tokenizer.model")
"""Files any saved tokenizer has one of."""


def load_processing_class(args: TrainingArgs, script: ScriptData | None = None, items: bool = False) -> Any:
    """The run's processing class, what checkpoints save whole as Trainer's ``save_pretrained`` does.  From
    ``args.resolved_tokenizer_path`` (``tokenizer_path``, else ``model_path``, else an adapter folder's base):
    its multimodal processor (``AutoProcessor``) where the folder saved one (``has_processor``), its image
    processor where it holds only that, else its tokenizer (``AutoTokenizer``); None when the run trains on the
    dataset's items (``items``: ``core.config.loss.trains_on_items``) and the folder holds neither.  Code in the
    folder (an ``auto_map``) runs only with ``model_kwargs.trust_remote_code``.  In place (``script``: the
    script's data), the script's own (``ScriptData.processing_class``)."""
    from transformers import AutoProcessor, AutoTokenizer, ProcessorMixin

    if script is not None:  # in place: the script's own object, as it is
        return script.processing_class
    path = args.resolved_tokenizer_path
    trust = {"trust_remote_code": args.model_kwargs.trust_remote_code}
    folder = Path(str(path))
    has_tokenizer = any((folder / f).is_file() for f in TOKENIZER_FILES)
    image_only = folder.is_dir() and not has_tokenizer and (folder / "preprocessor_config.json").is_file()
    if image_only or (folder.is_dir() and has_processor(folder)):
        processor: Any = AutoProcessor.from_pretrained(str(path), **trust)
        if image_only or isinstance(processor, ProcessorMixin):
            return processor  # a multimodal processor whole; an image model's image processor
    elif folder.is_dir() and items and not has_tokenizer:
        if not (folder / "preprocessor_config.json").is_file():
            return None  # a model saved without a processing class (Trainer needs none): the collator forms batches
    return AutoTokenizer.from_pretrained(path, **trust)


def has_processor(folder: Path) -> bool:
    """Whether ``folder`` holds a saved multimodal processor: its ``processor_config.json``, or (as older
    transformers saved one) a ``preprocessor_config.json`` naming its ``processor_class``."""
    if (folder / "processor_config.json").is_file():
        return True
    try:
        saved = json.loads((folder / "preprocessor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and "processor_class" in saved


def load_tokenizer(args: TrainingArgs, items: bool = False) -> PreTrainedTokenizerBase | None:
    """The tokenizer the run's data is tokenised with: ``text_tokenizer`` of ``load_processing_class``."""
    return cast("PreTrainedTokenizerBase | None", text_tokenizer(load_processing_class(args, items=items)))


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer inside ``processing_class`` (what the loop tokenises and pads with): a multimodal
    processor's (``ProcessorMixin.tokenizer``), else ``processing_class`` itself (a tokenizer, an image
    processor or feature extractor, None).  Checkpoints save ``processing_class`` whole, as Trainer does."""
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin):
        return getattr(processing_class, "tokenizer", None) or processing_class
    return processing_class


def loads_on_rank0_only(args: TrainingArgs, world_size: int, model_init: ModelInit | None = None) -> bool:
    """Whether rank 0 alone reads the weights and the other ranks build a meta-device skeleton
    (``fsdp_load_on_rank0``): FSDP2 with several ranks, a plain ``model_path`` model (no ``model_init``,
    no PEFT adapter or ``peft_config``) loaded with the named ``model_kwargs`` only (an extra
    ``from_pretrained`` keyword -- a quantization config, a config override, a revision -- could make the
    model differ from the one its ``config.json`` builds).  The same answer on every rank."""
    return (
        args.fsdp_load_on_rank0
        and args.distributed_backend == "fsdp"
        and world_size > 1
        and model_init is None
        and args.peft_config is None
        and args.model_path is not None
        and peft_adapter_base(args.model_path) is None
        and not args.model_kwargs.model_extra
        and quantization.saved_quantization(args.model_path) is None
    )


def load_model(args: TrainingArgs, skeleton: bool = False, model_init: ModelInit | None = None) -> PreTrainedModel:
    """The model to train, built in this worker: loaded (or built by ``model_init``), gradient checkpointing on,
    PEFT adapter applied.  Not yet moved to a device or wrapped.  Typed as a ``PreTrainedModel``: a
    ``PeftModel`` offers the same interface the engines and checkpoints use (``save_pretrained``, ``config``).

    ``skeleton`` (ranks other than 0 when ``loads_on_rank0_only``): the same model built from its config
    on the meta device, no weight read; the engine materialises it and fills it from rank 0."""
    if model_init is not None:
        model = call_model_init(model_init)
    else:
        assert args.model_path is not None  # validated: model_path or model_init
        base = peft_adapter_base(args.model_path)
        if skeleton:
            model = build_skeleton(args.model_path, args.model_kwargs)
        elif base is None:
            model = prepare_quantized(load_base_model(args.model_path, args.model_kwargs, args.device), args)
        else:
            model = prepare_quantized(load_base_model(base, args.model_kwargs, args.device), args)
            model = load_adapter(model, args.model_path, trainable=True)
            logger.info("model: base %s with the PEFT adapter of %s (trainable)", base, args.model_path)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model, args.gradient_checkpointing_kwargs)
    if args.peft_config is not None:
        model = apply_peft(model, build_peft_config(args.peft_config))
    if args.requires_grad is not None:
        set_requires_grad(model, args.requires_grad)
    if is_peft_model(model):
        if model.active_peft_config.is_prompt_learning:  # type: ignore[union-attr]
            raise ValueError(
                f"model: a {type(model.active_peft_config).__name__} adapter (prompt learning) is not "
                "supported; use an adapter method (LoRA, DoRA, IA3, ...)"
            )
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        logger.info("PEFT: %d of %d parameters trainable (%.2f%%)", trainable, total, 100.0 * trainable / max(total, 1))
        if trainable == 0:
            raise ValueError("the PEFT model has no trainable parameter (an adapter loaded for inference?)")
    return cast("PreTrainedModel", model)


def set_requires_grad(model: nn.Module, plan: dict[str, bool]) -> None:
    """Each parameter's ``requires_grad`` from ``plan`` (``TrainingArgs.requires_grad``), which must name
    exactly the model's parameters: a model rebuilt from a script's ``save_pretrained`` that lost a change
    made in memory (a replaced or added module) is refused, not trained differently."""
    parameters = dict(model.named_parameters())
    missing, unexpected = sorted(plan.keys() - parameters.keys()), sorted(parameters.keys() - plan.keys())
    if missing or unexpected:
        raise ValueError(
            "requires_grad: the model loaded in the workers does not have the parameters of the model it was "
            f"saved from (missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}): a change made in memory (a replaced or "
            "added module) that save_pretrained does not record; make it part of the model's class or config "
            "so that from_pretrained rebuilds it"
        )
    for name, parameter in parameters.items():
        parameter.requires_grad_(plan[name])


def call_model_init(model_init: Any) -> nn.Module:
    """``model_init()``, or ``model_init(None)`` for Trainer's one-argument ``model_init(trial)``."""
    try:
        required = [
            p
            for p in inspect.signature(model_init).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    model = model_init(None) if len(required) == 1 else model_init()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_init: returned {type(model).__name__}, not a torch model (nn.Module)")
    return model


def model_class(config: Any) -> Any:
    """The class a saved model loads with: the transformers class its ``config.json`` names in
    ``architectures`` (a ``BertForMaskedLM`` stays a masked LM, a T5 an encoder-decoder); remote code
    (``auto_map``) through the Auto class it maps; without ``architectures``, the causal LM of its
    ``model_type``.  A ``ValueError`` names an architecture this transformers does not have."""
    import transformers

    architectures = [str(a) for a in getattr(config, "architectures", None) or []]
    auto_map = getattr(config, "auto_map", None) or {}
    for name in architectures:
        found = getattr(transformers, name, None)
        if isinstance(found, type) and issubclass(found, transformers.PreTrainedModel):
            return found
    for auto_name, target in auto_map.items():
        if auto_name.startswith("AutoModel") and (not architectures or str(target).endswith(architectures[0])):
            return getattr(transformers, auto_name)
    if architectures:
        raise ValueError(
            f"model_path: config.json names architecture {architectures[0]!r}, which transformers "
            f"{transformers.__version__} does not have; upgrade transformers or save the model "
            "with a class it has"
        )
    return transformers.AutoModelForCausalLM


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` (a PEFT model's base) is a causal language model: a class of transformers' causal-LM
    mapping, or remote code mapped as ``AutoModelForCausalLM``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    inner = unwrap_peft(model)
    name = type(inner).__name__
    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    auto_map = getattr(getattr(inner, "config", None), "auto_map", None) or {}
    return name in names or str(auto_map.get("AutoModelForCausalLM", "")).endswith(f".{name}")


def load_base_model(path: Path | str, model_kwargs: ModelKwargs, device: str = "auto") -> PreTrainedModel:
    """``from_pretrained(path, **model_kwargs)`` of the class the folder's config names (``model_class``); a
    quantised model is loaded straight onto this rank's device (``device``: ``TrainingArgs.device``)."""
    from transformers import AutoConfig

    kwargs = model_kwargs.from_pretrained_kwargs()
    kwargs.update(quantized_placement(path, model_kwargs, device))
    # Absolute, so adapter_config.json of every checkpoint names a base model that loads from any folder.
    folder = str(Path(path).resolve())
    config = AutoConfig.from_pretrained(folder, trust_remote_code=model_kwargs.trust_remote_code)
    loaded: Any = model_class(config).from_pretrained(folder, **kwargs)
    return cast("PreTrainedModel", loaded)


def quantized_placement(path: Path | str, model_kwargs: ModelKwargs, device: str) -> dict[str, Any]:
    """``{"device_map": {"": this rank's device}}`` for a quantised model (bitsandbytes quantises where it
    loads, and a quantised model is not moved afterwards); ``{}`` for a plain one."""
    if not (model_kwargs.quantized() or quantization.saved_quantization(path)):
        return {}
    quantization.require_bitsandbytes("a quantized base model (model_kwargs.quantization_config)")
    return {"device_map": {"": quantization.load_device(device)}}


def prepare_quantized(model: nn.Module, args: TrainingArgs) -> nn.Module:
    """A quantised base: ``peft.prepare_model_for_kbit_training`` (frozen, its non-quantised weights in fp32;
    gradient checkpointing is switched on after, as for any model); any other model unchanged."""
    return quantization.prepare_for_training(model) if quantization.is_quantized(model) else model


def load_saved_model(folder: Path | str, **kwargs: Any) -> Any:
    """A saved model folder loaded with the class its config names (``model_class``), ``kwargs`` passed to
    ``from_pretrained``: a saved masked LM comes back a masked LM, never a causal LM."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=bool(kwargs.get("trust_remote_code")))
    return model_class(config).from_pretrained(str(folder), **kwargs)


def from_pretrained_kwargs(model_init_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """trl's ``model_init_kwargs`` as ``from_pretrained`` keyword arguments: a dtype's name (``torch_dtype``
    or ``dtype``, not ``auto``) resolved to the torch dtype, unset (None) ones left out."""
    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.pop("torch_dtype", None) or kwargs.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    return {k: v for k, v in kwargs.items() if v is not None}


def _from_config(cls: Any, config: Any, **kwargs: Any) -> Any:
    """``cls`` built from ``config`` (an Auto class's ``from_config``, a model class's ``_from_config``)."""
    if hasattr(cls, "from_config"):
        return cls.from_config(config, **kwargs)
    kwargs.pop("trust_remote_code", None)  # only the Auto classes take it
    return cls._from_config(config, **kwargs)


def build_skeleton(path: Path | str, model_kwargs: ModelKwargs) -> PreTrainedModel:
    """The model of ``path`` built from its ``config.json`` on the meta device (no weights read, no memory):
    the same classes, parameter names, shapes and dtype as ``load_base_model`` gives, for a rank that
    receives its weights from rank 0 (``parallel.fsdp``)."""
    from transformers import AutoConfig

    kwargs = model_kwargs.from_pretrained_kwargs()
    config = AutoConfig.from_pretrained(str(Path(path).resolve()), trust_remote_code=model_kwargs.trust_remote_code)
    dtype = kwargs.pop("dtype")
    if dtype == "auto":  # as saved, as from_pretrained reads it
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    build_kwargs = {k: kwargs[k] for k in ("attn_implementation", "trust_remote_code") if k in kwargs}
    with torch.device("meta"):
        model = _from_config(
            model_class(config),
            config,
            dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
            **build_kwargs,
        )
    model.eval()  # as from_pretrained returns it
    if model.can_generate():
        from transformers import GenerationConfig

        with contextlib.suppress(OSError):  # as from_pretrained: the saved generation config, if any
            model.generation_config = GenerationConfig.from_pretrained(str(Path(path).resolve()))
    return cast("PreTrainedModel", model)


def load_adapter(base: nn.Module, adapter_dir: Path, trainable: bool) -> nn.Module:
    """``PeftModel.from_pretrained(base, adapter_dir)``, after resizing the base's token embeddings to the
    vocabulary the adapter was saved with (PEFT saves the embeddings of a resized model with the adapter)."""
    from peft import PeftModel

    vocab = saved_vocab_size(adapter_dir)
    embeddings = getattr(base, "get_input_embeddings", lambda: None)()
    if vocab is not None and embeddings is not None and embeddings.weight.shape[0] != vocab:
        logger.info(
            "resizing the base model's token embeddings %d -> %d (saved with the adapter)",
            embeddings.weight.shape[0],
            vocab,
        )
        base.resize_token_embeddings(vocab)  # type: ignore[operator]
    return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)


def saved_vocab_size(adapter_dir: Path) -> int | None:
    """Rows of the input embedding matrix saved in an adapter folder (None when none was saved)."""
    from safetensors import safe_open

    file = Path(adapter_dir) / ADAPTER_WEIGHTS_FILE
    if not file.is_file():
        return None
    with safe_open(str(file), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if (
                key.endswith("embed_tokens.weight")
                or key.endswith("wte.weight")
                or key.endswith("word_embeddings.weight")
            ):
                return int(handle.get_slice(key).get_shape()[0])
    return None


def apply_peft(model: nn.Module, peft_config: Any) -> nn.Module:
    """``peft.get_peft_model(model, peft_config)``; a ``ValueError`` naming ``peft_config`` when it cannot apply
    (e.g. target modules that match nothing)."""
    from peft import get_peft_model

    if is_peft_model(model):
        raise ValueError(
            "peft_config: the model is already a PeftModel (from model_init or an adapter folder); "
            "drop peft_config, or return the base model from model_init"
        )
    try:
        return get_peft_model(model, peft_config)  # type: ignore[arg-type]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"peft_config: cannot be applied to {type(model).__name__}: {exc}") from exc


def enable_gradient_checkpointing(model: Any, kwargs: dict[str, Any]) -> None:
    """``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)``; with reentrant
    checkpointing the inputs are made to require grads (needed when the embeddings are frozen)."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} has no gradient_checkpointing_enable")
    enable(gradient_checkpointing_kwargs=dict(kwargs))
    if kwargs.get("use_reentrant", True) and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = False  # the cache is useless in training and warns with checkpointing


def check_model_setup(args: TrainingArgs, model_init: ModelInit | None = None) -> None:
    """Preflight (parent process): build the model's skeleton on the meta device (no weights read) and apply
    ``peft_config`` to it, so target modules that match nothing fail before launch.  Skipped for
    ``model_init`` (the function may be expensive) and when there is no ``peft_config``."""
    if args.peft_config is None or model_init is not None or args.model_path is None:
        return

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model_path, trust_remote_code=args.model_kwargs.trust_remote_code)
    with torch.device("meta"):
        skeleton = _from_config(model_class(config), config, trust_remote_code=args.model_kwargs.trust_remote_code)
    # get_peft_model fills in defaults (target_modules for known architectures) on the config it gets.
    apply_peft(skeleton, build_peft_config(args.peft_config))


def load_base_for_merge(args: TrainingArgs, model_init: ModelInit | None = None) -> nn.Module:
    """A fresh copy of the run's base model, without adapters, on CPU: from ``model_init`` (a PeftModel it
    returns is unloaded) or from ``model_path`` (an adapter folder's base model), not quantised by
    ``model_kwargs`` (the adapter is merged into the full-precision weights)."""
    if model_init is not None:
        model = call_model_init(model_init)
        return model.unload() if is_peft_model(model) else model  # type: ignore[operator]
    assert args.model_path is not None
    kwargs = args.model_kwargs
    if kwargs.quantized():  # merged into the full-precision weights the quantised base was made from
        plain = {k: v for k, v in kwargs.model_dump().items() if k != "quantization_config"}
        kwargs = ModelKwargs.model_validate(plain)
    return load_base_model(peft_adapter_base(args.model_path) or args.model_path, kwargs)


def merge_adapter(base: nn.Module, adapter_dir: Path, output_dir: Path, dtype: torch.dtype | None = None) -> Path:
    """Apply the adapter of ``adapter_dir`` to ``base``, ``merge_and_unload``, and write the merged model to
    ``output_dir`` with ``save_pretrained`` (Hugging Face layout), in ``dtype`` when given (merged in the
    base's dtype first).  Returns ``output_dir``."""
    model = load_adapter(base, adapter_dir, trainable=False)
    merged = model.merge_and_unload()  # type: ignore[operator]
    if dtype is not None:
        merged = merged.to(dtype)
    merged.save_pretrained(output_dir)
    return output_dir
