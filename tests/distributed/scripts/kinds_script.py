"""Script kinds not tried before, each in a public example's style (used by tests/distributed/test_script_kinds.py).

``python|torchrun kinds_script.py OUT KIND[,KIND...] [real]``: each kind is trained in turn in the same processes
(one launch), into ``OUT/<KIND>``; rank 0 writes ``OUT/<KIND>/summary.json``.  ``real`` uses transformers.Trainer
(the reference).  Tiny models from configs, data made here (nothing is downloaded).
- ``hpsearch``: transformers' hyperparameter-search recipe: ``model_init(trial)`` (a tiny BERT classifier),
  ``compute_metrics`` (accuracy), ``trainer.hyperparameter_search(backend="optuna", hp_space=...,
  direction="maximize", n_trials=3)`` with a seeded sampler; every trial is a ``train()`` on a fresh model, its
  checkpoints under ``OUT/hpsearch/run-<n>``.
- ``deepspeed``: a causal LM with transformers' published ``ds_config_zero3.json`` (ZeRO-3, parameters and
  optimizer offloaded to CPU, the JSON's AdamW and WarmupDecayLR, ``"auto"`` everywhere) as ``deepspeed=``;
  ``dsscheduler``: a ZeRO-2 JSON naming only its scheduler (Trainer's optimizer under DeepSpeed's WarmupLR).
- ``images``: run_image_classification.py in small: PIL images, ``set_transform`` drawing a random crop and flip
  on every access, its ``collate_fn``, a tiny ViT, ``dataloader_num_workers=2``.
- ``detection``: run_object_detection.py's shape: DETR-style segmentation labels (a dict of classes, boxes and
  masks per image) kept as lists by its ``collate_fn``, ``compute_metrics`` over per-batch lists
  (``eval_do_concat_batches=False``).
- ``audio``: run_audio_classification.py in small: WAV bytes decoded on every access, a random window each time.
- ``twotower``: run_clip.py in small: a CLIP dual encoder's contrastive loss, ``return_loss=True``, no labels.
- ``vlm``: vision-language SFT: a LLaVA model, a collator placing image tokens and masking the prompt.
- ``vlmdpo``: vision-language DPO: trl's ``DPOTrainer`` (ours: ``from trainbridge import DPOTrainer``) on a LLaVA
  model with a ``LlavaProcessor``, images with conversational preference rows.
- ``fsdp``: a causal LM with ``fsdp="full_shard auto_wrap"`` and an ``fsdp_config`` (wrapped class, activation
  checkpointing, CPU offload).
"""

from __future__ import annotations

import io
import json
import os
import random
import sys
import time
import wave
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
from accelerate.state import AcceleratorState
from PIL import Image
from torch.distributed.fsdp import FSDPModule
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BertForSequenceClassification,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPVisionConfig,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PretrainedConfig,
    PreTrainedModel,
    TrainerCallback,
    TrainingArguments,
    ViTConfig,
    ViTForImageClassification,
    Wav2Vec2Config,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2ForSequenceClassification,
)
from transformers.integrations.deepspeed import unset_hf_deepspeed_config
from transformers.utils import ModelOutput

if "real" in sys.argv[3:]:
    from transformers import Trainer
    from trl import DPOTrainer
else:
    from trainbridge import DPOTrainer, Trainer

from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama_once, tiny_bert_config

REAL = "real" in sys.argv[3:]
root = Path(sys.argv[1])
model_dir = root.parent / "tiny-model"
build_tiny_llama_once(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)


def common(out: Path, **fields) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out), report_to="none", use_cpu=True, seed=3, disable_tqdm=True, logging_steps=2, **fields
    )


