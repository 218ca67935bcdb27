"""Ready callbacks that make a framework's training loop honour a Stop (`air_magic.should_stop()`).

`TrainerStopCallback` is a Hugging Face `transformers.TrainerCallback`, and
`LightningStopCallback` a Lightning `Callback`: each asks `should_stop()` at
the end of every training step and, once it says so, has the trainer end its
loop after that step, on every rank at the same step, so `trainer.train()` /
`trainer.fit()` return normally (checkpoints and logging as at a normal end).

    from air_magic.integrations import TrainerStopCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[TrainerStopCallback()])

The frameworks are imported when a callback is first used, so `air_magic`
imports without them. Not for: the flag itself (stopping.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .stopping import should_stop

if TYPE_CHECKING:  # made on first use (module __getattr__)
    TrainerStopCallback: type
    LightningStopCallback: type

__all__ = ["LightningStopCallback", "TrainerStopCallback"]
_made: dict[str, type] = {}


def _trainer_stop_callback() -> type:
    from transformers import TrainerCallback

    class TrainerStopCallback(TrainerCallback):  # type: ignore[misc]
        """Ends `transformers.Trainer`'s loop after the step in which a Stop was asked (`should_stop()`)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if should_stop():
                control.should_training_stop = True
            return control

    return TrainerStopCallback


def _lightning_stop_callback() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the older package name
        from pytorch_lightning import Callback  # type: ignore[assignment]

    class LightningStopCallback(Callback):  # type: ignore[misc]
        """Ends a Lightning `Trainer`'s fit after the batch in which a Stop was asked (`should_stop()`)."""

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            if should_stop():
                trainer.should_stop = True

    return LightningStopCallback


_MAKERS = {"TrainerStopCallback": _trainer_stop_callback, "LightningStopCallback": _lightning_stop_callback}


def __getattr__(name: str) -> type:
    """The callback classes, made on first use (each imports its framework then)."""
    maker = _MAKERS.get(name)
    if maker is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _made:
        _made[name] = maker()
    return _made[name]
