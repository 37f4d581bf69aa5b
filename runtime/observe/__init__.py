"""What a training job shows its users while it runs: TensorBoard event files (``summary``), the training rates
written to them (``train_metrics``), the task's Prometheus metrics and the documents served beside them
(``metrics``), the chief's metric families (``chief_metrics``) and its log lines, as text or JSON (``logs``).

Rule: imports nothing of kubeps but :mod:`kubeps.runtime.errors`, :mod:`kubeps.runtime.contract` and
:mod:`kubeps.runtime.settings`, so the chief's coordinator and the checkpoint code (the sidecar evaluator) can both
use it; what it shows of the coordinator reaches it through a ``Protocol`` (``chief_metrics``). The writer library
(tensorboardX, the ``tensorboard`` extra) is imported only when a writer is created: ``import kubeps.runtime``
never loads it.
"""
