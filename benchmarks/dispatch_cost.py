"""Per-event dispatch cost of the CallbackManager for 0, 1 and 10 callbacks (a benchmark, not a test).

    python benchmarks/dispatch_cost.py

Measures ``manager.fire(event, context)`` for an event that 0 / 1 / 10 callbacks override, and for an
event none of 10 registered callbacks override (the lazy index makes that one branch).
"""

from __future__ import annotations

import tempfile
import timeit
from pathlib import Path

from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.dispatch import CallbackManager
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.events import Event


class StepCounter(Callback):
    def __init__(self) -> None:
        self.n = 0

    def on_step_end(self, context: TrainingContext, **kwargs: object) -> None:
        self.n += 1


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")
    (tmp / "d.jsonl").write_text('{"input_ids": [1, 2]}\n')
    args = TrainingArgs(model_path=tmp / "model", data_path=tmp / "d.jsonl", ckpt_output_dir=tmp / "out")
    context = TrainingContext(args=args, env=DistributedEnv())
    number = 200_000
    print(f"{'callbacks':>10} {'event':>16} {'ns/fire':>10}")
    for n in (0, 1, 10):
        manager = CallbackManager([StepCounter() for _ in range(n)])
        for event in (Event.STEP_END, Event.BEFORE_FORWARD):

            def fire(manager: CallbackManager = manager, event: Event = event) -> None:
                manager.fire(event, context)

            seconds = min(timeit.repeat(fire, number=number, repeat=5))
            print(f"{n:>10} {event.value:>16} {seconds / number * 1e9:>10.0f}")


if __name__ == "__main__":
    main()
