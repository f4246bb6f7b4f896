"""Least-squares fits of the profile's timing points: non-negative coefficients that minimise the relative error
(:func:`fit_relative`), on a Lawson-Hanson active-set solver (:func:`nnls`)."""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares min ||a x - b||, x >= 0 (Lawson-Hanson active set)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(iters):
        if passive.all() or (w[~passive] <= 1e-12).all():
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad] + 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def fit_relative(features: list[list[float]], seconds: list[float]) -> list[float]:
    """Coefficients c >= 0 minimising the relative error of ``features @ c`` against ``seconds``."""
    a = np.asarray(features, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / np.maximum(t, 1e-9)
    coef = nnls(a / scale * w[:, None], t * w)
    return [float(c) for c in coef / scale]


def fit_errors(features: list[list[float]], seconds: list[float], coef: list[float]) -> list[float]:
    pred = np.asarray(features, dtype=np.float64) @ np.asarray(coef)
    return [float(p / t - 1) for p, t in zip(pred, seconds)]