def summary_of(trainer, out: Path, **extra) -> dict:
    history = trainer.state.log_history
    last = out / f"checkpoint-{trainer.state.global_step}"
    return {
        "global_step": trainer.state.global_step,
        "loss_steps": [e["step"] for e in history if "loss" in e],
        "log_keys": sorted({k for e in history for k in e}),
        "losses": [e["loss"] for e in history if "loss" in e],
        "eval_steps": [e["step"] for e in history if "eval_loss" in e],
        "checkpoints": sorted(str(p.relative_to(out)) for p in out.rglob("checkpoint-*") if p.is_dir()),
        "checkpoint_files": sorted(p.name for p in last.iterdir()) if last.is_dir() else [],
        **extra,
    }


# ============================================================ hpsearch
def classification_rows(n: int, seed: int) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n).tolist()
    texts = [("x" if label else "y") + "".join(rng.choice(list("abcdefgh"), rng.integers(3, 12))) for label in labels]
    data = datasets.Dataset.from_dict({"sentence": texts, "label": labels})
    return data.map(lambda b: tokenizer(b["sentence"]), batched=True, remove_columns=["sentence"])


def hpsearch(out: Path) -> dict:
    import optuna

    def model_init(trial):
        config = tiny_bert_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, hidden_dropout_prob=0.0)
        return BertForSequenceClassification(config)

    def accuracy(eval_pred):
        predictions, labels = eval_pred
        return {"accuracy": float((np.argmax(predictions, axis=-1) == labels).mean())}

    values: dict[int, dict] = {}

    def hp_space(trial):  # rank 0's trials (the other ranks train the values it broadcasts)
        space = {
            "learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True),
            "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [4, 8]),
        }
        values[trial.number] = space
        return space

    trials: list[dict] = []

    def objective(metrics):  # the default's objective (the sum of the metrics), recorded per trial
        trials.append({k: metrics[k] for k in ("eval_loss", "eval_accuracy")})
        return metrics["eval_accuracy"]

    args = common(out, num_train_epochs=2, eval_strategy="epoch", save_strategy="epoch", save_total_limit=1)
    trainer = Trainer(
        model_init=model_init,
        args=args,
        train_dataset=classification_rows(48, 1),
        eval_dataset=classification_rows(21, 2),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    best = trainer.hyperparameter_search(
        hp_space=hp_space,
        compute_objective=objective,
        direction="maximize",
        backend="optuna",
        n_trials=3,
        sampler=optuna.samplers.RandomSampler(seed=5),
    )
    extra = {
        "best": None if best is None else best.hyperparameters,
        "trials": trials,
        "trial_values": [values[n] for n in sorted(values)],
    }
    return summary_of(trainer, out, **extra)


# ============================================================ deepspeed: a published recipe's JSON
DS_ZERO3_OFFLOAD = {  # transformers' docs' ds_config_zero3.json
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
            "warmup_type": "linear",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


class Engine(TrainerCallback):
    """The optimizer and schedule the run steps with, and the learning rate of each logged step."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)
        self.seen.update(optimizer=type(inner).__name__, scheduler=type(lr_scheduler).__name__)


def lm_rows(n: int, seed: int) -> datasets.Dataset:
    texts = [p + a for p, a in arithmetic_problems(n, seed)]
    return datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"]
    )


DS_ZERO2_SCHEDULER = {  # a ZeRO-2 recipe naming only its scheduler: Trainer's optimizer under DeepSpeed's WarmupLR
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": 3, "warmup_type": "linear"},
    },
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def deepspeed_recipe(out: Path, recipe_json: dict | None = None) -> dict:
    """ZeRO-3 with CPU offload, the JSON's AdamW and WarmupDecayLR, every "auto" filled (``recipe_json``: another
    JSON).  The reference (Trainer on CPU runs no DeepSpeed: accelerate drops it with use_cpu) runs the same
    arguments without it."""
    engine = Engine()
    config = out.parent / f"ds_config_{out.name}.json"  # as a recipe ships it: a file beside the run
    config.parent.mkdir(parents=True, exist_ok=True)
    written = config.with_suffix(f".{os.getpid()}")  # each rank writes it whole, then renames (no torn reads)
    written.write_text(json.dumps(recipe_json or DS_ZERO3_OFFLOAD))
    written.replace(config)
    recipe = {} if REAL else {"deepspeed": str(config)}
    # loaded before the arguments: ZeRO-3's zero.Init at from_pretrained needs DeepSpeed's comm, which accelerate
    # starts only off the CPU (use_cpu starts torch's gloo group); deepspeed.initialize partitions it instead
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = common(
        out,
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        **recipe,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=lm_rows(64, 1), data_collator=collator, callbacks=[engine])
    trainer.train()
    wrapped = trainer.model_wrapped
    zero = {}
    if hasattr(wrapped, "zero_optimization_stage"):  # the DeepSpeed engine that trained
        zero = {"stage": wrapped.zero_optimization_stage(), "offload_param": bool(wrapped.zero_offload_param())}
        zero["offload_optimizer"] = bool(wrapped.zero_offload_optimizer())
    history = trainer.state.log_history
    return summary_of(trainer, out, lrs=[e["learning_rate"] for e in history if "loss" in e], zero=zero, **engine.seen)


def deepspeed_scheduler(out: Path) -> dict:
    return deepspeed_recipe(out, DS_ZERO2_SCHEDULER)


# ============================================================ images: a random crop per access
def picture_rows(n: int, seed: int) -> datasets.Dataset:
    """``n`` 20x20 RGB PIL images (an ``Image`` column, as load_dataset("imagefolder") gives), labelled by
    brightness."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n).tolist()
    images = [Image.fromarray((rng.random((20, 20, 3)) * 128 + 100 * label).astype("uint8"), "RGB") for label in labels]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["dark", "light"])})
    return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)


