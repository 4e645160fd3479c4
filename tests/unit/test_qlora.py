"""Quantised (bitsandbytes 4-bit) base models, in process: loading, the facade's write of a 4-bit PEFT model,
errors before launch, and the packed weights FSDP2 finds."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from pydantic import ValidationError

from trainbridge.modeling import quantization
from trainbridge.modeling.load import load_model
from trainbridge.parallel.fsdp import packed_quantized_weights

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.0}


def four_bit(**kwargs):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32, **kwargs
    )


def test_a_4bit_base_loads_frozen_with_only_the_adapter_trainable(args_for):
    args = args_for(
        device="cpu", peft_config=LORA, gradient_checkpointing=True, model_kwargs={"quantization_config": four_bit()}
    )
    model = load_model(args)
    assert quantization.is_quantized(model) and model.get_base_model().is_loaded_in_4bit
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    packed = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    assert packed and not any(p.requires_grad for p in packed)
    # prepare_model_for_kbit_training: the weights left unquantised (embeddings, norms) are fp32
    assert all(p.dtype == torch.float32 for p in model.parameters() if type(p).__name__ != "Params4bit")
    assert model.get_base_model().is_gradient_checkpointing
    ids = torch.tensor([[1, 5, 9, 12]])
    layouts = [(p.shape, p.dtype) for p in packed]
    model.eval()
    with torch.no_grad():  # bitsandbytes' CPU inference repack stays off: FSDP2 shards the layout loaded
        model(input_ids=ids)
    model.train()
    assert [(p.shape, p.dtype) for p in packed] == layouts
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)


def test_quantized_model_kwargs_are_checked_before_launch(args_for, monkeypatch):
    args_for(peft_config=LORA, model_kwargs={"quantization_config": four_bit()})  # valid on CPU
    with pytest.raises(ValueError, match=r"trains through an adapter .*set peft_config"):
        args_for(model_kwargs={"quantization_config": four_bit()})
    with pytest.raises(ValidationError, match="ZeRO-3"):
        args_for(
            peft_config=LORA,
            model_kwargs={"quantization_config": four_bit()},
            distributed_backend="deepspeed",
            deepspeed_zero_stage=3,
        )
    with pytest.raises(ValidationError, match=r"model_kwargs.load_in_4bit: .*BitsAndBytesConfig\(load_in_4bit=True\)"):
        args_for(peft_config=LORA, model_kwargs={"load_in_4bit": True})
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(ValidationError, match=r"needs bitsandbytes; pip install 'trainbridge\[qlora\]'"):
        args_for(peft_config=LORA, model_kwargs={"quantization_config": four_bit()})


def test_a_missing_bitsandbytes_is_named_with_the_extra_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError("No module named 'bitsandbytes'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    with pytest.raises(ImportError, match=r"optim='adamw_8bit' needs bitsandbytes: pip install 'trainbridge\[qlora\]'"):
        quantization.require_bitsandbytes("optim='adamw_8bit'")


@pytest.mark.parametrize("storage, sharded", [(None, False), (torch.float32, True)])
def test_fsdp2_shards_packed_weights_only_in_float_storage(tiny_llama, storage, sharded):
    from transformers import AutoModelForCausalLM

    extra = {} if storage is None else {"bnb_4bit_quant_storage": storage}
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=four_bit(**extra))
    packed = {p for p in model.parameters() if type(p).__name__ == "Params4bit"}
    assert packed
    found = packed_quantized_weights(model)
    assert set(found) == packed and all(p.is_floating_point() == sharded for p in found)


DEFERRED = """
import sys
from trainbridge.modeling.quantization import defer_bitsandbytes
defer_bitsandbytes()
import transformers.trainer_utils, transformers.optimization, peft  # what a worker imports, peft among it
print("at import:", "bitsandbytes" in sys.modules)
import peft.helpers
if hasattr(peft.helpers, "bnb"):  # peft < 0.22 imports it at the helpers' top: the stand-in imports on first use
    peft.helpers.bnb.functional  # the analysis helper's dequantisation, used
else:  # peft >= 0.22 imports it where it is used
    import peft.tuners.lora.bnb  # peft's k-bit adapter layers, used
print("on use:", "bitsandbytes" in sys.modules)
"""


def test_bitsandbytes_is_imported_only_when_used():
    """peft before 0.22 imports bitsandbytes at its top wherever it is installed (bitsandbytes then warns about
    CPU kernels); after ``defer_bitsandbytes`` it stays unimported until quantised-weight code uses it (a fresh
    interpreter: this one has imported both)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", DEFERRED], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["at import: False", "on use: True"]
