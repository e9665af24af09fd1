"""One worker's training: ``train(cfg, run_dir, device)`` builds the run and runs the loop (``loop.py``), whose
recorder, evaluator and checkpointer each decide their own steps; ``resume.py`` continues from checkpoints."""

from decent_train.training.loop import OnRecord
from decent_train.training.train import train

__all__ = ["OnRecord", "train"]