def images(out: Path) -> dict:
    """run_image_classification.py in small: ``set_transform`` with a random crop and flip per access (PIL, no
    torchvision), its ``collate_fn``, ``remove_unused_columns=False``, a tiny ViT, accuracy, 2 loader workers."""

    def train_transforms(batch):  # a new crop each time an item is read
        crops = []
        for image in batch["image"]:
            left, top = (int(v) for v in torch.randint(0, 5, (2,)))
            crop = image.convert("RGB").crop((left, top, left + 16, top + 16))
            if torch.rand(()) < 0.5:
                crop = crop.transpose(0)  # PIL's FLIP_LEFT_RIGHT
            crops.append(torch.from_numpy(np.asarray(crop, dtype=np.float32) / 255.0).permute(2, 0, 1))
        batch["pixel_values"] = crops
        return batch

    def val_transforms(batch):
        center = [image.convert("RGB").crop((2, 2, 18, 18)) for image in batch["image"]]
        batch["pixel_values"] = [torch.from_numpy(np.asarray(c, np.float32) / 255.0).permute(2, 0, 1) for c in center]
        return batch

    def collate_fn(examples):
        pixel_values = torch.stack([example["pixel_values"] for example in examples])
        labels = torch.tensor([example["label"] for example in examples])
        return {"pixel_values": pixel_values, "labels": labels}

    def accuracy(eval_pred):
        return {"accuracy": float((np.argmax(eval_pred.predictions, axis=1) == eval_pred.label_ids).mean())}

    train, val = picture_rows(48, 1), picture_rows(10, 2)
    train.set_transform(train_transforms)
    val.set_transform(val_transforms)
    config = ViTConfig(
        image_size=16,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=2,
    )
    args = common(
        out,
        num_train_epochs=2,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        eval_strategy="epoch",
        save_strategy="epoch",
        remove_unused_columns=False,
        dataloader_num_workers=2,
    )
    trainer = Trainer(
        model=ViTForImageClassification(config),
        args=args,
        train_dataset=train,
        eval_dataset=val,
        data_collator=collate_fn,
        compute_metrics=accuracy,
    )
    trainer.train()
    metrics = trainer.evaluate()
    return summary_of(trainer, out, eval_accuracy=metrics["eval_accuracy"])


