"""The ``decent-train`` command: Hydra composes and validates the config once, then torchrun's elastic agent starts
the workers, forked from a process that imported torch once (``decent_train/forkserver.py``); on a cluster, torchrun
starts them as ``python -m decent_train.worker <run_dir>/resolved_config.yaml``."""
