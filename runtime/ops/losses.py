"""Losses with an explicit backward pass, for the ``nn`` layers (re-exported by :mod:`kubeps.runtime.ops.nn`):
``forward(logits, labels)`` returns the mean loss and caches what ``backward()`` needs to return its gradient with
respect to the logits."""

from __future__ import annotations

from typing import Any

from kubeps.runtime.ops import kernels

__all__ = ["Loss", "SigmoidCrossEntropy", "SoftmaxCrossEntropy"]


class Loss:
    """``forward(logits, labels) -> mean loss``; ``backward() -> d mean loss / d logits``."""

    def __init__(self) -> None:
        self._cache: tuple[Any, Any] | None = None

    def __call__(self, logits: Any, labels: Any) -> float:
        return self.forward(logits, labels)

    def forward(self, logits: Any, labels: Any) -> float:
        raise NotImplementedError

    def backward(self) -> Any:
        raise NotImplementedError


class SigmoidCrossEntropy(Loss):
    """Mean binary cross-entropy of logits against 0/1 (or soft) labels of the same shape."""

    def forward(self, logits: Any, labels: Any) -> float:
        xp = kernels.array_module(logits)
        labels = xp.asarray(labels, dtype=logits.dtype).reshape(logits.shape)
        per = kernels.sigmoid_cross_entropy_with_logits(logits, labels)
        self._cache = (logits, labels)
        return float(per.mean())

    def backward(self) -> Any:
        if self._cache is None:
            raise RuntimeError("SigmoidCrossEntropy: backward called before forward")
        logits, labels = self._cache
        return kernels.sigmoid_cross_entropy_with_logits_grad(logits, labels) / logits.size


class SoftmaxCrossEntropy(Loss):
    """Mean softmax cross-entropy; labels are class ids ``(batch,)`` or probability rows ``(batch, classes)``."""

    def forward(self, logits: Any, labels: Any) -> float:
        xp = kernels.array_module(logits)
        labels = xp.asarray(labels)
        if logits.ndim != 2:
            raise ValueError(f"SoftmaxCrossEntropy: logits has shape {tuple(logits.shape)}; allowed: (batch, classes)")
        if labels.ndim == 1:
            if labels.dtype.kind not in "iu" or (labels.size and (int(labels.min()) < 0
                                                                 or int(labels.max()) >= logits.shape[1])):
                raise ValueError(f"SoftmaxCrossEntropy: class-id labels must be integers in [0, {logits.shape[1]})")
            onehot = xp.zeros(logits.shape, dtype=logits.dtype)
            onehot[xp.arange(labels.shape[0]), labels] = 1
            labels = onehot
        labels = labels.astype(logits.dtype, copy=False)
        per = kernels.softmax_cross_entropy_with_logits(logits, labels)
        self._cache = (logits, labels)
        return float(per.mean())

    def backward(self) -> Any:
        if self._cache is None:
            raise RuntimeError("SoftmaxCrossEntropy: backward called before forward")
        logits, labels = self._cache
        return kernels.softmax_cross_entropy_with_logits_grad(logits, labels) / logits.shape[0]