# ============================================================ detection and segmentation: labels are lists of dicts
class DetectorConfig(PretrainedConfig):
    model_type = "tiny-detector"

    def __init__(self, num_classes: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_classes = num_classes


@dataclass
class DetectionOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    pred_boxes: torch.Tensor | None = None
    pred_masks: torch.Tensor | None = None


class TinyDetector(PreTrainedModel):
    """One box, class and 4x4 mask per image from a strided convolution; DETR's segmentation label format (a
    dict per image: ``class_labels``, ``boxes``, ``masks``)."""

    config_class = DetectorConfig

    def __init__(self, config: DetectorConfig) -> None:
        super().__init__(config)
        self.conv = torch.nn.Conv2d(3, 8, 4, 4)
        self.classes = torch.nn.Linear(8, config.num_classes)
        self.boxes = torch.nn.Linear(8, 4)
        self.masks = torch.nn.Conv2d(8, 1, 1)
        self.post_init()

    def forward(self, pixel_values, labels=None):
        features = self.conv(pixel_values)
        hidden = features.mean((2, 3))
        logits, boxes = self.classes(hidden), self.boxes(hidden).sigmoid()
        masks = self.masks(features)[:, 0]
        loss = None
        if labels is not None:  # the first object of each image
            per_image = [
                torch.nn.functional.cross_entropy(logits[i : i + 1], target["class_labels"][:1])
                + torch.nn.functional.l1_loss(boxes[i], target["boxes"][0])
                + torch.nn.functional.binary_cross_entropy_with_logits(masks[i], target["masks"][0])
                for i, target in enumerate(labels)
            ]
            loss = torch.stack(per_image).mean()
        return DetectionOutput(loss=loss, logits=logits, pred_boxes=boxes, pred_masks=masks)


class Boxes(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 3, 16, 16, generator=g)
        self.counts = [2] * n  # Trainer gathers each batch's labels across ranks: the same shapes on each
        self.targets = [
            {
                "class_labels": torch.randint(0, 3, (k,), generator=g),
                "boxes": torch.rand(k, 4, generator=g),
                "masks": (torch.rand(k, 4, 4, generator=g) > 0.5).float(),
            }
            for k in self.counts
        ]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": self.images[i], "labels": self.targets[i]}


def detection(out: Path) -> dict:
    """run_object_detection.py's shape: a ``collate_fn`` keeping ``labels`` as a list of dicts, and
    ``compute_metrics`` walking per-batch lists (``eval_do_concat_batches=False``)."""
    seen: dict = {}

    def collate_fn(batch):
        return {"pixel_values": torch.stack([x["pixel_values"] for x in batch]), "labels": [x["labels"] for x in batch]}

    def compute_metrics(eval_pred):
        batches = eval_pred.label_ids  # a list of per-image dicts per batch (gathered from the ranks)
        seen["batches"] = len(batches)
        objects = sum(len(target["class_labels"]) for batch in batches for target in batch)
        mask_pixels = sum(float(target["masks"].sum()) for batch in batches for target in batch)
        images = sum(len(np.asarray(p[1])) for p in eval_pred.predictions)  # (logits, boxes, masks) per batch
        return {"objects": objects, "images": images, "mask_pixels": mask_pixels}

    args = common(
        out,
        max_steps=4,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=3,
        learning_rate=1e-2,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=4,
        remove_unused_columns=False,
        eval_do_concat_batches=False,
    )
    torch.manual_seed(0)
    trainer = Trainer(
        model=TinyDetector(DetectorConfig()),
        args=args,
        train_dataset=Boxes(32, 1),
        eval_dataset=Boxes(10, 2),
        data_collator=collate_fn,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    history = trainer.state.log_history
    counts = [[e["eval_images"], e["eval_objects"], e["eval_mask_pixels"]] for e in history if "eval_images" in e]
    return summary_of(trainer, out, counts=counts, **seen)


# ============================================================ audio: decoded from WAV bytes on every access
def wav_bytes(samples: np.ndarray, rate: int = 16000) -> bytes:
    """A 16-bit mono WAV file's bytes (what an audiofolder's files hold)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def sound_rows(n: int, seed: int) -> datasets.Dataset:
    """``n`` WAV files (0.15 s at 16 kHz): a low or a high tone in noise, labelled by pitch."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n).tolist()
    t = np.arange(2400) / 16000
    files = [
        wav_bytes(0.5 * np.sin(2 * np.pi * (300 + 900 * y) * t) + 0.1 * rng.standard_normal(t.size)) for y in labels
    ]
    return datasets.Dataset.from_dict({"audio": files, "label": labels})


def decode(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as f:
        return np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32767


def audio(out: Path) -> dict:
    """run_audio_classification.py in small: ``set_transform`` decoding each file when it is read, a random
    1600-sample window per access (``random.randint``, as its ``random_subsample``), a Wav2Vec2 feature
    extractor, a tiny Wav2Vec2 classifier, accuracy."""
    extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, return_attention_mask=True)

    def train_transforms(batch):
        windows = []
        for data in batch["audio"]:
            wav = decode(data)
            start = random.randint(0, len(wav) - 1600)
            windows.append(wav[start : start + 1600])
        inputs = extractor(windows, sampling_rate=16000)
        return {"input_values": inputs.input_values, "attention_mask": inputs.attention_mask, "labels": batch["label"]}

    def val_transforms(batch):
        inputs = extractor([decode(data)[:1600] for data in batch["audio"]], sampling_rate=16000)
        return {"input_values": inputs.input_values, "attention_mask": inputs.attention_mask, "labels": batch["label"]}

    def accuracy(eval_pred):
        return {"accuracy": float((np.argmax(eval_pred.predictions, axis=1) == eval_pred.label_ids).mean())}

    train, val = sound_rows(24, 1), sound_rows(8, 2)
    train.set_transform(train_transforms, output_all_columns=False)
    val.set_transform(val_transforms, output_all_columns=False)
    config = Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        classifier_proj_size=16,
        mask_time_prob=0.0,
        num_labels=2,
    )
    args = common(
        out,
        num_train_epochs=1,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        eval_strategy="epoch",
        save_strategy="epoch",
        save_total_limit=1,
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=Wav2Vec2ForSequenceClassification(config),
        args=args,
        train_dataset=train,
        eval_dataset=val,
        processing_class=extractor,
        compute_metrics=accuracy,
    )
    trainer.train()
    return summary_of(trainer, out)


# ============================================================ two-tower: a contrastive image-text model
TINY_VISION = dict(
    image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
)
"""A CLIP vision tower of 16x16 images in four 8x8 patches (two-tower, LLaVA)."""


def captioned_rows(n: int, seed: int) -> datasets.Dataset:
    rows = picture_rows(n, seed)
    return rows.add_column("caption", ["a light picture" if y else "a dark one" for y in rows["label"]])


def two_tower(out: Path) -> dict:
    """run_clip.py in small: a CLIP dual encoder (image tower, text tower, in-batch contrastive loss), images
    and captions tokenised in ``set_transform``, its ``collate_fn`` with ``return_loss=True``; the evaluation
    loss is the contrastive loss (no labels)."""
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(
            image_size=16,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        projection_dim=16,
    )

    def transform(batch):
        center = [image.convert("RGB").crop((2, 2, 18, 18)) for image in batch["image"]]
        text = tokenizer(batch["caption"], padding="max_length", max_length=20, truncation=True)
        return {
            "pixel_values": [torch.from_numpy(np.asarray(c, np.float32) / 255.0).permute(2, 0, 1) for c in center],
            "input_ids": text.input_ids,
            "attention_mask": text.attention_mask,
        }

    def collate_fn(examples):
        return {
            "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "input_ids": torch.tensor([e["input_ids"] for e in examples], dtype=torch.long),
            "attention_mask": torch.tensor([e["attention_mask"] for e in examples], dtype=torch.long),
            "return_loss": True,
        }

    train, val = captioned_rows(32, 3), captioned_rows(8, 4)
    train.set_transform(transform)
    val.set_transform(transform)
    args = common(
        out,
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        remove_unused_columns=False,
    )
    torch.manual_seed(0)
    trainer = Trainer(
        model=CLIPModel(config), args=args, train_dataset=train, eval_dataset=val, data_collator=collate_fn
    )
    trainer.train()
    history = trainer.state.log_history
    return summary_of(trainer, out, eval_losses=[e["eval_loss"] for e in history if "eval_loss" in e])


# ============================================================ vision-language SFT: a LLaVA-style model
IMAGE_TOKEN = len(tokenizer)  # one id past the tokenizer's, as a processor adds "<image>"


def vision_language(out: Path) -> dict:
    """A VLM fine-tuning notebook's shape: a LLaVA model (CLIP vision tower, projector, Llama), a ``collate_fn``
    that puts the image's tokens before the prompt, pads, and masks the prompt and image tokens out of the
    labels; a random horizontal flip per access."""
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            image_size=16,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        text_config=LlamaConfig(
            vocab_size=IMAGE_TOKEN + 1,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=tokenizer.pad_token_id,
        ),
        image_token_id=IMAGE_TOKEN,
        image_seq_length=4,
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )
    rows = captioned_rows(40, 5)

    def transform(batch):
        pictures = []
        for image in batch["image"]:
            crop = image.convert("RGB").crop((2, 2, 18, 18))
            if torch.rand(()) < 0.5:
                crop = crop.transpose(0)
            pictures.append(torch.from_numpy(np.asarray(crop, np.float32) / 255.0).permute(2, 0, 1))
        return {"pixel_values": pictures, "caption": batch["caption"]}

    rows.set_transform(transform)

    def collate_fn(examples):
        ids, labels = [], []
        for e in examples:
            prompt = [IMAGE_TOKEN] * 4 + tokenizer("user: describe it\nassistant: ").input_ids
            answer = [*tokenizer(e["caption"], add_special_tokens=False).input_ids, tokenizer.eos_token_id]
            ids.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        return {
            "input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
            "labels": torch.tensor([x + [-100] * (width - len(x)) for x in labels]),
            "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
        }

    args = common(
        out,
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        save_strategy="steps",
        save_steps=3,
        remove_unused_columns=False,
    )
    torch.manual_seed(0)
    trainer = Trainer(
        model=LlavaForConditionalGeneration(config), args=args, train_dataset=rows, data_collator=collate_fn
    )
    trainer.train()
    return summary_of(trainer, out)


