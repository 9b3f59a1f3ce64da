"""Zeroth-order optimizers: HELENE, FZOO, and the MeZO (ZO-SGD) and ZO-Adam baselines; layer-wise param groups.

Imports only torch (the package is a leaf user of nothing else in the project; ``helene.hf``, the Hugging Face
``Trainer`` integration, imports transformers and is imported only when asked for)::

    from helene import FZOO, Helene, ZOSGD, layerwise_param_groups
    opt = Helene(layerwise_param_groups(model, lam=1.0), lr=1e-6)
    loss = opt.step(lambda: model(**batch).loss)      # no backward
"""

from helene.estimators import HESSIAN_ESTIMATORS, HessianEstimator
from helene.fzoo import FZOO
from helene.groups import layerwise_param_groups
from helene.optimizer import ZOSGD, Helene, ZOAdam
from helene.zo import ZerothOrderOptimizer

__all__ = [
    "FZOO",
    "HESSIAN_ESTIMATORS",
    "ZOSGD",
    "Helene",
    "HessianEstimator",
    "ZOAdam",
    "ZerothOrderOptimizer",
    "layerwise_param_groups",
]
