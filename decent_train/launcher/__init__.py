"""The ``decent-train`` command: Hydra composes and validates the config once, then torchrun's elastic agent starts
the workers (``python -m decent_train.worker <run_dir>/resolved_config.yaml``)."""