# ============================================================ fsdp: fsdp="full_shard auto_wrap" with an fsdp_config
FSDP_CONFIG = {  # an accelerate / transformers docs recipe's keys
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    "activation_checkpointing": True,
    "cpu_offload": True,
    "backward_prefetch": "backward_pre",
    "forward_prefetch": False,
    "use_orig_params": True,
    "sync_module_states": True,
    "cpu_ram_efficient_loading": True,
}


def fsdp_recipe(out: Path) -> dict:
    """A causal LM with ``fsdp="full_shard auto_wrap"`` and ``FSDP_CONFIG``.  The reference runs it without
    ``fsdp``: Trainer on CPU cannot run FSDP (accelerate drops it under ``use_cpu``), and sharding, offload and
    recomputation leave the losses as they are."""
    recipe = {} if REAL else {"fsdp": "full_shard auto_wrap", "fsdp_config": FSDP_CONFIG}
    args = common(out, max_steps=4, per_device_train_batch_size=4, learning_rate=3e-3, save_steps=2, **recipe)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=lm_rows(64, 3), data_collator=collator)
    trainer.train()
    units = sorted({type(m).__name__ for m in trainer.model_wrapped.modules() if isinstance(m, FSDPModule)})
    sharded = {
        "units": units,
        "offload": sorted(
            {
                type(group.offload_policy).__name__
                for m in trainer.model_wrapped.modules()
                if isinstance(m, FSDPModule) and (group := m._get_fsdp_state()._fsdp_param_group) is not None
            }
        ),
        "checkpointing": trainer.model.is_gradient_checkpointing,
    }
    return summary_of(trainer, out, fsdp=sharded if units else {})


