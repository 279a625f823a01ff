"""The ``largebatch train`` command's run: the loop, the data pipeline, checkpoints, processes.

Modules: ``train`` (the epochs of a run), ``run`` (its objects), ``loop`` (an epoch and an
evaluation, shared with the study), ``logs`` (trust-ratio samples, TensorBoard, W&B),
``data``, ``checkpoint``, ``distributed``.
"""

from largebatch.training.distributed import check_device, exit_process
from largebatch.training.logs import check_loggers
from largebatch.training.loop import Evaluation, evaluate, tensor_chunks, train_epoch
from largebatch.training.run import Run, fail
from largebatch.training.train import train

__all__ = [
    "Evaluation",
    "Run",
    "check_device",
    "check_loggers",
    "evaluate",
    "exit_process",
    "fail",
    "tensor_chunks",
    "train",
    "train_epoch",
]
