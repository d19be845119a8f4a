"""Routing policies: the non-learned baselines (``models.baselines``) and the learned router.

The learned router is a DQN whose Q-network scores every offering's feature row with one shared
network (``models.qnet``, torch, training only); its weights are exported to numpy for serving
(``models.policy``, no torch), trained in parallel with Ray Tune and tracked in MLflow
(``models.train``, ``models.registry``), and loaded from a path or a ``models:/`` URI by
``models.loader``.
"""
