"""PEFT and model customisation: config fields, bad input named before launch, and ``load_model``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.run_inputs import as_run, split_run
from trainbridge.core.config import TrainingArgs, build_peft_config
from trainbridge.demos.tiny_model import build_tiny_llama, write_arithmetic_dataset
from trainbridge.launch.launcher import PreflightError, preflight
from trainbridge.modeling.adapter_state import adapter_key_map, adapter_state_for_model
from trainbridge.modeling.load import load_model

peft = pytest.importorskip("peft")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    return {
        "model": build_tiny_llama(root / "model"),
        "data": write_arithmetic_dataset(root / "train.jsonl", 8, seed=1),
        "root": root,
    }


def args_for(assets, tmp_path, **overrides) -> TrainingArgs:
    values = dict(model_path=assets["model"], data_path=assets["data"], ckpt_output_dir=tmp_path / "out")
    values.update(overrides)
    return split_run(**values)


def errors_of(excinfo) -> str:
    return str(excinfo.value)


# ---------------------------------------------------------------------- config
def test_peft_config_dict_becomes_a_lora_config_and_round_trips_through_yaml(assets, tmp_path):
    args = args_for(assets, tmp_path, peft_config=LORA)
    config = build_peft_config(args.peft_config)  # kept as data, rebuilt where it is applied
    assert isinstance(config, peft.LoraConfig)
    assert config.r == 4 and config.task_type == "CAUSAL_LM"
    path = tmp_path / "run.yaml"
    args.to_yaml(path)
    again = TrainingArgs.from_yaml(path)
    assert again.peft_config == args.peft_config
    assert again.peft_config["r"] == 4 and set(again.peft_config["target_modules"]) == {"q_proj", "v_proj"}


def test_peft_config_object_is_kept_as_its_data(assets, tmp_path):
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    assert build_peft_config(args_for(assets, tmp_path, peft_config=config).peft_config) == config


def test_peft_config_without_peft_installed_names_the_field(assets, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ValidationError) as info:
        args_for(assets, tmp_path, peft_config=LORA)
    assert "peft_config" in errors_of(info) and "pip install 'trainbridge[peft]'" in errors_of(info)


@pytest.mark.parametrize(
    "config, words",
    [
        ({**LORA, "task_type": "SEQ_CLS"}, ["peft_config", "task_type", "CAUSAL_LM"]),
        ({**LORA, "inference_mode": True}, ["peft_config", "inference_mode=True", "nothing would train"]),
        (
            {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 4, "task_type": "CAUSAL_LM"},
            ["peft_config", "PromptTuningConfig", "prompt-learning method, not supported"],
        ),
        ({**LORA, "layers_pattern": "layers"}, ["peft_config", "not a valid peft config", "layers_to_transform"]),
        ({**LORA, "no_such_option": 1}, ["peft_config", "not a valid peft config", "no_such_option"]),
    ],
)
def test_lora_options_that_cannot_combine_fail_naming_the_field(assets, tmp_path, config, words):
    with pytest.raises(ValidationError) as info:
        args_for(assets, tmp_path, peft_config=config)
    for word in words:
        assert word in errors_of(info)


def test_target_modules_matching_nothing_fail_in_preflight_naming_peft_config(assets, tmp_path):
    args = args_for(assets, tmp_path, peft_config={**LORA, "target_modules": ["no_such_proj"]})
    with pytest.raises(PreflightError) as info:
        preflight(*as_run(args))
    assert "peft_config" in errors_of(info) and "no_such_proj" in errors_of(info)
    preflight(*as_run(args_for(assets, tmp_path, peft_config=LORA)))  # a config that applies passes


def test_merge_without_peft_and_stray_checkpointing_kwargs_are_rejected(assets, tmp_path):
    with pytest.raises(ValueError, match="merge_adapter_at_end: needs a PEFT model"):
        args_for(assets, tmp_path, merge_adapter_at_end=True)
    with pytest.raises(ValidationError, match="gradient_checkpointing_kwargs: given but gradient_checkpointing"):
        args_for(assets, tmp_path, gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValidationError, match=r"model_kwargs\.device_map"):
        args_for(assets, tmp_path, model_kwargs={"device_map": "auto"})


def test_model_path_or_model_init_is_required(assets, tmp_path):
    with pytest.raises(ValueError, match="model_path: None; required"):
        split_run(data_path=assets["data"], ckpt_output_dir=tmp_path)
    with pytest.raises(ValueError, match="tokenizer_path: required"):
        split_run(data_path=assets["data"], ckpt_output_dir=tmp_path, model_init=_tiny_model_init)


# ---------------------------------------------------------------------- adapter folders
def save_adapter(assets, directory: Path, resize_to: int | None = None) -> dict[str, torch.Tensor]:
    base = AutoModelForCausalLM.from_pretrained(assets["model"])
    if resize_to is not None:
        base.resize_token_embeddings(resize_to)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    model.save_pretrained(directory)  # as the facade saves an in-memory model
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_adapter_folder_as_model_path_loads_base_and_trainable_adapter(assets, tmp_path):
    params = save_adapter(assets, tmp_path / "adapter")
    args = args_for(assets, tmp_path, model_path=tmp_path / "adapter")
    assert args.resolved_tokenizer_path.resolve() == assets["model"].resolve()  # no tokenizer in the adapter folder
    model = load_model(args)
    assert isinstance(model, peft.PeftModel)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for name, param in model.named_parameters():
        assert torch.equal(param, params[name]), name


def test_resized_embeddings_of_an_in_memory_peft_model_round_trip(assets, tmp_path):
    params = save_adapter(assets, tmp_path / "adapter", resize_to=80)
    assert any("embed_tokens" in k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    model = load_model(args_for(assets, tmp_path, model_path=tmp_path / "adapter"))
    assert model.get_input_embeddings().weight.shape[0] == 80
    for name, param in model.named_parameters():
        assert torch.equal(param, params[name]), name


def test_adapter_folder_whose_base_is_missing_names_model_path(assets, tmp_path):
    save_adapter(assets, tmp_path / "adapter")
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_text(config.read_text().replace(str(assets["model"].resolve()), str(tmp_path / "gone")))
    with pytest.raises(ValidationError) as info:
        args_for(assets, tmp_path, model_path=tmp_path / "adapter")
    message = errors_of(info)
    assert "model_path" in message and "base model" in message and "gone" in message
    assert "base_model_name_or_path" in message


def test_peft_config_with_an_adapter_folder_is_rejected(assets, tmp_path):
    save_adapter(assets, tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"peft_config: model_path .* is already a PEFT adapter folder"):
        args_for(assets, tmp_path, model_path=tmp_path / "adapter", peft_config=LORA)


def test_adapter_key_map_round_trips_peft_saved_weights(assets, tmp_path):
    params = save_adapter(assets, tmp_path / "adapter")
    model = load_model(args_for(assets, tmp_path, peft_config=LORA))
    mapping = adapter_key_map(model)
    assert mapping and all(".default." in v and ".default." not in k for k, v in mapping.items())
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    state = adapter_state_for_model(model, saved)
    model.load_state_dict(state, strict=False)
    for name, param in model.named_parameters():
        if "lora_" in name:
            assert torch.equal(param, params[name]), name
    with pytest.raises(KeyError, match="do not match"):
        adapter_state_for_model(model, {**saved, "base_model.model.extra.lora_A.weight": torch.zeros(1)})


# ---------------------------------------------------------------------- model hooks
def _tiny_model_init():
    from transformers import LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=76, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    )


def _trial_model_init(trial):
    assert trial is None
    return _tiny_model_init()


def test_model_init_builds_the_model_and_peft_applies_on_top(assets, tmp_path):
    args = args_for(
        assets, tmp_path, model_path=None, tokenizer_path=assets["model"], model_init=_tiny_model_init, peft_config=LORA
    )
    model = load_model(args, model_init=_tiny_model_init)
    assert isinstance(model, peft.PeftModel) and model.config.num_hidden_layers == 1
    one_arg = load_model(args_for(assets, tmp_path), model_init=_trial_model_init)
    assert one_arg.config.num_hidden_layers == 1
    by_path = args_for(assets, tmp_path, model_init=f"{__name__}:_tiny_model_init")
    assert by_path.plan.model_init is _tiny_model_init
    with pytest.raises(TypeError, match="model_init: returned str"):
        load_model(args_for(assets, tmp_path), model_init=lambda: "not a model")


def test_model_kwargs_and_gradient_checkpointing_reach_the_model(assets, tmp_path):
    model = load_model(
        args_for(
            assets,
            tmp_path,
            model_kwargs={"dtype": "bfloat16", "attn_implementation": "eager"},
            gradient_checkpointing=True,
            peft_config=LORA,
        )
    )
    base = model.get_base_model()
    assert base.dtype == torch.bfloat16 and base.config._attn_implementation == "eager"
    assert base.is_gradient_checkpointing
    assert load_model(args_for(assets, tmp_path)).dtype == torch.float32  # the default stays fp32
    assert TrainingArgs.model_fields["model_kwargs"].default_factory().trust_remote_code is False


def test_dora_example_builds_its_args_with_and_without_quantize(assets):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "peft_dora" / "dora_finetuning.py"
    spec = importlib.util.spec_from_file_location("dora_finetuning_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    options = example.parse(
        [
            "--base_model",
            str(assets["model"]),
            "--data_path",
            str(assets["data"]),
            "--use_dora",
            "--device",
            "cpu",
            "--val_set_size",
            "0",
        ]
    )
    args = example.training_args(options)
    config = build_peft_config(args.peft_config)
    assert config.use_dora and config.r == 8 and len(config.target_modules) == 7
    if importlib.util.find_spec("bitsandbytes") is not None:  # QDoRA: a 4-bit base, valid on CPU too
        quantized = example.training_args(
            example.parse(
                [
                    "--base_model",
                    str(assets["model"]),
                    "--data_path",
                    str(assets["data"]),
                    "--quantize",
                    "--device",
                    "cpu",
                ]
            )
        )
        assert quantized.model_kwargs.quantized() and quantized.gradient_checkpointing


def test_trainer_gradient_checkpointing_is_carried_over_by_porting(assets, tmp_path):
    import warnings

    from transformers import TrainingArguments

    from trainbridge.hf.porting import training_args_from_hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = TrainingArguments(
            output_dir=str(tmp_path), gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}
        )
        args = training_args_from_hf(hf, model_path=assets["model"], data_path=assets["data"])
    assert args.gradient_checkpointing and args.gradient_checkpointing_kwargs == {"use_reentrant": True}
    assert not training_args_from_hf(
        TrainingArguments(output_dir=str(tmp_path)), model_path=assets["model"], data_path=assets["data"]
    ).gradient_checkpointing


# ---------------------------------------------------------------------- the real loop in process (one rank)
def test_lora_run_in_process_saves_adapters_resumes_exactly_and_merges(assets, tmp_path):
    from trainbridge.callbacks import BestCheckpointTracker, ScheduleCallback
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.loop.build import build_run
    from trainbridge.loop.loop import TrainingLoop

    data = write_arithmetic_dataset(tmp_path / "train.jsonl", 48, seed=1)

    def run(out: str, **overrides):
        args = args_for(
            assets,
            tmp_path,
            data_path=data,
            ckpt_output_dir=tmp_path / out,
            peft_config=LORA,
            max_seq_len=32,
            max_batch_len=64,
            effective_batch_size=8,
            learning_rate=1e-2,
            lr_scheduler="linear",
            max_steps=6,
            save_strategy="steps",
            save_steps=3,
            disable_tqdm=True,
            **overrides,
        )
        loop = TrainingLoop(
            as_run(args).args,
            DistributedEnv(),
            [ScheduleCallback(), BestCheckpointTracker()],
            build_run(*as_run(args), DistributedEnv()),
        )
        return loop, loop.run()

    straight, result = run("straight", merge_adapter_at_end=True)
    assert sorted(p.name for p in (tmp_path / "straight" / "checkpoint-6").glob("adapter_*")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    resumed, again = run("resumed", resume_from_checkpoint=tmp_path / "straight" / "checkpoint-3")
    assert again.resumed_from.endswith("checkpoint-3")
    for (name, a), b in zip(straight.engine.unwrapped.named_parameters(), resumed.engine.unwrapped.parameters()):
        assert torch.equal(a, b), name
    merged = AutoModelForCausalLM.from_pretrained(result.merged_model).eval()
    live = straight.engine.unwrapped.eval()
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, live(input_ids=ids).logits, atol=1e-5)


def test_the_merged_export_is_written_in_checkpoint_weights_dtype(assets, tmp_path):
    from safetensors.torch import load_file

    from trainbridge.callbacks import ScheduleCallback
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.loop.build import build_run
    from trainbridge.loop.loop import TrainingLoop

    args = args_for(
        assets,
        tmp_path,
        peft_config=LORA,
        max_seq_len=32,
        max_batch_len=64,
        effective_batch_size=8,
        max_steps=1,
        save_strategy="no",
        save_final_checkpoint=False,
        disable_tqdm=True,
        merge_adapter_at_end=True,
        checkpoint_weights_dtype="bfloat16",
    )
    result = TrainingLoop(
        as_run(args).args, DistributedEnv(), [ScheduleCallback()], build_run(*as_run(args), DistributedEnv())
    ).run()
    merged = Path(result.merged_model or "")
    assert {t.dtype for t in load_file(merged / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"
