"""What a training job is built from: models, datasets, optimizers and the metric logger.

Each component owns a small config dataclass (the schema of its ``conf/`` group, checked in ``__post_init__``) and a
``build_*`` function the worker calls.
"""
