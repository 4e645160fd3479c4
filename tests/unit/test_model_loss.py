"""The model's own loss (``step.model_loss``): any model with a task head trains through the real loop
in-process on Trainer's sample batches, and its checkpoints keep its class."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.run_inputs import as_run, split_run
from trainbridge.callbacks import ScheduleCallback
from trainbridge.core.callback import Callback
from trainbridge.core.config import RunPlan, TrainingArgs
from trainbridge.core.config.loss import ForwardLoss, LossFunction, TokenLoss
from trainbridge.core.context import TrainingContext
from trainbridge.core.distributed import DistributedEnv
from trainbridge.demos.tiny_model import build_tokenizer
from trainbridge.loop.build import build_run, choose_step
from trainbridge.loop.loop import TrainingLoop
from trainbridge.step.model_loss import ModelLoss

BERT = dict(
    vocab_size=80,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


def _save(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def bert_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return _save(BertForSequenceClassification(BertConfig(**BERT, num_labels=2)), tmp_path_factory.mktemp("cls"))


def _classification_rows(path: Path, count: int, seed: int) -> Path:
    """Text starting with 'x' is label 1, with 'y' label 0; an extra ``idx`` column the model does not take."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for i in range(count):
            label = rng.randrange(2)
            text = ("x" if label else "y") + "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 12)))
            handle.write(json.dumps({"text": text, "label": label, "idx": i}) + "\n")
    return path


class Logs(Callback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, context: TrainingContext, logs: dict[str, float], **kwargs: Any) -> None:
        self.logs.append(dict(logs))


