"""HELENE zeroth-order optimizer, with MeZO (ZO-SGD) and ZO-Adam baselines and layer-wise param groups.

Imports only torch (the package is a leaf user of nothing else in the project)::

    from helene import Helene, ZOSGD, layerwise_param_groups
    opt = Helene(layerwise_param_groups(model, lam=1.0), lr=1e-6)
    loss = opt.step(lambda: model(**batch).loss)      # no backward
"""

from helene.estimators import HESSIAN_ESTIMATORS, HessianEstimator
from helene.groups import layerwise_param_groups
from helene.optimizer import ZOSGD, Helene, ZOAdam
from helene.zo import ZerothOrderOptimizer

__all__ = [
    "HESSIAN_ESTIMATORS",
    "ZOSGD",
    "Helene",
    "HessianEstimator",
    "ZOAdam",
    "ZerothOrderOptimizer",
    "layerwise_param_groups",
]
