"""What a training job shows its users while it runs: TensorBoard event files (``summary``) and the training rates
written to them (``train_metrics``).

Rule: imports nothing of kubeps but :mod:`kubeps.runtime.errors` and :mod:`kubeps.runtime.contract`, so the chief's
coordinator and the checkpoint code (the sidecar evaluator) can both use it. The writer library (tensorboardX, the
``tensorboard`` extra) is imported only when a writer is created: ``import kubeps.runtime`` never loads it.
"""