def _accuracy(prediction: Any) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def test_sequence_classification_trains_on_its_own_loss_with_compute_metrics(bert_classifier, tmp_path):
    args = split_run(
        model_path=bert_classifier,
        data_path=_classification_rows(tmp_path / "train.jsonl", 64, 1),
        val_data_path=_classification_rows(tmp_path / "val.jsonl", 12, 2),
        ckpt_output_dir=tmp_path / "out",
        effective_batch_size=8,
        per_device_batch_size=4,
        learning_rate=5e-3,
        lr_scheduler="constant",
        num_epochs=3,
        logging_steps=4,
        eval_strategy="epoch",
        save_strategy="epoch",
        disable_tqdm=True,
        compute_metrics=_accuracy,
        max_grad_norm=1.0,
    )
    components = build_run(*as_run(args), DistributedEnv())
    assert isinstance(components.step, ModelLoss)
    assert components.steps_per_epoch == 8  # 64 items / (4 per micro-batch x 2 micro-batches)
    logs = Logs()
    result = TrainingLoop(as_run(args).args, DistributedEnv(), [ScheduleCallback(), logs], components).run()
    assert result.global_step == 24
    evals = [log for log in logs.logs if "eval_loss" in log]
    assert len(evals) == 3 and all("eval_accuracy" in log for log in evals)
    assert evals[-1]["eval_accuracy"] == 1.0 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    train_losses = [log["loss"] for log in logs.logs if "loss" in log]
    assert train_losses[-1] < train_losses[0]
    config = json.loads((tmp_path / "out" / "checkpoint-24" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]


def test_a_batch_holds_what_the_collator_made_of_the_items_minus_unused_columns(bert_classifier, tmp_path):
    seen: list[list[dict[str, Any]]] = []

    def collator(items: list[dict[str, Any]]) -> dict[str, Any]:
        from transformers import DataCollatorWithPadding

        from trainbridge.modeling.load import load_tokenizer

        seen.append(items)
        return DataCollatorWithPadding(load_tokenizer(args))(items)

    args = split_run(
        model_path=bert_classifier,
        data_path=_classification_rows(tmp_path / "train.jsonl", 16, 1),
        ckpt_output_dir=tmp_path / "out",
        effective_batch_size=8,
        per_device_batch_size=2,
        max_steps=2,
        save_strategy="no",
        save_final_checkpoint=False,
        disable_tqdm=True,
        data_collator=collator,
    )
    components = build_run(*as_run(args), DistributedEnv())
    batches = components.step.prepare(components.train_batches.set_epoch(0).steps[0])
    # the next step's first micro-batch is read ahead too, as under Trainer (accelerate's DataLoaderShard)
    assert len(batches.micro_batches) == 4 and len(seen) == 5 and all(len(items) == 2 for items in seen)
    assert set(seen[0][0]) == {"input_ids", "attention_mask", "label"}  # idx removed (not a forward argument)
    # BertForSequenceClassification takes **kwargs: num_items_in_batch counts the step's labels (8 items)
    assert batches.loss_units == 8.0 and batches.micro_units == [2.0] * 4
    assert int(batches.micro_batches[0]["num_items_in_batch"]) == 8


def test_a_model_without_a_loss_is_refused_saying_what_to_do(tmp_path):
    from transformers import BertConfig, BertModel

    folder = _save(BertModel(BertConfig(**BERT)), tmp_path / "bare")
    args = split_run(
        model_path=folder, data_path=_classification_rows(tmp_path / "t.jsonl", 4, 1), ckpt_output_dir=tmp_path / "out"
    )
    with pytest.raises(ValueError, match=r"^model: BertModel is not a causal LM and its forward takes no labels"):
        build_run(*as_run(args), DistributedEnv())


def test_the_saved_class_is_loaded_so_a_masked_lm_never_trains_as_a_causal_lm(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from trainbridge.modeling.load import load_model

    folder = _save(BertForMaskedLM(BertConfig(**BERT)), tmp_path / "mlm")
    args = split_run(
        model_path=folder, data_path=_classification_rows(tmp_path / "t.jsonl", 4, 1), ckpt_output_dir=tmp_path / "out"
    )
    model = load_model(args)
    assert type(model).__name__ == "BertForMaskedLM"
    assert choose_step(model, *as_run(args)) == ("samples", ForwardLoss(), None)
    with pytest.raises(ValueError, match="training_step: 'token_cross_entropy' trains causal LMs"):
        choose_step(model, args.model_copy(update={"training_step": "token_cross_entropy"}), RunPlan())


def test_the_loss_seam_is_chosen_once_at_build_time_from_the_plan_the_field_and_the_model(tmp_path, tiny_llama):
    def fn(model: Any, inputs: Any, **kwargs: Any) -> Any:
        return model(**inputs).loss

    from trainbridge.modeling.load import load_model

    data = _classification_rows(tmp_path / "t.jsonl", 4, 1)
    args = TrainingArgs(model_path=tiny_llama, data_path=data, ckpt_output_dir=tmp_path / "out")
    causal = load_model(args)
    assert choose_step(causal, args, RunPlan()) == ("token_budget", TokenLoss(), None)  # auto: a causal LM
    metrics = RunPlan(loss=TokenLoss(metrics=True))  # SFTTrainer's: trl's metrics travel with the loss
    assert choose_step(causal, args, metrics).loss == TokenLoss(metrics=True)
    assert choose_step(causal, args, RunPlan(loss=LossFunction(fn))) == ("samples", LossFunction(fn), None)
    named = args.model_copy(update={"training_step": "model_loss"})  # the user-facing field names a seam
    assert choose_step(causal, named, RunPlan()) == ("samples", ForwardLoss(), None)
    assert choose_step(causal, args, RunPlan(loss=ForwardLoss(), train_stream=[])).batches == "stream"
    with pytest.raises(ValueError, match=r"training_step: 'model_loss' trains on .* TokenLoss"):
        choose_step(causal, named, metrics)


def _train(args: TrainingArgs) -> tuple[Any, list[float]]:
    components = build_run(*as_run(args), DistributedEnv())
    assert isinstance(components.step, ModelLoss)
    logs = Logs()
    result = TrainingLoop(as_run(args).args, DistributedEnv(), [ScheduleCallback(), logs], components).run()
    return result, [log["loss"] for log in logs.logs if "loss" in log]


def _args(model: Path, data: Path, out: Path, **overrides: Any) -> TrainingArgs:
    values: dict[str, Any] = dict(
        model_path=model,
        data_path=data,
        ckpt_output_dir=out,
        effective_batch_size=8,
        per_device_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler="constant",
        max_steps=16,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    values.update(overrides)
    return split_run(**values)


def test_masked_lm_trains_on_the_masked_lm_loss_with_its_collator(tmp_path):
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

    folder = tmp_path / "mlm"
    BertForMaskedLM(BertConfig(**BERT)).save_pretrained(folder)
    tokenizer = build_tokenizer(folder)
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    tokenizer.save_pretrained(folder)
    data = tmp_path / "train.jsonl"
    rng = random.Random(0)
    data.write_text(
        "".join(
            json.dumps({"text": "abcdefgh" * 2 if rng.random() < 0.5 else "hgfedcba" * 2}) + "\n" for _ in range(64)
        )
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.3)
    result, losses = _train(_args(folder, data, tmp_path / "out", data_collator=collator))
    assert result.global_step == 16
    # the masked-LM loss over an 80-token vocabulary starts near ln(80) = 4.4 (a causal loss on this
    # repetitive text would start far lower), and falls
    assert losses[0] > 3.0 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    config = json.loads((tmp_path / "out" / "checkpoint-16" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]


def _t5_folder(folder: Path) -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=80,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        pad_token_id=0,
        decoder_start_token_id=0,
        eos_token_id=2,
    )
    model = T5ForConditionalGeneration(config)
    model.save_pretrained(folder)
    return model, build_tokenizer(folder)


def _reverse_rows(path: Path, count: int) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        source = [rng.randrange(4, 40) for _ in range(rng.randrange(3, 9))]
        rows.append(json.dumps({"input_ids": source, "labels": [t + 1 for t in reversed(source)]}) + "\n")
    path.write_text("".join(rows))
    return path


def test_t5_like_encoder_decoder_trains_on_its_seq2seq_loss(tmp_path):
    from transformers import DataCollatorForSeq2Seq

    folder = tmp_path / "t5"
    model, tokenizer = _t5_folder(folder)
    data = _reverse_rows(tmp_path / "train.jsonl", 64)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    result, losses = _train(_args(folder, data, tmp_path / "out", data_collator=collator))
    assert result.global_step == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    saved = json.loads((tmp_path / "out" / "checkpoint-16" / "config.json").read_text())
    assert saved["architectures"] == ["T5ForConditionalGeneration"]


def test_a_compute_loss_trains_and_evaluations_generate_with_the_models_own_loss(tmp_path):
    """``compute_loss`` with ``predict_with_generate`` (issue 39 item 4; refused before): the function's loss
    trains (the model's plus 100: the same gradients, every logged loss 200 more), and each evaluation gives
    ``compute_metrics`` generated ids with the model's own loss, as ``Seq2SeqTrainer.prediction_step``."""
    from transformers import DataCollatorForSeq2Seq

    folder = tmp_path / "t5"
    model, tokenizer = _t5_folder(folder)
    data, val = _reverse_rows(tmp_path / "train.jsonl", 16), _reverse_rows(tmp_path / "val.jsonl", 4)

    def offset(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        outputs = model(**inputs)
        return (outputs.loss + 100, outputs) if return_outputs else outputs.loss + 100

    runs = {}
    for name, code in (("plain", {}), ("offset", {"loss": LossFunction(offset)})):
        seen: list[Any] = []
        args = _args(
            folder,
            data,
            tmp_path / name,
            max_steps=4,
            val_data_path=val,
            eval_strategy="steps",
            eval_steps=2,
            predict_with_generate=True,
            generation_kwargs={"max_length": 6},
            compute_metrics=lambda p, seen=seen: seen.append(p) or {},  # type: ignore[func-returns-value]
            data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
            **code,
        )
        components = build_run(*as_run(args), DistributedEnv())
        logs = Logs()
        TrainingLoop(as_run(args).args, DistributedEnv(), [ScheduleCallback(), logs], components).run()
        runs[name] = (logs.logs, seen, type(components.step).__name__)
    (plain, plain_seen, _), (custom, seen, step) = runs["plain"], runs["offset"]
    assert step == "CustomLoss"
    losses = [(log["loss"], plain_log["loss"]) for log, plain_log in zip(custom, plain, strict=True) if "loss" in log]
    # 100 per micro-batch, two a step: the loss taken over the step's items, as Trainer's with num_items_in_batch
    assert len(losses) == 4 and all(ours == pytest.approx(theirs + 200, rel=1e-6) for ours, theirs in losses)
    evals = [(log["eval_loss"], plain_log["eval_loss"]) for log, plain_log in zip(custom, plain) if "eval_loss" in log]
    assert len(evals) == 2 and all(ours == pytest.approx(theirs, rel=1e-6) for ours, theirs in evals)
    for prediction, plain_prediction in zip(seen, plain_seen, strict=True):
        assert prediction.predictions.dtype.kind == "i"  # generated ids (max_length 6, padded to the config's 20)
        assert (prediction.predictions[:, 6:] == 0).all()
        np.testing.assert_array_equal(prediction.predictions, plain_prediction.predictions)


def test_image_classification_trains_on_pixel_values_with_its_image_processor(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    folder = tmp_path / "vit"
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
    )
    ViTForImageClassification(config).save_pretrained(folder)
    ViTImageProcessor(size={"height": 8, "width": 8}).save_pretrained(folder)
    data = tmp_path / "train.jsonl"
    rng = random.Random(0)
    rows = []
    for _ in range(64):
        label = rng.randrange(2)
        pixels = [
            [[(1.0 if label else -1.0) + rng.gauss(0, 0.3) for _ in range(8)] for _ in range(8)] for _ in range(3)
        ]
        rows.append(json.dumps({"pixel_values": pixels, "label": label}) + "\n")
    data.write_text("".join(rows))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(rows[:12]))
    result, losses = _train(
        _args(
            folder,
            data,
            tmp_path / "out",
            val_data_path=val,
            eval_strategy="steps",
            eval_steps=8,
            compute_metrics=_accuracy,
        )
    )
    assert result.global_step == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    assert result.final_eval_loss is not None
    checkpoint = tmp_path / "out" / "checkpoint-16"
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["ViTForImageClassification"]
    assert (checkpoint / "preprocessor_config.json").is_file()


def test_the_generation_cache_never_counts_as_logits_as_in_trainers_prediction_step():
    """A causal LM's eval outputs carry its cache (``cache`` in transformers 5.2x, ``past_key_values`` before); with
    no ``keys_to_ignore_at_inference`` on the config, Trainer drops it, so the logits are one tensor, as
    ``preprocess_logits_for_metrics(logits, labels)`` expects."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainbridge.step.model_loss import inference_ignore_keys, predictions_of

    config = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        outputs = model(input_ids=ids, labels=ids, use_cache=True)
    logits = predictions_of(outputs, inference_ignore_keys(model.config))
    assert isinstance(logits, torch.Tensor) and logits.shape == (1, 4, 40)
    config.keys_to_ignore_at_inference = []  # a config that keeps everything: as Trainer, nothing is dropped
    assert inference_ignore_keys(config) == []
