"""The training step as a seam: what varies by task (how batches are formed, what the loss is) behind one
interface (``base.TrainStep``), chosen at build time (``loop.build.build_run``).

- ``base``: ``TrainStep``, ``StepBatches``, ``EvalOutput``.
- ``token_ce``: padding-free token-budget batches and the summed token cross entropy (causal LMs).
- ``model_loss``: Trainer's sample batches and the loss the model's forward returns (any other model).
- ``trainer_methods``: a Trainer subclass's ``training_step`` / ``prediction_step`` on ``model_loss``'s batches.
- ``token_metrics``: trl's SFT metrics ``entropy``, ``mean_token_accuracy`` and ``num_tokens``.
"""

from trainbridge.step.base import EvalOutput, StepBatches, TrainStep
from trainbridge.step.token_ce import TokenCrossEntropy

__all__ = ["EvalOutput", "StepBatches", "TokenCrossEntropy", "TrainStep"]