# ============================================================ vision-language DPO: trl's DPOTrainer on a LLaVA model
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def vision_language_dpo(out: Path) -> dict:
    """trl's dpo_vlm.py in small: a LLaVA model loaded from a folder (trl loads its reference from the same path),
    a ``LlavaProcessor`` (CLIP image processor, the tokenizer with ``<image>``) as ``processing_class``, rows of
    ``images`` and conversational ``prompt`` / ``chosen`` / ``rejected``."""
    from trl import DPOConfig

    vlm_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vlm_tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
        tokenizer=vlm_tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=VLM_CHAT_TEMPLATE,
    )
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            image_size=16,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        text_config=LlamaConfig(
            vocab_size=len(vlm_tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=128,
            pad_token_id=vlm_tokenizer.pad_token_id,
        ),
        image_token_id=vlm_tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=4,
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )
    folder = root.parent / "tiny-llava"
    if int(os.environ.get("RANK", "0")) == 0 and not folder.exists():
        torch.manual_seed(0)
        LlavaForConditionalGeneration(config).save_pretrained(folder.with_suffix(".tmp"))
        folder.with_suffix(".tmp").replace(folder)
    while not (folder / "config.json").exists():  # the other rank waits for rank 0's folder
        time.sleep(0.1)
    rng = np.random.default_rng(7)
    pictures = [Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")) for _ in range(24)]
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    rows = datasets.Dataset.from_dict(
        {
            "images": [[p] for p in pictures],
            "prompt": [question] * len(pictures),
            "chosen": [[{"role": "assistant", "content": [{"type": "text", "text": "a light one"}]}]] * len(pictures),
            "rejected": [[{"role": "assistant", "content": [{"type": "text", "text": "dark"}]}]] * len(pictures),
        }
    )
    args = DPOConfig(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=3,
        learning_rate=1e-3,
        logging_steps=2,
        save_steps=2,
        report_to="none",
        use_cpu=True,
        seed=3,
        disable_tqdm=True,
    )
    model = LlavaForConditionalGeneration.from_pretrained(folder)
    trainer = DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=processor)
    trainer.train()
    history = trainer.state.log_history
    return summary_of(trainer, out, margins=[e["rewards/margins"] for e in history if "rewards/margins" in e])


CASES = {
    "hpsearch": hpsearch,
    "deepspeed": deepspeed_recipe,
    "dsscheduler": deepspeed_scheduler,
    "images": images,
    "detection": detection,
    "audio": audio,
    "twotower": two_tower,
    "vlm": vision_language,
    "vlmdpo": vision_language_dpo,
    "fsdp": fsdp_recipe,
}


def main() -> None:
    for kind in sys.argv[2].split(","):
        out = root / kind
        torch.manual_seed(0)
        summary = CASES[kind](out)
        if int(os.environ.get("RANK", "0")) == 0:
            (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
            print("SUMMARY", kind, json.dumps(summary, default=str))
        # the next kind as in a process of its own: no DeepSpeed / FSDP plugin (the state, ZeRO-3 loading, and the
        # environment TrainingArguments sets for accelerate) left from this one
        AcceleratorState._reset_state()
        unset_hf_deepspeed_config()
        for name in [
            n for n in os.environ if n.startswith(("FSDP_", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"))
        ]:
            del os.environ[name]


if __name__ == "__main__":  # imported: tests/unit/test_script_kinds.py runs main() in place
    main()
    if REAL:  # the reference leaves without finalisation (see facade_script.py); ours as scripts end
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
