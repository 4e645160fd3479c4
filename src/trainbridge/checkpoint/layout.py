"""Every name inside a checkpoint folder ``checkpoint-{step}/``, and the checkpoint folders beside it.

A checkpoint holds::

    config.json, generation_config.json      the model's configuration (save_pretrained)
    model.safetensors | model-*.safetensors  the weights in Hugging Face layout (+ model.safetensors.index.json)
    adapter_model.safetensors                instead, for a PEFT model: its adapter (+ adapter_config.json)
    tokenizer files                          as the tokenizer's save_pretrained writes them
    training_state.json                      the loop's counters, sampler position and callback states
    rng_state.pth | rng_state_{rank}.pth     each rank's RNG states (Trainer's names)
    optimizer.pt                             a replicated optimizer's state (one process, DDP)
    scheduler.pt                             the LR scheduler's state
    dcp/                                     torch.distributed.checkpoint: model and/or optimizer shards
    deepspeed/state/                         DeepSpeed's own checkpoint (ZeRO partitions, fp32 masters)
    trainer_state.json, training_args.bin    under HuggingFaceCallbacks, as Trainer writes them
    manifest.json                            every file's size and SHA-256, the run's fingerprint
    COMPLETE                                 written last

Beside the checkpoints in the run folder: ``.tmp-checkpoint-{step}`` (being written; ``.owner`` names its
writer), ``.old-checkpoint-{step}`` (an earlier checkpoint of the same step during a re-save),
``.deleting-checkpoint-{step}`` (being rotated away) and ``merged/`` (a PEFT run's merged export).
"""

from __future__ import annotations

from trainbridge.modeling.load import ADAPTER_WEIGHTS_FILE as ADAPTER_WEIGHTS_FILE  # PEFT's name, read there too

CONFIG_FILE = "config.json"
"""The model's configuration (``save_pretrained``)."""
SAFE_WEIGHTS_FILE = "model.safetensors"
"""The weights in one file (``save_pretrained``)."""
SAFE_WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
"""The index of sharded weights (``save_pretrained`` of a large model)."""

TRAINING_STATE_FILE = "training_state.json"
"""The loop's counters, sampler position and callback states."""
OPTIMIZER_FILE = "optimizer.pt"
"""A replicated optimizer's state (``torch.save`` of ``Optimizer.state_dict()``), written by rank 0."""
SCHEDULER_FILE = "scheduler.pt"
"""The LR scheduler's state."""
SCALER_FILE = "scaler.pt"
"""fp16's loss-scaler state (``GradScaler.state_dict()``; Trainer's ``SCALER_NAME``), written by rank 0."""
SHARDED_STATE_DIR = "dcp"
"""The ``torch.distributed.checkpoint`` folder: each rank's shards of the model's own (training-precision)
weights under ``model``, and of the optimizer state under ``optimizer``."""
DCP_METADATA_FILE = ".metadata"
"""The metadata file DCP writes into ``dcp/`` (``torch.distributed.checkpoint.filesystem``'s name)."""
DEEPSPEED_DIR = "deepspeed"
"""DeepSpeed's save folder; its checkpoint is the tag folder ``DEEPSPEED_TAG`` inside it."""
DEEPSPEED_TAG = "state"
TRAINER_STATE_FILE = "trainer_state.json"
"""Trainer's ``TrainerState`` (``TRAINER_STATE_NAME``), written under ``HuggingFaceCallbacks``."""
TRAINING_ARGS_FILE = "training_args.bin"
"""Trainer's ``TrainingArguments`` (``TRAINING_ARGS_NAME``, ``torch.save``), written under ``HuggingFaceCallbacks``."""
MANIFEST_FILE = "manifest.json"
"""Every file's size and SHA-256, and the run's fingerprint (``checkpoint.manifest``)."""
COMPLETE_MARKER = "COMPLETE"
"""Written last: a checkpoint without it is not one."""
OWNER_FILE = ".owner"
"""In a temporary checkpoint folder: the run id, host and pid of the process that writes it."""

TMP_PREFIX = ".tmp-checkpoint-"
OLD_PREFIX = ".old-checkpoint-"
DELETING_PREFIX = ".deleting-checkpoint-"
MERGED_DIR = "merged"
"""Folder (in the run folder) of the merged export of a PEFT run (``merge_adapter_at_end``)."""


def rng_state_file_name(rank: int, world_size: int) -> str:
    """A rank's RNG-state file, named as Trainer names it: ``rng_state.pth`` for a run of one process,
    ``rng_state_{rank}.pth`` otherwise."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"
